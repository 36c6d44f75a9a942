"""The policy interface: queue keys and the step hook every scheduling policy implements (``Policy``)."""
from __future__ import annotations

from typing import Iterator

from superinfer_jax.sched.request import Request, RequestState


RUNNING = RequestState.RUNNING
ROTARY = RequestState.ROTARY
WAITING = RequestState.WAITING


class Policy:
  """Base: FCFS-style queue keys and step logic (vLLM v1 ``fcfs``)."""
  name = "base"
  reactive_mode = "recompute"
  uses_host_pool = True   # False: KV never goes to host, so eager write-back would only waste D2H bandwidth
  uses_running_needs = False  # True: schedule_step calls sched.running_needs() first (kept incrementally)

  def __init__(self):
    self._head_counter = 0

  # Queue keys: ascending = head of the queue. Fixed while the request sits in the queue.
  def waiting_key(self, r: Request, sched) -> tuple:
    return (1, r.arrival_time)

  def preempted_key(self, r: Request, sched) -> tuple:
    self._head_counter += 1
    return (0, -self._head_counter)  # re-queued at the head (vLLM v1)

  def rotary_key(self, r: Request, sched) -> tuple:
    return (r.state_time,)

  def rotary_keys(self, rs, sched) -> list:
    """``[rotary_key(r, sched) for r in rs]`` (policies override it where one pass is cheaper)."""
    return [self.rotary_key(r, sched) for r in rs]

  def candidates(self, sched, now: float) -> Iterator[Request]:
    """Waiting + rotary requests, highest priority first."""
    return sched.waiting.iter_requests()

  def scan_candidates(self, sched, now: float) -> Iterator[Request]:
    """``candidates()`` for a scan that changes no queue while it runs (``prioritize``), which may read the
    queues without a snapshot (``SortedQueue.view``). Default: ``candidates()``."""
    return self.candidates(sched, now)

  def schedule_step(self, sched, plan, now: float) -> None:
    raise NotImplementedError
