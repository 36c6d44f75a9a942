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

One writer. Every field is read freely (they are plain slots, so the scheduler's hot loops read them at
slot speed), but written only by this module's transitions, each of which checks the state it leaves:
``admit`` (WAITING / PREEMPTED -> RUNNING), ``preempt`` (RUNNING -> PREEMPTED), ``rotate_out_all``
(RUNNING -> ROTARY), ``rotate_in_all`` (ROTARY -> RUNNING, its pending token scheduled), ``finish``
(any live state -> FINISHED / ABORTED), and the token accounting of a step: ``record_scheduled`` (a
dispatched step computes tokens and samples) and ``token_done`` (a sampled token came back). The two
queue-handle fields ``_qentry`` and ``queued_demand`` belong to ``sched/queue.py`` (``FIELD_WRITERS``).
``tests/sched/test_sched_ownership.py`` runs the scheduler with every other writer refused.
"""
from __future__ import annotations

import enum
from typing import Hashable

from superinfer_jax.kv.layout import blocks_for


class RequestState(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  ROTARY = "rotary"
  PREEMPTED = "preempted"
  FINISHED = "finished"
  ABORTED = "aborted"


TERMINAL = (RequestState.FINISHED, RequestState.ABORTED)


class Request:
  """One request's scheduling state (module docstring: states, token accounting, the one writer)."""
  __slots__ = ("req_id", "prompt_len", "max_tokens", "arrival_time", "ttft_slo", "tbt_slo", "state",
               "state_time", "first_token_time", "last_token_time", "finish_time", "finish_reason",
               "num_generated", "num_computed_tokens", "inflight_samples", "num_preemptions", "num_rotations",
               "tbt_max", "_qentry", "queued_demand", "touched_step", "admit_step", "out_step",
               "generated_at_admit", "block_hashes", "num_cached_tokens")

  def __init__(self, req_id: Hashable, prompt_len: int, max_tokens: int, arrival_time: float,
               ttft_slo: float | None = None, tbt_slo: float | None = None, block_hashes: tuple | None = None):
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
    self._qentry = None  # its entry in a scheduler queue (written by sched/queue.py only)
    # Device blocks it counts for in its queue's demand (blocks_for(planned_tokens)); meaningful only while it
    # is queued; written by sched/queue.py only.
    self.queued_demand = 0
    self.touched_step = -1  # the last step that moved it between states (-1: none yet)
    self.admit_step = 0  # the step it last entered RUNNING (residency)
    self.out_step = -1  # the step it was last rotated out (-1: never; same-step round trips)
    self.generated_at_admit = 0  # num_generated + inflight_samples when it last entered RUNNING
    # Content hashes of its full prompt blocks (kv/prefix_hash.py), read-only; None: no prefix caching for it.
    if block_hashes is not None and len(block_hashes) > prompt_len:
      raise ValueError(f"request {req_id!r}: {len(block_hashes)} block hashes for a {prompt_len}-token prompt")
    self.block_hashes = block_hashes
    self.num_cached_tokens: int | None = None  # prompt tokens its first admission found cached (None: not yet)

  # ---------------------------------------------------------------------------------------------- reads
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

  def rotatable(self, step: int) -> bool:
    """May be rotated out at ``step`` (the one definition; a RUNNING request): decode phase (exactly one token
    without KV), it has sampled a token since it last entered RUNNING (so a prefill, first or recompute, is
    never interrupted and every rotation follows progress), not moved earlier in ``step``, and not about to
    finish (its in-flight step samples its last token: rotating it out would copy KV freed a step later)."""
    gen = self.num_generated + self.inflight_samples
    return (self.prompt_len + gen - self.num_computed_tokens == 1 and self.touched_step != step
            and self.generated_at_admit < gen < self.max_tokens)

  def resident_for(self, step: int) -> int:
    """Steps it has been RUNNING at ``step`` since it last entered RUNNING (``min_residency`` reads it)."""
    return step - self.admit_step

  def next_step_need(self, block_size: int) -> tuple[int, int]:
    """(device blocks, tokens) this RUNNING request needs next step, without a token budget: its tokens
    without KV, and the blocks they add (0, 0 once in-flight samples reach ``max_tokens``)."""
    gen = self.num_generated + self.inflight_samples
    c = self.num_computed_tokens
    rem = self.prompt_len + gen - c
    if rem <= 0 or gen >= self.max_tokens:
      return 0, 0
    return blocks_for(c + rem, block_size) - blocks_for(c, block_size), rem

  # ----------------------------------------------------------------------------------------- transitions
  def admit(self, step: int, now: float, cached_tokens: int = 0) -> None:
    """WAITING / PREEMPTED -> RUNNING at ``step`` (a prefill chunk follows: ``record_scheduled``). Its first
    ``cached_tokens`` tokens' KV came from the prefix cache (whole blocks): they count as computed, and on
    the first admission they are its ``num_cached_tokens``."""
    if self.state is not RequestState.WAITING and self.state is not RequestState.PREEMPTED:
      raise _bad_transition(self, "admit")
    if cached_tokens:
      if self.num_computed_tokens or not 0 < cached_tokens < self.planned_tokens:
        raise _bad_transition(self, f"admit with {cached_tokens} cached tokens")
      self.num_computed_tokens = cached_tokens
    if self.num_cached_tokens is None:
      self.num_cached_tokens = cached_tokens
    self.state = RequestState.RUNNING
    self.state_time = now
    self.touched_step = self.admit_step = step
    self.generated_at_admit = self.num_generated + self.inflight_samples

  def preempt(self, step: int, now: float) -> None:
    """RUNNING -> PREEMPTED (recompute preemption): its KV is dropped, so nothing counts as computed."""
    if self.state is not RequestState.RUNNING:
      raise _bad_transition(self, "preempt")
    self.num_computed_tokens = 0
    self.state = RequestState.PREEMPTED
    self.state_time = now
    self.touched_step = step
    self.num_preemptions += 1

  def finish(self, reason: str, now: float, aborted: bool = False) -> None:
    """Any live state -> FINISHED (``reason``), or ABORTED with ``aborted``."""
    if self.state in TERMINAL:
      raise _bad_transition(self, "finish")
    self.state = RequestState.ABORTED if aborted else RequestState.FINISHED
    self.state_time = self.finish_time = now
    self.finish_reason = reason

  def token_done(self, now: float) -> None:
    """A dispatched step's sampled token came back at ``now``: it moves from in flight to generated, and the
    first-token / last-token times and the largest gap between tokens are stamped."""
    if not self.inflight_samples:
      raise _bad_transition(self, "token_done")
    self.inflight_samples -= 1
    self.num_generated += 1
    if self.first_token_time is None:
      self.first_token_time = now
    else:
      gap = now - self.last_token_time
      if gap > self.tbt_max:
        self.tbt_max = gap
    self.last_token_time = now

  def __repr__(self):
    return (f"Request({self.req_id!r}, {self.state.value}, prompt={self.prompt_len}, gen={self.num_generated}"
            f"/{self.max_tokens}, computed={self.num_computed_tokens})")


