"""Device idle time between consecutive model steps, from real timestamps (not host phase timers).

``DeviceIdleProbe`` is attached to an engine (``LLMEngine(..., idle_probe=probe)`` or
``engine.idle_probe = probe``). For every dispatched step k the engine calls ``dispatched(tokens_k)`` right
after the jitted call returned, i.e. once step k is enqueued on the device: the probe records that time
``d_k`` and hands ``tokens_k`` (an output of step k) to a watcher thread that blocks in
``block_until_ready`` and records ``e_k``, the time step k's outputs became ready (the step's end; the
outputs of one executable become ready together). The device waits for the host before step k+1 for

    idle_k = max(0, d_{k+1} - e_k)

(step k+1 cannot start before it is enqueued, and the device is free from ``e_k``). Steps dispatched while
the previous one still ran give 0. ``idle_ms()`` lists idle_k for consecutive dispatched pairs; a pair
whose gap spans a host step that dispatched nothing is left out (``break_chain``).

Error of the method: ``e_k`` can only be late, never early: the watcher notes the time after it woke and
took the GIL (a busy host thread holds it for up to ``sys.getswitchinterval()``, 5 ms by default; the bench
lowers it to 0.1 ms while it measures). The engine also reports when the host itself read step k's ids
(``read(k)``), which is also after the true end; ``e_k`` is the earlier of the two. A late ``e_k`` can
only hide idle time, so idle_k is a lower bound, tight to the wake-up latency that
``wakeup_latency_ms()`` measures (hand-off of an already-ready array to the watcher). ``d_{k+1}`` is when
the host's enqueue returned, a little after the device could have started.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Optional

import jax


class DeviceIdleProbe:
  """See the module docstring. ``start()`` / ``stop()`` bracket a measured run; ``reset()`` clears."""

  def __init__(self):
    self._q: "queue.Queue" = queue.Queue()
    self._thread: Optional[threading.Thread] = None
    self._lock = threading.Lock()
    self.reset()

  def reset(self) -> None:
    with self._lock:
      self._dispatch: list[float] = []
      self._ready: dict[int, float] = {}
      self._breaks: set[int] = set()      # k: no idle pair (k-1, k)
      self._latency: list[float] = []

  def start(self) -> "DeviceIdleProbe":
    if self._thread is None:
      self._thread = threading.Thread(target=self._watch, name="device-idle-probe", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    """Waits until every dispatched step was seen ready, then ends the watcher."""
    if self._thread is not None:
      self._q.put(None)
      self._thread.join()
      self._thread = None

  def dispatched(self, out: jax.Array) -> int:
    """Called by the engine right after step k's jitted call returned; ``out`` is one of its outputs.
    Returns k (the engine passes it to ``read``)."""
    t = time.perf_counter()
    with self._lock:
      k = len(self._dispatch)
      self._dispatch.append(t)
    self._q.put((k, out, t))
    return k

  def read(self, k: int) -> None:
    """Called by the engine when the host has read step k's sampled ids (so step k had ended)."""
    t = time.perf_counter()
    with self._lock:
      self._ready[k] = min(t, self._ready.get(k, t))

  def break_chain(self) -> None:
    """The next dispatched step does not follow the last one directly (a host step dispatched nothing)."""
    with self._lock:
      self._breaks.add(len(self._dispatch))

  def _watch(self) -> None:
    while True:
      item = self._q.get()
      if item is None:
        return
      k, out, t_put = item
      out.block_until_ready()
      t = time.perf_counter()
      with self._lock:
        if k < 0:
          self._latency.append(t - t_put)
        else:
          self._ready[k] = min(t, self._ready.get(k, t))

  @property
  def num_dispatched(self) -> int:
    with self._lock:
      return len(self._dispatch)

  def idle_ms(self, since: int = 0) -> list[float]:
    """idle_k in ms for every consecutive pair (k, k+1) of dispatched steps, k >= ``since``, whose end was
    seen (call after ``stop()``)."""
    with self._lock:
      d, e, breaks = list(self._dispatch), dict(self._ready), set(self._breaks)
    return [1e3 * max(0.0, d[k + 1] - e[k]) for k in range(since, len(d) - 1) if k in e and k + 1 not in breaks]

  def wakeup_latency_ms(self, samples: int = 20) -> float:
    """Median ms from handing the (started) watcher an already-ready array to it noting the time."""
    x = jax.numpy.zeros(())
    x.block_until_ready()
    for _ in range(samples):
      self._q.put((-1, x, time.perf_counter()))
    while True:
      with self._lock:
        if len(self._latency) >= samples:
          ts = sorted(self._latency)
          self._latency = []
          return 1e3 * ts[len(ts) // 2]
      time.sleep(1e-4)
