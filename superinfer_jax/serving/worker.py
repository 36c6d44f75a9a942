"""The engine thread: owns the (not thread-safe) ``LLMEngine`` and steps it continuously.

HTTP handlers (asyncio) talk to it only through ``EngineWorker``'s methods, which never block:

* ``submit(...)`` puts an "add" command on a thread-safe ``queue.Queue`` and returns an ``asyncio.Queue``
  on which the engine thread delivers, with ``loop.call_soon_threadsafe``, the request's events:
  ``("output", RequestOutput)`` per step with new tokens (the last one has ``finished``),
  ``("error", APIError)`` when it fails (rejected by the engine: 400; a step raised: 500).
* ``abort(request_id)`` (client gone) puts an "abort" command; the request's blocks are freed at once.
* ``call(fn)`` runs ``fn(engine)`` in the engine thread between steps and returns a future (metrics
  snapshots, invariant checks).

The loop: drain commands (blocking briefly when the engine is idle), then ``engine.step()``. An exception
inside a step fails every live request with a 500 error (the step's requests cannot be told apart from
the rest once the engine raised), aborts them, and the loop goes on; if the engine cannot be drained
afterwards (the real engine cannot today: its pipelined plans stay in flight in the scheduler) it is
rebuilt with ``engine_factory`` (when given). ``stop()`` aborts whatever is left
(each gets a 503 error event) and joins the thread.

Admission is bounded by ``max_queue``: at most that many requests accepted and not yet finished (waiting,
running, rotary or still in the command queue); beyond it ``submit`` raises a 429 ``APIError``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import traceback
from typing import Any, Callable, Optional

from superinfer_jax.serving.protocol import APIError

log = logging.getLogger("superinfer_jax.serving")


class EngineWorker:

  def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, *, max_queue: int = 256,
               metrics: Any = None, engine_factory: Optional[Callable[[], Any]] = None,
               idle_wait_s: float = 0.05):
    if max_queue < 1:
      raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    self.engine = engine
    self.loop = loop
    self.max_queue = max_queue
    self.metrics = metrics
    self.engine_factory = engine_factory
    self.idle_wait_s = idle_wait_s
    self._cmds: queue.Queue = queue.Queue()
    self._sinks: dict[str, asyncio.Queue] = {}     # engine thread only
    self._admitted = 0                             # event loop only
    self._admitted_lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._outbox: list = []
    self.step_errors = 0
    self.fatal: Optional[str] = None

  # ------------------------------------------------------------------------------- event-loop side
  def start(self) -> None:
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and not self._stop.is_set()

  @property
  def num_admitted(self) -> int:
    return self._admitted

  def submit(self, request_id: str, prompt: Any, params: Any, *, ttft_slo=None, tbt_slo=None) -> asyncio.Queue:
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
    self._cmds.put(("add", request_id, prompt, params, ttft_slo, tbt_slo, q))
    return q

  def done(self, request_id: str) -> None:
    """The handler got its request's final event (or gave up on it): frees its admission slot."""
    with self._admitted_lock:
      self._admitted -= 1

  def abort(self, request_id: str) -> None:
    self._cmds.put(("abort", request_id))

  def call(self, fn: Callable[[Any], Any]) -> "asyncio.Future":
    """Runs ``fn(engine)`` in the engine thread; an awaitable of its result."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    if not self._thread.is_alive():
      fut.set_exception(RuntimeError("the engine thread is not running"))
    else:
      self._cmds.put(("call", fn, fut))
    return asyncio.wrap_future(fut, loop=self.loop)

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

  def _handle(self, cmd: tuple) -> None:
    kind = cmd[0]
    if kind == "add":
      _, rid, prompt, params, ttft_slo, tbt_slo, q = cmd
      if self._stop.is_set():
        self._deliver(q, ("error", APIError(503, "the server is shutting down", type="server_error",
                                            code="unavailable")))
        return
      try:
        self.engine.add_request(prompt, params, request_id=rid, ttft_slo=ttft_slo, tbt_slo=tbt_slo)
      except ValueError as e:   # RequestError
        self._deliver(q, ("error", APIError(400, str(e), code="invalid_value")))
        return
      except Exception as e:  # pylint: disable=broad-except
        log.exception("add_request failed")
        self._deliver(q, ("error", APIError(500, f"the engine failed to queue the request: {e}",
                                            type="server_error", code="engine_error")))
        return
      self._sinks[rid] = q
      if self.metrics is not None:
        self.metrics.on_arrival(rid, self.engine.get_request(rid).arrival_time)
    elif kind == "abort":
      rid = cmd[1]
      if rid in self._sinks:
        self._sinks.pop(rid)
        try:
          self.engine.abort(rid)
        except Exception:  # pylint: disable=broad-except
          log.exception("abort failed")
        if self.metrics is not None:
          self.metrics.on_finish(rid, "abort")
    elif kind == "call":
      _, fn, fut = cmd
      if fut.set_running_or_notify_cancel():
        try:
          fut.set_result(fn(self.engine))
        except BaseException as e:  # pylint: disable=broad-except
          fut.set_exception(e)

  def _drain_commands(self, block: bool) -> None:
    try:
      cmd = self._cmds.get(timeout=self.idle_wait_s) if block else self._cmds.get_nowait()
    except queue.Empty:
      return
    while True:
      self._handle(cmd)
      try:
        cmd = self._cmds.get_nowait()
      except queue.Empty:
        return

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
      self.engine.block_manager.check_invariants()
    except Exception:  # pylint: disable=broad-except
      log.exception("the engine did not recover from a failed step")
      if self.engine_factory is None:
        raise
      # The engine has no reset API: a pipelined step that raised leaves its plans in flight in the scheduler,
      # so it is rebuilt (weights reloaded). The old one goes first, so its KV pool is freed before the new
      # one allocates.
      log.warning("rebuilding the engine")
      self.engine = None
      gc.collect()
      self.engine = self.engine_factory()

  def _step(self) -> None:
    outputs = self.engine.step()
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
      while not self._stop.is_set():
        busy = self.engine.has_unfinished()
        self._drain_commands(block=not busy)
        if self._stop.is_set():
          break
        if not self.engine.has_unfinished():
          if self.metrics is not None:
            self.metrics.after_step(self.engine)
          self._flush()
          continue
        try:
          self._step()
        except Exception as e:  # pylint: disable=broad-except
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
      # Shutdown: cancel what is left, then answer the commands still queued.
      self._fail_all(APIError(503, "the server shut down before the request finished", type="server_error",
                              code="unavailable"))
      try:
        while self.engine.has_unfinished():
          self.engine.step()
      except Exception:  # pylint: disable=broad-except
        log.exception("draining at shutdown failed")
      self._drain_commands(block=False)
      self._flush()
    except BaseException as e:  # pylint: disable=broad-except
      self.fatal = f"{type(e).__name__}: {e}"
      log.exception("the engine thread died")
      self._stop.set()
      self._fail_all(APIError(500, f"the engine thread died: {self.fatal}", type="server_error",
                              code="engine_error"))
      try:
        self._drain_commands(block=False)
      except Exception:  # pylint: disable=broad-except
        pass
      self._flush()


def _put_all(batch) -> None:
  for q, event in batch:
    q.put_nowait(event)
