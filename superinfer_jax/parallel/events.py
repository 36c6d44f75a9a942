"""Engine-input events of a multi-process server, broadcast from process 0 before every engine iteration.

In a multi-process ``serve.py`` run only process 0 receives HTTP requests, yet every process runs the
engine loop: replicated scheduling (``distributed.py``) needs the same inputs everywhere to make the same
plans. So each iteration of the engine loop starts with one ``EventChannel.exchange``: process 0 sends the
``EventBatch`` of what happened since the last one (new requests with their prompt token ids, sampling
params, SLOs and request id; aborts; the stop flag), every process receives those bytes, decodes them and
applies the same events in the same order (``serving/worker.py``), then all step. Process 0 applies the
decoded copy too, so what it applies is byte for byte what the others apply. The shared clock and the
plan digest of ``ReplicatedSchedule`` keep checking that the plans stay identical.

Wire format of one exchange (two ``distributed.broadcast_from_primary`` collectives at most):

* header ``int32[1]``: the payload's byte length n (0: an empty batch; nothing else is sent);
* payload ``uint8[bucket(n)]``: the batch as UTF-8 JSON, zero-padded to a power of two (at least
  ``min_bucket``), so a run compiles a handful of broadcast shapes, not one per length.

Idle: when the engine has no work, process 0 waits for a command for at most ``idle_interval_s`` before
it broadcasts an empty batch, so the other processes wait inside one collective for at most about that
long (gloo does not time out a collective that waits for its peers) and nobody spins.

No JAX at module level (the collective is imported when first used).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from superinfer_jax.model.sampling_params import SamplingParams

WIRE_VERSION = 2


@dataclasses.dataclass(frozen=True)
class AddEvent:
  """A new request: ``prompt`` is token ids (a list of ints) or a string the engine tokenizes; ``cache_salt``
  its prefix-cache salt (every process applies it alike, so their hits and plans agree)."""
  request_id: str
  prompt: Union[str, Sequence[int]]
  params: SamplingParams
  ttft_slo: Optional[float] = None
  tbt_slo: Optional[float] = None
  cache_salt: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class AbortEvent:
  """Abort a request: its client went away, or (``shutdown``) the server is stopping."""
  request_id: str
  shutdown: bool = False


Event = Union[AddEvent, AbortEvent]


@dataclasses.dataclass
class EventBatch:
  """One engine iteration's inputs, applied in order before the step.

  ``time``: process 0's engine-clock reading when the batch was made, the arrival time of its adds on every
  process (None in a single-process run: the engine reads its own clock). ``stop``: after these events
  every process drains its engine and leaves the loop."""
  time: Optional[float] = None
  events: list = dataclasses.field(default_factory=list)
  stop: bool = False

  @property
  def empty(self) -> bool:
    return not self.events and not self.stop


# --------------------------------------------------------------------------------------------- codec

def encode_batch(batch: EventBatch) -> bytes:
  """JSON bytes of ``batch``. ValueError for a prompt that is neither a string nor integer token ids."""
  evs = []
  for ev in batch.events:
    if isinstance(ev, AddEvent):
      prompt = ev.prompt if isinstance(ev.prompt, str) else [_token_id(t) for t in ev.prompt]
      evs.append(["add", ev.request_id, prompt, dataclasses.asdict(ev.params), ev.ttft_slo, ev.tbt_slo,
                  ev.cache_salt])
    elif isinstance(ev, AbortEvent):
      evs.append(["abort", ev.request_id, bool(ev.shutdown)])
    else:
      raise TypeError(f"not an engine event: {ev!r}")
  return json.dumps({"v": WIRE_VERSION, "time": batch.time, "stop": bool(batch.stop), "events": evs},
                    separators=(",", ":"), allow_nan=False).encode()


def _tuples(v):
  """JSON lists back to the tuples they were (``logit_bias``: a tuple of (id, bias) pairs)."""
  return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def decode_batch(data: bytes) -> EventBatch:
  """Inverse of ``encode_batch`` (sequences in the params come back as tuples)."""
  d = json.loads(data.decode())
  if d.get("v") != WIRE_VERSION:
    raise ValueError(f"event batch of wire version {d.get('v')!r}, expected {WIRE_VERSION}: every process must "
                     "run the same code")
  evs: list = []
  for e in d["events"]:
    if e[0] == "add":
      _, rid, prompt, params, ttft, tbt, salt = e
      params = SamplingParams(**{k: _tuples(v) for k, v in params.items()})
      evs.append(AddEvent(rid, prompt, params, ttft, tbt, salt))
    elif e[0] == "abort":
      evs.append(AbortEvent(e[1], e[2]))
    else:
      raise ValueError(f"unknown event kind {e[0]!r}")
  return EventBatch(time=d["time"], events=evs, stop=d["stop"])


def _token_id(t: Any) -> int:
  if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
    raise ValueError(f"prompt token ids must be integers, got {t!r}")
  return int(t)


def bucket_size(n: int, min_bucket: int = 256) -> int:
  """The padded payload length for ``n`` bytes: the next power of two, at least ``min_bucket``."""
  return max(min_bucket, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


# ------------------------------------------------------------------------------------------- channel

class EventChannel:
  """Process 0 -> every process: one ``EventBatch`` per engine iteration (see the module docstring).

  ``broadcast(x: np.ndarray) -> np.ndarray`` returns process 0's ``x`` in every process (same shape and
  dtype everywhere); default ``distributed.broadcast_from_primary``, a JAX collective. ``is_source``
  defaults to ``jax.process_index() == 0``. Tests inject both."""

  def __init__(self, *, is_source: Optional[bool] = None,
               broadcast: Optional[Callable[[np.ndarray], np.ndarray]] = None,
               idle_interval_s: float = 1.0, min_bucket: int = 256):
    if not idle_interval_s > 0:
      raise ValueError(f"idle_interval_s must be > 0, got {idle_interval_s!r}")
    if min_bucket < 1:
      raise ValueError(f"min_bucket must be >= 1, got {min_bucket}")
    if broadcast is None:
      from superinfer_jax.parallel.distributed import broadcast_from_primary  # pylint: disable=import-outside-toplevel
      broadcast = broadcast_from_primary
    if is_source is None:
      import jax  # pylint: disable=import-outside-toplevel
      is_source = jax.process_index() == 0
    self.is_source = bool(is_source)
    self.idle_interval_s = float(idle_interval_s)
    self.min_bucket = int(min_bucket)
    self._broadcast = broadcast
    self.exchanges = 0          # exchange() calls (one per engine iteration)
    self.payloads = 0           # non-empty batches sent / received
    self.payload_bytes = 0      # their unpadded bytes

  def exchange(self, batch: Optional[EventBatch] = None) -> EventBatch:
    """Process 0 passes its batch, the others None; every process gets the decoded batch back.

    Every process must call this the same number of times, in the same order relative to the engine's
    other collectives (the engine loop does: exactly once per iteration)."""
    if self.is_source:
      if batch is None:
        raise ValueError("process 0 must pass the batch it sends")
      data = b"" if batch.empty else encode_batch(batch)
      if len(data) >= 2**31:
        raise ValueError(f"event batch of {len(data)} bytes is too large for one exchange")
      header = np.array([len(data)], np.int32)
    else:
      header = np.zeros(1, np.int32)
    n = int(np.asarray(self._broadcast(header)).reshape(-1)[0])
    self.exchanges += 1
    if n == 0:
      return EventBatch()
    buf = np.zeros(bucket_size(n, self.min_bucket), np.uint8)
    if self.is_source:
      buf[:n] = np.frombuffer(data, np.uint8)
    got = np.asarray(self._broadcast(buf)).reshape(-1)
    self.payloads += 1
    self.payload_bytes += n
    return decode_batch(got[:n].tobytes())
