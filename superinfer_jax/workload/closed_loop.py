"""Submission times of a workload whose requests may wait on another request's finish (a closed loop).

An open-loop request (``after_request_id is None``) is due at its ``arrival_s``. A closed-loop one (the next
turn of a conversation, ``workload/multiturn.py``) is due ``think_time_s`` after the request it names has
FINISHED; until then it is not due at all, however late it gets. ``ArrivalQueue`` is the one place this rule
lives: the real-engine replay (``experiment/workload_replay.py``) and the simulator (``sim/event_loop.py``)
both pop due requests from it and report every finish (and every request that will never finish: refused,
aborted) back to it. Times are seconds relative to the start of the run. Pure Python, no JAX.
"""
from __future__ import annotations

import heapq
import math
from typing import Any, Optional, Sequence


class ArrivalQueue:
  """The requests of one run not yet submitted, with the time each becomes due (None: waiting on a finish).

  Use: ``due(now)`` pops every request due by ``now`` as ``(spec, arrival_s)`` in (time, id) order, where
  ``arrival_s`` is the time it became due (the arrival to record: for a closed-loop request, its
  predecessor's finish plus its think time); ``finished(rid, t)`` releases the requests waiting on ``rid``;
  ``dropped(rid)`` removes, transitively, those that wait on a request that will never finish and returns
  them. ``next_due_s()`` is the earliest known due time (None: nothing is due until something finishes).
  """

  def __init__(self, requests: Sequence[Any]):
    ids = {str(s.request_id) for s in requests}
    self._heap: list[tuple[float, str, int, Any]] = []
    self._waiting: dict[str, list[Any]] = {}
    for i, s in enumerate(requests):
      after = getattr(s, "after_request_id", None)
      if after is None:
        self._heap.append((float(s.arrival_s), str(s.request_id), i, s))
      elif str(after) not in ids:
        raise ValueError(f"{s.request_id}: after_request_id {after!r} is not in the workload")
      else:
        self._waiting.setdefault(str(after), []).append(s)
    heapq.heapify(self._heap)
    self._order = len(requests)
    self._num_waiting = sum(len(v) for v in self._waiting.values())

  def __len__(self) -> int:
    """Requests not yet submitted: due later, or waiting on a request that has not finished."""
    return len(self._heap) + self._num_waiting

  def next_due_s(self) -> Optional[float]:
    return self._heap[0][0] if self._heap else None

  def due(self, now_s: float) -> list[tuple[Any, float]]:
    """Pops every request due by ``now_s``: ``(spec, arrival_s)`` in (due time, id) order."""
    out = []
    while self._heap and self._heap[0][0] <= now_s:
      t, _, _, spec = heapq.heappop(self._heap)
      out.append((spec, t))
    return out

  def finished(self, request_id: str, t_s: float) -> None:
    """``request_id`` finished at ``t_s``: each request waiting on it becomes due ``think_time_s`` later."""
    if not math.isfinite(t_s):
      raise ValueError(f"finish time of {request_id} must be finite, got {t_s}")
    for s in self._waiting.pop(str(request_id), ()):
      self._num_waiting -= 1
      heapq.heappush(self._heap, (t_s + float(s.think_time_s), str(s.request_id), self._order, s))
      self._order += 1

  def dropped(self, request_id: str) -> list[Any]:
    """``request_id`` will never finish (refused, aborted): removes the requests that wait on it, and on
    them, and so on; returns them (they are never submitted)."""
    out, stack = [], [str(request_id)]
    while stack:
      for s in self._waiting.pop(stack.pop(), ()):
        self._num_waiting -= 1
        out.append(s)
        stack.append(str(s.request_id))
    return out

  def drain(self) -> list[Any]:
    """Removes and returns everything not yet submitted (due later or waiting), e.g. at a time limit."""
    out = [entry[3] for entry in sorted(self._heap)]
    self._heap = []
    for waiting in self._waiting.values():
      out.extend(waiting)
    self._waiting = {}
    self._num_waiting = 0
    return out
