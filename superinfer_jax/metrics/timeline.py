"""Per-request timelines and the per-request JSONL file ``OUTPUT_DIR/requests-<policy>-<rps>.jsonl``.

One JSON object per line, one line per submitted request (finished or not). All times are seconds on ONE
clock shared by every field of a run (wall clock ``time.time()``, ``time.perf_counter()`` or a virtual
clock — only differences are used):

  ==================  =====================  =============================================================
  key                 type                   meaning
  ==================  =====================  =============================================================
  request_id          str                    unique within the file
  arrival_s           float                  when the request arrived / was submitted (s)
  prompt_len          int >= 1               prompt tokens
  output_len          int >= 0               output tokens generated (for a finished request: all of them)
  token_times_s       list[float]            time each output token was emitted, non-decreasing, all
                                             >= arrival_s; one entry per token (an HTTP client that gets
                                             several tokens in one chunk may log fewer entries than
                                             output_len; metrics then follow vLLM: TTFT/TBT from the
                                             entries, TPOT from output_len)
  state_changes       list[[float, str]]     [time_s, new_state], in time order; states below
  finish_reason       str | null             "length" | "stop" | "abort" | null (did not finish)
  target_output_len   int | null             (optional) the requested max_tokens
  first_scheduled_s   float | null           (optional) when the prefill was first scheduled
  source              str                    (optional) dataset record id
  ==================  =====================  =============================================================

Any other keys are kept in ``RequestTimeline.extra`` and written back unchanged.

States (``state_changes``): ``waiting`` (queued, no KV), ``running`` (KV on device, in the batch),
``rotary`` (KV parked in host memory — entering it is a *rotation*; the paper's name), ``preempted`` (KV dropped, will recompute),
``finished``. Other names are allowed (plots colour them grey). A rotation is a change INTO ``rotary``.

Finished means ``finish_reason`` in {"length", "stop"} (not null, not "abort").
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Iterable, Sequence

import numpy as np

WAITING = "waiting"
RUNNING = "running"
ROTARY = "rotary"
PREEMPTED = "preempted"
FINISHED = "finished"
STATES = (WAITING, RUNNING, ROTARY, PREEMPTED, FINISHED)
FINISH_OK = ("length", "stop")

_REQUIRED = ("request_id", "arrival_s", "prompt_len", "output_len", "token_times_s", "state_changes",
             "finish_reason")
_OPTIONAL = ("target_output_len", "first_scheduled_s", "source")


@dataclasses.dataclass
class RequestTimeline:
  """What happened to one request (see the module docstring for units and invariants)."""
  request_id: str
  arrival_s: float
  prompt_len: int
  output_len: int
  token_times_s: list[float]
  state_changes: list[tuple[float, str]] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  target_output_len: int | None = None
  first_scheduled_s: float | None = None
  source: str = ""
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def finished(self) -> bool:
    return self.finish_reason in FINISH_OK and self.output_len >= 1 and len(self.token_times_s) >= 1

  @property
  def ttft_s(self) -> float | None:
    """Arrival -> first output token (s); None without any token."""
    return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

  @property
  def e2e_s(self) -> float | None:
    """Arrival -> last output token (s) of a finished request; None otherwise."""
    return self.token_times_s[-1] - self.arrival_s if self.finished else None

  @property
  def tpot_s(self) -> float | None:
    """(e2e - TTFT) / (output_len - 1) (s) of a finished request; None if output_len <= 1 or unfinished."""
    if not self.finished or self.output_len <= 1:
      return None
    return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_len - 1)

  def tbt_gaps_s(self) -> np.ndarray:
    """Every gap between consecutive token timestamps (s), float64 [len(token_times_s) - 1]."""
    return np.diff(np.asarray(self.token_times_s, dtype=np.float64))

  @property
  def num_rotations(self) -> int:
    """State changes into ``rotary`` (rotations out to host memory)."""
    return sum(1 for _, s in self.state_changes if s == ROTARY)

  @property
  def num_preemptions(self) -> int:
    """State changes into ``preempted`` (recompute preemptions)."""
    return sum(1 for _, s in self.state_changes if s == PREEMPTED)

  def validate(self) -> None:
    """Raises ValueError if an invariant of the module docstring does not hold."""
    rid = self.request_id
    problems = []
    if not isinstance(rid, str) or not rid:
      problems.append("request_id must be a non-empty str")
    if not _finite(self.arrival_s):
      problems.append("arrival_s must be a finite number")
    if not _is_int(self.prompt_len) or self.prompt_len < 1:
      problems.append("prompt_len must be an int >= 1")
    if not _is_int(self.output_len) or self.output_len < 0:
      problems.append("output_len must be an int >= 0")
    t = self.token_times_s
    if not all(_finite(x) for x in t):
      problems.append("token_times_s must be finite numbers")
    elif t:
      if any(b < a for a, b in zip(t, t[1:])):
        problems.append("token_times_s must be non-decreasing")
      if _finite(self.arrival_s) and t[0] < self.arrival_s:
        problems.append("first token before arrival")
      if _is_int(self.output_len) and len(t) > self.output_len:
        problems.append(f"{len(t)} token times but output_len={self.output_len}")
    for sc in self.state_changes:
      if len(sc) != 2 or not _finite(sc[0]) or not isinstance(sc[1], str):
        problems.append(f"bad state change {sc!r}")
        break
    else:
      times = [sc[0] for sc in self.state_changes]
      if any(b < a for a, b in zip(times, times[1:])):
        problems.append("state_changes must be in time order")
    if self.finish_reason is not None and not isinstance(self.finish_reason, str):
      problems.append("finish_reason must be a str or None")
    if self.finish_reason in FINISH_OK and not t:
      problems.append("finished request without token times")
    if problems:
      raise ValueError(f"request {rid!r}: " + "; ".join(problems))

  def to_json_dict(self) -> dict[str, Any]:
    d: dict[str, Any] = {
        "request_id": self.request_id, "arrival_s": float(self.arrival_s),
        "prompt_len": int(self.prompt_len), "output_len": int(self.output_len),
        "token_times_s": [float(x) for x in self.token_times_s],
        "state_changes": [[float(ts), str(s)] for ts, s in self.state_changes],
        "finish_reason": self.finish_reason,
        "target_output_len": self.target_output_len, "first_scheduled_s": self.first_scheduled_s,
        "source": self.source,
    }
    for k, v in self.extra.items():
      d.setdefault(k, v)
    return d

  @classmethod
  def from_json_dict(cls, d: dict[str, Any]) -> "RequestTimeline":
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
      raise ValueError(f"per-request record lacks keys {missing}")
    known = set(_REQUIRED) | set(_OPTIONAL)
    return cls(
        request_id=str(d["request_id"]), arrival_s=float(d["arrival_s"]),
        prompt_len=int(d["prompt_len"]), output_len=int(d["output_len"]),
        token_times_s=[float(x) for x in d["token_times_s"]],
        state_changes=[(float(ts), str(s)) for ts, s in d["state_changes"]],
        finish_reason=d["finish_reason"], target_output_len=d.get("target_output_len"),
        first_scheduled_s=d.get("first_scheduled_s"), source=d.get("source") or "",
        extra={k: v for k, v in d.items() if k not in known})


def _finite(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and \
      math.isfinite(x)


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def format_rps(rps: float) -> str:
  """The rps as it appears in file names: ``f"{rps:g}"`` (2.0 -> "2", 2.5 -> "2.5", inf -> "inf")."""
  return f"{float(rps):g}"


def requests_filename(policy: str, rps: float, repeat: int | None = None) -> str:
  """``requests-<policy>-<rps>.jsonl``, or ``requests-<policy>-<rps>-rep<repeat>.jsonl`` for a repeat.

  rps via ``format_rps``; ``repeat`` is the 0-based repeat index of that (policy, rps) run (None: no
  suffix, the single-run name).
  """
  if not policy or "/" in policy:
    raise ValueError(f"bad policy name {policy!r}")
  if repeat is None:
    return f"requests-{policy}-{format_rps(rps)}.jsonl"
  if isinstance(repeat, bool) or not _is_int(repeat) or repeat < 0:
    raise ValueError(f"bad repeat {repeat!r} (an int >= 0 or None)")
  return f"requests-{policy}-{format_rps(rps)}-rep{int(repeat)}.jsonl"


# Non-greedy policy: the rps is the shortest tail that is a ``format_rps`` number, so "1e-05" stays whole
# while a policy may still contain '-' (and '_'). Only a policy ending in "-<digits>e" is ambiguous.
_REQUESTS_RE = re.compile(
    r"^requests-(?P<policy>.+?)-(?P<rps>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|inf)"
    r"(?:-rep(?P<repeat>\d+))?\.jsonl$")


def parse_requests_filename_full(name: str) -> tuple[str, float, int | None] | None:
  """(policy, rps, repeat) of a ``requests_filename`` name (any directory prefix), or None.

  ``repeat`` is None for the plain ``requests-<policy>-<rps>.jsonl`` form.
  """
  m = _REQUESTS_RE.match(os.path.basename(name))
  if m is None:
    return None
  rep = m.group("repeat")
  return m.group("policy"), float(m.group("rps")), None if rep is None else int(rep)


def parse_requests_filename(name: str) -> tuple[str, float] | None:
  """(policy, rps) of a ``requests_filename`` name, with or without ``-rep<k>``, or None.

  Policy may contain '-' and '_'.
  """
  full = parse_requests_filename_full(name)
  return None if full is None else full[:2]


def write_timelines(path: str, timelines: Iterable[RequestTimeline], *, validate: bool = True) -> None:
  """Writes the per-request JSONL (one object per line, strict JSON: no NaN/inf)."""
  with open(path, "w", encoding="utf-8") as f:
    for tl in timelines:
      if validate:
        tl.validate()
      f.write(json.dumps(tl.to_json_dict(), allow_nan=False) + "\n")


def read_timelines(path: str) -> list[RequestTimeline]:
  """Reads a per-request JSONL written by ``write_timelines`` (or any writer of the same schema)."""
  with open(path, encoding="utf-8") as f:
    return [RequestTimeline.from_json_dict(json.loads(line)) for line in f if line.strip()]


def timelines_from_records(records: Sequence[dict[str, Any]]) -> list[RequestTimeline]:
  return [RequestTimeline.from_json_dict(r) for r in records]


class TimelineRecorder:
  """Collects per-request events from an engine/simulator/client into ``RequestTimeline``s.

  Call order per request: ``add_request`` once, then any ``state``/``token`` calls in time order, then
  ``finish``. ``state`` ignores a repeated state (no change) so callers may report every step. Requests
  never finished keep ``finish_reason=None``. Times are seconds on the run's one clock.
  """

  def __init__(self):
    self._tl: dict[str, RequestTimeline] = {}

  def add_request(self, request_id: str, arrival_s: float, prompt_len: int, *,
                  target_output_len: int | None = None, source: str = "",
                  initial_state: str | None = WAITING) -> None:
    if request_id in self._tl:
      raise ValueError(f"request {request_id!r} added twice")
    tl = RequestTimeline(request_id=request_id, arrival_s=float(arrival_s), prompt_len=int(prompt_len),
                         output_len=0, token_times_s=[], target_output_len=target_output_len,
                         source=source)
    if initial_state is not None:
      tl.state_changes.append((float(arrival_s), initial_state))
    self._tl[request_id] = tl

  def state(self, request_id: str, t: float, state: str) -> None:
    """Records a state change at ``t`` (s) unless the request is already in ``state``."""
    tl = self._tl[request_id]
    if tl.state_changes and tl.state_changes[-1][1] == state:
      return
    if state == RUNNING and tl.first_scheduled_s is None:
      tl.first_scheduled_s = float(t)
    tl.state_changes.append((float(t), state))

  def token(self, request_id: str, t: float, num_tokens: int = 1) -> None:
    """Records ``num_tokens`` output tokens emitted at ``t`` (s) (one timestamp per token)."""
    tl = self._tl[request_id]
    tl.token_times_s.extend([float(t)] * num_tokens)
    tl.output_len += num_tokens

  def finish(self, request_id: str, t: float, reason: str = "length") -> None:
    """Marks the request finished at ``t`` (s) with ``reason`` ("length" | "stop" | "abort")."""
    tl = self._tl[request_id]
    tl.finish_reason = reason
    self.state(request_id, t, FINISHED)

  def __contains__(self, request_id: str) -> bool:
    return request_id in self._tl

  def __len__(self) -> int:
    return len(self._tl)

  def get(self, request_id: str) -> RequestTimeline:
    return self._tl[request_id]

  def timelines(self) -> list[RequestTimeline]:
    """All timelines in the order requests were added."""
    return list(self._tl.values())
