"""The engine thread: owns the (not thread-safe) ``LLMEngine`` and steps it continuously.

HTTP handlers (asyncio) talk to it only through ``EngineWorker``'s methods, which never block:

* ``submit(...)`` puts an "add" command on a thread-safe ``queue.Queue`` and returns an ``asyncio.Queue``
  on which the engine thread delivers, with ``loop.call_soon_threadsafe``, the request's events:
  ``("output", RequestOutput)`` per step with new tokens (the last one has ``finished``),
  ``("error", APIError)`` when it fails (rejected by the engine: 400; a step raised: 500).
* ``abort(request_id)`` (client gone) puts an "abort" command; the request's blocks are freed at once.
* ``abort_all()`` (the end of a graceful drain) aborts every live request, each with a 503 error event.
* ``call(fn)`` runs ``fn(engine)`` in the engine thread between steps and returns a future (metrics
  snapshots, invariant checks).

The loop, once per iteration: drain the commands (blocking briefly when the engine is idle) into an
``EventBatch`` of new requests and aborts (``parallel/events.py``), apply it to the engine, run the
queued ``call``s, then ``engine.step()``. An exception inside a step fails every live request with a 500
error (the step's requests cannot be told apart from the rest once the engine raised), aborts them, and
the loop goes on; if the engine cannot be drained afterwards (the real engine cannot today: its pipelined
plans stay in flight in the scheduler) it is rebuilt with ``engine_factory`` (when given). ``stop()``
aborts whatever is left (each gets a 503 error event) and joins the thread.

Multi-process (``channel``: an ``EventChannel``): process 0's worker broadcasts each iteration's batch
before applying it, and every other process runs ``follow()``, the same loop fed by the broadcast instead
of the command queue, so all engines get the same events before the same step (docs/parallel.md). The
adds carry process 0's clock reading as their arrival time; a shutdown is a batch that aborts every live
request and stops every loop. A failed step is fatal there (the engines cannot be drained or rebuilt in
lockstep): the engine thread ends and ``/health`` answers 503. A request's ``cache_salt`` rides on its add
event (``AddEvent.cache_salt``), so every process applies it alike.

``warmup(engine)`` (e.g. precompiling every step shape) runs in the engine thread before the loop; ``ready``
says it is done (the app answers 503 until then). A step that compiles a new shape is logged as such.
Admission is bounded by ``max_queue`` requests accepted and not finished (``submit`` raises a 429 beyond).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import time
import traceback
from typing import Any, Callable, Optional

from superinfer_jax.parallel.events import AbortEvent, AddEvent, EventBatch
from superinfer_jax.serving.protocol import APIError
from superinfer_jax.util import freeze_heap, unfreeze_heap

log = logging.getLogger("superinfer_jax.serving")


class EngineWorker:

  def __init__(self, engine: Any, loop: Optional[asyncio.AbstractEventLoop], *, max_queue: int = 256,
               metrics: Any = None, engine_factory: Optional[Callable[[], Any]] = None,
               idle_wait_s: float = 0.05, channel: Any = None, warmup: Optional[Callable[[Any], None]] = None):
    if max_queue < 1:
      raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if channel is not None and engine_factory is not None:
      raise ValueError("a multi-process worker cannot rebuild its engine: give no engine_factory")
    self.engine, self.loop, self.max_queue, self.metrics = engine, loop, max_queue, metrics
    self.engine_factory, self.idle_wait_s = engine_factory, idle_wait_s
    self._cmds: queue.Queue = queue.Queue()
    self._sinks: dict[str, asyncio.Queue] = {}     # engine thread only
    self._admitted = 0                             # event loop only
    self._admitted_lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._outbox: list = []
    self._calls: list = []                         # "call" commands of this iteration (engine thread only)
    self.channel = channel
    self.step_errors = 0
    self.fatal: Optional[str] = None
    self.warmup = warmup
    self._ready = threading.Event()
    self._compiled = -1                            # the engine's compiled step variants after the last step

  # ------------------------------------------------------------------------------- event-loop side
  def start(self) -> None:
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and not self._stop.is_set()

  @property
  def ready(self) -> bool:
    """The warm-up (if any) has run: the engine serves."""
    return self._ready.is_set()

  @property
  def num_admitted(self) -> int:
    return self._admitted

  def submit(self, request_id: str, prompt: Any, params: Any, *, ttft_slo=None, tbt_slo=None,
             cache_salt: Optional[str] = None) -> asyncio.Queue:
    """Queues a request for the engine; returns its event queue. 429 when the admission queue is full,
    503 when the engine is stopping."""
    if not self.alive:
      raise APIError(503, "the server is shutting down" if self._stop.is_set() else
                     f"the engine thread is not running ({self.fatal or 'stopped'})",
                     type="server_error", code="unavailable")
    with self._admitted_lock:
      if self._admitted >= self.max_queue:
        if self.metrics is not None:
          self.metrics.rejected.labels(reason="queue_full").inc()
        raise APIError(429, f"the server is at capacity: {self._admitted} requests are queued or running "
                            f"(--max_queue={self.max_queue}); retry later", type="rate_limit_error",
                       code="queue_full")
      self._admitted += 1
    q: asyncio.Queue = asyncio.Queue()
    self._cmds.put(("add", request_id, prompt, params, ttft_slo, tbt_slo, cache_salt, q))
    return q

  def done(self, request_id: str) -> None:
    """The handler got its request's final event (or gave up on it): frees its admission slot."""
    with self._admitted_lock:
      self._admitted -= 1

  def abort(self, request_id: str) -> None:
    self._cmds.put(("abort", request_id))

  def abort_all(self) -> None:
    """Aborts every live request as a shutdown would (each gets a 503 error event), without stopping."""
    self._cmds.put(("abort_all",))

  def call(self, fn: Callable[[Any], Any]) -> "asyncio.Future":
    """Runs ``fn(engine)`` in the engine thread; an awaitable of its result."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    if not self._thread.is_alive():
      fut.set_exception(RuntimeError("the engine thread is not running"))
    else:
      self._cmds.put(("call", fn, fut))
    return asyncio.wrap_future(fut, loop=self.loop)

  def follow(self) -> None:
    """A non-zero process of a multi-process run: runs the engine loop in the calling thread, fed by process
    0's broadcasts, until process 0 stops. Raises RuntimeError if the loop died."""
    if self.channel is None or self.channel.is_source:
      raise ValueError("follow() is for the processes other than 0 of a multi-process run")
    self._run()
    if self.fatal is not None:
      raise RuntimeError(f"the engine loop died: {self.fatal}")

  def stop(self, timeout: float = 30.0) -> None:
    """Aborts what is left and joins the engine thread (idempotent)."""
    self._stop.set()
    self._cmds.put(("wake",))
    if self._thread.is_alive():
      self._thread.join(timeout)

  # ------------------------------------------------------------------------------ engine-thread side
  def _deliver(self, q: asyncio.Queue, event: tuple) -> None:
    """Queues an event for the event loop; ``_flush`` hands the step's events over in one wake-up."""
    self._outbox.append((q, event))

  def _flush(self) -> None:
    if not self._outbox:
      return
    batch, self._outbox = self._outbox, []
    try:
      self.loop.call_soon_threadsafe(_put_all, batch)
    except RuntimeError:   # the loop is closed (shutdown): nobody is listening any more
      pass

  def _drain(self, block: bool) -> list:
    timeout = self.channel.idle_interval_s if self.channel is not None else self.idle_wait_s
    try:
      cmds = [self._cmds.get(timeout=timeout) if block else self._cmds.get_nowait()]
    except queue.Empty:
      return []
    while True:
      try:
        cmds.append(self._cmds.get_nowait())
      except queue.Empty:
        return cmds

  def _collect(self, block: bool) -> tuple[EventBatch, list]:
    """Process 0 (or a single process): the commands queued since the last iteration as an ``EventBatch``,
    with the event queue of each add (None for aborts). Queues the ``call``s for ``_run_calls``; answers
    adds with 503 once stopping. When stopping, the batch also aborts every live request and stops."""
    cmds = self._drain(block)
    stopping = self._stop.is_set()                  # after the wait: stop() wakes it
    events, queues = [], []
    live = dict.fromkeys(self._sinks)               # insertion order: the shutdown aborts' order
    for cmd in cmds:
      kind = cmd[0]
      if kind == "add":
        _, rid, prompt, params, ttft_slo, tbt_slo, cache_salt, q = cmd
        if stopping:
          self._deliver(q, ("error", APIError(503, "the server is shutting down", type="server_error",
                                              code="unavailable")))
          continue
        events.append(AddEvent(rid, prompt, params, ttft_slo, tbt_slo, cache_salt))
        queues.append(q)
        live[rid] = None
      elif kind == "abort":
        if cmd[1] in live:   # else it already finished or was never accepted
          events.append(AbortEvent(cmd[1]))
          queues.append(None)
          del live[cmd[1]]
      elif kind == "call":
        self._calls.append(cmd)
      elif kind == "abort_all":
        for rid in live:
          events.append(AbortEvent(rid, shutdown=True))
          queues.append(None)
        live.clear()
    if stopping:
      for rid in live:
        events.append(AbortEvent(rid, shutdown=True))
        queues.append(None)
    # Multi-process: the adds' arrival time, process 0's reading of the shared clock (the others' add_request
    # must not read the clock themselves: that would be a collective process 0 does not join).
    now = self.engine.replica.local_now() if self.channel is not None and events else None
    return EventBatch(time=now, events=events, stop=stopping), queues

  def _next_batch(self) -> tuple[EventBatch, list]:
    """This iteration's events: collected here (process 0, single process), broadcast to the others."""
    if self.channel is not None and not self.channel.is_source:
      batch = self.channel.exchange(None)
      return batch, [None] * len(batch.events)
    batch, queues = self._collect(block=not self.engine.has_unfinished())
    if self.channel is not None:
      batch = self.channel.exchange(batch)   # the decoded copy: exactly what the other processes apply
    return batch, queues

  def _apply(self, batch: EventBatch, queues: list) -> None:
    """Applies the events in order. Engine calls depend on the batch only (every process makes the same
    ones); sinks, deliveries and metrics exist on process 0 only."""
    at = {} if batch.time is None else {"arrival_time": batch.time}
    for ev, q in zip(batch.events, queues):
      if isinstance(ev, AddEvent):
        rid = ev.request_id
        salt = ev.cache_salt
        try:
          self.engine.add_request(ev.prompt, ev.params, request_id=rid, ttft_slo=ev.ttft_slo,
                                  tbt_slo=ev.tbt_slo, **at, **({} if salt is None else {"cache_salt": salt}))
        except ValueError as e:   # RequestError
          if q is not None:
            self._deliver(q, ("error", APIError(400, str(e), code="invalid_value")))
          continue
        except Exception as e:  # pylint: disable=broad-except
          log.exception("add_request failed")
          if q is not None:
            self._deliver(q, ("error", APIError(500, f"the engine failed to queue the request: {e}",
                                                type="server_error", code="engine_error")))
          continue
        if q is not None:
          self._sinks[rid] = q
          if self.metrics is not None:
            self.metrics.on_arrival(rid, self.engine.get_request(rid).arrival_time, len(ev.prompt))
      else:
        rid = ev.request_id
        sink = self._sinks.pop(rid, None)
        try:
          self.engine.abort(rid)
        except Exception:  # pylint: disable=broad-except
          log.exception("abort failed")
        if sink is not None and ev.shutdown:
          self._deliver(sink, ("error", APIError(503, "the server shut down before the request finished",
                                                 type="server_error", code="unavailable")))
        if sink is not None and self.metrics is not None:
          self.metrics.on_finish(rid, "error" if ev.shutdown else "abort")

  def _run_calls(self) -> None:
    calls, self._calls = self._calls, []
    for _, fn, fut in calls:
      if fut.set_running_or_notify_cancel():
        try:
          fut.set_result(fn(self.engine))
        except BaseException as e:  # pylint: disable=broad-except
          fut.set_exception(e)

  def _fail_all(self, err: APIError) -> None:
    for rid, q in list(self._sinks.items()):
      self._deliver(q, ("error", err))
      try:
        self.engine.abort(rid)
      except Exception:  # pylint: disable=broad-except
        pass
      if self.metrics is not None:
        self.metrics.on_finish(rid, "error")
    self._sinks.clear()

  def _recover(self) -> None:
    """After a failed step: drain the aborted requests; rebuild the engine if that fails too."""
    try:
      for _ in range(8):
        if not self.engine.has_unfinished():
          break
        self.engine.step()
      if self.engine.has_unfinished():
        raise RuntimeError("the engine still has unfinished requests after aborting them all")
      self.engine.check_invariants()
      return
    except Exception:  # pylint: disable=broad-except
      log.exception("the engine did not recover from a failed step")
      if self.engine_factory is None:
        raise
    # The engine has no reset API: a pipelined step that raised leaves its plans in flight in the scheduler,
    # so it is rebuilt (weights reloaded). The old one goes first, so its KV pool is freed before the new one
    # allocates: outside the except block (the exception's traceback holds the failed step's frames, which
    # reference the old engine), and with the heap unfrozen (a frozen engine in a reference cycle is never
    # collected: util.freeze_heap), frozen again afterwards if it was.
    log.warning("rebuilding the engine")
    self.engine = None
    frozen = gc.get_freeze_count() > 0
    unfreeze_heap()
    self.engine = self.engine_factory()
    if frozen:
      freeze_heap()

  def _step(self) -> None:
    t0 = time.perf_counter()
    outputs = self.engine.step()
    compiled = self.engine.num_compiled_shapes() if hasattr(self.engine, "num_compiled_shapes") else -1
    if compiled > self._compiled >= 0:
      log.warning("a step compiled %d new shape(s) on the request path (%.2f s; %d compiled in all): "
                  "--precompile with the bucket floors at their maxima compiles every shape before serving",
                  compiled - self._compiled, time.perf_counter() - t0, compiled)
    self._compiled = compiled
    for o in outputs:
      q = self._sinks.get(o.request_id)
      if q is None:           # aborted by its client: drop, forget
        if o.finished:
          self.engine.release(o.request_id)
        continue
      if self.metrics is not None:
        self.metrics.on_output(o)
      if o.finished:
        self._sinks.pop(o.request_id)
        if o.finish_reason == "error":
          self._deliver(q, ("error", APIError(500, o.error or "the engine failed the request",
                                              type="server_error", code="engine_error")))
        else:
          self._deliver(q, ("output", o))
        self.engine.release(o.request_id)
        if self.metrics is not None:
          self.metrics.on_finish(o.request_id, o.finish_reason)
      elif o.token_ids or o.text:
        self._deliver(q, ("output", o))

  def _run(self) -> None:
    try:
      if self.warmup is not None:
        self.warmup(self.engine)
      self._compiled = self.engine.num_compiled_shapes() if hasattr(self.engine, "num_compiled_shapes") else -1
      self._ready.set()
      while True:
        batch, queues = self._next_batch()
        self._apply(batch, queues)
        self._run_calls()
        if batch.stop:
          break
        if self.engine.has_unfinished():
          try:
            self._step()
          except Exception as e:  # pylint: disable=broad-except
            if self.channel is not None:
              raise   # the other processes cannot recover in lockstep: fatal (module docstring)
            self.step_errors += 1
            if self.metrics is not None:
              self.metrics.step_errors.inc()
            log.error("engine step failed: %s", traceback.format_exc())
            self._fail_all(APIError(500, f"the engine step failed: {type(e).__name__}: {e}",
                                    type="server_error", code="engine_error"))
            self._recover()
        if self.metrics is not None:
          self.metrics.after_step(self.engine)
        self._flush()
      # Shutdown: the stop batch aborted what was live; drain the engine (every process alike), then answer
      # the commands still queued (adds get 503; no live request is left to abort).
      try:
        while self.engine.has_unfinished():
          self._step()
      except Exception:  # pylint: disable=broad-except
        log.exception("draining at shutdown failed")
      if self.channel is None or self.channel.is_source:
        self._collect(block=False)
        self._run_calls()
      self._flush()
    except BaseException as e:  # pylint: disable=broad-except
      self.fatal = f"{type(e).__name__}: {e}"
      log.exception("the engine thread died")
      self._stop.set()
      self._fail_all(APIError(500, f"the engine thread died: {self.fatal}", type="server_error",
                              code="engine_error"))
      try:
        self._collect(block=False)
        self._run_calls()
      except Exception:  # pylint: disable=broad-except
        pass
      self._flush()


def _put_all(batch) -> None:
  for q, event in batch:
    q.put_nowait(event)
