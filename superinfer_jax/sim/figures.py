"""The paper's experiments as named simulator runs (``scripts/simulate.py --figure NAME``).

A ``Figure`` is one or more ``Part``s; a part is a set of settings (flat names of ``SweepSpec``,
``EngineConfig`` and ``SimConfig`` fields, as their flags are named) on top of the paper's common setting
(``COMMON``: GH200, Qwen2.5-32B, ShareGPT, 2,400 requests = the paper's 120 s at RPS 20, SLOs 5 s / 100
ms, B_xfer 2400, DuplexKV with the pipeline). ``run_figure`` runs each part with ``sim.runner.
run_sim_sweep`` (the same rows, timelines and per-directory plots as any ``simulate.py`` run), and draws the
figure itself (``metrics.plots.plot_figure_panels``: a column per panel, a row per metric, one line per
policy / variant). Settings the user gave on the command line (``explicit``) win over the figure's, so
``--figure=main --num_requests=24`` is a quick look at the same experiment.

Layout of ``output_dir`` (fresh: an earlier one is moved aside, ``sweep.fresh_output_dir``):
  figure-<name>.png            the figure
  figure.json                  the figure's description, each part's settings as applied, row counts
  results.jsonl, requests-*    the runs, for a one-part figure; else one such directory per part:
  <part>/results.jsonl ...

Settings the paper does not state are marked [G] in ``paper`` (docs/simulator.md "Figures"). No JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

from superinfer_jax.sweep import SweepSpec, fresh_output_dir
from superinfer_jax.metrics import plots as plots_lib
from superinfer_jax.metrics.results import format_comparison_table
from superinfer_jax.sim.config import SimConfig

# The paper's evaluation setting (docs/paper.md §5 and the §2.2 defaults table).
COMMON: dict[str, Any] = dict(hardware="gh200", model="qwen2.5-32b", dataset="sharegpt", num_requests=2400,
                              ttft_slo=5.0, tbt_slo=0.1, proactive_swap_budget=2400, transfer_mode="duplex",
                              kv_layout="block_first", pipeline=True, arrival_process="poisson")
QWEN_RPS = "5,10,13,15,18,20"       # paper §5 RPS sweeps (ShareGPT): Qwen2.5-32B and Mixtral
LLAMA_RPS = "35,40,45,50,55,60"     # Llama-3-8B
LATENCY = ("ttft_p99_s", "tbt_p99_s")
ATTAINMENT = ("slo_attainment", "ttft_attainment", "tbt_attainment")
ROTATION = ("rotations_per_step", "blocks_in_per_step", "exposed_transfer_share")


@dataclasses.dataclass(frozen=True)
class Part:
  """One sweep of a figure: ``settings`` (flat flag names -> typed values) over ``COMMON``; its panel plots
  ``x_key`` (a results-row field) on the x axis."""
  name: str
  title: str
  settings: dict[str, Any]
  x_key: str = "rps"


@dataclasses.dataclass(frozen=True)
class Figure:
  """A paper experiment: its parts, what it reproduces (``paper``), the metrics drawn; ``merge`` draws all
  parts in one panel (they share an x axis), else a panel per part."""
  name: str
  paper: str
  parts: tuple[Part, ...]
  metrics: tuple[str, ...]
  merge: bool = False
  log_x: tuple[str, ...] = ()


FIGURES: dict[str, Figure] = {f.name: f for f in (
    Figure("motivation", "Fig. 1 (paper.md §5 row 14): FCFS / Waiting-First / Swapped-First P99 TTFT and TBT vs "
           "RPS, Qwen2.5-32B, ShareGPT; the paper reads it at RPS 20 (WF ~10x better P99 TTFT, ~100x worse "
           "P99 TBT; SF ~ FCFS)",
           (Part("policies", "FCFS / WF / SF", dict(policies="fcfs,wf,sf", rps=QWEN_RPS)),),
           metrics=LATENCY + ("slo_attainment",)),
    Figure("bandwidth", "Fig. 2 (row 15): P99 latency vs swap bandwidth at RPS 20 (50 -> 150 GB/s roughly halves "
           "P99 TTFT); the paper's swapping scheduler there is not named: WF and rotasched here [G]",
           (Part("bandwidth", "swap bandwidth", dict(policies="wf,rotasched", rps="20",
                                                     vary="swap_bandwidth_gbps:25,50,100,150,200"),
                 x_key="swap_bandwidth_gbps"),),
           metrics=LATENCY + ATTAINMENT + ROTATION),
    Figure("main", "Fig. 16 (rows 1-2): SLO / TTFT / TBT attainment vs RPS per model at the paper's RPS sweeps "
           "(ShareGPT), vLLM's FCFS vs RotaSched + DuplexKV",
           (Part("llama-3-8b", "Llama-3-8B", dict(model="llama-3-8b", policies="fcfs,rotasched", rps=LLAMA_RPS)),
            Part("qwen2.5-32b", "Qwen2.5-32B", dict(model="qwen2.5-32b", policies="fcfs,rotasched", rps=QWEN_RPS)),
            Part("mixtral-8x7b", "Mixtral-8x7B", dict(model="mixtral-8x7b", policies="fcfs,rotasched",
                                                      rps=QWEN_RPS))),
           metrics=ATTAINMENT + ("output_throughput_tok_s",) + LATENCY),
    Figure("budget", "Fig. 21 (row 16): B_xfer 300 -> 4800 at RPS 20 (P99 TTFT ~10x lower, P99 TBT lower too)",
           (Part("budget", "B_xfer sweep", dict(policies="rotasched", rps="20",
                                                vary="proactive_swap_budget:300,600,1200,2400,4800"),
                 x_key="proactive_swap_budget"),),
           metrics=LATENCY + ATTAINMENT + ROTATION, log_x=("proactive_swap_budget",)),
    Figure("alpha_beta", "Figs. 19-20 (paper.md §1.2): alpha, beta_F, beta_B one at a time around the defaults "
           "(3, 0.5, 0) at RPS 20; the swept values are [G]",
           (Part("alpha", "alpha", dict(policies="rotasched", rps="20", vary="alpha:0.5,1,2,3,5"), x_key="alpha"),
            Part("beta_f", "beta_F", dict(policies="rotasched", rps="20", vary="beta_f:0,0.25,0.5,1,2"),
                 x_key="beta_f"),
            Part("beta_b", "beta_B", dict(policies="rotasched", rps="20", vary="beta_b:-10,-5,-1,0,1"),
                 x_key="beta_b")),
           metrics=LATENCY + ATTAINMENT),
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
           metrics=ATTAINMENT + LATENCY),
)}


@dataclasses.dataclass
class FigureResult:
  output_dir: str
  plot: str
  rows: dict[str, list[dict[str, Any]]]     # part name -> its rows
  report: str                               # the comparison tables, per part


def figure_names() -> list[str]:
  return list(FIGURES)


def get_figure(name: str) -> Figure:
  if name not in FIGURES:
    raise ValueError(f"unknown figure {name!r}; known: {', '.join(FIGURES)}")
  return FIGURES[name]


def part_configs(part: Part, spec: SweepSpec, engine_config, sim_config: SimConfig, *,
                 explicit: Sequence[str] = ()) -> tuple[SweepSpec, Any, SimConfig, dict[str, Any]]:
  """(spec, engine config, sim config, settings applied) of ``part``: ``COMMON`` then the part's settings,
  each unless ``explicit`` (names the user set) holds it. ``ValueError`` for a setting no config has."""
  settings = {k: v for k, v in {**COMMON, **part.settings}.items() if k not in set(explicit)}
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


def run_figure(name: str, spec: SweepSpec, engine_config, sim_config: SimConfig, *,
               explicit: Sequence[str] = (), output_dir: Optional[str] = None, timelines: bool = False,
               log=print) -> FigureResult:
  """Runs figure ``name`` into ``output_dir`` (default ``runs/figure-<name>``; fresh) and draws it.

  ``spec`` / ``engine_config`` / ``sim_config`` are the command line's; ``explicit`` the names set there
  (they override the figure's settings). ``timelines`` also draws each run's per-request timeline (seconds
  per run). Returns the rows by part, the figure's path and the per-part comparison tables."""
  from superinfer_jax.sim.runner import run_sim_sweep   # pylint: disable=import-outside-toplevel
  fig = get_figure(name)
  out = output_dir or os.path.join("runs", f"figure-{name}")
  configs = [(p, part_configs(p, spec, engine_config, sim_config, explicit=explicit)) for p in fig.parts]
  fresh_output_dir(out)
  rows: dict[str, list[dict[str, Any]]] = {}
  tables = []
  described = []
  for part, (p_spec, p_eng, p_sim, settings) in configs:
    part_dir = out if len(fig.parts) == 1 else os.path.join(out, part.name)
    p_spec = dataclasses.replace(p_spec, output_dir=part_dir)
    log(f"[figure {name}] part {part.name}: {', '.join(f'{k}={v}' for k, v in part.settings.items())} -> "
        f"{part_dir}")
    part_rows = run_sim_sweep(p_spec, p_eng, p_sim, log=log, row_tags={"figure": name, "figure_part": part.name})
    plots_lib.plot_results_dir(part_dir, timelines=timelines)
    rows[part.name] = part_rows
    tables.append(f"== {name} / {part.name} ({part.title}) ==\n{format_comparison_table(part_rows)}")
    described.append({"name": part.name, "title": part.title, "dir": os.path.relpath(part_dir, out),
                      "x_key": part.x_key, "settings": settings, "num_rows": len(part_rows)})
  if fig.merge:
    panels = [(fig.paper.split(":")[0], fig.parts[0].x_key, [r for p in fig.parts for r in rows[p.name]])]
  else:
    panels = [(p.title, p.x_key, rows[p.name]) for p in fig.parts]
  hw = sorted({r["hardware"] for rs in rows.values() for r in rs})
  plot = plots_lib.plot_figure_panels(
      panels, os.path.join(out, f"figure-{name}.png"), metrics=fig.metrics, log_x=fig.log_x,
      title=f"{name} ({', '.join(hw)}): {fig.paper.split(':')[0]}")
  with open(os.path.join(out, "figure.json"), "w") as f:
    json.dump({"figure": name, "paper": fig.paper, "explicit": sorted(explicit), "parts": described,
               "plot": os.path.basename(plot)}, f, indent=2, default=str)
  report = "\n\n".join(tables + [f"figure: {plot}"])
  return FigureResult(output_dir=out, plot=plot, rows=rows, report=report)


__all__ = ["COMMON", "FIGURES", "Figure", "FigureResult", "Part", "figure_names", "get_figure", "part_configs",
           "run_figure"]
