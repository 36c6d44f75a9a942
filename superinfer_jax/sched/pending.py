"""``PendingQueues``: the requests that are not running, in the two queues the policy orders, and the device
blocks they would need.

* ``waiting``: WAITING and PREEMPTED requests, keyed by the policy's ``waiting_key`` / ``preempted_key``;
* ``rotary``: ROTARY requests (KV parked on host), keyed by its ``rotary_keys``.

Keys are fixed at push time and the policy's (``policies/base.py``); a queued request counts
``blocks_for(planned_tokens)`` device blocks in its queue's ``demand`` (``queue.SortedQueue``), so
``demand`` is the sum over both queues, O(1). ``waiting_view`` / ``rotary_view`` are the read-only faces
(``queue.QueueView``) policies get. It never touches the block manager and never changes a request's state.
Pure Python, no JAX.
"""
from __future__ import annotations

from superinfer_jax.sched.queue import QueueView, SortedQueue
from superinfer_jax.sched.request import Request, RequestState
from superinfer_jax.kv.layout import blocks_for


class PendingQueues:
  """The waiting and rotary queues of one scheduler (module docstring)."""

  def __init__(self, policy, config, block_size: int):
    """``policy``: the ``Policy`` whose keys order the queues; ``config``: the ``SchedulerConfig`` its keys
    read; ``block_size``: tokens per KV block (the demand's unit)."""
    self._policy = policy
    self._config = config
    self._block_size = block_size
    self.waiting = SortedQueue()
    self.rotary = SortedQueue()
    self.waiting_view = QueueView(self.waiting)
    self.rotary_view = QueueView(self.rotary)

  @property
  def demand(self) -> int:
    """Device blocks every queued request would need (``blocks_for(planned_tokens)``, summed)."""
    return self.waiting.demand + self.rotary.demand

  def enqueue_waiting(self, r: Request, preempted: bool) -> None:
    """Queues a WAITING (or, with ``preempted``, a PREEMPTED) request where the policy places it."""
    p = self._policy
    key = p.preempted_key(r, self._config) if preempted else p.waiting_key(r, self._config)
    self.waiting.push(r, key, blocks_for(r.planned_tokens, self._block_size))

  def enqueue_rotary_many(self, rs) -> None:
    """Queues the ROTARY requests ``rs`` in order, keyed by the policy (one call per step's victims)."""
    bs = self._block_size
    demands = [(r.prompt_len + r.num_generated + r.inflight_samples + bs - 1) // bs for r in rs]  # blocks_for, inline
    self.rotary.push_many(rs, self._policy.rotary_keys(rs, self._config), demands)

  def dequeue(self, r: Request) -> None:
    """Removes a queued request from its queue (``KeyError`` if it is not queued)."""
    (self.rotary if r.state is RequestState.ROTARY else self.waiting).remove(r)

  def requeue(self, r: Request) -> None:
    """Removes and queues again a queued request whose key or demand may have changed (a token came back
    for it under lookahead)."""
    self.dequeue(r)
    if r.state is RequestState.ROTARY:
      self.enqueue_rotary_many((r,))
    else:
      self.enqueue_waiting(r, preempted=r.state is RequestState.PREEMPTED)
