"""Injected time sources for the scheduler: the real engine uses ``WallClock``, the simulator ``VirtualClock``.

A clock is any object with ``now() -> float`` (seconds; non-decreasing). No JAX.
"""
from __future__ import annotations

import time


class WallClock:
  """Wall-clock seconds on the ``time.time()`` scale (the reference code's time source), but advanced by
  ``time.monotonic()`` so it never goes backwards when the system clock is adjusted; optionally shifted.

  ``offset`` is subtracted, so ``WallClock(offset=time.time())`` reads seconds since construction.
  """

  def __init__(self, offset: float = 0.0):
    self.offset = offset
    self._epoch = time.time() - time.monotonic()

  def now(self) -> float:
    return self._epoch + time.monotonic() - self.offset


class VirtualClock:
  """Simulated time: starts at ``start`` and moves only when told to. Invariant: never goes backwards."""

  def __init__(self, start: float = 0.0):
    self._t = float(start)

  def now(self) -> float:
    return self._t

  def advance(self, dt: float) -> float:
    if dt < 0:
      raise ValueError(f"VirtualClock.advance: negative dt {dt}")
    self._t += dt
    return self._t

  def set(self, t: float) -> float:
    if t < self._t:
      raise ValueError(f"VirtualClock.set: {t} is before now ({self._t})")
    self._t = float(t)
    return self._t
