"""Largest-VLT-first merges of the waiting and rotary queues: lazy iterators over both, highest VLT first.

Inputs are queue entry lists ``(key, seq, request)`` sorted ascending by key; outputs yield requests. They
never change the queues."""
from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from typing import Iterator

from superinfer_jax.sched.request import Request


def _lvf_merge(waiting: list, rotary: list, now: float, alpha: float) -> Iterator[Request]:
  """Largest VLT first over the two queues' entry lists (each sorted by its VLT zero point, ascending):
  snapshots, or the queues' own lists for a read-only scan (``scan_candidates``).

  The same order as ``heapq.merge(waiting, rotary, key=k)`` with ``k = (-VLT, -x)``, ``x`` the un-ReLU'd lag
  (``now - key`` for waiting, ``alpha * (now - key)`` for rotary), ties going to waiting. Since
  ``VLT = max(x, 0)`` is monotone in ``x``, ``(VLT, x)`` orders exactly as ``x`` does: rotary comes first iff
  its ``x`` is strictly larger. The scan runs every step, so the merge works run by run: along a queue
  ``x`` never grows (the keys ascend; float subtraction and, for ``alpha >= 0``, multiplication are
  monotone), so the entries that go before the other queue's head form a prefix, found by bisection and
  passed on as one lazy slice (``islice``: no copy, as a run is often consumed only in part). Per request only
  C code runs (``map``, ``chain``); Python work is per run.
  A negative alpha reverses the rotary order of ``x``: then the plain element-wise merge is used.
  """
  if alpha < 0:
    return _lvf_merge_pairwise(waiting, rotary, now, alpha)
  return itertools.chain.from_iterable(_lvf_runs(waiting, rotary, now, alpha))


def _lvf_runs(waiting: list, rotary: list, now: float, alpha: float) -> Iterator:
  """``_lvf_merge``'s runs (``alpha >= 0``): iterables of requests, alternately from each queue."""
  nw = len(waiting)
  nr = len(rotary)
  i = j = 0
  bisect_left = bisect.bisect_left
  islice = itertools.islice  # runs are lazy views of the lists (no copy: a run is often consumed only in part)
  while i < nw and j < nr:
    xw = now - waiting[i][0][0]
    # Rotary entries that go before waiting[i]: those with alpha * (now - key) > xw (a prefix from j).
    k = bisect_left(rotary, True, j, nr, key=lambda e: not alpha * (now - e[0][0]) > xw)
    if k > j:
      yield map(_REQ, islice(rotary, j, k))
      j = k
      if j == nr:
        break
    xr = alpha * (now - rotary[j][0][0])
    # Waiting entries that go before rotary[j]: those with not xr > now - key (a prefix from i, >= 1 long).
    k = bisect_left(waiting, True, i + 1, nw, key=lambda e: xr > now - e[0][0])
    yield map(_REQ, islice(waiting, i, k))
    i = k
  if i < nw:
    yield map(_REQ, islice(waiting, i, None))
  if j < nr:
    yield map(_REQ, islice(rotary, j, None))


_REQ = operator.itemgetter(2)  # a queue entry's request


def _lvf_merge_pairwise(waiting: list, rotary: list, now: float, alpha: float) -> Iterator[Request]:
  """``_lvf_merge`` one entry at a time (any alpha): compares the two heads' ``x``, yields the larger."""
  nw = len(waiting)
  nr = len(rotary)
  i = j = 0
  if nw and nr:
    xw = now - waiting[0][0][0]
    xr = alpha * (now - rotary[0][0][0])
    while True:
      if xr > xw:
        yield rotary[j][2]
        j += 1
        if j == nr:
          break
        xr = alpha * (now - rotary[j][0][0])
      else:
        yield waiting[i][2]
        i += 1
        if i == nw:
          break
        xw = now - waiting[i][0][0]
  while i < nw:
    yield waiting[i][2]
    i += 1
  while j < nr:
    yield rotary[j][2]
    j += 1
