"""Real-time replay of a workload on an in-process ``LLMEngine``.

The driver plays the client: request i is submitted at ``t0 + arrival_s[i]`` on the engine's clock, with
that scheduled time as its arrival (so queueing before submission counts against TTFT, as with a real
client), ``ignore_eos=True``, greedy, and ``max_tokens`` = the workload's output length (the paper's
benchmark setting, docs/paper.md §5). Between steps it records every output token's timestamp (as the engine
stamped it) and every state change the engine reports in its outputs (running / rotary / preempted, at
the time of the plan that made it; waiting at arrival; finished) into a ``TimelineRecorder``. When nothing is live it sleeps until the next arrival.

Closed loop (a multi-turn workload, ``RequestSpec.after_request_id``): such a request is submitted only
``think_time_s`` after the request it names has finished (the time of its last token), and that time is its
arrival; ``workload.closed_loop.ArrivalQueue`` holds the rule. A request whose predecessor was refused is
never submitted and is reported in ``rejected`` too.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Optional, Sequence

from superinfer_jax.metrics.timeline import RequestTimeline, TimelineRecorder
from superinfer_jax.util import progress_bar
from superinfer_jax.workload.closed_loop import ArrivalQueue


@dataclasses.dataclass
class ReplayResult:
  """What one replay produced. Times are seconds on the engine's clock."""
  timelines: list[RequestTimeline]
  duration_s: float                      # first arrival -> last token (or time limit)
  engine_stats: dict[str, Any]
  rejected: list[tuple[str, str]]        # (request id, error) refused at add_request
  compilations: tuple                    # (model-step, rotation) compilations during the replay (None: unknown)
  timed_out: bool = False
  step_times_s: list[float] = dataclasses.field(default_factory=list)  # wall time of every engine.step()
  loadavg_1m: tuple = (None, None)       # the machine's 1-minute load average at the start and the end
  cpu_share: Optional[float] = None      # this process's CPU s per wall s inside engine.step() (StepTimer)


def _compilations(engine) -> tuple[Optional[int], Optional[int]]:
  """(model-step, rotation-kernel) compiled variants so far (process-wide jit caches); None where this
  JAX version hides the count (it is read through a private API)."""
  from superinfer_jax.rotation import kernels  # pylint: disable=import-outside-toplevel
  step = engine.num_compiled_shapes()
  return (step if step >= 0 else None), kernels.compiled_variants()


def loadavg_1m() -> Optional[float]:
  """The machine's 1-minute load average (None where the OS has none)."""
  try:
    return os.getloadavg()[0]
  except (AttributeError, OSError):
    return None


class StepTimer:
  """Runs ``engine.step()`` and records its wall time and this process's CPU time (all threads) per call,
  so a run's step times and its CPU share while stepping can be compared with the warm-up's."""

  def __init__(self):
    self.step_times_s: list[float] = []
    self.cpu_s = 0.0

  def step(self, engine):
    ts, cs = time.perf_counter(), time.process_time()
    outputs = engine.step()
    self.cpu_s += time.process_time() - cs
    self.step_times_s.append(time.perf_counter() - ts)
    return outputs

  @property
  def cpu_share(self) -> Optional[float]:
    """CPU seconds per wall second inside ``step()`` (None before any step)."""
    busy = sum(self.step_times_s)
    return self.cpu_s / busy if busy > 0 else None


def _diff(after: Optional[int], before: Optional[int]) -> Optional[int]:
  return None if after is None or before is None else after - before


def _admit(engine, queue: ArrivalQueue, t0: float, now: float, recorder: TimelineRecorder,
           live: set[str], rejected: list[tuple[str, str]], bar) -> None:
  """Adds the requests of ``queue`` due by ``now`` (``t0`` + their due time, which is their arrival) to
  ``engine`` (greedy, exactly ``output_len`` tokens) and to ``recorder``; a refused one (``ValueError``) goes
  to ``rejected`` and never goes ``live``, and so do the requests that wait on it (never submitted)."""
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  for spec, due_s in queue.due(now - t0):
    rid = str(spec.request_id)
    arrival = t0 + due_s
    prompt = spec.prompt_token_ids if spec.prompt_token_ids is not None else spec.prompt
    recorder.add_request(rid, arrival, spec.prompt_len, target_output_len=spec.output_len,
                         source=getattr(spec, "source", "") or "")
    try:
      engine.add_request(prompt, SamplingParams(max_tokens=spec.output_len, temperature=0.0,
                                                ignore_eos=True),
                         request_id=rid, arrival_time=arrival)
    except ValueError as e:  # RequestError: refused, recorded as never finished
      rejected.append((rid, str(e)))
      dropped = queue.dropped(rid)
      rejected.extend((str(d.request_id), f"never submitted: it comes after {rid}, which was refused")
                      for d in dropped)
      if bar is not None:
        bar.update(1 + len(dropped))
      continue
    live.add(rid)


