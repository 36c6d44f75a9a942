"""Load and SLOs derived from this machine's measured engine step time, so every box sees the same contention.

A fixed request rate and fixed SLOs mean different experiments on different machines: on a box whose steps
are twice as slow, 1 req/s is twice the load and a 0.6 s TBT SLO is half as many steps, and a policy that
time-slices (``rotasched``) misses TBT where it met it before. So the main job first measures the engine
(the median wall time of the warm-up's steps, which run the job's own prompts at its batch shapes) and
states the experiment in step units:

  * ``tbt_slo = tbt_slo_steps * step_s`` and ``ttft_slo = ttft_slo_steps * step_s``;
  * load: the real scheduler and block manager (``fcfs``, the job's pool, budgets and requests, all
    submitted at once), driven by the simulator's event loop (``sim.event_loop.simulate``, one virtual second
    per step, pipeline off), count the steps ``S`` the engine needs to serve the workload when it is never
    idle; ``capacity = N / (S * step_s)`` requests/s, and the job offers
    ``rps = load_factor * capacity`` (4 significant digits, so file names and rows carry the same number).
    A mean-footprint formula was tried first and overestimated capacity
    2.8x: a few long prompts hog a small pool and cause head-of-line blocking, which only the real
    scheduling logic accounts for.

Every number, and the reasoning, goes into ``Calibration.explain()`` (printed above the table) and
``config.json``. Each timed run then records the step times it saw; ``step_drift`` compares them with the
warm-up's, so a run during which another process took the CPU is flagged rather than silently compared.
That part is pure Python (no JAX).

The simulator's calibration measurement also lives here (its profile format and fits are
``sim/calibration.py``; ``scripts/calibrate.py`` joins the two), on the real code paths:

* **Model steps** (``measure_steps``). An ``LLMEngine`` (the run's engine config: bucket floors, pipeline,
  dtype) runs (a) *decode* points: ``B`` requests with ``c``-token prompts; after their prefills, each
  ``step()`` is one decode token per request, timed as the engine's step period (warm-up steps dropped, median
  of the rest); (b) *prefill* points: one request with a ``P``-token prompt and ``max_tokens=1``, the whole
  request timed (one prefill step plus the host's bookkeeping), warm-up repeats dropped, median of the rest.
  Every shape is compiled before timing (``precompile_steps`` with the configured floors, plus the warm-up).
* **Transfers** (``measure_transfers``). A ``DuplexKV`` built as the engine builds it (same spec, mode, host
  memory kind, buckets) ``issue()``s ``N`` blocks D2H only, H2D only, and both at once; each timed to
  completion (``wait`` and ``block_until_ready``), median of repeats. ``naive`` mode is timed too, for the
  curve's small-segment point.
* **Machine** (``measure_machine``, ``physical_memory_gb``): numpy streaming bandwidth and f32 matmul rate.

These import JAX and the engine inside their functions only; the module's top level imports no JAX.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable, Optional, Sequence

import numpy as np

from superinfer_jax.engine.config import EngineConfig
from superinfer_jax.sim import calibration as cal
from superinfer_jax.sim.event_loop import simulate
from superinfer_jax.workload.types import RequestSpec

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The measured step time and what was derived from it (seconds, tokens, requests/s)."""
  step_s: float                 # median warm-up step wall time
  step_p10_s: float
  step_p90_s: float
  num_steps: int                # warm-up steps measured
  num_requests: int
  mean_prompt_len: float
  mean_output_len: float
  pool_tokens: int              # device blocks x block size
  saturated_steps: int          # steps to serve every request submitted at once (real scheduler, fcfs)
  capacity_rps: float
  load_factor: float
  rps: float
  ttft_slo_steps: float
  tbt_slo_steps: float
  ttft_slo_s: float
  tbt_slo_s: float
  loadavg_1m: Optional[float] = None
  cpu_count: Optional[int] = None

  def explain(self) -> str:
    """The header the main job prints: what was measured, what was derived, and why."""
    la = "n/a" if self.loadavg_1m is None else f"{self.loadavg_1m:.1f}"
    return "\n".join([
        f"[calibrate] engine step time on this machine: {1e3 * self.step_s:.0f} ms median over "
        f"{self.num_steps} warm-up steps (p10 {1e3 * self.step_p10_s:.0f}, p90 {1e3 * self.step_p90_s:.0f} ms); "
        f"load average {la} on {self.cpu_count or '?'} CPUs",
        f"[calibrate] SLOs in steps, so every machine is judged alike: TTFT SLO = {self.ttft_slo_steps:g} steps "
        f"= {self.ttft_slo_s:.2f} s, TBT SLO = {self.tbt_slo_steps:g} steps = {self.tbt_slo_s:.3f} s",
        f"[calibrate] load: the scheduler serves the {self.num_requests} requests (mean prompt "
        f"{self.mean_prompt_len:.0f}, output {self.mean_output_len:.0f} tokens) submitted at once in "
        f"{self.saturated_steps} steps on the {self.pool_tokens}-token device pool -> capacity "
        f"{self.capacity_rps:.3f} req/s; offered {self.load_factor:g} x capacity = {self.rps:.3f} req/s "
        f"(memory contention by design)",
    ] + ([f"[calibrate] note: load average {la} >= {self.cpu_count} CPUs: other work shares this machine; the "
          f"step time (so the load and SLOs) reflects it, and runs that get quieter will be flagged"]
         if self.loadavg_1m is not None and self.cpu_count and self.loadavg_1m >= self.cpu_count else []))

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def saturated_steps(prompt_lens: Sequence[int], output_lens: Sequence[int], *, scheduler_config,
                    num_device_blocks: int, num_host_blocks: int, block_size: int,
                    max_steps: int = 1_000_000) -> int:
  """Steps the real ``Scheduler`` (policy ``fcfs``) needs to serve every request submitted at t = 0 on a
  pool of ``num_device_blocks`` blocks: the engine's makespan in steps when it is never idle. The simulator's
  event loop drives it (``sim.event_loop.simulate``: the scheduler and block manager built from the config,
  pipeline off, every step one virtual second, copies free), so each plan is one step. A request the
  scheduler refuses raises its ``ValueError``."""
  if not prompt_lens or len(prompt_lens) != len(output_lens):
    raise ValueError("calibration needs the workload's prompt and output lengths")
  config = dataclasses.replace(EngineConfig(), scheduler=dataclasses.replace(scheduler_config, policy="fcfs"),
                               num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
                               block_size=block_size, pipeline=False)
  width = len(str(len(prompt_lens)))   # ids that sort in submission order
  requests = [RequestSpec(request_id=f"{i:0{width}d}", prompt="", prompt_len=int(p), output_len=int(o))
              for i, (p, o) in enumerate(zip(prompt_lens, output_lens))]
  res = simulate(requests, config, _OneSecondSteps(), time_limit_s=max_steps - 0.5)
  if res.rejected:
    raise ValueError(res.rejected[0][1])
  if res.timed_out:
    raise RuntimeError(f"the workload did not finish within {max_steps} scheduler steps")
  return res.counters["plans"]


