"""Hardware profiles for the simulator's cost model: ``configs/hardware/<name>.json`` -> ``HardwareProfile``.

Every number in a profile file carries its source, so a reader can tell a datasheet figure from a paper
figure, a measurement or a placeholder. File format (all keys required unless marked optional; unknown keys
are an error)::

  {
    "name": "h200",                       # label written into results rows
    "description": "...",
    "hbm_bandwidth_gbps": {"value": 4800, "source": "..."},   # device memory bandwidth, GB/s (1e9 B/s)
    "hbm_capacity_gb":    {"value": 141,  "source": "..."},   # device memory, GB (1e9 B)
    "peak_tflops":        {"value": 790,  "source": "..."},   # dense peak at the model dtype, TFLOP/s
    "mem_efficiency":     {"value": 0.8,  "source": "..."},   # achieved fraction of HBM bandwidth, (0, 1]
    "flop_efficiency":    {"value": 0.7,  "source": "..."},   # achieved fraction of peak FLOP/s, (0, 1]
    "step_overhead_s":    {"value": 0.0015, "source": "..."}, # fixed cost of one model step, s
    "tp_bandwidth_gbps":  {"value": 450,  "source": "..."},   # GPU<->GPU link per direction (all-reduce), GB/s
    "tp_latency_s":       {"value": 1e-5, "source": "..."},   # latency of one all-reduce, s
    "host_memory_gb":     {"value": 480,  "source": "..."},   # (optional) host DRAM, GB; only for a warning
    "link": {                               # device <-> host link that KV rotations use
      "name": "PCIe Gen5 x16",
      "d2h_gbps_by_segment": {"points": [[65536, 4.5], [1048576, 30], [8388608, 60]], "source": "..."},
      "h2d_gbps_by_segment": {"points": [...], "source": "..."},  # [segment bytes, GB/s], sizes increasing
      "duplex_cap_gbps":   {"value": 120, "source": "..."},       # both directions together, GB/s
      "launch_overhead_s": {"value": 1e-5, "source": "..."},      # per batched transfer (one direction), s
      "kernel_d2h_gbps":   {"value": 256, "source": "..."},       # (optional) one merged-kernel launch's rate,
      "kernel_h2d_gbps":   {"value": 289, "source": "..."}        # per direction, GB/s (absent: the curve)
    }
  }

``load_hardware_profile(name_or_path)`` reads a built-in name (a file in ``configs/hardware/``) or a path and
raises ``ProfileError`` naming the file and the field for anything missing, unknown or out of range. Pure
Python (no JAX, no numpy).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional

HARDWARE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "configs", "hardware")


class ProfileError(ValueError):
  """A hardware profile is missing a field, has an unknown field, or a value out of range."""


@dataclasses.dataclass(frozen=True)
class LinkProfile:
  """The device <-> host link: per-direction bandwidth by segment size, a duplex cap, a launch cost.

  Curves are tuples of ``(segment_bytes, GB/s)`` with increasing sizes (see ``transfer.curve_bandwidth``).
  """
  name: str
  d2h_curve: tuple[tuple[float, float], ...]
  h2d_curve: tuple[tuple[float, float], ...]
  duplex_cap_gbps: float
  launch_overhead_s: float
  # Rate of one launch that moves a whole batch (modes merged_kernel and duplex), per direction, GB/s; None:
  # such a batch moves at the segment curve's rate (transfer.kernel_rates).
  kernel_d2h_gbps: Optional[float] = None
  kernel_h2d_gbps: Optional[float] = None

  def scaled(self, factor: float) -> "LinkProfile":
    """The same link with every bandwidth (curves, duplex cap, kernel rates) multiplied by ``factor``."""
    return dataclasses.replace(
        self, d2h_curve=tuple((s, b * factor) for s, b in self.d2h_curve),
        h2d_curve=tuple((s, b * factor) for s, b in self.h2d_curve),
        duplex_cap_gbps=self.duplex_cap_gbps * factor,
        kernel_d2h_gbps=None if self.kernel_d2h_gbps is None else self.kernel_d2h_gbps * factor,
        kernel_h2d_gbps=None if self.kernel_h2d_gbps is None else self.kernel_h2d_gbps * factor)

  @property
  def plateau_gbps(self) -> float:
    """The D2H curve's bandwidth at its largest segment (what a bandwidth override is set against)."""
    return self.d2h_curve[-1][1]


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """One accelerator (and its host link) as the cost model sees it. Units in the field names."""
  name: str
  description: str
  hbm_bandwidth_gbps: float
  hbm_capacity_gb: float
  peak_tflops: float
  mem_efficiency: float
  flop_efficiency: float
  step_overhead_s: float
  tp_bandwidth_gbps: float
  tp_latency_s: float
  link: LinkProfile
  host_memory_gb: Optional[float] = None
  # Whether KV copies run beside the model step (GPU copy engines) or take the same cores and wait for it
  # (CPU: a memcpy competes with the matmuls): with False the simulator starts a plan's copies only when the
  # step in flight has finished.
  copies_overlap_compute: bool = True
  # Whether a step costs the engine's padded shape bucket (T, S and the block-table width rounded up to powers
  # of two over the engine's floors) rather than the batch it really formed. The JAX engine on a CPU is
  # compute-bound even at decode, so a 9-token step costs what a 16-token one does (measured: about 2x an
  # 8-token step); a GPU profile models an unpadded ragged kernel, as the paper's vLLM runs.
  pad_to_buckets: bool = False
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, hash=False)
  path: str = dataclasses.field(default="", compare=False)

  def with_swap_bandwidth(self, gbps: float) -> "HardwareProfile":
    """The profile with its host link scaled so that the D2H plateau is ``gbps`` GB/s (the curves keep their
    shape, so small segments stay slow; the duplex cap scales by the same factor). ``gbps <= 0``: unchanged."""
    if not gbps or gbps <= 0:
      return self
    return dataclasses.replace(self, link=self.link.scaled(gbps / self.link.plateau_gbps))


