"""Recorded request traces (CSV, JSONL): arrivals and lengths of real serving logs, as a ``Workload``.

Three formats: two CSVs told apart by the header row, and JSON lines (a file whose first non-blank
character is ``{``; a ``.gz`` file of any of them is read through gzip):

* **Azure LLM inference trace** (Azure Public Dataset, 2023/2024: ``AzureLLMInferenceTrace_{code,conv}.csv``):
  ``TIMESTAMP,ContextTokens,GeneratedTokens``. ``TIMESTAMP`` is a date-time such as
  ``YYYY-MM-DD HH:MM:SS.fffffff`` (more than 6 fractional digits are truncated to microseconds; an ISO ``T``
  and a trailing ``Z`` / UTC offset are accepted) or a number of seconds.
* **Splitwise** (Patel et al., ISCA 2024 traces): ``arrived_at,num_prefill_tokens,num_decode_tokens``, with
  ``arrived_at`` in seconds.
* **Mooncake** (Qin et al., FAST 2025, kvcache-ai/Mooncake ``FAST25-release/traces``): one JSON object per
  line, ``timestamp`` (milliseconds from the trace's start; read as seconds / 1000), ``input_length``,
  ``output_length`` (tokens) and ``hash_ids`` (one id per 512-token prompt block, ``ceil(input_length /
  512)`` of them, chained: equal leading ids mean an equal prefix). They become ``RequestSpec.block_ids``
  with ``block_ids_tokens = 512`` (``workload.reuse`` expands them to the engine's block size); a line
  without ``hash_ids`` gives ``block_ids = None``. Extra keys are ignored.

Columns may come in any order and extra columns are ignored. Rows are sorted by arrival; times are made
relative to the first request (which arrives at 0). A row with 0 context or 0 generated tokens cannot be a
request (``RequestSpec`` needs >= 1 of each) and is skipped and counted; a row that does not parse is an
error naming the file and line (``TraceError``, a ``ValueError``).

Prompts longer than the model's context (``context_len``: prompt + output > it) follow a stated rule
(``context_rule``), counted in ``TraceInfo``: ``drop`` (the default) removes them; ``clip`` keeps the
prompt's first ``context_len - output_len`` tokens (at least 1; the output is cut only if it alone does not
fit) and the block ids of those tokens (``types.clip_block_ids``). Both apply before the window is taken.

Each request becomes a ``RequestSpec`` with ``prompt=""``, ``prompt_len`` = the recorded context tokens and
``output_len`` = the recorded generated tokens; with ``token_ids=True`` its ``prompt_token_ids`` are
synthetic ids of that length (seeded; their values mean nothing, only the length does). The simulator
passes ``token_ids=False`` (it needs lengths only; a 20,000-request trace would otherwise hold tens of
millions of ids).

``rescale_to_rps`` keeps the recorded burstiness but stretches the time axis so the mean rate is a given
RPS (by ``rescale_factor``). Packaged traces (``PACKAGED_TRACES``, files in ``workload/data/`` with their
provenance and license in its README) are named instead of a path: ``splitwise`` is the Splitwise
conversation trace, ``mooncake`` the Mooncake conversation trace. Standard library and numpy only (no JAX).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import gzip
import json
import math
import os
import re
from typing import Optional

import numpy as np

from superinfer_jax.workload.types import RequestSpec, Workload, _keep, clip_block_ids

AZURE = "azure"
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
MOONCAKE = "mooncake"
PACKAGED_TRACES = {"splitwise": os.path.join(DATA_DIR, "splitwise_conv.csv"),
                   "mooncake": os.path.join(DATA_DIR, "mooncake_conversation.jsonl.gz")}
SPLITWISE = "splitwise"
TRACE_COLUMNS = {     # CSV header columns: time, prompt tokens, output tokens
    AZURE: ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    SPLITWISE: ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
}
JSONL_FIELDS = {      # JSON-lines keys: time, prompt tokens, output tokens, block ids (optional)
    MOONCAKE: ("timestamp", "input_length", "output_length", "hash_ids"),
}
TIME_UNIT_S = {AZURE: 1.0, SPLITWISE: 1.0, MOONCAKE: 1e-3}      # seconds per recorded time unit
BLOCK_IDS_TOKENS = {MOONCAKE: 512}                              # prompt tokens per recorded block id
CONTEXT_RULES = ("drop", "clip")


class TraceError(ValueError):
  """A trace file is missing, empty, of an unknown format, or has a row that does not parse."""


@dataclasses.dataclass(frozen=True)
class TraceInfo:
  """What reading a trace kept and dropped."""
  path: str
  format: str
  rows: int                     # data rows read
  skipped_zero: int             # rows with 0 context or 0 generated tokens
  filtered: int                 # rows outside the length bounds
  kept: int
  duration_s: float             # first to last kept arrival (before any rescaling)
  context_len: Optional[int] = None    # the context the rule applied to (None: none)
  context_rule: str = "drop"
  context_dropped: int = 0      # requests over context_len removed (rule drop), before the window
  context_clipped: int = 0      # requests over context_len clipped (rule clip), in the window

  @property
  def mean_rps(self) -> float:
    """Mean arrival rate of the kept requests (requests / s); inf if they all arrive at once."""
    if self.kept <= 1:
      return math.inf
    return (self.kept - 1) / self.duration_s if self.duration_s > 0 else math.inf


def detect_trace_format(header: list[str], path: str = "<trace>", jsonl: bool = False) -> str:
  """``azure`` | ``splitwise`` from a CSV header row, or with ``jsonl`` ``mooncake`` from the keys of the
  first JSON line; ``TraceError`` naming the expected headers / keys."""
  if jsonl:
    names = set(header)
    for fmt, keys in JSONL_FIELDS.items():
      if set(keys[:3]) <= names:
        return fmt
    expected = " or ".join(",".join(k[:3]) for k in JSONL_FIELDS.values())
    raise TraceError(f"{path}: unknown JSON-lines trace format: keys {','.join(sorted(names))!r} lack the "
                     f"Mooncake keys (expected {expected}[,hash_ids])")
  names = {h.strip() for h in header}
  for fmt, cols in TRACE_COLUMNS.items():
    if set(cols) <= names:
      return fmt
  expected = " or ".join(",".join(c) for c in TRACE_COLUMNS.values())
  raise TraceError(f"{path}: unknown trace format: header {','.join(h.strip() for h in header)!r} has neither "
                   f"the Azure nor the Splitwise columns (expected {expected})")


_FRACTION = re.compile(r"(\.\d{6})\d+")


def parse_timestamp(text: str) -> float:
  """Seconds from a number or a date-time (``YYYY-MM-DD HH:MM:SS[.fffffff]``, ISO ``T``, ``Z`` / offset);
  naive date-times are taken as UTC. ``ValueError`` if neither."""
  s = text.strip()
  try:
    v = float(s)
  except ValueError:
    pass
  else:
    if not math.isfinite(v):
      raise ValueError(f"timestamp {text!r} is not finite")
    return v
  s = _FRACTION.sub(r"\1", s)
  if s.endswith("Z"):
    s = s[:-1] + "+00:00"
  dt = datetime.datetime.fromisoformat(s)
  if dt.tzinfo is None:
    dt = dt.replace(tzinfo=datetime.timezone.utc)
  return dt.timestamp()


def _count(text: str, col: str, where: str) -> int:
  try:
    v = float(text.strip())
  except ValueError:
    raise TraceError(f"{where}: {col} = {text!r} is not a number") from None
  if not math.isfinite(v) or v < 0 or v != int(v):
    raise TraceError(f"{where}: {col} = {text!r} is not a whole number >= 0")
  return int(v)


def _open(path: str):
  """The trace file as text (through gzip for ``.gz``)."""
  if path.endswith(".gz"):
    return gzip.open(path, "rt", newline="", encoding="utf-8-sig")
  return open(path, newline="", encoding="utf-8-sig")


def _is_jsonl(path: str) -> bool:
  with _open(path) as f:
    for line in f:
      if line.strip():
        return line.lstrip().startswith("{")
  return False


def _read_jsonl_rows(path: str):
  """``_read_rows`` of a JSON-lines trace (Mooncake): the fifth element of a row is its block ids (a tuple)
  or None without ``hash_ids``; ``TraceError`` for a line that is not a JSON object, a missing key, a bad
  count or as many ``hash_ids`` as ``ceil(input_length / 512)`` not."""
  rows, fmt = [], None
  n_rows = skipped = 0
  with _open(path) as f:
    for line_num, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{line_num}"
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
      if not isinstance(obj, dict):
        raise TraceError(f"{where}: not a JSON object")
      if fmt is None:
        fmt = detect_trace_format(list(obj), path, jsonl=True)
      t_key, p_key, o_key, ids_key = JSONL_FIELDS[fmt]
      n_rows += 1
      missing = [k for k in (t_key, p_key, o_key) if k not in obj]
      if missing:
        raise TraceError(f"{where}: no {', '.join(missing)}")
      t = obj[t_key]
      if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise TraceError(f"{where}: {t_key} = {t!r} is not a number")
      p, o = _count(str(obj[p_key]), p_key, where), _count(str(obj[o_key]), o_key, where)
      ids = obj.get(ids_key)
      if ids is not None:
        per = BLOCK_IDS_TOKENS[fmt]
        if (not isinstance(ids, list) or
            not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids)):
          raise TraceError(f"{where}: {ids_key} must be a list of ints >= 0")
        if len(ids) != -(-p // per):
          raise TraceError(f"{where}: {len(ids)} {ids_key} but {p_key} = {p} needs ceil({p} / {per}) = "
                           f"{-(-p // per)}")
        ids = tuple(ids)
      if p == 0 or o == 0:
        skipped += 1
        continue
      rows.append((t * TIME_UNIT_S[fmt], n_rows, p, o, ids))
  if fmt is None:
    raise TraceError(f"{path}: empty trace (no JSON line)")
  return fmt, rows, n_rows, skipped


def _read_rows(path: str) -> tuple[str, list[tuple], int, int]:
  """The data rows of the trace at ``path``: ``(format, rows, data rows, rows skipped)``, each row
  ``(arrival s, data-row number, prompt tokens, output tokens, block ids or None)`` in file order; rows with
  0 prompt or 0 output tokens are skipped (counted), blank lines ignored. ``TraceError`` for an empty file,
  an unknown header, a short row or an unparsable field (naming ``path:line``)."""
  if _is_jsonl(path):
    return _read_jsonl_rows(path)
  with _open(path) as f:
    reader = csv.reader(f)
    header = next((row for row in reader if any(c.strip() for c in row)), None)
    if header is None:
      raise TraceError(f"{path}: empty trace (no header row)")
    fmt = detect_trace_format(header, path)
    index = {h.strip(): i for i, h in enumerate(header)}
    t_col, p_col, o_col = TRACE_COLUMNS[fmt]
    ti, pi, oi = index[t_col], index[p_col], index[o_col]
    need = max(ti, pi, oi)
    rows = []
    n_rows = skipped = 0
    for row in reader:
      if not any(c.strip() for c in row):
        continue
      n_rows += 1
      where = f"{path}:{reader.line_num}"
      if len(row) <= need:
        raise TraceError(f"{where}: {len(row)} fields, the header has {len(header)}")
      try:
        t = parse_timestamp(row[ti])
      except ValueError:
        raise TraceError(f"{where}: {t_col} = {row[ti]!r} is neither seconds nor a date-time") from None
      p, o = _count(row[pi], p_col, where), _count(row[oi], o_col, where)
      if p == 0 or o == 0:
        skipped += 1
        continue
      rows.append((t, n_rows, p, o, None))
  return fmt, rows, n_rows, skipped


def apply_context_rule(p: int, o: int, ids, per: int, context_len: int) -> tuple[int, int, object]:
  """``(prompt, output, block ids)`` of a request clipped to ``context_len`` tokens (rule ``clip``): the
  prompt keeps its first ``max(1, context_len - o)`` tokens, the output what is then left (at most ``o``),
  the block ids those of the kept prompt."""
  p2 = max(1, min(p, context_len - o))
  o2 = min(o, context_len - p2)
  return p2, o2, (clip_block_ids(ids, per, p2) if ids is not None else None)


def read_trace(path: str, *, num_requests: Optional[int] = None, min_prompt_len: int = 1,
               max_prompt_len: Optional[int] = None, min_output_len: int = 1,
               max_output_len: Optional[int] = None, max_total_len: Optional[int] = None,
               token_ids: bool = True, vocab_size: int = 32000, seed: int = 0,
               name: Optional[str] = None, start: int = 0, context_len: Optional[int] = None,
               context_rule: str = "drop") -> tuple[Workload, TraceInfo]:
  """Reads an Azure or Splitwise trace CSV or a Mooncake JSON-lines trace (module docstring) into a
  ``Workload``, arrivals relative to the first kept request, plus a ``TraceInfo``. Length bounds as
  ``workload.filter_requests``; then the context rule (``context_rule`` ``drop`` | ``clip`` for requests
  whose prompt + output exceeds ``context_len``; counted); then the first ``start`` requests (by arrival)
  are skipped and ``num_requests`` keeps the next N (a window of the trace). ``path`` may name a packaged
  trace (``PACKAGED_TRACES``)."""
  path = resolve_trace(path)
  if not os.path.isfile(path):
    raise TraceError(f"trace {path!r} is not a file")
  if num_requests is not None and num_requests < 1:
    raise TraceError(f"num_requests must be >= 1, got {num_requests}")
  if context_rule not in CONTEXT_RULES:
    raise TraceError(f"context_rule must be one of {', '.join(CONTEXT_RULES)}, got {context_rule!r}")
  if context_len is not None and context_len < 2:
    raise TraceError(f"context_len must be >= 2 tokens, got {context_len}")
  fmt, rows, n_rows, skipped = _read_rows(path)
  if not n_rows:
    raise TraceError(f"{path}: no data rows after the header")
  rows.sort()
  kept = [r for r in rows if _keep(r[2], r[3], min_prompt_len, max_prompt_len, min_output_len, max_output_len,
                                   max_total_len)]
  filtered = len(rows) - len(kept)
  over = [] if context_len is None else [r for r in kept if r[2] + r[3] > context_len]
  dropped = 0
  if over and context_rule == "drop":
    kept = [r for r in kept if r[2] + r[3] <= context_len]
    dropped = len(over)
  if start < 0 or (start and start >= len(kept)):
    raise TraceError(f"{path}: window start {start} is outside the {len(kept)} requests kept")
  kept = kept[start:]
  if num_requests is not None:
    kept = kept[:num_requests]
  if not kept:
    raise TraceError(f"{path}: no request left ({n_rows} rows, {skipped} with 0 tokens, {filtered} outside "
                     f"the length bounds, {dropped} over the context of {context_len} tokens)")
  per = BLOCK_IDS_TOKENS.get(fmt, 0)
  clipped = 0
  if context_len is not None and context_rule == "clip":
    out = []
    for t, line, p, o, ids in kept:
      if p + o > context_len:
        p, o, ids = apply_context_rule(p, o, ids, per, context_len)
        clipped += 1
      out.append((t, line, p, o, ids))
    kept = out
  t0 = kept[0][0]
  rng = np.random.default_rng(seed)
  lo = min(100, max(vocab_size - 1, 0))
  base = os.path.basename(path)
  label = name or (base[:-3] if base.endswith(".gz") else base).rsplit(".", 1)[0]
  reqs = []
  for i, (t, line, p, o, blocks) in enumerate(kept):
    ids = tuple(rng.integers(lo, vocab_size, size=p).tolist()) if token_ids else None
    reqs.append(RequestSpec(request_id=f"{label}-{i}", prompt="", prompt_len=p, output_len=o,
                            arrival_s=float(t - t0), prompt_token_ids=ids, source=f"{fmt}:{label}:{line}",
                            block_ids=blocks, block_ids_tokens=per if blocks is not None else 0))
  info = TraceInfo(path=path, format=fmt, rows=n_rows, skipped_zero=skipped, filtered=filtered, kept=len(reqs),
                   duration_s=float(kept[-1][0] - t0), context_len=context_len, context_rule=context_rule,
                   context_dropped=dropped, context_clipped=clipped)
  return Workload(reqs, name=label), info


def resolve_trace(path: str) -> str:
  """The file of a packaged trace's name (``PACKAGED_TRACES``), else ``path`` itself."""
  return PACKAGED_TRACES.get(path, path)