class _OneSecondSteps:
  """The cost model of ``saturated_steps``: a step (empty or not) takes one virtual second, copies none."""
  empty_step_s = 1.0
  block_bytes = 0

  @staticmethod
  def step_time(seqs) -> float:
    del seqs
    return 1.0

  @staticmethod
  def transfer_time(blocks_out: int, blocks_in: int) -> float:
    del blocks_out, blocks_in
    return 0.0


def derive(step_times_s: Sequence[float], prompt_lens: Sequence[int], output_lens: Sequence[int], *,
           num_steps_saturated: int, pool_tokens: int, load_factor: float, ttft_slo_steps: float,
           tbt_slo_steps: float, loadavg_1m: Optional[float] = None,
           cpu_count: Optional[int] = None) -> Calibration:
  """Derives the load and SLOs (see the module docstring). Raises ``ValueError`` on empty or bad input."""
  st = np.asarray(step_times_s, dtype=np.float64)
  if st.size == 0 or not np.all(np.isfinite(st)) or np.any(st <= 0):
    raise ValueError("calibration needs positive, finite step times")
  if not prompt_lens or len(prompt_lens) != len(output_lens):
    raise ValueError("calibration needs the workload's prompt and output lengths")
  for name, v in (("load_factor", load_factor), ("ttft_slo_steps", ttft_slo_steps),
                  ("tbt_slo_steps", tbt_slo_steps)):
    if not v > 0:
      raise ValueError(f"{name} must be > 0, got {v!r}")
  if num_steps_saturated < 1 or pool_tokens < 1:
    raise ValueError("num_steps_saturated and pool_tokens must be >= 1")
  step = float(np.median(st))
  n = len(prompt_lens)
  capacity = n / (num_steps_saturated * step)
  return Calibration(
      step_s=step, step_p10_s=float(np.percentile(st, 10)), step_p90_s=float(np.percentile(st, 90)),
      num_steps=int(st.size), num_requests=n, mean_prompt_len=float(np.mean(prompt_lens)),
      mean_output_len=float(np.mean(output_lens)), pool_tokens=int(pool_tokens),
      saturated_steps=int(num_steps_saturated), capacity_rps=capacity, load_factor=float(load_factor),
      rps=float(f"{load_factor * capacity:.4g}"), ttft_slo_steps=float(ttft_slo_steps), tbt_slo_steps=float(tbt_slo_steps),
      ttft_slo_s=ttft_slo_steps * step, tbt_slo_s=tbt_slo_steps * step, loadavg_1m=loadavg_1m,
      cpu_count=cpu_count if cpu_count is not None else os.cpu_count())


