"""``SchedulerProtocol``: the seam the engine and the simulator drive a scheduler through (no JAX).

``sched.Scheduler`` implements it; a drop-in scheduler needs only these members. Neither driver reaches
into a scheduler's internals: request state changes travel in the ``StepPlan`` (``admitted``,
``rotated_out``, ``rotated_in``, ``preempted``, ``round_trips``), finished requests come back from
``on_step_done``.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Optional, Protocol, runtime_checkable

from superinfer_jax.sched.plan import StepPlan
from superinfer_jax.sched.request import Request


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
  """A snapshot of a scheduler and its block pools (``SchedulerProtocol.stats``), for metrics and health.

  Request counts by state; ``demand_blocks``: device blocks the waiting + rotary requests would need to run
  (``blocks_for(planned_tokens)`` summed); pool sizes and free blocks per tier; ``pending_writebacks``: full
  dirty blocks queued for eager write-back; ``totals``: the cumulative counters (steps, rotations, blocks
  moved, preemptions, admitted, finished, aborted, ...), a copy; ``prefix_cache``: prefix caching's counters
  in blocks (``queried``, ``device_hits``, ``host_hits``: full prompt blocks of first admissions and those
  found per tier; ``rehits``: found again by requests re-admitted after a recompute preemption;
  ``readopted_blocks``: re-adopted with no copy by swap-ins; cached / evictable blocks and evictions per
  tier: ``BlockManager.prefix_cache_stats``).
  """
  num_waiting: int
  num_running: int
  num_rotary: int
  demand_blocks: int
  device_blocks: int
  free_device_blocks: int
  host_blocks: int
  free_host_blocks: int
  pending_writebacks: int
  totals: dict
  prefix_cache: dict = dataclasses.field(default_factory=dict)


@runtime_checkable
class SchedulerProtocol(Protocol):
  """What a driver (``engine.LLMEngine``, the simulator) calls, in this order per step:

  ``schedule(lookahead)`` -> issue the plan's copies -> dispatch its step -> ``on_step_done(plan, ...)``
  (under lookahead the next ``schedule(True)`` comes before the previous plan's ``on_step_done``).
  """

  def add_request(self, req: Request) -> None:
    """Queue a fresh request; ``ValueError`` if its id is live or it can never fit the device pool."""

  def abort(self, req_id: Hashable) -> bool:
    """End a live request and release its blocks; False if the id is unknown."""

  def schedule(self, lookahead: bool = False) -> StepPlan:
    """Plan the next step at the clock's time."""

  def on_step_done(self, plan: StepPlan, new_tokens: Optional[dict] = None, finished: Optional[dict] = None,
                   now: Optional[float] = None) -> dict:
    """The step of ``plan`` finished; ``finished`` holds the engine's stops (``{req_id: reason}``). Returns
    ``{req_id: reason}`` of every request that finished with it, in finish order: "length" when it reached
    its ``max_tokens`` (decided here, and only here), else the engine's reason."""

  def pop_finished(self) -> list[Request]:
    """Terminal requests since the last call (drivers call it so nothing is hoarded)."""

  def has_unfinished(self) -> bool:
    """True while any request is waiting, running or rotary."""

  def stats(self) -> SchedulerStats:
    """Request counts, pool occupancy and cumulative counters now (reads only)."""

  def check_invariants(self) -> None:
    """Asserts the scheduler's and its block manager's invariants (``AssertionError`` naming the first
    violation); reads only."""
