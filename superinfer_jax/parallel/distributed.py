"""Multi-host runs: ``jax.distributed.initialize`` from flags / env, and replicated scheduling.

Launch (docs/parallel.md): every host runs the same script with the same flags plus
``--coordinator_address=HOST0:PORT --num_processes=N --process_id=i`` (or JAX's own environment / cluster
detection when the flags are unset and ``--num_processes`` > 1 is not given). Each process drives its local
devices; the mesh spans all of them; every process runs the same jitted step on its shards.

How all processes take identical decisions: **deterministic replicated scheduling**. Every process runs the
same host code on the same inputs (same flags, same prompts / workload seed), so its scheduler, block
manager and DuplexKV bookkeeping make the same plan, provided they read the same clock. The one
non-deterministic input is wall time, so ``ReplicatedSchedule`` replaces the engine's clock with a shared
one: each ``now()`` is one tiny all-gather in which process 0's reading wins, and which also carries every
process's running digest of the plans made so far; a mismatch raises ``PlanDivergenceError`` at once
(before a diverged plan can drive a collective into a deadlock). No plan is broadcast: it is recomputed
identically everywhere and verified.

Inputs that reach one process only (a server's HTTP requests) are broadcast before the step that uses them:
``events.EventChannel`` sends each engine iteration's new requests and aborts from process 0 to all
(``broadcast_from_primary``), and every process applies them in the same order.

Only process 0 writes results, prints, and serves HTTP (``is_primary``).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

_FLAGS_DEFINED: set[int] = set()


class PlanDivergenceError(RuntimeError):
  """Two processes of a multi-host run made different plans (their inputs or host code differ)."""


# ---------------------------------------------------------------------------------------------- flags

def define_distributed_flags(flag_values=None) -> None:
  """``--coordinator_address``, ``--num_processes``, ``--process_id`` (idempotent per FlagValues)."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flag_values if flag_values is not None else flags.FLAGS
  if id(fv) in _FLAGS_DEFINED:
    return
  _FLAGS_DEFINED.add(id(fv))
  flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0's coordinator "
                      "(unset: JAX_COORDINATOR_ADDRESS or single process)", flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "multi-host: number of processes (unset: "
                       "JAX_NUM_PROCESSES, else 1)", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "multi-host: this process's index in [0, num_processes) "
                       "(unset: JAX_PROCESS_ID)", flag_values=fv)


def distributed_args(coordinator_address: str | None, num_processes: int | None,
                     process_id: int | None, env=None) -> dict[str, Any] | None:
  """The ``jax.distributed.initialize`` kwargs from flags, falling back to ``JAX_COORDINATOR_ADDRESS`` /
  ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``; None for a single-process run. ValueError when incomplete."""
  env = os.environ if env is None else env
  addr = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
  n = num_processes if num_processes is not None else _env_int(env, "JAX_NUM_PROCESSES")
  pid = process_id if process_id is not None else _env_int(env, "JAX_PROCESS_ID")
  if n is None and addr is None:
    return None
  if n is None or n < 1:
    raise ValueError(f"--num_processes must be >= 1 with --coordinator_address, got {n!r}")
  if n == 1:
    return None
  if addr is None or pid is None:
    raise ValueError("a multi-process run needs --coordinator_address and --process_id "
                     f"(got coordinator_address={addr!r}, process_id={pid!r})")
  if not 0 <= pid < n:
    raise ValueError(f"--process_id={pid} is not in [0, {n})")
  return dict(coordinator_address=addr, num_processes=n, process_id=pid)


def _env_int(env, name: str) -> int | None:
  v = env.get(name)
  if v in (None, ""):
    return None
  try:
    return int(v)
  except ValueError:
    raise ValueError(f"{name}={v!r} is not an integer") from None


