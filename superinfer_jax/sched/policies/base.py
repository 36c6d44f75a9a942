"""The policy interface (``Policy``): queue keys and the step hook every scheduling policy implements.

A policy sees the scheduler only through the ``StepBuilder`` it is handed (``sched/step.py``: read-only queue
views and the step's operations) and the ``SchedulerConfig`` its keys read. It never writes a plan field or
the scheduler's state; the one state it keeps is its own (``FCFS``'s head counter for LIFO re-queueing).
"""
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
  uses_running_needs = False  # True: schedule_step calls step.running_needs() first (kept incrementally)

  def __init__(self):
    self._head_counter = 0

  # Queue keys: ascending = head of the queue. Fixed while the request sits in the queue. ``config``: the
  # scheduler's ``SchedulerConfig``.
  def waiting_key(self, r: Request, config) -> tuple:
    return (1, r.arrival_time)

  def preempted_key(self, r: Request, config) -> tuple:
    self._head_counter += 1
    return (0, -self._head_counter)  # re-queued at the head (vLLM v1)

  def rotary_key(self, r: Request, config) -> tuple:
    return (r.state_time,)

  def rotary_keys(self, rs, config) -> list:
    """``[rotary_key(r, config) for r in rs]`` (policies override it where one pass is cheaper)."""
    return [self.rotary_key(r, config) for r in rs]

  def candidates(self, step) -> Iterator[Request]:
    """Waiting + rotary requests, highest priority first (a snapshot: admission may change the queues)."""
    return step.waiting.iter_requests()

  def scan_candidates(self, step) -> Iterator[Request]:
    """``candidates()`` for a scan that changes no queue while it runs (``prioritize``), which may read the
    queues without a snapshot (``QueueView.view``). Default: ``candidates()``."""
    return self.candidates(step)

  def schedule_step(self, step) -> None:
    """Plans one step through ``step`` (a ``StepBuilder``): its operations, in the order the policy takes them."""
    raise NotImplementedError
