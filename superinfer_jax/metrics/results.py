"""The ``results.jsonl`` schema (one row per policy x RPS), its validator, JSONL I/O and the comparison table.

One schema for the real engine (``engine="real"``), the simulator (``"sim"``) and the HTTP load client
(``"http"``). Required keys (``RESULTS_SCHEMA``; more keys are allowed and kept):

  engine, model, hardware, policy (str); rps (float > 0, may be inf); num_requests, num_finished
  (int, 0 <= num_finished <= num_requests); ttft_slo_s, tbt_slo_s (float > 0, s); ttft_attainment,
  tbt_attainment, slo_attainment (float in [0, 1]); ttft_p50_s, ttft_p99_s, tbt_p50_s, tbt_p99_s,
  tpot_p50_s, tpot_p99_s, e2e_p99_s (float >= 0 s, or null when there is no sample);
  output_throughput_tok_s (float >= 0, tokens/s); num_rotations, swap_out_bytes, swap_in_bytes,
  num_recompute_preemptions (int >= 0; counters from the engine/simulator, 0 for the HTTP client if the
  server does not report them).

``results_row`` builds a row from timelines (metrics in ``latency.py``) plus those counters, and adds the
other metrics of ``compute_metrics`` (means, P90s, request throughput, duration) as extra keys.
Rows are strict JSON: no NaN anywhere; an infinite ``rps`` ("send all at once") is written as the string
"inf" by ``write_jsonl`` and read back as float inf by ``read_jsonl``.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Sequence

from superinfer_jax.metrics.latency import compute_metrics
from superinfer_jax.metrics.timeline import RequestTimeline

_STR, _INT, _NUM, _FRAC, _LAT, _CNT = "str", "int", "num", "frac", "lat", "count"

RESULTS_SCHEMA: dict[str, str] = {
    "engine": _STR, "model": _STR, "hardware": _STR, "policy": _STR, "rps": _NUM,
    "num_requests": _INT, "num_finished": _INT, "ttft_slo_s": _NUM, "tbt_slo_s": _NUM,
    "ttft_attainment": _FRAC, "tbt_attainment": _FRAC, "slo_attainment": _FRAC,
    "ttft_p50_s": _LAT, "ttft_p99_s": _LAT, "tbt_p50_s": _LAT, "tbt_p99_s": _LAT,
    "tpot_p50_s": _LAT, "tpot_p99_s": _LAT, "e2e_p99_s": _LAT,
    "output_throughput_tok_s": _NUM, "num_rotations": _CNT, "swap_out_bytes": _CNT,
    "swap_in_bytes": _CNT, "num_recompute_preemptions": _CNT,
}
RESULTS_KEYS = tuple(RESULTS_SCHEMA)
ENGINES = ("real", "sim", "http")


def _num(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_results_row(row: dict[str, Any]) -> None:
  """Raises ValueError naming every problem of ``row`` against ``RESULTS_SCHEMA`` (module docstring)."""
  if not isinstance(row, dict):
    raise ValueError(f"results row must be a dict, got {type(row).__name__}")
  problems = []
  for key, kind in RESULTS_SCHEMA.items():
    if key not in row:
      problems.append(f"missing {key}")
      continue
    v = row[key]
    if kind == _STR:
      ok = isinstance(v, str) and bool(v)
    elif kind == _INT:
      ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
    elif kind == _CNT:
      ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
    elif kind == _FRAC:
      ok = _num(v) and 0.0 <= v <= 1.0
    elif kind == _LAT:
      ok = v is None or (_num(v) and math.isfinite(v) and v >= 0)
    else:  # _NUM
      ok = _num(v) and not math.isnan(v) and v >= 0 and (key == "rps" or math.isfinite(v))
    if not ok:
      problems.append(f"{key}={v!r} is not a valid {kind}")
  if not problems:
    if row["num_finished"] > row["num_requests"]:
      problems.append("num_finished > num_requests")
    if row["rps"] <= 0 or row["ttft_slo_s"] <= 0 or row["tbt_slo_s"] <= 0:
      problems.append("rps, ttft_slo_s and tbt_slo_s must be > 0")
    for m in ("ttft", "tbt", "tpot"):
      lo, hi = row[f"{m}_p50_s"], row[f"{m}_p99_s"]
      if lo is not None and hi is not None and lo > hi * (1 + 1e-9) + 1e-12:
        problems.append(f"{m}_p50_s > {m}_p99_s")
  if problems:
    raise ValueError("invalid results row: " + "; ".join(problems))


def results_row(timelines: Sequence[RequestTimeline], *, engine: str, model: str, hardware: str,
                policy: str, rps: float, ttft_slo_s: float, tbt_slo_s: float,
                num_rotations: int | None = None, swap_out_bytes: int = 0, swap_in_bytes: int = 0,
                num_recompute_preemptions: int | None = None, duration_s: float | None = None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
  """The validated ``results.jsonl`` row of one (policy, rps) run.

  Args:
    timelines: every submitted request's timeline.
    engine: "real" | "sim" | "http".
    model, hardware, policy: names for the row.
    rps: the offered load (requests/s).
    ttft_slo_s, tbt_slo_s: SLOs (s).
    num_rotations, num_recompute_preemptions: counters from the engine; None -> counted from the
      timelines' state changes (changes into "rotary" / "preempted").
    swap_out_bytes, swap_in_bytes: bytes moved device->host / host->device by rotations.
    duration_s: the run's length (s) for throughputs; None -> see ``compute_metrics``.
    extra: more keys (e.g. swap_out_blocks, seed, dataset); they may not override required keys.
  """
  m = compute_metrics(timelines, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, duration_s=duration_s)
  row: dict[str, Any] = {
      "engine": engine, "model": model, "hardware": hardware, "policy": policy, "rps": float(rps),
      "ttft_slo_s": float(ttft_slo_s), "tbt_slo_s": float(tbt_slo_s),
      "num_rotations": int(m["num_rotations_observed"] if num_rotations is None else num_rotations),
      "swap_out_bytes": int(swap_out_bytes), "swap_in_bytes": int(swap_in_bytes),
      "num_recompute_preemptions": int(m["num_preemptions_observed"]
                                       if num_recompute_preemptions is None
                                       else num_recompute_preemptions),
  }
  for k, v in m.items():
    row.setdefault(k, v)
  for k, v in (extra or {}).items():
    if k in RESULTS_SCHEMA:
      raise ValueError(f"extra may not override required key {k!r}")
    row[k] = v
  validate_results_row(row)
  return row


def _encode(v):
  if isinstance(v, float) and math.isinf(v):
    return "inf" if v > 0 else "-inf"
  return v


def write_jsonl(path: str, rows: Iterable[dict[str, Any]], *, append: bool = False) -> None:
  """Writes dicts one per line (strict JSON; a float +-inf becomes the string "inf"/"-inf")."""
  d = os.path.dirname(path)
  if d:
    os.makedirs(d, exist_ok=True)
  with open(path, "a" if append else "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps({k: _encode(v) for k, v in row.items()}, allow_nan=False) + "\n")


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """Reads one dict per non-blank line; ``rps`` "inf" comes back as float inf."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        row = json.loads(line)
        if isinstance(row.get("rps"), str):
          row["rps"] = float(row["rps"])
        rows.append(row)
  return rows


