"""What a ``DuplexKV`` has moved and how long its copies took: ``TransferStats`` and ``CopyGroups``.

Times are host wall-clock seconds (``time.perf_counter``). Two per issue() call ("a group" of copies):

* ``copy_time_s`` (issue -> ready): from the start of ``issue()`` to the moment its copies are seen landed
  (every destination array ``is_ready()``). Serialized modes wait inside ``issue()``, so their groups end
  there exactly; a ``duplex`` group is closed by the first ``poll()`` that finds it landed, so its time is an
  upper bound with the resolution of the caller's poll interval (the engine polls once a step).
* ``blocked_time_s`` (exposed on the host): time the caller's thread sat occupied by copies: the whole
  ``issue()`` of a serialized mode (it returns only once its copies landed) and ``wait()`` calls. ``copy_time_s - blocked_time_s`` is the hidden
  part. A device-side stall (a model step queued behind an H2D copy it reads) is not visible here; it shows
  in the caller's wait for the step's outputs.

Nothing here blocks except ``CopyGroups.wait``; ``poll`` only asks ``is_ready()`` (no device->host copy).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence


@dataclasses.dataclass
class TransferStats:
  """Counters of everything an engine has moved (cumulative)."""
  issues: int = 0               # issue() calls
  blocks_out: int = 0           # D2H blocks (swap-out + write-back)
  writeback_blocks: int = 0     # of which eager write-back
  blocks_in: int = 0            # H2D blocks
  bytes_out: int = 0
  bytes_in: int = 0
  batches_out: int = 0          # D2H device_put calls (naive: one per segment; merged: one per block)
  batches_in: int = 0           # H2D device_put calls (same; prefetch() calls count)
  segments_out: int = 0         # contiguous D2H segments (block-first batched modes: one per block)
  segments_in: int = 0
  prefetched_blocks: int = 0    # swap-in blocks whose H2D was started by prefetch()
  gathers: int = 0              # jitted gather launches
  scatters: int = 0             # jitted scatter launches
  landed_groups: int = 0        # issue() calls whose copies have all been seen landed
  copy_time_s: float = 0.0      # issue -> ready, summed over landed groups (module docstring)
  blocked_time_s: float = 0.0   # host time blocked on copies (exposed)

  @property
  def hidden_time_s(self) -> float:
    """Copy time the host did not wait for (``copy_time_s - blocked_time_s``, >= 0)."""
    return max(0.0, self.copy_time_s - self.blocked_time_s)

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["hidden_time_s"] = self.hidden_time_s
    return d


class CopyGroups:
  """The copy groups an engine has issued and not yet seen land; books their times into ``stats``."""

  def __init__(self, stats: TransferStats):
    self.stats = stats
    self._groups: list[tuple[float, list]] = []   # (issue start, destination arrays not yet ready)

  def add(self, t_start: float, arrays: Sequence) -> None:
    """Registers one issue()'s destination arrays (issued at ``t_start``); an empty group lands at once."""
    arrays = [a for a in arrays if not a.is_ready()]
    if arrays:
      self._groups.append((t_start, arrays))
    else:
      self._land(t_start, time.perf_counter())

  def poll(self) -> int:
    """Closes every group whose arrays are all ready (never blocks); returns how many are still in flight."""
    now, left = time.perf_counter(), []
    for t0, arrays in self._groups:
      arrays = [a for a in arrays if not a.is_ready()]
      if arrays:
        left.append((t0, arrays))
      else:
        self._land(t0, now)
    self._groups = left
    return len(left)

  def block(self, arrays) -> None:
    """Blocks until ``arrays`` (any pytree) are ready, booking the wait as blocked (exposed) time."""
    import jax  # pylint: disable=import-outside-toplevel
    t = time.perf_counter()
    jax.block_until_ready(arrays)
    self.stats.blocked_time_s += time.perf_counter() - t

  def add_serial(self, t_start: float, blocked_before: float) -> None:
    """Books a serialized issue() that started at ``t_start`` and has just returned with its copies landed:
    the whole span is copy time and exposed (replacing the waits booked inside it since the stats read
    ``blocked_before``)."""
    now = time.perf_counter()
    self._land(t_start, now)
    self.stats.blocked_time_s = blocked_before + (now - t_start)

  def wait(self) -> None:
    """Blocks until every group has landed (blocked time booked), then closes them all."""
    self.block([a for _, arrays in self._groups for a in arrays])
    self.poll()

  def _land(self, t0: float, t1: float) -> None:
    self.stats.landed_groups += 1
    self.stats.copy_time_s += t1 - t0
