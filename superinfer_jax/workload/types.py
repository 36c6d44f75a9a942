"""Request and workload types shared by the engine, the simulator and the HTTP load client.

A ``RequestSpec`` is what a load generator submits: a prompt, the number of output tokens to generate and
the arrival time (seconds from the start of the run). A ``Workload`` is an ordered, immutable list of them.

Invariants (checked in ``RequestSpec.__post_init__``):
  * ``prompt_len >= 1`` and ``output_len >= 1`` (tokens);
  * ``prompt_token_ids`` is ``None`` or has exactly ``prompt_len`` ids;
  * ``arrival_s >= 0`` (seconds, relative to the run's start);
  * ``think_time_s`` is finite and >= 0, and non-zero only with an ``after_request_id`` (not its own id).
  * ``block_ids`` is ``None`` (no reuse information: every dataset and CSV trace) with ``block_ids_tokens == 0``,
    or has exactly ``ceil(prompt_len / block_ids_tokens)`` ids (ints >= 0), ``block_ids_tokens >= 1``.
A ``Workload`` built by ``with_arrivals`` has non-decreasing arrival times.

Closed-loop requests (multi-turn conversations, ``workload/multiturn.py``): a spec with ``after_request_id``
is submitted only once that request has FINISHED (its last token), ``think_time_s`` later; its arrival is
that submission time. Its own ``arrival_s`` is then only a lower bound (the conversation's start) that
keeps a workload's order non-decreasing. A ``Workload`` checks that every ``after_request_id`` names a
request listed earlier in it (so there is no cycle). ``workload/closed_loop.py`` (``ArrivalQueue``) is the
one place that turns these fields into submission times (the real-engine replay and the simulator use it);
every other workload leaves both fields at their defaults (None, 0.0).

Pure Python + numpy, no JAX. Text is tokenized by ``superinfer_jax.model.tokenizer.encode_text``.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestSpec:
  """One request of a workload.

  Attributes:
    request_id: unique id within the workload (string).
    prompt: prompt text ("" for synthetic token-only prompts).
    prompt_len: prompt length in tokens (under the tokenizer the loader was given).
    output_len: number of tokens to generate (the engine runs with ignore_eos and max_tokens=output_len).
    arrival_s: arrival time in seconds since the start of the run.
    prompt_token_ids: the prompt's token ids, or None when only the text is kept.
    source: where the request came from (dataset name/record id), free-form.
    after_request_id: None (an open-loop request, submitted at ``arrival_s``), or the id of the request
      whose finish releases this one (closed loop: the previous turn of a conversation).
    think_time_s: with ``after_request_id``: seconds between that request's finish and this one's
      submission (the user's think time; 0 = at once).
    block_ids: the prompt's recorded block hash ids (the Mooncake trace: one per 512-token block, chained, so
      equal leading ids mean an equal prefix), or None when the workload records no reuse. The engine's own
      block hashes are ``derived_block_ids(block_size)`` (``workload.reuse.expand_block_ids``).
    block_ids_tokens: the prompt tokens each of ``block_ids`` covers (512 for Mooncake; the last id covers
      what is left); 0 when ``block_ids`` is None.
  """
  request_id: str
  prompt: str
  prompt_len: int
  output_len: int
  arrival_s: float = 0.0
  prompt_token_ids: tuple[int, ...] | None = None
  source: str = ""
  after_request_id: str | None = None
  think_time_s: float = 0.0
  block_ids: tuple[int, ...] | None = None
  block_ids_tokens: int = 0

  def __post_init__(self):
    if self.prompt_len < 1:
      raise ValueError(f"{self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
    if self.output_len < 1:
      raise ValueError(f"{self.request_id}: output_len must be >= 1, got {self.output_len}")
    if self.arrival_s < 0 or not np.isfinite(self.arrival_s):
      raise ValueError(f"{self.request_id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
    if not (np.isfinite(self.think_time_s) and self.think_time_s >= 0):
      raise ValueError(f"{self.request_id}: think_time_s must be finite and >= 0, got {self.think_time_s}")
    if self.after_request_id is None:
      if self.think_time_s != 0:
        raise ValueError(f"{self.request_id}: think_time_s={self.think_time_s} needs an after_request_id")
    elif not isinstance(self.after_request_id, str) or not self.after_request_id:
      raise ValueError(f"{self.request_id}: after_request_id must be a non-empty string or None, got "
                       f"{self.after_request_id!r}")
    elif self.after_request_id == self.request_id:
      raise ValueError(f"{self.request_id}: a request cannot come after itself")
    if self.prompt_token_ids is not None:
      if not isinstance(self.prompt_token_ids, tuple):
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
      if len(self.prompt_token_ids) != self.prompt_len:
        raise ValueError(f"{self.request_id}: {len(self.prompt_token_ids)} prompt_token_ids but "
                         f"prompt_len={self.prompt_len}")
    if self.block_ids is None:
      if self.block_ids_tokens != 0:
        raise ValueError(f"{self.request_id}: block_ids_tokens={self.block_ids_tokens} without block_ids "
                         "(0 when there are none)")
    else:
      if not isinstance(self.block_ids, tuple):
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
      t = self.block_ids_tokens
      if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"{self.request_id}: block_ids_tokens must be an int >= 1 with block_ids, got {t!r}")
      want = -(-self.prompt_len // t)
      if len(self.block_ids) != want:
        raise ValueError(f"{self.request_id}: {len(self.block_ids)} block_ids but prompt_len={self.prompt_len} "
                         f"needs ceil({self.prompt_len} / {t}) = {want}")

  def derived_block_ids(self, block_size: int) -> tuple[int, ...] | None:
    """The prompt's block hashes at the engine's ``block_size`` (``ceil(prompt_len / block_size)`` of them,
    ``workload.reuse.expand_block_ids``), or None when the request records no reuse. Computed on each call,
    not stored (a whole Mooncake trace at block size 16 is ~9M ids)."""
    if self.block_ids is None:
      return None
    from superinfer_jax.workload.reuse import expand_block_ids  # pylint: disable=import-outside-toplevel
    return expand_block_ids(self.block_ids, self.block_ids_tokens, self.prompt_len, block_size)

  @property
  def total_len(self) -> int:
    """Prompt + output tokens: the context length the request reaches at its last token."""
    return self.prompt_len + self.output_len

  def to_json_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    if self.prompt_token_ids is not None:
      d["prompt_token_ids"] = list(self.prompt_token_ids)
    if self.block_ids is not None:
      d["block_ids"] = list(self.block_ids)
    return d

  @classmethod
  def from_json_dict(cls, d: dict[str, Any]) -> "RequestSpec":
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in fields}
    if kw.get("prompt_token_ids") is not None:
      kw["prompt_token_ids"] = tuple(kw["prompt_token_ids"])
    if kw.get("block_ids") is not None:
      kw["block_ids"] = tuple(kw["block_ids"])
    return cls(**kw)


def filter_requests(requests: Iterable[RequestSpec], *, min_prompt_len: int = 1,
                    max_prompt_len: int | None = None, min_output_len: int = 1,
                    max_output_len: int | None = None,
                    max_total_len: int | None = None) -> list[RequestSpec]:
  """Requests whose lengths (tokens) lie within the given inclusive bounds.

  ``max_total_len`` bounds ``prompt_len + output_len`` (use the model's context length so every request
  fits). ``None`` means unbounded.
  """
  return [r for r in requests if _keep(r.prompt_len, r.output_len, min_prompt_len, max_prompt_len,
                                        min_output_len, max_output_len, max_total_len)]


def clip_block_ids(block_ids: tuple[int, ...], block_ids_tokens: int, prompt_len: int) -> tuple[int, ...]:
  """The leading ``ceil(prompt_len / block_ids_tokens)`` ids: those of a prompt cut to its first
  ``prompt_len`` tokens (the last one may now cover only part of its block; the tokens it covers are the
  recorded block's first ones, so every engine block inside them keeps its hash)."""
  return tuple(block_ids[:-(-prompt_len // block_ids_tokens)])


def _keep(p: int, o: int, min_p, max_p, min_o, max_o, max_total) -> bool:
  return (p >= min_p and (max_p is None or p <= max_p) and o >= min_o and
          (max_o is None or o <= max_o) and (max_total is None or p + o <= max_total))


class Workload(Sequence[RequestSpec]):
  """An immutable, ordered list of ``RequestSpec`` plus a name (for results rows and file names)."""

  def __init__(self, requests: Iterable[RequestSpec], name: str = "workload"):
    self._requests = tuple(requests)
    self.name = name
    ids = [r.request_id for r in self._requests]
    if len(set(ids)) != len(ids):
      raise ValueError("duplicate request ids in workload")
    seen: set = set()
    for r in self._requests:
      if r.after_request_id is not None and r.after_request_id not in seen:
        raise ValueError(f"{r.request_id}: after_request_id {r.after_request_id!r} is not a request listed "
                         "before it in the workload")
      seen.add(r.request_id)

  def __len__(self) -> int:
    return len(self._requests)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return Workload(self._requests[i], self.name)
    return self._requests[i]

  def __iter__(self) -> Iterator[RequestSpec]:
    return iter(self._requests)

  def __repr__(self) -> str:
    return f"Workload(name={self.name!r}, num_requests={len(self)})"

  @property
  def requests(self) -> tuple[RequestSpec, ...]:
    return self._requests

  @property
  def closed_loop(self) -> bool:
    """Whether some request waits on another's finish (``after_request_id``): such a workload must be
    replayed through ``closed_loop.ArrivalQueue`` (the real-engine replay and the simulator do)."""
    return any(r.after_request_id is not None for r in self._requests)

  def take(self, n: int) -> "Workload":
    """The first ``n`` requests (all of them if fewer)."""
    return Workload(self._requests[:n], self.name)

  def filter(self, **bounds) -> "Workload":
    """``filter_requests`` with the same keyword bounds."""
    return Workload(filter_requests(self._requests, **bounds), self.name)

  def with_arrivals(self, arrival_s: Sequence[float]) -> "Workload":
    """Copy with ``arrival_s[i]`` assigned to request i (needs one non-decreasing time per request)."""
    arr = np.asarray(arrival_s, dtype=np.float64)
    if arr.shape != (len(self),):
      raise ValueError(f"need {len(self)} arrival times, got shape {arr.shape}")
    if len(arr) > 1 and np.any(np.diff(arr) < 0):
      raise ValueError("arrival times must be non-decreasing")
    return Workload((dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(self, arr)), self.name)

  def map(self, fn: Callable[[RequestSpec], RequestSpec]) -> "Workload":
    return Workload((fn(r) for r in self), self.name)

  def scale_lengths(self, factor: float, max_total_len: int | None = None) -> "Workload":
    """Every prompt and output length times ``factor`` (rounded, at least 1), for a length-scaled variant
    of a workload; arrivals and ids unchanged. With ``max_total_len`` a request is clipped to it (the
    output first, down to 1 token, then the prompt). Prompt token ids, if any, are repeated cyclically (or
    cut) to the new length. Block ids (``RequestSpec.block_ids``) follow a shortened prompt (its leading ids,
    ``clip_block_ids``); a lengthened prompt has new tokens with no recorded ids, so it keeps none (None).
    ``factor == 1`` returns the workload itself."""
    if not factor > 0 or not np.isfinite(factor):
      raise ValueError(f"length scale must be a finite number > 0, got {factor!r}")
    if factor == 1.0:
      return self

    def scaled(r: RequestSpec) -> RequestSpec:
      p = max(1, int(round(r.prompt_len * factor)))
      o = max(1, int(round(r.output_len * factor)))
      if max_total_len is not None and p + o > max_total_len:
        o = max(1, max_total_len - p)
        p = max(1, min(p, max_total_len - o))
      ids = None
      if r.prompt_token_ids is not None:
        ids = tuple(r.prompt_token_ids[i % r.prompt_len] for i in range(p))
      blocks = {}
      if r.block_ids is not None:
        blocks = (dict(block_ids=clip_block_ids(r.block_ids, r.block_ids_tokens, p)) if p <= r.prompt_len
                  else dict(block_ids=None, block_ids_tokens=0))
      return dataclasses.replace(r, prompt_len=p, output_len=o, prompt_token_ids=ids, **blocks)

    return self.map(scaled)

  def stats(self) -> dict[str, float]:
    """Token-length summary (mean/p50/p99/max of prompt and output lengths) and the arrival span (s)."""
    if not self._requests:
      return {"num_requests": 0}
    p = np.array([r.prompt_len for r in self], dtype=np.float64)
    o = np.array([r.output_len for r in self], dtype=np.float64)
    a = np.array([r.arrival_s for r in self], dtype=np.float64)
    out: dict[str, float] = {"num_requests": len(self)}
    for name, x in (("prompt_len", p), ("output_len", o)):
      out[f"{name}_mean"] = float(x.mean())
      out[f"{name}_p50"] = float(np.percentile(x, 50))
      out[f"{name}_p99"] = float(np.percentile(x, 99))
      out[f"{name}_max"] = float(x.max())
    out["arrival_span_s"] = float(a.max() - a.min())
    return out

  def save_jsonl(self, path: str) -> None:
    """One ``RequestSpec.to_json_dict()`` per line (a replayable snapshot of the workload)."""
    with open(path, "w", encoding="utf-8") as f:
      for r in self:
        f.write(json.dumps(r.to_json_dict(), ensure_ascii=False) + "\n")

  @classmethod
  def load_jsonl(cls, path: str, name: str | None = None) -> "Workload":
    """Inverse of ``save_jsonl``."""
    with open(path, encoding="utf-8") as f:
      reqs = [RequestSpec.from_json_dict(json.loads(line)) for line in f if line.strip()]
    return cls(reqs, name or path)