def append_results_row(path: str, row: dict[str, Any]) -> None:
  """Validates ``row`` and appends it to ``path`` (creating the file and its directory)."""
  validate_results_row(row)
  write_jsonl(path, [row], append=True)


def read_results(path: str, *, validate: bool = True) -> list[dict[str, Any]]:
  """Rows of a results.jsonl, each validated."""
  rows = read_jsonl(path)
  if validate:
    for i, row in enumerate(rows):
      try:
        validate_results_row(row)
      except ValueError as e:
        raise ValueError(f"{path}:{i + 1}: {e}") from None
  return rows


# (key, header, format) of the comparison table; latencies printed in ms.
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("rps", "rps", "{:.3g}"), ("policy", "policy", "{}"),
    ("num_finished", "done", "{}"), ("slo_attainment", "SLO%", "pct"),
    ("ttft_attainment", "TTFT%", "pct"), ("tbt_attainment", "TBT%", "pct"),
    ("ttft_p50_s", "TTFT p50 ms", "ms"), ("ttft_p99_s", "TTFT p99 ms", "ms"),
    ("tbt_p50_s", "TBT p50 ms", "ms"), ("tbt_p99_s", "TBT p99 ms", "ms"),
    ("tbt_worst_p99_s", "worst TBT p99 ms", "ms"), ("tbt_request_attainment", "TBT req%", "pct"),
    ("tpot_p99_s", "TPOT p99 ms", "ms"), ("output_throughput_tok_s", "tok/s", "{:.1f}"),
    ("num_rotations", "rot", "{}"), ("rotations_per_step", "rot/step", "{:.2f}"),
    ("mean_residency_steps", "resid", "{:.1f}"), ("num_recompute_preemptions", "recomp", "{}"),
    ("prefix_device_hit_rate", "hit dev%", "pct"), ("prefix_host_hit_rate", "hit host%", "pct"),
    ("prefill_tokens_saved", "pf saved", "{}"),
    ("repeat", "rep", "{}"), ("step_time_p50_s", "step ms", "ms"), ("step_time_drift", "drift", "{:.2f}"), ("cpu_share_drift", "cpu", "{:.2f}"),
)


def _cell(v, fmt: str) -> str:
  if v is None:
    return "-"
  if fmt == "pct":
    return f"{100.0 * v:.1f}"
  if fmt == "ms":
    return f"{1000.0 * v:.1f}"
  return fmt.format(v)


def format_comparison_table(rows: Sequence[dict[str, Any]],
                            columns: Sequence[tuple[str, str, str]] = TABLE_COLUMNS) -> str:
  """A fixed-width text table, one line per row, sorted by (rps, policy, repeat); "-" for missing values;
  a row flagged ``perturbed`` gets a "*" after its policy."""
  rows = sorted(rows, key=lambda r: (float(r.get("rps", 0)), str(r.get("policy", "")), r.get("repeat") or 0))
  cells = [[h for _, h, _ in columns]]
  cells += [[_cell(r.get(k), f) + ("*" if k == "policy" and r.get("perturbed") else "") for k, _, f in columns]
            for r in rows]
  columns = list(columns)
  widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
  lines = []
  for j, c in enumerate(cells):
    lines.append("  ".join(s.ljust(w) if columns[i][0] == "policy" else s.rjust(w)
                           for i, (s, w) in enumerate(zip(c, widths))).rstrip())
    if j == 0:
      lines.append("  ".join("-" * w for w in widths))
  return "\n".join(lines)


def print_comparison_table(rows: Sequence[dict[str, Any]], **kwargs) -> None:
  print(format_comparison_table(rows, **kwargs))