# Fields written by a module other than this one (the queue's handle on a request); every other field is this
# module's alone.
FIELD_WRITERS = {"_qentry": "superinfer_jax.sched.queue", "queued_demand": "superinfer_jax.sched.queue"}


def _bad_transition(r: Request, what: str) -> RuntimeError:
  return RuntimeError(f"{what} is not a transition of {r!r} (state {r.state.value}, "
                      f"{r.inflight_samples} token(s) in flight)")


# Batched transitions: one call per step and batch on the scheduler's hot paths; each decides exactly as one
# call per request would.
def rotate_out_all(rs, step: int, now: float) -> int:
  """RUNNING -> ROTARY for each of ``rs`` (KV parked on host at ``step``); returns the steps they had each
  been RUNNING, summed (``StepPlan.residency_steps``)."""
  running = RequestState.RUNNING
  rotary = RequestState.ROTARY
  residency = 0
  for r in rs:
    if r.state is not running:
      raise _bad_transition(r, "rotate out")
    r.state = rotary
    r.state_time = now
    r.touched_step = r.out_step = step
    r.num_rotations += 1
    residency += step - r.admit_step
  return residency


def rotate_in_all(rs, step: int, now: float, block_size: int, count_needs: bool) -> tuple[int, int]:
  """ROTARY -> RUNNING for each of ``rs``, with its one pending token scheduled in ``step`` (computed by the
  step and sampled: a rotary request is in its decode phase). Returns ``(blocks, tokens)`` they need the
  step after (``running_needs``'s terms; ``(0, 0)`` unless ``count_needs``)."""
  running = RequestState.RUNNING
  need_tok = need_blk = 0
  for r in rs:
    if r.state is not RequestState.ROTARY or r.prompt_len + r.num_generated + r.inflight_samples \
        - r.num_computed_tokens != 1:
      raise _bad_transition(r, "rotate in")
    c = r.num_computed_tokens + 1  # the pending token, computed by this step
    r.state = running
    r.state_time = now
    r.touched_step = r.admit_step = step
    r.generated_at_admit = gen = c - r.prompt_len  # num_generated + inflight_samples
    r.num_computed_tokens = c
    r.inflight_samples += 1
    if count_needs and gen < r.max_tokens - 1:  # gen + 1 < max_tokens: it needs its next token's slot
      need_tok += 1
      if not c % block_size:
        need_blk += 1
  return need_blk, need_tok


def record_scheduled(reqs: dict, seqs, block_size: int, count_needs: bool, on_computed) -> tuple[int, int, int]:
  """A dispatched step computes ``seqs`` (``ScheduledSeq``s of RUNNING requests in ``reqs``, by id), in order:
  ``on_computed(req_id, num_computed_tokens)`` is told each request's new computed count (the block
  manager's ``mark_computed``), its computed tokens advance by its chunk, and a chunk that ends at its known
  tokens samples one token (in flight until ``token_done``). Returns ``(tokens, need_blocks, need_tokens)``:
  the chunks' tokens, and with ``count_needs`` the blocks and tokens those requests need the step after
  (``running_needs``'s terms), else zeros."""
  total = need_tok = need_blk = 0
  bs = block_size
  for seq in seqs:
    rid = seq.req_id
    r = reqs[rid]
    n = seq.num_new_tokens
    new = seq.num_computed_tokens + n
    on_computed(rid, new)
    r.num_computed_tokens = new
    total += n
    if seq.sample:
      r.inflight_samples += 1
      if count_needs and r.num_generated + r.inflight_samples < r.max_tokens:  # else it will finish
        need_tok += 1  # the sampled token's KV
        if new % bs == 0:
          need_blk += 1
    elif count_needs:  # a prefill chunk short of the known tokens
      rem = r.prompt_len + r.num_generated + r.inflight_samples - new
      need_tok += rem
      need_blk += (new + rem + bs - 1) // bs - (new + bs - 1) // bs  # blocks_for(new + rem) - blocks_for(new), inline
  return total, need_blk, need_tok