def rescale_factor(workload: Workload, rps: float) -> float:
  """The factor ``rescale_to_rps`` multiplies arrival times by: ``((n - 1) / rps) / last arrival`` (0 for
  ``rps = inf``; 1 when all requests arrive at once or there is only one)."""
  if not rps > 0:
    raise TraceError(f"rps must be > 0, got {rps}")
  n = len(workload)
  last = workload[n - 1].arrival_s if n else 0.0
  if math.isinf(rps):
    return 0.0
  if n <= 1 or last <= 0:
    return 1.0
  return ((n - 1) / rps) / last


def rescale_to_rps(workload: Workload, rps: float) -> Workload:
  """The workload with its arrival times scaled so the mean rate is ``rps`` (``(n - 1) / last arrival``);
  the relative gaps (burstiness) are kept. ``rps = inf``: everything at 0. A workload whose requests all
  arrive at once (or only one request) is returned unchanged."""
  factor = rescale_factor(workload, rps)
  if factor == 1.0:
    return workload
  return workload.with_arrivals([r.arrival_s * factor for r in workload])


def load_trace(path: str, *, rps: Optional[float] = None, **kwargs) -> Workload:
  """``read_trace`` then, if ``rps`` is given, ``rescale_to_rps``."""
  w, _ = read_trace(path, **kwargs)
  return rescale_to_rps(w, rps) if rps is not None else w


__all__ = ["AZURE", "BLOCK_IDS_TOKENS", "CONTEXT_RULES", "DATA_DIR", "JSONL_FIELDS", "MOONCAKE", "PACKAGED_TRACES",
           "SPLITWISE", "TIME_UNIT_S", "TRACE_COLUMNS", "TraceError", "TraceInfo", "apply_context_rule",
           "detect_trace_format", "load_trace", "parse_timestamp", "read_trace", "rescale_factor", "rescale_to_rps",
           "resolve_trace"]
