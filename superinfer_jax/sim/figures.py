"""The paper's experiments as named simulator runs (``scripts/simulate.py --figure NAME``), over seeds.

A ``Figure`` is one or more ``Part``s; a part is a set of settings (flat names of ``SweepSpec``,
``EngineConfig`` and ``SimConfig`` fields, as their flags are named) on top of the paper's common setting
(``COMMON``: GH200, Qwen2.5-32B, 2,400 requests = the paper's 120 s at RPS 20, SLOs 5 s / 100 ms, B_xfer
2400, DuplexKV with the pipeline) and of a workload (``WORKLOADS``: the ShareGPT stand-in as loaded, its
length-scaled variant, or the Splitwise production trace). A part's RPS values are the paper's; a workload
scales them by its ``rps_scale`` (the trace's own operating point). ``run_figure`` runs each part once per
seed with ``sim.sim_sweep.run_sim_sweep`` (for ShareGPT a seed draws other requests and arrivals; for a trace
it picks another window of it), and then:
  * draws the figure (``metrics.plots.plot_figure_panels``: a column per panel, a row per metric, one line
    per policy / variant: the mean over seeds, the min-max range shaded);
  * summarises every point over the seeds (mean, min, max of each metric, and its contention: pool
    occupancy and live KV demand P50 / P99, contended steps, rotations, preemptions), and marks the points
    where nothing contended on some seed (``uncontended_seeds``);
  * checks the figure's ``Claim``s (the paper's statement as a ratio of two points and a bound) on every
    seed: a claim holds only if it holds on each one, at points that contended.
Settings the user gave on the command line (``explicit``) win over the figure's and the workload's, so
``--figure=main --num_requests=24`` is a quick look at the same experiment.

Layout of ``output_dir`` (fresh: an earlier one is moved aside, ``sweep.fresh_output_dir``):
  figure-<name>.png            the figure
  figure.json                  the figure, workload, seeds, each part's settings as applied, the claims
  summary.jsonl                one line per (part, series, x): mean / min / max over the seeds
  report.txt                   the summary tables and the claims, as printed
  [<part>/]seed-<k>/           each seed's run: results.jsonl, requests-*, plots (the part directory only
                               for a figure of several parts)

Settings the paper does not state are marked [G] in ``paper`` (docs/simulator.md "Figures"). No JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

from superinfer_jax.metrics import plots as plots_lib
from superinfer_jax.sim.config import SimConfig
from superinfer_jax.sim.figure_summary import (CONTENTION, check_claims, claims_markdown, format_claims,
                                               format_summary, summarize_points)
from superinfer_jax.sim.results_file import replace_block
from superinfer_jax.sweep import SweepSpec, fresh_output_dir

# The paper's evaluation setting (docs/paper.md §5 and the §2.2 defaults table); the workload is WORKLOADS'.
COMMON: dict[str, Any] = dict(hardware="gh200", model="qwen2.5-32b", num_requests=2400, ttft_slo=5.0,
                              tbt_slo=0.1, proactive_swap_budget=2400, transfer_mode="duplex",
                              kv_layout="block_first", pipeline=True, arrival_process="poisson")
QWEN_RPS = "5,10,13,15,18,20"       # paper §5 RPS sweeps (ShareGPT): Qwen2.5-32B and Mixtral
LLAMA_RPS = "35,40,45,50,55,60"     # Llama-3-8B
PAPER_RPS = 20.0                    # the point Figs. 1, 2, 19-21 are read at
LATENCY = ("ttft_p99_s", "tbt_p99_s", "tbt_worst_p99_s")
ATTAINMENT = ("slo_attainment", "ttft_attainment", "tbt_attainment", "tbt_request_attainment")
ROTATION = ("rotations_per_step", "blocks_in_per_step", "exposed_transfer_share")


@dataclasses.dataclass(frozen=True)
class Workload:
  """A figure workload: settings over ``COMMON`` and the factor its RPS values are multiplied by."""
  name: str
  title: str
  settings: dict[str, Any]
  rps_scale: float = 1.0


# The length scale makes live KV exceed the pool at RPS 20 (docs/simulator.md "Contention"); the trace's
# point (rps_scale x 20) is the rate at which it contends without overloading the GPU's compute.
SHAREGPT_LENGTH_SCALE = 1.05
SPLITWISE_RPS = 5.75
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("sharegpt", "ShareGPT stand-in as loaded", dict(dataset="sharegpt")),
    Workload("sharegpt_long", f"ShareGPT stand-in, lengths x{SHAREGPT_LENGTH_SCALE:g}",
             dict(dataset="sharegpt", length_scale=SHAREGPT_LENGTH_SCALE)),
    Workload("splitwise", f"Splitwise conversation trace, time-scaled to {SPLITWISE_RPS:g} rps at the paper's 20",
             dict(trace="splitwise", trace_arrivals="rescale"), rps_scale=SPLITWISE_RPS / PAPER_RPS),
)}
# Mooncake: a 600-request window per seed (about 3 minutes of the trace), its rate set by contention
# (sim/contention_load.py); Llama-3.1-8B, whose 128k context holds the trace's prompts (docs/simulator.md).
MOONCAKE_WINDOW = 600
WORKLOADS["mooncake"] = Workload(
    "mooncake", "Mooncake conversation trace, each window's rate set by contention",
    dict(trace="mooncake", trace_arrivals="contention", model="llama-3.1-8b", num_requests=MOONCAKE_WINDOW))
WORKLOADS["splitwise_contention"] = Workload(
    "splitwise_contention", "Splitwise conversation trace, each window's rate set by contention",
    dict(trace="splitwise", trace_arrivals="contention"))
DEFAULT_WORKLOAD = "sharegpt_long"


@dataclasses.dataclass(frozen=True)
class Part:
  """One sweep of a figure: ``settings`` (flat flag names -> typed values) over ``COMMON``; its panel plots
  ``x_key`` (a results-row field) on the x axis."""
  name: str
  title: str
  settings: dict[str, Any]
  x_key: str = "rps"


@dataclasses.dataclass(frozen=True)
class Claim:
  """The paper's statement ``text`` as ``metric(num) / metric(den) <op> bound``, checked per seed; ``num``
  and ``den`` select one row of ``part`` each by field values (``base_policy``, a swept setting, ``rps``
  in the paper's units, which the workload scales)."""
  text: str
  part: str
  metric: str
  num: dict[str, Any]
  den: dict[str, Any]
  op: str
  bound: float
  # Both points must have contended on a seed for the claim to hold there (a scheduling comparison says
  # nothing without memory pressure). False where the load is set by contention of a reference arm and the
  # arms compared may remove it themselves (prefix caching: an arm that no longer contends is the gain).
  needs_contention: bool = True


@dataclasses.dataclass(frozen=True)
class Figure:
  """A paper experiment: its parts, what it reproduces (``paper``), the metrics drawn, its claims; ``merge``
  draws all parts in one panel (they share an x axis), else a panel per part; ``contended``: a figure
  meant to show contention (its uncontended points are flagged in the report)."""
  name: str
  paper: str
  parts: tuple[Part, ...]
  metrics: tuple[str, ...]
  merge: bool = False
  log_x: tuple[str, ...] = ()
  claims: tuple[Claim, ...] = ()
  contended: bool = True


def _at(policy: str, **fields) -> dict[str, Any]:
  return {"base_policy": policy, **fields}


_PT = dict(rps=PAPER_RPS)
CACHING = {"off": dict(enable_prefix_caching=False),
           "device": dict(enable_prefix_caching=True, host_prefix_cache=False),
           "device+host": dict(enable_prefix_caching=True, host_prefix_cache=True)}
CACHE_POLICIES = ("fcfs", "fcfs_swap", "rotasched", "rotasched_strict")
PREFIX = ("prefix_hit_rate", "prefix_host_hit_rate", "prefill_tokens_saved", "prefix_host_evictions")


def _arm(policy: str, caching: str) -> str:
  return f"{policy}[{','.join(f'{k}={str(v).lower()}' for k, v in CACHING[caching].items())}]"


def _prefix_claims(part: str) -> tuple:
  """prefix_reuse's claims on one hardware part: the host tier against device-only caching per policy, device
  caching against none, and RotaSched with the host tier against vLLM-style fcfs with device-only caching."""
  out = []
  for p in CACHE_POLICIES:
    out.append(Claim(f"{part} {p}: device+host P99 TTFT <= device-only's", part, "ttft_p99_s",
                     _at(p, **CACHING["device+host"]), _at(p, **CACHING["device"]), "<=", 1.0, False))
    out.append(Claim(f"{part} {p}: device+host SLO attainment >= device-only's", part, "slo_attainment",
                     _at(p, **CACHING["device+host"]), _at(p, **CACHING["device"]), ">=", 1.0, False))
    out.append(Claim(f"{part} {p}: device-only P99 TTFT <= caching off's", part, "ttft_p99_s",
                     _at(p, **CACHING["device"]), _at(p, **CACHING["off"]), "<=", 1.0, False))
  for p in ("rotasched", "rotasched_strict"):
    out.append(Claim(f"{part} {p} with the host tier: SLO attainment >= fcfs with device-only caching's", part,
                     "slo_attainment", _at(p, **CACHING["device+host"]), _at("fcfs", **CACHING["device"]), ">=",
                     1.0, False))
  return tuple(out)


_PREFIX_POLICIES = ",".join(_arm(p, c) for p in CACHE_POLICIES for c in CACHING)
FIGURES: dict[str, Figure] = {f.name: f for f in (
    Figure("motivation", "Fig. 1 (paper.md §5 row 14): FCFS / Waiting-First / Swapped-First P99 TTFT and TBT vs "
           "RPS, Qwen2.5-32B; the paper reads it at RPS 20 (WF ~10x better P99 TTFT, ~100x worse P99 TBT; "
           "SF ~ FCFS)",
           (Part("policies", "FCFS / WF / SF", dict(policies="fcfs,wf,sf", rps="10,15,20")),),
           metrics=LATENCY + ("slo_attainment", "kv_demand_p50"),
           claims=(Claim("WF P99 TTFT <= 1/3 of FCFS's", "policies", "ttft_p99_s", _at("wf", **_PT),
                         _at("fcfs", **_PT), "<=", 1 / 3),
                   Claim("WF P99 TBT (pooled gaps, the paper's) >= 10x FCFS's", "policies", "tbt_p99_s",
                         _at("wf", **_PT), _at("fcfs", **_PT), ">=", 10.0),
                   Claim("WF P99 worst TBT per request >= 10x FCFS's", "policies", "tbt_worst_p99_s",
                         _at("wf", **_PT), _at("fcfs", **_PT), ">=", 10.0))),
    Figure("bandwidth", "Fig. 2 (row 15): vLLM with offloading (fcfs_swap: reactive swap preemption; sf: vLLM "
           "v0's swapped-first) at RPS 20, swap bandwidth 50 -> 150 GB/s roughly halves P99 TTFT. vLLM's engine, "
           "not ours: its swap copies each block layer by layer (transfer_mode naive) before the step, which "
           "waits for them (no pipeline)",
           (Part("bandwidth", "swap bandwidth", dict(policies="fcfs_swap,sf", rps="20", pipeline=False,
                                                     transfer_mode="naive",
                                                     vary="swap_bandwidth_gbps:50,100,150"),
                 x_key="swap_bandwidth_gbps"),),
           metrics=LATENCY + ATTAINMENT + ROTATION,
           claims=(Claim("fcfs_swap P99 TTFT at 150 GB/s <= 0.7x at 50", "bandwidth", "ttft_p99_s",
                         _at("fcfs_swap", swap_bandwidth_gbps=150), _at("fcfs_swap", swap_bandwidth_gbps=50),
                         "<=", 0.7),)),
    Figure("main", "Fig. 16 (rows 1-2): SLO / TTFT / TBT attainment vs RPS per model at the paper's RPS sweeps, "
           "vLLM's FCFS vs RotaSched + DuplexKV",
           (Part("llama-3-8b", "Llama-3-8B", dict(model="llama-3-8b", policies="fcfs,rotasched", rps=LLAMA_RPS)),
            Part("qwen2.5-32b", "Qwen2.5-32B", dict(model="qwen2.5-32b", policies="fcfs,rotasched", rps=QWEN_RPS)),
            Part("mixtral-8x7b", "Mixtral-8x7B", dict(model="mixtral-8x7b", policies="fcfs,rotasched",
                                                      rps=QWEN_RPS))),
           metrics=ATTAINMENT + ("output_throughput_tok_s",) + LATENCY, contended=False),
    Figure("budget", "Fig. 21 (row 16): B_xfer 300 -> 4800 at RPS 20 (P99 TTFT ~10x lower, P99 TBT lower too)",
           (Part("budget", "B_xfer sweep", dict(policies="rotasched,rotasched_strict", rps="20",
                                                vary="proactive_swap_budget:300,600,1200,2400,4800"),
                 x_key="proactive_swap_budget"),),
           metrics=LATENCY + ATTAINMENT + ROTATION, log_x=("proactive_swap_budget",),
           claims=tuple(c for p in ("rotasched", "rotasched_strict") for c in (
               Claim(f"{p}: P99 TTFT at B_xfer 4800 < at 300", "budget", "ttft_p99_s",
                     _at(p, proactive_swap_budget=4800), _at(p, proactive_swap_budget=300), "<", 1.0),
               Claim(f"{p}: P99 TBT at B_xfer 4800 < at 300", "budget", "tbt_p99_s",
                     _at(p, proactive_swap_budget=4800), _at(p, proactive_swap_budget=300), "<", 1.0)))),
    Figure("alpha_beta", "Figs. 19-20 (paper.md §1.2): alpha, beta_F, beta_B one at a time around the defaults "
           "(3, 0.5, 0) at RPS 20, Algorithm 1 as written (rotasched) and with urgency past the VLT zero point "
           "(rotasched_strict); the swept values are [G]",
           (Part("alpha", "alpha", dict(policies="rotasched,rotasched_strict", rps="20", vary="alpha:1,3,5"),
                 x_key="alpha"),
            Part("beta_f", "beta_F", dict(policies="rotasched,rotasched_strict", rps="20", vary="beta_f:0,0.5,2"),
                 x_key="beta_f"),
            Part("beta_b", "beta_B", dict(policies="rotasched,rotasched_strict", rps="20", vary="beta_b:-10,0,1"),
                 x_key="beta_b")),
           metrics=LATENCY + ATTAINMENT,
           claims=tuple(c for p in ("rotasched", "rotasched_strict") for c in (
               Claim(f"{p}: raising beta_F 0 -> 2 hurts P99 TTFT", "beta_f", "ttft_p99_s", _at(p, beta_f=2),
                     _at(p, beta_f=0), ">", 1.0),
               Claim(f"{p}: raising beta_B -10 -> 1 hurts P99 worst TBT per request", "beta_b", "tbt_worst_p99_s",
                     _at(p, beta_b=1), _at(p, beta_b=-10), ">", 1.0),
               Claim(f"{p}: raising alpha 1 -> 5 hurts P99 TTFT", "alpha", "ttft_p99_s", _at(p, alpha=5),
                     _at(p, alpha=1), ">", 1.0),
               Claim(f"{p}: raising alpha 1 -> 5 improves P99 worst TBT per request", "alpha", "tbt_worst_p99_s",
                     _at(p, alpha=5), _at(p, alpha=1), "<", 1.0)))),
    Figure("headline", "The SLO-attainment headline (paper.md §5 rows 1-2) at the paper's RPS 20: vLLM (fcfs), "
           "vLLM with offloading (fcfs_swap, sf), Waiting-First and RotaSched (as written and strict)",
           (Part("policies", "policies", dict(policies="fcfs,fcfs_swap,sf,wf,rotasched,rotasched_strict",
                                               rps="20")),),
           metrics=ATTAINMENT + LATENCY,
           claims=tuple(Claim(f"{p} SLO attainment >= {b}'s", "policies", "slo_attainment",
                              _at(p, **_PT), _at(b, **_PT), ">=", 1.0)
                        for p in ("rotasched", "rotasched_strict") for b in ("fcfs", "fcfs_swap", "sf", "wf"))),
    Figure("ablation", "Fig. 17 (row 17): RotaSched without DuplexKV (naive per-segment copies) at B_xfer 300 "
           "(L) and 2400 (H), the full system (duplex, 2400), and FCFS; RPS 10-20 [G]",
           (Part("fcfs", "FCFS", dict(policies="fcfs", rps="10,15,20")),
            Part("rotasched", "RotaSched", dict(policies="rotasched", rps="10,15,20",
                                                vary="transfer_mode:naive,duplex;proactive_swap_budget:300,2400"))),
           metrics=LATENCY + ATTAINMENT + ROTATION, merge=True),
    Figure("tp", "Fig. 22: TP=2 (over NVLink on the paper's GH200 NVL2) vs TP=1 for Qwen2.5-32B and "
           "Mixtral-8x7B, FCFS vs RotaSched; RPS up to 30 [G] (TP=2 doubles HBM and the step's bandwidth)",
           (Part("qwen2.5-32b", "Qwen2.5-32B", dict(model="qwen2.5-32b", policies="fcfs,rotasched",
                                                    rps="10,15,20,25,30", vary="tensor_parallel_size:1,2")),
            Part("mixtral-8x7b", "Mixtral-8x7B", dict(model="mixtral-8x7b", policies="fcfs,rotasched",
                                                      rps="10,15,20,25,30", vary="tensor_parallel_size:1,2"))),
           metrics=ATTAINMENT + LATENCY, contended=False),
    Figure("prefix_reuse", "Prefix reuse at production scale (issue 50): prefix caching off / device only / "
           "device + host under fcfs, fcfs_swap, rotasched and rotasched_strict, GH200 (NVLink-C2C) and H200 "
           "(PCIe), Llama-3.1-8B on the Mooncake trace (workload mooncake); each window's load set by contention "
           "(--load_target), the x axis",
           (Part("gh200", "GH200 (C2C)", dict(hardware="gh200", policies=_PREFIX_POLICIES), x_key="load_target"),
            Part("h200", "H200 (PCIe)", dict(hardware="h200", policies=_PREFIX_POLICIES), x_key="load_target")),
           metrics=ATTAINMENT + LATENCY + PREFIX + ("rotations_per_step", "exposed_transfer_share"),
           claims=_prefix_claims("gh200") + _prefix_claims("h200")),
)}


@dataclasses.dataclass
class FigureResult:
  output_dir: str
  plot: str
  rows: dict[str, list[dict[str, Any]]]     # part name -> its rows, every seed's
  summary: list[dict[str, Any]]             # one entry per (part, series, x): see ``summarize_points``
  claims: list[dict[str, Any]]              # one entry per claim: see ``check_claims``
  report: str                               # the summary tables and the claims


def figure_names() -> list[str]:
  return list(FIGURES)


def workload_names() -> list[str]:
  return list(WORKLOADS)


def get_figure(name: str) -> Figure:
  if name not in FIGURES:
    raise ValueError(f"unknown figure {name!r}; known: {', '.join(FIGURES)}")
  return FIGURES[name]


def get_workload(name: str) -> Workload:
  if name not in WORKLOADS:
    raise ValueError(f"unknown figure workload {name!r}; known: {', '.join(WORKLOADS)}")
  return WORKLOADS[name]


def _scale_rps(text: str, factor: float) -> str:
  return text if factor == 1.0 else ",".join(f"{float(v) * factor:g}" for v in text.split(","))


def part_configs(part: Part, spec: SweepSpec, engine_config, sim_config: SimConfig, *,
                 explicit: Sequence[str] = (), workload: Optional[str] = None
                 ) -> tuple[SweepSpec, Any, SimConfig, dict[str, Any]]:
  """(spec, engine config, sim config, settings applied) of ``part``: ``COMMON``, the workload's settings
  (``None``: ``DEFAULT_WORKLOAD``), then the part's (its RPS values times the workload's ``rps_scale``),
  each unless ``explicit`` (names the user set) holds it. ``ValueError`` for a setting no config has."""
  w = get_workload(workload or DEFAULT_WORKLOAD)
  settings = {**COMMON, **w.settings, **part.settings}
  if "rps" in part.settings:
    settings["rps"] = _scale_rps(part.settings["rps"], w.rps_scale)
  settings = {k: v for k, v in settings.items() if k not in set(explicit)}
  spec_names = {f.name for f in dataclasses.fields(SweepSpec)}
  sim_names = {f.name for f in dataclasses.fields(SimConfig)}
  spec_s = {k: v for k, v in settings.items() if k in spec_names}
  sim_s = {k: v for k, v in settings.items() if k in sim_names}
  eng_s = {k: v for k, v in settings.items() if k not in spec_names and k not in sim_names}
  try:
    engine_config = engine_config.replace(**eng_s) if eng_s else engine_config
  except TypeError as e:   # configtree: unknown setting
    raise ValueError(f"figure part {part.name!r}: {e}") from None
  return (dataclasses.replace(spec, **spec_s), engine_config, sim_config.replace(**sim_s) if sim_s else sim_config,
          settings)


def _run_part(name: str, wl: Workload, part: Part, config, seeds: Sequence[int], part_dir: str, *,
              timelines: bool, log) -> list[dict[str, Any]]:
  """Every seed's run of one part (``config`` = ``part_configs``'s tuple) into ``part_dir/seed-<k>``, each
  plotted; returns the rows of all seeds, tagged with the figure, part and workload."""
  from superinfer_jax.sim.sim_sweep import run_sim_sweep   # pylint: disable=import-outside-toplevel
  p_spec, p_eng, p_sim, _ = config
  log(f"[figure {name} / {wl.name}] part {part.name}: "
      f"{', '.join(f'{k}={v}' for k, v in part.settings.items())}, seeds {seeds} -> {part_dir}")
  part_rows = []
  for s in seeds:
    s_spec = dataclasses.replace(p_spec, seed=s, output_dir=os.path.join(part_dir, f"seed-{s}"))
    part_rows += run_sim_sweep(s_spec, p_eng, p_sim, log=log,
                               row_tags={"figure": name, "figure_part": part.name, "figure_workload": wl.name})
    plots_lib.plot_results_dir(s_spec.output_dir, timelines=timelines)
  return part_rows


def _write_outputs(out: str, figure: dict[str, Any], summary: Sequence[dict[str, Any]], report: str) -> None:
  """``figure.json`` (``figure``), ``summary.jsonl`` (a line per summarised point) and ``report.txt``."""
  with open(os.path.join(out, "figure.json"), "w") as f:
    json.dump(figure, f, indent=2, default=str)
  with open(os.path.join(out, "summary.jsonl"), "w") as f:
    for e in summary:
      f.write(json.dumps(e, default=str) + "\n")
  with open(os.path.join(out, "report.txt"), "w") as f:
    f.write(report + "\n")


def run_figure(name: str, spec: SweepSpec, engine_config, sim_config: SimConfig, *,
               explicit: Sequence[str] = (), output_dir: Optional[str] = None, timelines: bool = False,
               seeds: Optional[Sequence[int]] = None, workload: Optional[str] = None,
               results_file: Optional[str] = None, log=print) -> FigureResult:
  """Runs figure ``name`` on ``workload`` (``None``: ``DEFAULT_WORKLOAD``) once per seed of ``seeds``
  (``None``: ``spec.seed`` alone) into ``output_dir`` (default ``runs/figure-<name>-<workload>``; fresh),
  draws it, summarises each point over the seeds and checks the figure's claims (module docstring).
  ``results_file``: also rewrite the block ``<figure>-<workload>`` of that markdown results file (e.g.
  ``docs/results/simulator.md``) with the claims table (``results_file.replace_block``).

  ``spec`` / ``engine_config`` / ``sim_config`` are the command line's; ``explicit`` the names set there
  (they override the figure's and the workload's settings; ``seed`` is always the loop's). ``timelines``
  also draws each run's per-request timeline (seconds per run)."""
  fig = get_figure(name)
  wl = get_workload(workload or DEFAULT_WORKLOAD)
  seeds = list(seeds) if seeds is not None else [spec.seed]
  if not seeds:
    raise ValueError("run_figure: no seeds")
  out = output_dir or os.path.join("runs", f"figure-{name}-{wl.name}")
  configs = [(p, part_configs(p, spec, engine_config, sim_config, explicit=explicit, workload=wl.name))
             for p in fig.parts]
  fresh_output_dir(out)
  rows: dict[str, list[dict[str, Any]]] = {}
  summary: list[dict[str, Any]] = []
  described = []
  tables = []
  for part, config in configs:
    part_dir = out if len(fig.parts) == 1 else os.path.join(out, part.name)
    rows[part.name] = _run_part(name, wl, part, config, seeds, part_dir, timelines=timelines, log=log)
    part_summary = summarize_points(part.name, part.x_key, rows[part.name], fig.metrics)
    summary += part_summary
    tables.append(f"== {name} / {part.name} ({part.title}) on {wl.name}: mean [min, max] over seeds {seeds} ==\n"
                  f"{format_summary(part_summary)}")
    described.append({"name": part.name, "title": part.title, "dir": os.path.relpath(part_dir, out),
                      "x_key": part.x_key, "settings": config[3], "num_rows": len(rows[part.name])})
  claims = check_claims(fig, rows, wl.rps_scale, ignore_rps=wl.settings.get("trace_arrivals") == "contention")
  if fig.contended and summary and all(e["uncontended_seeds"] == e["seeds"] for e in summary):
    tables.append(f"WARNING: figure {name} is meant to show contention, but on {wl.name} nothing contended at "
                  "any point on any seed: its comparisons say nothing about scheduling under memory pressure")
  if fig.merge:
    panels = [(fig.paper.split(":")[0], fig.parts[0].x_key, [r for p in fig.parts for r in rows[p.name]])]
  else:
    panels = [(p.title, p.x_key, rows[p.name]) for p in fig.parts]
  hw = sorted({r["hardware"] for rs in rows.values() for r in rs})
  plot = plots_lib.plot_figure_panels(
      panels, os.path.join(out, f"figure-{name}.png"), metrics=fig.metrics, log_x=fig.log_x,
      title=f"{name} ({', '.join(hw)}, {wl.title}, {len(seeds)} seeds): {fig.paper.split(':')[0]}")
  report = "\n\n".join(tables + ([f"claims over seeds {seeds}:\n{format_claims(claims)}"] if claims else [])
                       + [f"figure: {plot}"])
  _write_outputs(out, {"figure": name, "paper": fig.paper, "workload": dataclasses.asdict(wl), "seeds": seeds,
                       "explicit": sorted(explicit), "parts": described, "claims": claims,
                       "plot": os.path.basename(plot)}, summary, report)
  if results_file and claims:
    replace_block(results_file, f"{name}-{wl.name}", claims_markdown(name, wl.name, claims))
  return FigureResult(output_dir=out, plot=plot, rows=rows, summary=summary, claims=claims, report=report)


__all__ = ["COMMON", "Claim", "DEFAULT_WORKLOAD", "FIGURES", "Figure", "FigureResult", "Part", "WORKLOADS",
           "Workload", "figure_names", "get_figure", "get_workload", "part_configs", "run_figure", "workload_names"]
