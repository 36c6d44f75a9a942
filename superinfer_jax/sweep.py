"""The sweep both harnesses share: ``SweepSpec`` (model, workload recipe, policies, variants, loads), the
variant helpers, the output directory and the closing report.

Host-side only (no JAX, no engine): ``experiment.real_sweep`` (the real engine) and ``sim.sim_sweep`` (the
simulator) both build on it, and ``experiment.real_sweep`` re-exports every name for code that imports it there.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from typing import Any, Optional, Sequence

from superinfer_jax.configtree import knob
from superinfer_jax.metrics import plots as plots_lib
from superinfer_jax.metrics.results import format_comparison_table
from superinfer_jax.workload.arrivals import ARRIVAL_PROCESSES
from superinfer_jax.workload.multiturn import THINK_TIME_DISTS


@dataclasses.dataclass(frozen=True)
class SweepSpec:
  """One experiment: a model, a workload recipe, the policies, variants and loads to compare.

  Every field is also a flag of ``run_experiment.py`` (``configtree.define_flags(SweepSpec)``).
  """
  model: str = knob("smollm2-135m", "HF dir, .gguf, orbax dir, or smollm2-135m")
  dataset: str = knob("sharegpt", "sharegpt | sharegpt_multiturn (ShareGPT conversations, one closed-loop request "
                                  "per turn) | synthetic | path to a ShareGPT/LMSYS/trace file")
  num_requests: int = knob(32, "requests per run (sharegpt_multiturn: conversations per run)")
  rps: str = knob("1", "comma list of request rates (requests/s); inf = all at once (ignored with "
                       "--calibrate, which derives one)")
  policies: str = knob("fcfs,rotasched", "comma list of scheduling policies; 'name[setting=value,...]' runs that "
                                        "policy with its own engine settings (e.g. rotasched[proactive_swap_budget=8])")
  vary: str = knob("", "engine settings to sweep, 'name:v1,v2' items joined by ';' (cartesian product), "
                       "e.g. 'transfer_mode:naive,merged,duplex' or 'alpha:1,3;beta_b:-10,0'")
  repeats: int = knob(1, "timed runs per (policy, variant, rps), in alternating order")
  seed: int = knob(0, "seeds request selection and arrivals")
  output_dir: str = knob("runs/experiment", "where results, timelines and plots go")
  max_prompt_len: Optional[int] = knob(None, "drop requests with longer prompts", none_as=0)
  max_output_len: Optional[int] = knob(None, "drop requests with longer outputs", none_as=0)
  min_output_len: int = knob(1, "drop requests with shorter outputs")
  synthetic_prompt_len: str = knob("uniform:16,256", "prompt length distribution (synthetic)")
  synthetic_output_len: str = knob("uniform:16,128", "output length distribution (synthetic)")
  max_turns: int = knob(4, "sharegpt_multiturn: at most this many turns per conversation")
  think_time_s: float = knob(1.0, "sharegpt_multiturn: a turn is submitted this long (s) after the previous "
                                  "turn's last token")
  think_time_dist: str = knob("fixed", "sharegpt_multiturn: think times equal to --think_time_s, or exponential "
                                       "with that mean (seeded by --seed)", choices=THINK_TIME_DISTS)
  arrival_process: str = knob("poisson", "arrival process", choices=ARRIVAL_PROCESSES)
  burstiness: float = knob(1.0, "gamma burstiness (vLLM convention: shape = burstiness)")
  warmup: bool = knob(True, "compile the step shapes (and measure the step time) before the timed runs")
  calibrate: bool = knob(False, "derive the load and the SLOs from this machine's measured step time")
  load_factor: float = knob(0.9, "--calibrate: offered load as a multiple of the engine's capacity")
  ttft_slo_steps: float = knob(40.0, "--calibrate: TTFT SLO in measured steps")
  tbt_slo_steps: float = knob(5.0, "--calibrate: TBT SLO in measured steps")
  drift_tolerance: float = knob(1.5, "flag a run whose median step time leaves [warm-up / x, warm-up * x]")
  cpu_share_tolerance: float = knob(
      1.15, "flag a run whose CPU seconds per wall second of stepping fall below the warm-up's / x (another "
            "process took the CPU)")
  time_limit_s: Optional[float] = knob(None, "abort a run after this many seconds", none_as=0.0)
  hardware: Optional[str] = knob(
      None, "the hardware the results are for. A real run: its label in the results (unset: the JAX device "
            "kind). The simulator: the profile it loads, a name in configs/hardware/ (gh200, h200, a100-80gb, "
            "cpu) or a JSON path (unset: h200), whose name labels the results", none_as="")
  progress: bool = knob(True, "progress bars")

  def __post_init__(self):
    if not self.policy_names:
      raise ValueError("no policies given")
    if self.repeats < 1 or self.num_requests < 1 or self.max_turns < 1:
      raise ValueError("repeats, num_requests and max_turns must be >= 1")
    if not self.think_time_s >= 0:
      raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")
    if any(not (r > 0) for r in self.rps_values):
      raise ValueError(f"rps values must be > 0 (inf allowed), got {self.rps}")
    if not self.drift_tolerance > 1.0 or not self.cpu_share_tolerance > 1.0:
      raise ValueError(f"drift_tolerance and cpu_share_tolerance must be > 1, got {self.drift_tolerance}, "
                       f"{self.cpu_share_tolerance}")
    self.variants  # parses --vary (ValueError on a bad item)
    self.arms  # parses the policies' own settings

  def make_workload(self, tokenizer, rps: float, *, max_total_len: int, vocab_size: int):
    """This sweep's workload at ``rps``: the same requests at every rate (only the arrivals differ)."""
    from superinfer_jax.workload import make_workload  # pylint: disable=import-outside-toplevel
    return make_workload(self.dataset, tokenizer, num_requests=self.num_requests, rps=rps, seed=self.seed,
                         process=self.arrival_process, burstiness=self.burstiness, max_total_len=max_total_len,
                         max_prompt_len=self.max_prompt_len, max_output_len=self.max_output_len,
                         min_output_len=self.min_output_len, synthetic_prompt_len=self.synthetic_prompt_len,
                         synthetic_output_len=self.synthetic_output_len, vocab_size=vocab_size,
                         max_turns=self.max_turns, think_time_s=self.think_time_s,
                         think_time_dist=self.think_time_dist)

  @property
  def policy_entries(self) -> list[str]:
    """The ``policies`` items as written (a name, or ``name[setting=value,...]``); commas inside brackets do
    not split."""
    items, depth, cur = [], 0, ""
    for ch in self.policies:
      depth += (ch == "[") - (ch == "]")
      if ch == "," and depth == 0:
        items.append(cur)
        cur = ""
      else:
        cur += ch
    items.append(cur)
    return [p.strip() for p in items if p.strip()]

  @property
  def policy_names(self) -> list[str]:
    """The scheduling policy of each ``policy_entries`` item (its name, without settings)."""
    return [parse_policy_entry(p)[0] for p in self.policy_entries]

  @property
  def arms(self) -> list[tuple[str, dict[str, str]]]:
    """Every (policy, variant) to run, in order: each policy entry crossed with ``variants``, the entry's own
    settings applied over the variant's (``ValueError`` on a malformed entry)."""
    return [(name, {**v, **own}) for name, own in map(parse_policy_entry, self.policy_entries)
            for v in self.variants]

  @property
  def rps_values(self) -> list[float]:
    return parse_float_list(self.rps)

  @property
  def variants(self) -> list[dict[str, str]]:
    """The cartesian product of ``vary``: a list of {setting: value-as-text} ({} when nothing varies)."""
    axes = []
    for item in (x.strip() for x in self.vary.split(";")):
      if not item:
        continue
      name, sep, values = item.partition(":")
      vals = [v.strip() for v in values.split(",") if v.strip()]
      if not sep or not name.strip() or not vals:
        raise ValueError(f"--vary item {item!r} is not 'name:v1,v2,...'")
      axes.append([(name.strip(), v) for v in vals])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def parse_policy_entry(entry: str) -> tuple[str, dict[str, str]]:
  """``"rotasched"`` -> ("rotasched", {}); ``"rotasched[proactive_swap_budget=8]"`` -> ("rotasched",
  {"proactive_swap_budget": "8"}) (the inverse of ``variant_label``). ``ValueError`` on a malformed entry."""
  name, sep, rest = entry.partition("[")
  if not sep:
    return entry.strip(), {}
  if not rest.endswith("]") or not name.strip():
    raise ValueError(f"policy {entry!r} is not 'name' or 'name[setting=value,...]'")
  settings = {}
  for item in rest[:-1].split(","):
    key, eq, value = item.partition("=")
    if not eq or not key.strip() or not value.strip():
      raise ValueError(f"policy {entry!r}: {item!r} is not 'setting=value'")
    settings[key.strip()] = value.strip()
  return name.strip(), settings


