"""``EngineStats``: the engine's counters since it started (steps, rotations, bytes moved, host time by phase).

Host-side only; no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class EngineStats:
  """Counters since the engine started. Bytes use the KV spec's block size (all layers, K and V)."""
  steps: int = 0
  model_steps: int = 0
  tokens_scheduled: int = 0
  tokens_generated: int = 0
  rotations_out: int = 0
  rotations_in: int = 0
  blocks_out: int = 0            # D2H blocks of rotations (swap-out)
  blocks_writeback: int = 0      # D2H blocks of eager write-back
  blocks_in: int = 0             # H2D blocks
  bytes_out: int = 0             # D2H bytes (swap-out + write-back)
  bytes_in: int = 0
  round_trips: int = 0           # rotated out and back in within one step (rotasched_code)
  recompute_preemptions: int = 0
  contended_steps: int = 0       # steps planned under memory contention (rotation considered)
  residency_steps: int = 0       # sum over rotations out of the steps the request had been resident
  rescheduled_drops: int = 0     # lookahead slots dropped because the request finished
  discarded_tokens: int = 0      # zero-bubble: tokens computed for a request that had stopped a step before
  batch_rebuilds: int = 0        # steps whose host inputs were rebuilt (the rest were updated in place)
  step_time_s: float = 0.0       # wall time spent inside step()
  host_time_s: float = 0.0       # ... of which not blocked waiting for sampled tokens
  wait_time_s: float = 0.0       # ... blocked in device_get of the sampled ids
  # Host time by phase (seconds): plan (scheduler), issue (DuplexKV), dispatch (build_batch + device_put +
  # jitted call), process (stop checks, detokenization, on_step_done).
  schedule_time_s: float = 0.0
  issue_time_s: float = 0.0
  dispatch_time_s: float = 0.0
  process_time_s: float = 0.0
  # CPU time of the host thread in dispatch (its own work; the wall time may include waiting for a core).
  dispatch_cpu_time_s: float = 0.0
  # Host time the device sits idle for in the loop: from reading step k's ids to dispatching step k+1
  # (pipelined: process + dispatch; the plan and transfers of k+1 are hidden behind step k; zero-bubble:
  # none, k+1 is dispatched before k's ids are read).
  exposed_host_time_s: float = 0.0

  @property
  def rotations_per_step(self) -> float:
    """Rotations out per planned step."""
    return self.rotations_out / self.steps if self.steps else 0.0

  @property
  def mean_residency_steps(self) -> Optional[float]:
    """Mean steps a request stayed RUNNING before it was rotated out (None: no rotation)."""
    return self.residency_steps / self.rotations_out if self.rotations_out else None

  @property
  def host_time_share(self) -> float:
    """Share of step() wall time the host spends working (not blocked on the device)."""
    return self.host_time_s / self.step_time_s if self.step_time_s > 0 else 0.0

  @property
  def exposed_host_share(self) -> float:
    """Share of step() wall time the device waits for the host (upper bound; see exposed_host_time_s)."""
    return self.exposed_host_time_s / self.step_time_s if self.step_time_s > 0 else 0.0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["host_time_share"] = self.host_time_share
    d["rotations_per_step"] = self.rotations_per_step
    d["mean_residency_steps"] = self.mean_residency_steps
    d["exposed_host_share"] = self.exposed_host_share
    return d