def _record_outputs(outputs, recorder: TimelineRecorder, live: set[str], bar, now: float,
                    queue: Optional[ArrivalQueue] = None, t0: float = 0.0) -> float:
  """Records one step's ``outputs`` (state changes, token times, finishes: a finish without a token time
  at ``now``), drops finished ids from ``live`` and reports each finish to ``queue`` (which releases the
  requests waiting on it). Returns the latest token time in them (-inf: none)."""
  last = -math.inf
  for o in outputs:
    for t, state in o.state_changes:
      recorder.state(o.request_id, t, state)
    if o.timestamps:
      for ts in o.timestamps:
        recorder.token(o.request_id, ts)
      last = max(last, o.timestamps[-1])
    if o.finished:
      t_fin = o.timestamps[-1] if o.timestamps else now
      recorder.finish(o.request_id, t_fin, o.finish_reason or "length")
      live.discard(o.request_id)
      if queue is not None:
        queue.finished(o.request_id, t_fin - t0)
      if bar is not None:
        bar.update(1)
  return last


def replay_workload(engine, requests: Sequence[Any], *, desc: str = "replay", progress: bool = True,
                    time_limit_s: Optional[float] = None, idle_sleep_max_s: float = 0.05) -> ReplayResult:
  """Replays ``requests`` (``workload.RequestSpec``s, any order) on ``engine`` in real time.

  Args:
    engine: an ``LLMEngine`` (fresh, or at least idle).
    requests: specs with ``request_id``, ``prompt_token_ids`` (or ``prompt``), ``output_len``,
      ``arrival_s`` (seconds after the start of the replay), optionally ``after_request_id`` and
      ``think_time_s`` (closed loop: submitted that long after the named request finished).
    time_limit_s: stop (abort what is left) after this many seconds; unfinished requests stay in the
      timelines with ``finish_reason=None``.
  Returns a ``ReplayResult``; every request appears in ``timelines`` exactly once.
  """
  clock = engine.clock
  queue = ArrivalQueue(requests)
  recorder = TimelineRecorder()
  rejected: list[tuple[str, str]] = []
  live: set[str] = set()
  compiled_before = _compilations(engine)
  bar = progress_bar(len(queue), desc, progress)
  load_start = loadavg_1m()
  timer = StepTimer()
  t0 = clock.now()
  timed_out = False
  last_token_t = t0
  while len(queue) or live:
    now = clock.now()
    if time_limit_s is not None and now - t0 > time_limit_s:
      timed_out = True
      break
    _admit(engine, queue, t0, now, recorder, live, rejected, bar)
    if not live:
      nxt_s = queue.next_due_s()
      if nxt_s is None:   # only requests waiting on one that never finished: cannot happen, never hang
        rejected.extend((str(s.request_id), "never submitted: its predecessor did not finish")
                        for s in queue.drain())
        break
      time.sleep(min(idle_sleep_max_s, max(0.0, t0 + nxt_s - clock.now())))
      continue
    outputs = timer.step(engine)
    last_token_t = max(last_token_t, _record_outputs(outputs, recorder, live, bar, clock.now(), queue, t0))
  if timed_out:
    for rid in list(live):
      engine.abort(rid)
    while engine.has_unfinished():
      engine.step()
  if bar is not None:
    bar.close()
  return ReplayResult(timelines=recorder.timelines(), duration_s=max(last_token_t - t0, 1e-9),
                      engine_stats=engine.stats.as_dict(), rejected=rejected,
                      compilations=tuple(_diff(a, b) for a, b in zip(_compilations(engine), compiled_before)),
                      timed_out=timed_out, step_times_s=timer.step_times_s, loadavg_1m=(load_start, loadavg_1m()),
                      cpu_share=timer.cpu_share)
