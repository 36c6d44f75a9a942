"""Per-card tuning table of the ragged paged attention kernel: lookup at trace time, and writing new entries.

The table is ``pallas_kernels/tuning/ragged_paged_attention.json``::

  {"version": 1, "entries": [{"key": {"card", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                                      "block_size", "mode", "context_bucket", "batch_bucket"},
                              "config": {<subset of TUNABLES>}, "meta": {...}}]}

``card`` is ``normalize_card(device_kind)``; ``mode`` is ``"decode"`` or ``"mixed"``; ``context_bucket`` is
the next power of two of the block-table capacity in tokens (``max_blocks * block_size``) and
``batch_bucket`` the next power of two of the number of sequences (both static shapes). ``meta`` holds what
produced the entry (command, timing, card); it is never read by the kernel. The table is read at every trace
(it is small), so a rewritten table applies to the next trace.

``select`` returns the tunable overrides for a launch and a ``TuningChoice`` saying which entry was chosen
and why; a missing table, card or head config falls back to ``{}`` (the kernel's ``auto_config``). Explicit
kernel arguments always win over the table (the caller merges them last).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Optional

TUNABLES = ("tile_q", "blocks_per_iter", "num_splits", "num_warps", "num_stages")
DEFAULT_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning",
                                  "ragged_paged_attention.json")
TABLE_ENV = "PALLAS_ATTENTION_TUNING_TABLE"
_KEY_FIELDS = ("card", "num_q_heads", "num_kv_heads", "head_dim", "dtype", "block_size", "mode",
               "context_bucket", "batch_bucket")


def normalize_card(device_kind: str) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': lower case, runs of non-alphanumerics -> '-'."""
  return re.sub(r"[^a-z0-9]+", "-", str(device_kind).lower()).strip("-")


def pow2_bucket(n: int) -> int:
  """Smallest power of two >= max(n, 1)."""
  return 1 << max(0, math.ceil(math.log2(max(int(n), 1))))


@dataclasses.dataclass(frozen=True)
class TuningChoice:
  """Which table entry a launch uses. reason: 'exact', 'nearest' (same card / heads / dtype / mode, the
  closest buckets in log2 distance), or why the default was used ('no table', 'no entry for card ...')."""
  key: dict
  reason: str
  config: dict
  entry_key: Optional[dict] = None


def load_table(path: str = DEFAULT_TABLE_PATH) -> dict:
  """The table as a dict ``{"version", "entries"}``; a missing file is an empty table. Validates fields."""
  if not os.path.exists(path):
    return {"version": 1, "entries": []}
  with open(path, encoding="utf-8") as f:
    table = json.load(f)
  for e in table.get("entries", []):
    missing = set(_KEY_FIELDS) - set(e.get("key", {}))
    unknown = set(e.get("config", {})) - set(TUNABLES)
    if missing or unknown:
      raise ValueError(f"bad tuning entry {e}: missing key fields {sorted(missing)}, "
                       f"unknown tunables {sorted(unknown)}")
  return table


def table_path() -> str:
  """The table the kernel reads: ``$PALLAS_ATTENTION_TUNING_TABLE`` if set (a tuning run writing elsewhere),
  else ``DEFAULT_TABLE_PATH``."""
  return os.environ.get(TABLE_ENV, "") or DEFAULT_TABLE_PATH


def make_key(*, device_kind: str, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: str,
             block_size: int, decode: bool, max_blocks: int, num_seqs: int) -> dict:
  """The lookup key of one launch (all static)."""
  return dict(card=normalize_card(device_kind), num_q_heads=int(num_q_heads), num_kv_heads=int(num_kv_heads),
              head_dim=int(head_dim), dtype=str(dtype), block_size=int(block_size),
              mode="decode" if decode else "mixed", context_bucket=pow2_bucket(max_blocks * block_size),
              batch_bucket=pow2_bucket(num_seqs))


def select(key: dict, path: Optional[str] = None) -> TuningChoice:
  """The table's overrides for ``key`` (a ``make_key`` dict): exact entry, else the nearest bucket of the
  same card / head config / dtype / block size / mode, else ``{}`` with the reason."""
  entries = load_table(path or table_path())["entries"]
  if not entries:
    return TuningChoice(key, "default: tuning table empty or absent", {})
  same_card = [e for e in entries if e["key"]["card"] == key["card"]]
  if not same_card:
    return TuningChoice(key, f"default: no entry for card {key['card']}", {})
  fixed = ("num_q_heads", "num_kv_heads", "head_dim", "dtype", "block_size", "mode")
  same = [e for e in same_card if all(e["key"][f] == key[f] for f in fixed)]
  if not same:
    return TuningChoice(key, "default: no entry for this head config / dtype / block size / mode", {})

  def distance(e):
    return (abs(math.log2(e["key"]["context_bucket"]) - math.log2(key["context_bucket"]))
            + abs(math.log2(e["key"]["batch_bucket"]) - math.log2(key["batch_bucket"])))
  best = min(same, key=distance)
  reason = "exact" if distance(best) == 0 else "nearest"
  return TuningChoice(key, reason, dict(best["config"]), dict(best["key"]))


def merge_overrides(table_config: dict, explicit: dict) -> dict:
  """Table values, then explicit (non-None) arguments on top: explicit always wins."""
  out = {k: v for k, v in table_config.items() if k in TUNABLES}
  out.update({k: v for k, v in explicit.items() if v is not None})
  return out


def write_entry(key: dict, config: dict, meta: dict, path: Optional[str] = None) -> None:
  """Adds or replaces the entry with exactly ``key`` in ``path`` (default ``table_path()``); entries are kept
  sorted by key for stable diffs."""
  path = path or table_path()
  unknown = set(config) - set(TUNABLES)
  if unknown or set(key) != set(_KEY_FIELDS):
    raise ValueError(f"bad entry: key {key}, config {config}")
  table = load_table(path)
  entries = [e for e in table["entries"] if e["key"] != key]
  entries.append({"key": dict(key), "config": dict(config), "meta": dict(meta)})
  entries.sort(key=lambda e: [str(e["key"][f]).zfill(8) for f in _KEY_FIELDS])
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)
