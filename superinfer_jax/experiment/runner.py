"""Policy × RPS sweeps on the real engine (``scripts/run_experiment.py`` is a thin flag wrapper).

Output directory layout (one schema for the real engine, the simulator and the HTTP client):
  results.jsonl                      one row per (policy, rps): ``metrics.results_row`` + engine counters
  requests-<policy>-<rps>.jsonl      per-request timelines (``metrics.timeline`` schema)
  config.json                        snapshot of the sweep and engine configuration
  plots/*.png                        ``metrics.plots.plot_results_dir``
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import time
from typing import Any, Optional, Sequence

from superinfer_jax.experiment.replay import replay_workload
from superinfer_jax.metrics import plots as plots_lib
from superinfer_jax.metrics.results import append_results_row, format_comparison_table, results_row
from superinfer_jax.metrics.timeline import requests_filename, write_timelines


@dataclasses.dataclass
class SweepSpec:
  """One experiment: a model, a workload recipe, the policies and loads to compare."""
  model: str = "smollm2-135m"
  dataset: str = "sharegpt"              # "sharegpt" | "synthetic" | a path
  num_requests: int = 32
  rps: Sequence[float] = (1.0,)
  policies: Sequence[str] = ("fcfs", "rotasched")
  seed: int = 0
  output_dir: str = "runs/experiment"
  max_prompt_len: Optional[int] = None
  max_output_len: Optional[int] = None
  min_output_len: int = 1
  synthetic_prompt_len: str = "uniform:16,256"
  synthetic_output_len: str = "uniform:16,128"
  arrival_process: str = "poisson"
  burstiness: float = 1.0
  warmup: bool = True
  time_limit_s: Optional[float] = None  # per (policy, rps) replay
  hardware: Optional[str] = None        # label in results rows (default: the JAX device kind)
  progress: bool = True


def _hardware_label() -> str:
  import jax  # pylint: disable=import-outside-toplevel
  d = jax.devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', d.platform)}"


def _model_label(model: str) -> str:
  return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model


def _fresh_output_dir(path: str) -> None:
  """Creates ``path``; an earlier run's non-empty directory is moved to ``<path>.prev-<time>`` first
  (nothing is overwritten or lost)."""
  if os.path.isdir(path) and os.listdir(path):
    moved = f"{os.path.normpath(path)}.prev-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(path, moved)
    print(f"[run] moved the earlier results in {path} to {moved}", flush=True)
  os.makedirs(path, exist_ok=True)


def _warm_up(model_tuple, engine_config, workload, progress: bool) -> int:
  """Compiles the step shapes a run will hit: the same prompts, all at t=0, short outputs, same pool.

  Returns the engine's device pool size (blocks), so later engines can be pinned to it."""
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  engine = LLMEngine(model_tuple, engine_config)
  engine.precompile_rotation()
  engine.precompile_steps()
  prompts = [s.prompt_token_ids for s in workload]
  params = [SamplingParams(max_tokens=min(s.output_len, 24), ignore_eos=True) for s in workload]
  t = time.perf_counter()
  engine.generate(prompts, params)
  if progress:
    print(f"[warm-up] {len(prompts)} requests, {engine.num_compiled_shapes()} compiled step shapes, "
          f"{time.perf_counter() - t:.1f} s", flush=True)
  return engine.num_device_blocks