def step_drift(step_times_s: Sequence[float], reference_step_s: float) -> Optional[float]:
  """Median step time of a run over the reference (warm-up) median; None without steps."""
  if not len(step_times_s) or not reference_step_s > 0:
    return None
  return float(np.median(np.asarray(step_times_s, dtype=np.float64))) / reference_step_s


def is_perturbed(drift: Optional[float], tolerance: float) -> bool:
  """True when a run's step times left ``[ref / tolerance, ref * tolerance]``."""
  return drift is not None and not (1.0 / tolerance <= drift <= tolerance)


def interleaved_order(policies: Sequence[str], repeats: int) -> list[tuple[int, str]]:
  """(repeat, policy) in run order: each repeat reverses the previous one's order (ABBA...), so a slow
  drift of the machine during the job weighs on every policy alike."""
  out = []
  for k in range(repeats):
    order = list(policies) if k % 2 == 0 else list(reversed(policies))
    out += [(k, p) for p in order]
  return out


def _median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs))


# ------------------------------------------------------------------------ real-engine measurement (sim profile)
def measure_machine(seconds: float = 1.0) -> dict[str, float]:
  """This machine's streaming read bandwidth (GB/s, numpy sum over 256 MB f32) and f32 matmul rate
  (TFLOP/s, numpy 1024^3 matmul), each the best of a few repeats within about ``seconds``."""
  a = np.ones(64 << 20, np.float32)        # 256 MB
  a.sum()
  best_bw = 0.0
  t_end = time.perf_counter() + seconds / 2
  while True:
    t = time.perf_counter()
    a.sum()
    dt = time.perf_counter() - t
    best_bw = max(best_bw, a.nbytes / dt / GB)
    if time.perf_counter() > t_end:
      break
  del a
  n = 1024
  x = np.ones((n, n), np.float32)
  x @ x
  best_fl = 0.0
  t_end = time.perf_counter() + seconds / 2
  while True:
    t = time.perf_counter()
    x @ x
    dt = time.perf_counter() - t
    best_fl = max(best_fl, 2.0 * n ** 3 / dt / 1e12)
    if time.perf_counter() > t_end:
      break
  return {"read_gbps": best_bw, "matmul_tflops": best_fl}


def _prompt_fn(engine) -> Callable[[int], list[int]]:
  """A seeded generator of random ``n``-token prompts (ids >= 100, below ``engine``'s vocabulary size)."""
  rng = np.random.default_rng(0)
  vocab = engine.model_config.vocab_size
  lo = min(100, vocab - 1)
  return lambda n: rng.integers(lo, vocab, size=n).tolist()


def _run_to_idle(engine, ids: Sequence[int]) -> list[float]:
  """Steps ``engine`` until it has no unfinished request, then releases ``ids``; returns each step's wall
  time (s)."""
  times = []
  while engine.has_unfinished():
    t = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - t)
  for i in ids:
    engine.release(i)
  return times


