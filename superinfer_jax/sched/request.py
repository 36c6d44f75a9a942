"""Request lifecycle for the scheduler.

States (docs/paper.md §1; the *rotary* state is the paper's new one)::

    WAITING --admit--> RUNNING --rotate out--> ROTARY --rotate in--> RUNNING
                          |  \\--recompute preemption--> PREEMPTED --admit--> RUNNING
                          +--> FINISHED (stop / length)     any live state --abort--> ABORTED

* WAITING: never run; no KV anywhere.
* RUNNING: KV on device (resident in the block manager), scheduled in steps.
* ROTARY: KV parked on host (swapped in the block manager); resumes by a swap-in (no recompute).
* PREEMPTED: KV dropped; waits to recompute prompt + generated tokens (``num_computed_tokens == 0``).
* FINISHED / ABORTED: terminal; all blocks released.

Token accounting (invariants): ``num_tokens = prompt_len + num_generated``;
``0 <= num_computed_tokens <= num_tokens + inflight_samples``; a request is in its *decode phase* when exactly
one of its tokens lacks KV (``num_tokens + inflight_samples - num_computed_tokens == 1``); it is
*mid-prefill* when more than one does and some KV exists. ``inflight_samples`` (0 or 1) counts tokens a
dispatched-but-unfinished step will append (lookahead).

Times are seconds from the injected clock: ``arrival_time``, ``first_token_time``, ``last_token_time``
(None until the first token), ``state_time`` (when the current state was entered: the paper's t_run for
RUNNING), ``finish_time``. Per-request SLOs ``ttft_slo``/``tbt_slo`` default (None) to the scheduler's.
"""
from __future__ import annotations

import enum
from typing import Hashable


class RequestState(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  ROTARY = "rotary"
  PREEMPTED = "preempted"
  FINISHED = "finished"
  ABORTED = "aborted"


TERMINAL = (RequestState.FINISHED, RequestState.ABORTED)


class Request:
  """One request's scheduling state. Mutated only by the scheduler (and the engine via ``on_step_done``)."""
  __slots__ = ("req_id", "prompt_len", "max_tokens", "arrival_time", "ttft_slo", "tbt_slo", "state", "state_time", "first_token_time",
               "last_token_time", "finish_time", "finish_reason", "num_generated", "num_computed_tokens",
               "inflight_samples", "num_preemptions", "num_rotations", "tbt_max", "_qentry", "_demand",
               "_touched_step", "_admit_step", "_out_step", "_gen_at_admit")

  def __init__(self, req_id: Hashable, prompt_len: int, max_tokens: int, arrival_time: float,
               ttft_slo: float | None = None, tbt_slo: float | None = None):
    if prompt_len < 1:
      raise ValueError(f"request {req_id!r}: prompt_len must be >= 1, got {prompt_len}")
    if max_tokens < 1:
      raise ValueError(f"request {req_id!r}: max_tokens must be >= 1, got {max_tokens}")
    self.req_id = req_id
    self.prompt_len = prompt_len
    self.max_tokens = max_tokens
    self.arrival_time = float(arrival_time)
    self.ttft_slo = ttft_slo
    self.tbt_slo = tbt_slo
    self.state = RequestState.WAITING
    self.state_time = self.arrival_time
    self.first_token_time: float | None = None
    self.last_token_time: float | None = None
    self.finish_time: float | None = None
    self.finish_reason: str | None = None
    self.num_generated = 0
    self.num_computed_tokens = 0
    self.inflight_samples = 0
    self.num_preemptions = 0
    self.num_rotations = 0
    self.tbt_max = 0.0
    self._qentry = None  # the entry of this request in a scheduler queue (internal)
    self._demand = 0  # blocks counted in the scheduler's waiting+rotary demand (internal)
    self._touched_step = -1  # last step that moved this request between states (internal)
    self._admit_step = 0  # step it last entered RUNNING (internal; residency)
    self._out_step = -1  # step it was last rotated out (internal; same-step round trips)
    self._gen_at_admit = 0  # num_generated + inflight_samples when it last entered RUNNING (internal)

  # Read-only view of the scheduler's bookkeeping, for policies (the fields stay the scheduler's to write).
  @property
  def touched_step(self) -> int:
    """The last step that moved this request between states (-1: none yet)."""
    return self._touched_step

  @property
  def queued_demand(self) -> int:
    """Device blocks this request counts for in the scheduler's waiting + rotary demand while queued
    (``blocks_for(planned_tokens)``)."""
    return self._demand

  @property
  def admit_step(self) -> int:
    """The step it last entered RUNNING."""
    return self._admit_step

  @property
  def generated_at_admit(self) -> int:
    """``num_generated + inflight_samples`` when it last entered RUNNING."""
    return self._gen_at_admit

  @property
  def queue_key(self) -> tuple | None:
    """Its key in the scheduler queue it sits in (ascending = head), or None when not queued."""
    e = self._qentry
    return None if e is None else e[0]

  @property
  def num_tokens(self) -> int:
    return self.prompt_len + self.num_generated

  @property
  def planned_tokens(self) -> int:
    """Tokens the request will have once in-flight steps complete (lookahead: +1 per pending sample)."""
    return self.prompt_len + self.num_generated + self.inflight_samples

  def __repr__(self):
    return (f"Request({self.req_id!r}, {self.state.value}, prompt={self.prompt_len}, gen={self.num_generated}"
            f"/{self.max_tokens}, computed={self.num_computed_tokens})")