_TOP_NUMBERS = {  # field -> (lower bound, lower bound inclusive?, upper bound or None)
    "hbm_bandwidth_gbps": (0.0, False, None), "hbm_capacity_gb": (0.0, False, None),
    "peak_tflops": (0.0, False, None), "mem_efficiency": (0.0, False, 1.0),
    "flop_efficiency": (0.0, False, 1.0), "step_overhead_s": (0.0, True, None),
    "tp_bandwidth_gbps": (0.0, False, None), "tp_latency_s": (0.0, True, None),
}
_OPTIONAL_NUMBERS = {"host_memory_gb": (0.0, False, None)}
_FLAGS = ("copies_overlap_compute", "pad_to_buckets")   # optional sourced booleans
_LINK_NUMBERS = {"duplex_cap_gbps": (0.0, False, None), "launch_overhead_s": (0.0, True, None)}
_LINK_OPTIONAL = {"kernel_d2h_gbps": (0.0, False, None), "kernel_h2d_gbps": (0.0, False, None)}
_LINK_CURVES = ("d2h_gbps_by_segment", "h2d_gbps_by_segment")


def builtin_profile_names() -> list[str]:
  """Names of the JSON profiles under ``configs/hardware/`` (without ``.json``)."""
  if not os.path.isdir(HARDWARE_DIR):
    return []
  return sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".json"))


def resolve_profile_path(name_or_path: str) -> str:
  """The file of a built-in profile name or an existing path; ``ProfileError`` otherwise."""
  if os.path.isfile(name_or_path):
    return name_or_path
  path = os.path.join(HARDWARE_DIR, f"{name_or_path}.json")
  if os.path.isfile(path):
    return path
  raise ProfileError(f"no hardware profile {name_or_path!r}: not a file and not one of "
                     f"{builtin_profile_names()} (configs/hardware/)")


def load_hardware_profile(name_or_path: str) -> HardwareProfile:
  """Reads and validates a hardware profile (see the module docstring for the format)."""
  path = resolve_profile_path(name_or_path)
  try:
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ProfileError(f"cannot read hardware profile {path}: {e}") from e
  return profile_from_dict(d, path=path)