def variant_label(policy: str, variant: dict[str, str]) -> str:
  """``policy`` or ``policy[name=value,...]`` (used in rows, tables and file names)."""
  if not variant:
    return policy
  return f"{policy}[{','.join(f'{k}={v}' for k, v in variant.items())}]"


def apply_variant(engine_config, variant: dict[str, str]):
  """``engine_config`` with the variant's settings parsed to their fields' types (bool: true/false)."""
  from superinfer_jax import configtree  # pylint: disable=import-outside-toplevel
  index = configtree.flat_index(type(engine_config))
  settings = {}
  for name, text in variant.items():
    if name not in index:
      raise ValueError(f"--vary: unknown engine setting {name!r}")
    base, _ = configtree.base_type(index[name].type)
    if base is bool:
      if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"--vary {name}: {text!r} is not a bool")
      settings[name] = text.lower() in ("true", "1")
    else:
      try:
        settings[name] = base(text)
      except ValueError:
        raise ValueError(f"--vary {name}: {text!r} is not a {base.__name__}") from None
  return engine_config.replace(**settings)


def fresh_output_dir(path: str) -> None:
  """Creates ``path``; an earlier run's non-empty directory is moved to ``<path>.prev-<time>`` first
  (nothing is overwritten or lost)."""
  if os.path.isdir(path) and os.listdir(path):
    moved = f"{os.path.normpath(path)}.prev-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(path, moved)
    print(f"[run] moved the earlier results in {path} to {moved}", flush=True)
  os.makedirs(path, exist_ok=True)


