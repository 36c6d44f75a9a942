"""Small integer helpers shared across packages (pure Python: importable without JAX or numpy).

``cdiv`` is the one ceiling division; ``kv/layout.py``'s ``blocks_for`` (a request's block count) is ``cdiv`` under
that name. A hot path that inlines it says so in a comment; ``pallas_kernels/`` uses ``jax.experimental.pallas``'
own ``cdiv`` / ``next_power_of_2``.
"""
from __future__ import annotations

import gc
import os
import threading


def cdiv(a: int, b: int) -> int:
  """Ceiling of ``a / b`` for ints ``a >= 0``, ``b > 0``: e.g. the blocks of ``b`` tokens that hold ``a``.

  ``cdiv(0, 16) == 0``, ``cdiv(16, 16) == 1``, ``cdiv(17, 16) == 2``.
  """
  return -(-a // b)


def next_power_of_2(n: int) -> int:
  """Smallest power of two ``>= n``; 1 for ``n <= 1``.

  ``next_power_of_2(5) == 8``, ``next_power_of_2(8) == 8``, ``next_power_of_2(0) == 1``.
  """
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def progress_bar(total: int, desc: str, enabled: bool = True, unit: str = "req"):
  """A tqdm bar over ``total`` items (None when disabled or tqdm is missing): long runs show progress."""
  if not enabled:
    return None
  try:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


def _parse_cache_size(text: str) -> int | None:
  """A sysfs cache ``size`` (``"1024K"``, ``"2M"``, ``"512"``: bytes) in KiB; None if unreadable."""
  text = text.strip().upper()
  scale = {"K": 1, "M": 1024, "G": 1024 * 1024}.get(text[-1:], None)
  digits = text[:-1] if scale else text
  if not digits.isdigit():
    return None
  return int(digits) * scale if scale else int(digits) // 1024


def machine_description(cpuinfo_path: str = "/proc/cpuinfo",
                        cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> dict:
  """What a benchmark row needs to say which machine produced it (Linux; fields are None where unknown).

  ``{"cpu": "<model name> (<vendor> family F model M)", "cpus": os.cpu_count(), "l2_kib": L2 KiB of cpu0's
  cache, "l3_kib": ...}``. Host-side timings here move with the core's caches more than with its clock
  (the scheduler's rotation touches hundreds of cold requests a step), so a ratio is only comparable between rows
  of the same ``cpu`` and ``l2_kib``.
  """
  fields: dict[str, str] = {}
  try:
    with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
      for line in f:
        if not line.strip():
          break  # the first processor's block only
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  name = fields.get("model name")
  ident = " ".join(p for p in (fields.get("vendor_id"), fields.get("cpu family") and f"family {fields['cpu family']}",
                               fields.get("model") and f"model {fields['model']}") if p)
  cpu = f"{name} ({ident})" if name and ident else (name or ident or None)
  sizes: dict[int, int] = {}
  try:
    entries = sorted(os.listdir(cache_dir))
  except OSError:
    entries = []
  for entry in entries:
    try:
      with open(os.path.join(cache_dir, entry, "level"), encoding="utf-8") as f:
        level = int(f.read().strip())
      with open(os.path.join(cache_dir, entry, "type"), encoding="utf-8") as f:
        kind = f.read().strip()
      with open(os.path.join(cache_dir, entry, "size"), encoding="utf-8") as f:
        size = _parse_cache_size(f.read())
    except (OSError, ValueError):
      continue
    if kind != "Instruction" and size is not None:
      sizes[level] = size
  return {"cpu": cpu, "cpus": os.cpu_count(), "l2_kib": sizes.get(2), "l3_kib": sizes.get(3)}


def freeze_heap() -> int:
  """Collects garbage, then moves every object the cyclic collector tracks into its permanent generation
  (``gc.freeze()``), where later collections do not look; returns how many objects are frozen.

  Why: a full (oldest-generation) collection walks every tracked object, and a serving process holds hundreds
  of thousands of them (imports, the GGUF reader's cached metadata, compiled step shapes); a pass that comes
  due mid-loop stalls the host for several engine steps, which lands in every running request's TBT. Frozen,
  those long-lived objects are no longer walked, so a full pass only sees the objects created since.

  Call it once the objects that live as long as the process exist (imports, weights, tokenizer; vLLM freezes at
  the same point). Frozen objects are still freed by reference counting, but the cyclic collector never
  examines them: a frozen object that later becomes unreachable only through a reference cycle stays in
  memory. Freeze before building engines that will be replaced, or call ``unfreeze_heap()`` before dropping a
  frozen one (an engine holds its KV pool).
  """
  gc.collect()
  gc.freeze()
  return gc.get_freeze_count()


def unfreeze_heap() -> None:
  """Undoes ``freeze_heap()`` (the frozen objects go back to the oldest generation) and collects: what only
  reference cycles kept alive since the freeze is freed."""
  gc.unfreeze()
  gc.collect()