def profile_from_dict(d: Mapping[str, Any], path: str = "<dict>") -> HardwareProfile:
  """Validates a profile dict (the JSON's content) into a ``HardwareProfile``; ``ProfileError`` if bad."""
  where = f"hardware profile {path}"
  if not isinstance(d, Mapping):
    raise ProfileError(f"{where}: not a JSON object")
  known = {"name", "description", "link"} | set(_FLAGS) | set(_TOP_NUMBERS) | set(_OPTIONAL_NUMBERS)
  unknown = sorted(set(d) - known)
  if unknown:
    raise ProfileError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
  missing = sorted(k for k in ({"name", "link"} | set(_TOP_NUMBERS)) if k not in d)
  if missing:
    raise ProfileError(f"{where}: missing field(s) {missing}")
  name = d["name"]
  if not isinstance(name, str) or not name or "/" in name:
    raise ProfileError(f"{where}: name must be a non-empty string without '/', got {name!r}")
  description = d.get("description", "")
  if not isinstance(description, str):
    raise ProfileError(f"{where}: description must be a string")
  sources: dict[str, str] = {}
  values: dict[str, Any] = {}
  for key, bounds in _TOP_NUMBERS.items():
    values[key] = _sourced_number(d[key], key, bounds, where, sources)
  for key, bounds in _OPTIONAL_NUMBERS.items():
    values[key] = _sourced_number(d[key], key, bounds, where, sources) if key in d else None
  for key in _FLAGS:
    if key in d:
      e = _sourced(d[key], key, where, sources)
      if set(e) - {"value", "source"} or not isinstance(e.get("value"), bool):
        raise ProfileError(f"{where}: {key} must be {{'value': true|false, 'source': ...}}")
      values[key] = e["value"]
  link = d["link"]
  if not isinstance(link, Mapping):
    raise ProfileError(f"{where}: link must be an object")
  lrequired = {"name"} | set(_LINK_NUMBERS) | set(_LINK_CURVES)
  lknown = lrequired | set(_LINK_OPTIONAL)
  unknown = sorted(set(link) - lknown)
  if unknown:
    raise ProfileError(f"{where}: unknown link field(s) {unknown}; known: {sorted(lknown)}")
  missing = sorted(k for k in lrequired if k not in link)
  if missing:
    raise ProfileError(f"{where}: missing link field(s) {missing}")
  if not isinstance(link["name"], str) or not link["name"]:
    raise ProfileError(f"{where}: link.name must be a non-empty string")
  lvals = {k: _sourced_number(link[k], f"link.{k}", b, where, sources) for k, b in _LINK_NUMBERS.items()}
  lopt = {k: _sourced_number(link[k], f"link.{k}", b, where, sources) for k, b in _LINK_OPTIONAL.items()
          if k in link}
  curves = {k: _sourced_curve(link[k], f"link.{k}", where, sources) for k in _LINK_CURVES}
  lp = LinkProfile(name=link["name"], d2h_curve=curves["d2h_gbps_by_segment"],
                   h2d_curve=curves["h2d_gbps_by_segment"], duplex_cap_gbps=lvals["duplex_cap_gbps"],
                   launch_overhead_s=lvals["launch_overhead_s"], **lopt)
  return HardwareProfile(name=name, description=description, link=lp, sources=sources, path=path, **values)


def _sourced(entry: Any, key: str, where: str, sources: dict[str, str]) -> Mapping[str, Any]:
  if not isinstance(entry, Mapping):
    raise ProfileError(f"{where}: {key} must be an object with a 'source' string, got {entry!r}")
  src = entry.get("source")
  if not isinstance(src, str) or not src.strip():
    raise ProfileError(f"{where}: {key} has no 'source' (every number must say where it comes from)")
  sources[key] = src
  return entry


def _sourced_number(entry: Any, key: str, bounds, where: str, sources: dict[str, str]) -> float:
  e = _sourced(entry, key, where, sources)
  extra = sorted(set(e) - {"value", "source"})
  if extra:
    raise ProfileError(f"{where}: {key} has unknown key(s) {extra} (only 'value' and 'source')")
  v = e.get("value")
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    raise ProfileError(f"{where}: {key}.value must be a finite number, got {v!r}")
  lo, lo_incl, hi = bounds
  if (v < lo if lo_incl else v <= lo) or (hi is not None and v > hi):
    rng = f"{'[' if lo_incl else '('}{lo:g}, {'inf)' if hi is None else f'{hi:g}]'}"
    raise ProfileError(f"{where}: {key}.value = {v!r} is outside {rng}")
  return float(v)


def _sourced_curve(entry: Any, key: str, where: str, sources: dict[str, str]) -> tuple[tuple[float, float], ...]:
  e = _sourced(entry, key, where, sources)
  extra = sorted(set(e) - {"points", "source"})
  if extra:
    raise ProfileError(f"{where}: {key} has unknown key(s) {extra} (only 'points' and 'source')")
  pts = e.get("points")
  if not isinstance(pts, list) or not pts:
    raise ProfileError(f"{where}: {key}.points must be a non-empty list of [segment bytes, GB/s]")
  out = []
  for p in pts:
    ok = (isinstance(p, (list, tuple)) and len(p) == 2
          and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                  for x in p))
    if not ok:
      raise ProfileError(f"{where}: {key}.points entry {p!r} is not [segment bytes > 0, GB/s > 0]")
    out.append((float(p[0]), float(p[1])))
  if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
    raise ProfileError(f"{where}: {key}.points must have strictly increasing segment sizes")
  return tuple(out)