def finish_report(output_dir: str, rows: Sequence[dict[str, Any]]) -> str:
  """Writes the plots for ``output_dir`` and returns the comparison table + where the plots are."""
  paths = plots_lib.plot_results_dir(output_dir)
  table = format_comparison_table(rows)
  lines = [table]
  if any(r.get("perturbed") for r in rows):
    lines.append("* = perturbed run: its median step time, or the CPU time this process got per wall second, "
                 "drifted beyond the tolerance from the warm-up's (another process took the CPU?); compare "
                 "such rows with care")
  lines += ["", f"results: {os.path.join(output_dir, 'results.jsonl')}"]
  lines += [f"plot: {p}" for p in paths]
  return "\n".join(lines)


def parse_float_list(text: str) -> list[float]:
  """'1,2.5,inf' -> [1.0, 2.5, inf]; raises ValueError naming the bad item."""
  out = []
  for item in str(text).split(","):
    item = item.strip()
    if not item:
      continue
    try:
      v = float(item)
    except ValueError:
      raise ValueError(f"not a number: {item!r} in {text!r}") from None
    if math.isnan(v):
      raise ValueError(f"NaN in {text!r}")
    out.append(v)
  if not out:
    raise ValueError(f"empty list: {text!r}")
  return out


__all__ = ["SweepSpec", "apply_variant", "finish_report", "fresh_output_dir", "parse_float_list",
           "variant_label"]
