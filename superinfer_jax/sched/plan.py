"""The scheduler's output for one engine step.

``StepPlan`` fields (the engine reads them in this order: rotations, then the model step):
  * ``step_id``: 0, 1, 2, ...; ``time``: the clock reading the plan was made at; ``lookahead``: planned while
    the previous step was still in flight.
  * ``scheduled``: ``list[ScheduledSeq]`` in batch order. ``ScheduledSeq(req_id, num_new_tokens,
    num_computed_tokens, block_table, sample)``: feed tokens ``[num_computed_tokens, num_computed_tokens +
    num_new_tokens)`` of the request (prompt ids, then generated ids; in lookahead the last one is the token
    the in-flight step is sampling); ``block_table`` is a fresh ``array('i')`` of device block ids (``kv/block_manager.py``) covering
    ``num_computed_tokens + num_new_tokens`` tokens; ``sample`` is True when the chunk reaches the end of
    the known tokens, i.e. the step must sample a token for this request (False for a partial prefill chunk).
  * ``swap_out``: D2H ``(device, host)`` pairs of requests rotated out this step (normally dirty tail blocks).
  * ``writeback``: D2H ``(device, host)`` pairs of the eager write-back (full blocks, computed earlier).
  * ``swap_in``: H2D ``(host, device)`` pairs of requests rotated in this step.
    The three copy lists are ``PairList``s (``kv/pairs.py``): they read like lists of 2-tuples; fast
    consumers use the ``srcs`` / ``dsts`` columns. The scheduler extends them column-wise.
    The engine executes them under the ordering contract stated in ``kv/block_manager.py``.
  * ``rotated_out``, ``rotated_in``, ``preempted`` (recompute), ``admitted`` (from WAITING/PREEMPTED):
    request-id lists (finishes come back from ``on_step_done``). ``round_trips``: requests
    rotated out and back in within this step (only ``rotasched_code``, as the reference fork does); each is
    in both ``rotated_out`` and ``rotated_in`` (the ordering contract's one exception, clause 3).
    ``residency_steps``: the
    steps the requests in ``rotated_out`` had each stayed RUNNING, summed (mean residency = its running sum
    over rotations out).
  * Counters: ``num_rotations`` (= len(rotated_out) + len(rotated_in)), ``blocks_out`` (= len(swap_out)),
    ``blocks_in`` (= len(swap_in)), ``blocks_writeback`` (= len(writeback)), ``num_recompute_preemptions``
    (= len(preempted)), ``num_batched_tokens`` (sum of num_new_tokens), ``contention`` (True when the step
    ran under memory contention, i.e. rotation was considered).
  * Prefix caching (docs/prefix_caching.md), blocks: ``prefix_queried`` (full prompt blocks of the requests
    admitted for the first time), ``prefix_device_hits`` / ``prefix_host_hits`` (of those, found on device /
    loaded from host: their H2D pairs are in ``swap_in``), ``prefix_rehits`` (blocks a request re-admitted
    after a recompute preemption found cached: its own KV, counted apart from the hits across requests).
"""
from __future__ import annotations

import dataclasses
from typing import Hashable

from superinfer_jax.kv.pairs import PairList, h2d_pairs


class ScheduledSeq:
  """One sequence of a step (see the module docstring)."""
  __slots__ = ("req_id", "num_new_tokens", "num_computed_tokens", "block_table", "sample")

  def __init__(self, req_id: Hashable, num_new_tokens: int, num_computed_tokens: int,
               block_table, sample: bool):
    self.req_id = req_id
    self.num_new_tokens = num_new_tokens
    self.num_computed_tokens = num_computed_tokens
    self.block_table = block_table
    self.sample = sample

  def __repr__(self):
    return (f"ScheduledSeq({self.req_id!r}, new={self.num_new_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, sample={self.sample})")

  def __eq__(self, other):
    return isinstance(other, ScheduledSeq) and all(
        getattr(self, k) == getattr(other, k) for k in self.__slots__)


@dataclasses.dataclass
class StepPlan:
  step_id: int
  time: float
  lookahead: bool = False
  scheduled: list = dataclasses.field(default_factory=list)
  swap_out: PairList = dataclasses.field(default_factory=PairList)
  swap_in: PairList = dataclasses.field(default_factory=h2d_pairs)  # srcs: an array of host ids
  writeback: PairList = dataclasses.field(default_factory=PairList)
  rotated_out: list = dataclasses.field(default_factory=list)
  rotated_in: list = dataclasses.field(default_factory=list)
  preempted: list = dataclasses.field(default_factory=list)
  admitted: list = dataclasses.field(default_factory=list)
  round_trips: list = dataclasses.field(default_factory=list)
  residency_steps: int = 0   # sum over rotated_out of the steps each had been RUNNING (since it last entered)
  num_batched_tokens: int = 0
  contention: bool = False
  prefix_queried: int = 0
  prefix_device_hits: int = 0
  prefix_host_hits: int = 0
  prefix_rehits: int = 0

  @property
  def num_rotations(self) -> int:
    return len(self.rotated_out) + len(self.rotated_in)

  @property
  def blocks_out(self) -> int:
    return len(self.swap_out)

  @property
  def blocks_in(self) -> int:
    return len(self.swap_in)

  @property
  def blocks_writeback(self) -> int:
    return len(self.writeback)

  @property
  def num_recompute_preemptions(self) -> int:
    return len(self.preempted)

  @property
  def has_work(self) -> bool:
    """True when the step computes, copies or changes any request's state."""
    return bool(self.scheduled or self.swap_out or self.swap_in or self.writeback or self.rotated_out
                or self.rotated_in or self.preempted)

  @property
  def is_empty(self) -> bool:
    return not (self.scheduled or self.swap_out or self.swap_in or self.writeback)

  def scheduled_ids(self) -> list:
    return [s.req_id for s in self.scheduled]