def initialize_from_flags(flag_values=None) -> bool:
  """Calls ``jax.distributed.initialize`` when the flags / env ask for several processes (before any other
  JAX call of the script). Returns True for a multi-process run."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flag_values if flag_values is not None else flags.FLAGS
  args = distributed_args(fv.coordinator_address, fv.num_processes, fv.process_id)
  if args is None:
    return False
  import jax  # pylint: disable=import-outside-toplevel
  jax.distributed.initialize(**args)
  return True


def is_primary() -> bool:
  """True in process 0 (or a single-process run): the one that writes results and serves HTTP."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.process_index() == 0


# ------------------------------------------------------------------------------- replicated scheduling

def plan_fingerprint(plan) -> bytes:
  """Bytes that identify a ``StepPlan``'s decisions: batch, copies, rotations, preemptions."""
  seqs = [(s.req_id, s.num_new_tokens, s.num_computed_tokens, tuple(s.block_table), s.sample)
          for s in plan.scheduled]
  copies = [(list(p.srcs), list(p.dsts)) for p in (plan.swap_out, plan.writeback, plan.swap_in)]
  return repr((plan.step_id, seqs, copies, list(plan.rotated_out), list(plan.rotated_in),
               list(plan.preempted), list(plan.admitted))).encode()


class ReplicatedSchedule:
  """Shared clock + running plan digest for a multi-process engine (see the module docstring).

  ``allgather(words int32[4]) -> int32[P, 4]`` is the exchange (default: ``multihost_utils.process_allgather``,
  a collective over every process); tests inject a fake."""

  def __init__(self, clock, allgather=None):
    self.inner = clock
    self._allgather = allgather or _process_allgather
    self._hash = hashlib.blake2b(digest_size=8)
    self.num_plans = 0
    self.exchanges = 0

  @property
  def digest(self) -> str:
    return self._hash.hexdigest()

  def local_now(self) -> float:
    """This process's own clock reading, no exchange (process 0's is what ``now()`` gives every process)."""
    return self.inner.now()

  def describe(self) -> str:
    return f"{self.num_plans} plans, digest {self.digest}"

  def record(self, plan) -> None:
    self._hash.update(plan_fingerprint(plan))
    self.num_plans += 1

  def now(self) -> float:
    """Process 0's clock reading; raises ``PlanDivergenceError`` if any process's plans differ."""
    words = np.concatenate([np.array([self.inner.now()], np.float64).view(np.int32),
                            np.frombuffer(self._hash.digest(), np.int32)])
    got = np.asarray(self._allgather(words)).reshape(-1, 4)
    self.exchanges += 1
    bad = [i for i in range(got.shape[0]) if not np.array_equal(got[i, 2:], got[0, 2:])]
    if bad:
      raise PlanDivergenceError(f"processes {bad} made different plans from process 0 within the first "
                                f"{self.num_plans} plans: their inputs or host code differ")
    return float(got[0, :2].copy().view(np.float64)[0])

  def wrap(self, scheduler) -> "_RecordingScheduler":
    return _RecordingScheduler(scheduler, self)


class _RecordingScheduler:
  """Forwards everything to the wrapped scheduler; records every plan ``schedule()`` returns."""

  def __init__(self, inner, replica: ReplicatedSchedule):
    self._inner = inner
    self._replica = replica

  def schedule(self, *args, **kwargs):
    plan = self._inner.schedule(*args, **kwargs)
    self._replica.record(plan)
    return plan

  def __getattr__(self, name):
    return getattr(self._inner, name)


def _process_allgather(words: np.ndarray) -> np.ndarray:
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return multihost_utils.process_allgather(words)


def broadcast_from_primary(x: np.ndarray) -> np.ndarray:
  """Process 0's ``x`` in every process (``x`` of the same shape and dtype everywhere; the others' values
  are ignored): ``multihost_utils.broadcast_one_to_all``, one collective over every process."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(x)))


def replicated_schedule(clock) -> ReplicatedSchedule | None:
  """A ``ReplicatedSchedule`` over ``clock`` in a multi-process run, else None."""
  import jax  # pylint: disable=import-outside-toplevel
  return ReplicatedSchedule(clock) if jax.process_count() > 1 else None
