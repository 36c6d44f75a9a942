"""``SortedQueue``: the scheduler's waiting and rotary queues, sorted by a key fixed at push time.

Keys are the policies' queue keys (``policies.py``): times that only grow for most pushes (arrivals, last-token
times), so a push is usually an append. Ascending = head. Pure Python (no JAX).
"""
from __future__ import annotations

import bisect
from typing import Iterator

from superinfer_jax.sched.request import Request


class SortedQueue:
  """Requests sorted by a key fixed at push time (ascending = head). O(log n) search + memmove updates."""

  def __init__(self):
    self._items: list = []
    self._seq = 0

  def push(self, r: Request, key) -> None:
    self._seq += 1
    entry = (key, self._seq, r)
    items = self._items
    # Fast path: keys are mostly times that only grow (arrivals, last-token times), so most pushes append.
    if not items or items[-1][0] <= key:
      items.append(entry)  # the new seq is the largest, so entry sorts after every equal key
    else:
      bisect.insort(items, entry)
    r._qentry = entry

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

  def head(self) -> Request | None:
    return self._items[0][2] if self._items else None
