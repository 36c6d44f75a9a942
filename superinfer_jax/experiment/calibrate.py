"""Load and SLOs derived from this machine's measured engine step time, so every box sees the same contention.

A fixed request rate and fixed SLOs mean different experiments on different machines: on a box whose steps
are twice as slow, 1 req/s is twice the load and a 0.6 s TBT SLO is half as many steps, and a policy that
time-slices (``rotasched``) misses TBT where it met it before. So the main job first measures the engine
(the median wall time of the warm-up's steps, which run the job's own prompts at its batch shapes) and
states the experiment in step units:

  * ``tbt_slo = tbt_slo_steps * step_s`` and ``ttft_slo = ttft_slo_steps * step_s``;
  * load: the real scheduler and block manager (``fcfs``, the job's pool, budgets and requests, all
    submitted at once, on a virtual clock) count the steps ``S`` the engine needs to serve the workload when
    it is never idle; ``capacity = N / (S * step_s)`` requests/s, and the job offers
    ``rps = load_factor * capacity`` (4 significant digits, so file names and rows carry the same number).
    A mean-footprint formula was tried first and overestimated capacity
    2.8x: a few long prompts hog a small pool and cause head-of-line blocking, which only the real
    scheduling logic accounts for.

Every number, and the reasoning, goes into ``Calibration.explain()`` (printed above the table) and
``config.json``. Each timed run then records the step times it saw; ``step_drift`` compares them with the
warm-up's, so a run during which another process took the CPU is flagged rather than silently compared.
Pure Python (no JAX).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import numpy as np

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.sched import Request, Scheduler, VirtualClock


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
  pool of ``num_device_blocks`` blocks: the engine's makespan in steps when it is never idle."""
  if not prompt_lens or len(prompt_lens) != len(output_lens):
    raise ValueError("calibration needs the workload's prompt and output lengths")
  clock = VirtualClock()
  s = Scheduler(dataclasses.replace(scheduler_config, policy="fcfs"),
                BlockManager(num_device_blocks, num_host_blocks, block_size), clock)
  for i, (p, o) in enumerate(zip(prompt_lens, output_lens)):
    s.add_request(Request(i, int(p), int(o), 0.0))
  steps = 0
  while s.has_unfinished():
    if steps >= max_steps:
      raise RuntimeError(f"the workload did not finish within {max_steps} scheduler steps")
    plan = s.schedule()
    clock.advance(1.0)
    s.on_step_done(plan)
    s.pop_finished()
    steps += 1
  return steps


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