def run_sweep(spec: SweepSpec, engine_config, *, model_tuple=None) -> list[dict[str, Any]]:
  """Runs every (policy, rps) of ``spec`` with ``engine_config`` (its ``policy`` is overridden).

  ``model_tuple`` = (cfg, params, tokenizer) skips loading ``spec.model`` (tests pass tiny models).
  Returns the results rows (also appended to ``<output_dir>/results.jsonl``).
  """
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  from superinfer_jax.workload import make_workload  # pylint: disable=import-outside-toplevel
  if not spec.policies:
    raise ValueError("no policies given")
  if not spec.rps or any(not (r > 0) for r in spec.rps):
    raise ValueError(f"rps values must be > 0 (inf allowed), got {list(spec.rps)}")
  _fresh_output_dir(spec.output_dir)
  if model_tuple is None:
    from superinfer_jax.model import load_model, load_tokenizer  # pylint: disable=import-outside-toplevel
    cfg, params = load_model(spec.model, dtype=engine_config.model.dtype)
    try:
      tokenizer = load_tokenizer(spec.model)
    except FileNotFoundError:
      if spec.dataset != "synthetic":
        raise
      tokenizer = None  # synthetic prompts are token ids; outputs then carry no text
    model_tuple = (cfg, params, tokenizer)
  cfg, _, tokenizer = model_tuple
  max_len = min(engine_config.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
  # A request must fit the device pool on its own (the engine refuses it otherwise).
  max_len = min(max_len, engine_config.num_device_blocks * engine_config.block_size
                if engine_config.num_device_blocks else max_len)
  hardware = spec.hardware or _hardware_label()
  results_path = os.path.join(spec.output_dir, "results.jsonl")
  with open(os.path.join(spec.output_dir, "config.json"), "w") as f:
    json.dump({"sweep": dataclasses.asdict(spec), "engine": engine_config.as_flat_dict(),
               "model_config": getattr(cfg, "__dict__", str(cfg)) if not dataclasses.is_dataclass(cfg)
               else dataclasses.asdict(cfg), "hardware": hardware}, f, indent=2, default=str)

  def workload_at(rps: float):
    return make_workload(spec.dataset, tokenizer, num_requests=spec.num_requests, rps=rps, seed=spec.seed,
                         process=spec.arrival_process, burstiness=spec.burstiness, max_total_len=max_len,
                         max_prompt_len=spec.max_prompt_len, max_output_len=spec.max_output_len,
                         min_output_len=spec.min_output_len,
                         synthetic_prompt_len=spec.synthetic_prompt_len,
                         synthetic_output_len=spec.synthetic_output_len, vocab_size=cfg.vocab_size)

  workloads = {rps: workload_at(rps) for rps in spec.rps}
  if spec.warmup:
    n = _warm_up(model_tuple, engine_config.replace(policy=spec.policies[0]),
                 workloads[spec.rps[0]], spec.progress)
    engine_config = engine_config.replace(num_device_blocks=n)
    gc.collect()
  rows = []
  for rps in spec.rps:
    for policy in spec.policies:
      engine = LLMEngine(model_tuple, engine_config.replace(policy=policy))
      # A pool sized from free device memory is pinned after the first engine: later engines must not
      # size theirs from what an earlier engine's cache left free (every policy gets the same pool).
      engine_config = engine_config.replace(num_device_blocks=engine.num_device_blocks)
      res = replay_workload(engine, workloads[rps], desc=f"{policy} @ {rps:g} rps", progress=spec.progress,
                            time_limit_s=spec.time_limit_s)
      st = res.engine_stats
      row = results_row(
          res.timelines, engine="real", model=_model_label(spec.model), hardware=hardware, policy=policy,
          rps=rps, ttft_slo_s=engine_config.scheduler.ttft_slo, tbt_slo_s=engine_config.scheduler.tbt_slo,
          num_rotations=st["rotations_out"], swap_out_bytes=st["bytes_out"], swap_in_bytes=st["bytes_in"],
          num_recompute_preemptions=st["recompute_preemptions"], duration_s=res.duration_s,
          extra={"num_device_blocks": engine.num_device_blocks, "num_host_blocks": engine.num_host_blocks,
                 "block_size": engine_config.block_size, "rotations_in": st["rotations_in"],
                 "blocks_out": st["blocks_out"], "blocks_writeback": st["blocks_writeback"],
                 "blocks_in": st["blocks_in"], "steps": st["steps"],
                 "host_time_share": st["host_time_share"], "step_compilations_during_run": res.compilations[0],
                 "rotation_compilations_during_run": res.compilations[1],
                 "num_rejected": len(res.rejected), "timed_out": res.timed_out,
                 "pipeline": engine_config.pipeline, "attention": engine_config.model.attention,
                 "dtype": engine_config.model.dtype})
      append_results_row(results_path, row)
      write_timelines(os.path.join(spec.output_dir, requests_filename(policy, rps)), res.timelines)
      rows.append(row)
      del engine, res     # free this engine's device cache and host pool before the next one
      gc.collect()
      if spec.progress:
        print(f"[{policy} @ {rps:g} rps] finished {row['num_finished']}/{row['num_requests']}, "
              f"SLO attainment {row['slo_attainment']:.2f}, rotations {row['num_rotations']}", flush=True)
  return rows


def finish_report(output_dir: str, rows: Sequence[dict[str, Any]]) -> str:
  """Writes the plots for ``output_dir`` and returns the comparison table + where the plots are."""
  paths = plots_lib.plot_results_dir(output_dir)
  table = format_comparison_table(rows)
  lines = [table, "", f"results: {os.path.join(output_dir, 'results.jsonl')}"]
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
