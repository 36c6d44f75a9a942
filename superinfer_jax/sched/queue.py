"""``SortedQueue``: the scheduler's waiting and rotary queues, sorted by a key fixed at push time, with the
device blocks their requests would need (``demand``); ``QueueView``: the read-only face policies get.

Keys are the policies' queue keys (``policies/``): times that only grow for most pushes (arrivals, last-token
times), so a push is usually an append. Ascending = head. A queued request carries its entry (``_qentry``) and
its demand (``queued_demand``); this module is the one writer of both (``request.FIELD_WRITERS``). Pure Python
(no JAX).
"""
from __future__ import annotations

import bisect
import operator
from typing import Iterator

from superinfer_jax.sched.request import Request


_DEMAND = operator.attrgetter("queued_demand")


class SortedQueue:
  """Requests sorted by a key fixed at push time (ascending = head). O(log n) search + memmove updates.
  ``demand``: the sum of the queued requests' demands (blocks), kept on every push and removal; a request's
  ``queued_demand`` is set when it is pushed and left as it was when it is removed."""

  def __init__(self):
    self._items: list = []
    self._seq = 0
    self.demand = 0

  def push(self, r: Request, key, demand: int) -> None:
    self.push_many((r,), (key,), (demand,))

  def push_many(self, rs, keys, demands) -> None:
    """Queues each ``r`` of ``rs`` under the matching key of ``keys`` with the matching device-block demand
    of ``demands``, in order; equal keys keep push order."""
    self.demand += sum(demands)
    items = self._items
    seq = self._seq
    n = len(keys)
    if n > 1 and (not items or items[-1][0] <= keys[0]) and all(map(operator.le, keys, keys[1:])):
      # Bulk path (a step's rotation victims share their last-token time): keys ascend from the tail, so
      # every push is an append (what the loop below does): one extend, entries built in C.
      entries = list(zip(keys, range(seq + 1, seq + n + 1), rs))
      items += entries
      for r, entry, d in zip(rs, entries, demands):
        r._qentry = entry
        r.queued_demand = d
      self._seq = seq + n
      return
    for r, key, d in zip(rs, keys, demands):
      r.queued_demand = d
      seq += 1
      entry = (key, seq, r)
      # Fast path: keys are mostly times that only grow (arrivals, last-token times), so most pushes append
      # (the new seq is the largest, so the entry sorts after every equal key).
      if not items or items[-1][0] <= key:
        items.append(entry)
      else:
        bisect.insort(items, entry)
      r._qentry = entry
    self._seq = seq

  def remove_many(self, rs) -> None:
    """``remove(r)`` for each of ``rs`` (distinct requests in this queue). In queue order (how admission takes
    them: candidates are scanned head first) it costs one filtering pass over the queue up to the last of them;
    in any other order, one pass over the whole queue. Raises ``KeyError``, changing nothing, if one of them is
    not in this queue."""
    items = self._items
    entries = [r._qentry for r in rs]
    if not entries:
      return
    last = entries[-1]  # the last of rs in queue order, if rs is in queue order (checked by the count below)
    j = -1 if last is None else bisect.bisect_left(items, last)  # entries compare by (key, seq): seq is unique
    if j < 0 or j >= len(items) or items[j] is not last:
      raise KeyError(f"{rs[-1]!r} not in this queue")
    for r in rs:
      r._qentry = None  # marks them for the filters below
    k = len(entries)
    kept = [e for e in items[:j + 1] if e[2]._qentry is e]
    if len(kept) == j + 1 - k:
      items[:j + 1] = kept
    else:
      kept = [e for e in items if e[2]._qentry is e]  # some of rs lie after rs[-1], or are not queued
      if len(kept) != len(items) - k:
        for r, e in zip(rs, entries):
          r._qentry = e
        raise KeyError("remove_many: some requests are not in this queue")
      items[:] = kept
    self.demand -= sum(map(_DEMAND, rs))

  def remove(self, r: Request) -> None:
    entry = r._qentry
    items = self._items
    if items and items[0] is entry:  # fast path: admission takes from the head
      del items[0]
    else:
      i = bisect.bisect_left(items, entry)
      if i >= len(items) or items[i] is not entry:
        raise KeyError(f"{r!r} not in this queue")
      del items[i]
    r._qentry = None
    self.demand -= r.queued_demand

  def __len__(self) -> int:
    return len(self._items)

  def __bool__(self) -> bool:
    return bool(self._items)

  def requests(self) -> list[Request]:
    """A snapshot, head first (safe to iterate while the queue changes)."""
    return [e[2] for e in self._items]

  def iter_requests(self) -> Iterator[Request]:
    """Lazy head-first iteration over a snapshot (O(1) Python work per request actually consumed)."""
    return (e[2] for e in list(self._items))

  def entries(self) -> list:
    """Snapshot of ``(key, seq, request)`` entries, head first."""
    return list(self._items)

  def view(self) -> list:
    """The ``(key, seq, request)`` entries themselves, head first: no copy, so valid only while the queue does
    not change (a read-only scan such as ``prioritize``; the caller must not mutate it). Under rotation the
    rotary queue holds ~800 entries, and a snapshot's copy touches every entry's reference count each step."""
    return self._items

  def head(self) -> Request | None:
    return self._items[0][2] if self._items else None


class QueueView:
  """A read-only face of a ``SortedQueue`` (what policies see): length, truth, snapshots, head-first
  iteration, and ``view()``, the live entry list for a scan that changes no queue. It never changes the
  queue."""
  __slots__ = ("_q",)

  def __init__(self, queue: SortedQueue):
    self._q = queue

  def __len__(self) -> int:
    return len(self._q._items)

  def __bool__(self) -> bool:
    return bool(self._q._items)

  @property
  def demand(self) -> int:
    return self._q.demand

  def requests(self) -> list[Request]:
    return self._q.requests()

  def iter_requests(self) -> Iterator[Request]:
    return self._q.iter_requests()

  def entries(self) -> list:
    return self._q.entries()

  def view(self) -> list:
    return self._q._items

  def head(self) -> Request | None:
    return self._q.head()