def _decode_point(engine, prompt, b: int, c: int, warmup: int, repeats: int) -> cal.StepPoint:
  """``b`` requests with ``c``-token prompts: after their prefills, the decode steps are timed; the point
  is the median of the ``repeats`` steps after ``warmup``, at their mid-run context."""
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  chunks = -(-b * c // engine.config.scheduler.max_num_batched_tokens)   # steps the prefills may take
  sp = SamplingParams(max_tokens=warmup + repeats + chunks + 2, ignore_eos=True)
  ids = [engine.add_request(prompt(c), sp) for _ in range(b)]
  while engine.has_unfinished() and not all(engine.get_request(i).token_ids for i in ids):
    engine.step()
  times = _run_to_idle(engine, ids)
  samples = times[warmup:warmup + repeats] or times[:1]
  ctx = c + warmup + len(samples) // 2          # mid-run context of the timed steps
  return cal.StepPoint("decode", b, b, c, cal.decode_shape(b, ctx), _median(samples), tuple(samples))


def _prefill_point(engine, prompt, n: int, warmup: int, repeats: int) -> cal.StepPoint:
  """One ``n``-token request with ``max_tokens=1``, the whole request timed ``warmup + repeats`` times; the
  point is the median after the warm-up."""
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  sp = SamplingParams(max_tokens=1, ignore_eos=True)
  times = []
  for _ in range(warmup + repeats):
    t = time.perf_counter()
    rid = engine.add_request(prompt(n), sp)
    while engine.has_unfinished():
      engine.step()
    times.append(time.perf_counter() - t)
    engine.release(rid)
  samples = times[warmup:] or times[-1:]
  return cal.StepPoint("prefill", 1, n, 0, cal.prefill_shape(n), _median(samples), tuple(samples))


def measure_steps(engine, *, decode_batches: Sequence[int], decode_contexts: Sequence[int],
                  prefill_chunks: Sequence[int], warmup: int, repeats: int,
                  log: Callable[[str], None] = lambda s: None) -> list[cal.StepPoint]:
  """Times ``engine`` (an idle ``LLMEngine``) at the decode and prefill points of the grid (module
  docstring): one ``StepPoint`` per (context, batch) decode pair, then one per prefill chunk; ``engine`` is
  idle again on return. Token ids are random: their values do not change the step time."""
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  prompt = _prompt_fn(engine)
  # One untimed pass through the whole loop first: first-use costs outside the compiled step buckets
  # would otherwise land in the first decode point.
  if decode_batches and decode_contexts:
    b0, c0 = max(decode_batches), min(decode_contexts)
    sp = SamplingParams(max_tokens=warmup + 2, ignore_eos=True)
    _run_to_idle(engine, [engine.add_request(prompt(c0), sp) for _ in range(b0)])
  points = []
  for c in decode_contexts:
    for b in decode_batches:
      p = _decode_point(engine, prompt, b, c, warmup, repeats)
      log(f"[calibrate] decode batch {b:3d} context {c:5d}: {p.seconds * 1e3:8.2f} ms/step "
          f"({len(p.samples)} steps)")
      points.append(p)
  for n in prefill_chunks:
    p = _prefill_point(engine, prompt, n, warmup, repeats)
    log(f"[calibrate] prefill {n:5d} tokens: {p.seconds * 1e3:8.2f} ms ({len(p.samples)} repeats)")
    points.append(p)
  return points


def measure_transfers(engine_config, model_cfg, *, block_counts: Sequence[int], warmup: int, repeats: int,
                      naive_blocks: Sequence[int] = (), log: Callable[[str], None] = lambda s: None
                      ) -> list[cal.TransferPoint]:
  """Times ``DuplexKV.issue()`` (built as ``LLMEngine._make_duplex`` builds it) of ``N`` blocks D2H, H2D
  and both, for each ``N`` of ``block_counts`` in the config's transfer mode (naive mode for
  ``naive_blocks``)."""
  import jax  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.forward import init_kv_cache  # pylint: disable=import-outside-toplevel
  from superinfer_jax.rotation import DuplexKV  # pylint: disable=import-outside-toplevel
  rc = engine_config.rotation
  dtype = engine_config.model.dtype
  spec = model_cfg.kv_spec(engine_config.block_size, dtype=dtype)
  top = max(list(block_counts) + list(naive_blocks) + [1])
  device = jax.local_devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
  points = []

  def run(mode: str, counts: Sequence[int]):
    dk = DuplexKV(spec, 2 * top, mode=mode, device=device, host_memory_kind=kind,
                  min_bucket=rc.rotation_min_bucket, max_bucket=rc.rotation_max_bucket)
    cache = init_kv_cache(model_cfg, 2 * top + 1, engine_config.block_size, dtype)
    # Seed host blocks top..2top-1 (the H2D sources) with one D2H.
    cache = dk.issue(cache, swap_out=[(1 + i, top + i) for i in range(top)])
    dk.wait()
    for n in counts:
      cases = {"d2h": dict(swap_out=[(1 + i, i) for i in range(n)]),
               "h2d": dict(swap_in=[(top + i, 1 + top + i) for i in range(n)]),
               "both": dict(swap_out=[(1 + i, i) for i in range(n)],
                            swap_in=[(top + i, 1 + top + i) for i in range(n)])}
      for name, kw in cases.items():
        times = []
        for _ in range(warmup + repeats):
          t = time.perf_counter()
          cache = dk.issue(cache, **kw)
          dk.wait()
          jax.block_until_ready(cache)
          times.append(time.perf_counter() - t)
        s = _median(times[warmup:] or times[-1:])
        out = len(kw.get("swap_out", ()))
        inn = len(kw.get("swap_in", ()))
        points.append(cal.TransferPoint(mode, out, inn, s))
        log(f"[calibrate] {mode:6s} {name:4s} {n:3d} blocks x {spec.block_bytes / 2**20:.3f} MiB: "
            f"{s * 1e3:8.3f} ms ({(out + inn) * spec.block_bytes / s / GB:.2f} GB/s)")
    return cache

  run(rc.transfer_mode if rc.transfer_mode != "naive" else "duplex", block_counts)
  if naive_blocks:
    run("naive", naive_blocks)
  return points




def physical_memory_gb() -> float:
  """This machine's physical memory (GB, 1e9 bytes); 16.0 where the OS does not report it."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
  except (ValueError, OSError, AttributeError):
    return 16.0
