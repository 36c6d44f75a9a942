"""Policy × variant × RPS sweeps on the real engine (``scripts/run_experiment.py`` is a thin flag wrapper).

Output directory layout (one schema for the real engine, the simulator and the HTTP client):
  results.jsonl                         one row per run: ``metrics.results_row`` + engine counters + the
                                        run's step times, drift flag, machine load and rotation figures
  requests-<label>-<rps>[-rep<k>].jsonl per-request timelines (``metrics.timeline`` schema); ``label`` is
                                        the policy, or ``policy[setting=value,...]`` for a variant
  config.json                           the sweep, the engine config tree (flat), the calibration
  *.png                                 ``metrics.plots.plot_results_dir``

Run order: with ``repeats > 1`` the (policy, variant) runs of each repeat go in alternating order (ABBA), so
a machine that slows down during the job weighs on every policy alike; every repeat is its own row.
With ``calibrate`` the load and the SLOs come from this machine's measured step time (``calibrate.py``).
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import math
import os
import time
from typing import Any, Callable, Optional, Sequence

from superinfer_jax import util
from superinfer_jax.configtree import knob
from superinfer_jax.experiment import calibrate as calib
from superinfer_jax.experiment.replay import StepTimer, loadavg_1m, replay_workload
from superinfer_jax.metrics import plots as plots_lib
from superinfer_jax.metrics.results import append_results_row, format_comparison_table, results_row
from superinfer_jax.metrics.timeline import requests_filename, write_timelines
from superinfer_jax.workload.arrivals import ARRIVAL_PROCESSES


@dataclasses.dataclass(frozen=True)
class SweepSpec:
  """One experiment: a model, a workload recipe, the policies, variants and loads to compare.

  Every field is also a flag of ``run_experiment.py`` (``configtree.define_flags(SweepSpec)``).
  """
  model: str = knob("smollm2-135m", "HF dir, .gguf, orbax dir, or smollm2-135m")
  dataset: str = knob("sharegpt", "sharegpt | synthetic | path to a ShareGPT/LMSYS/trace file")
  num_requests: int = knob(32, "requests per run")
  rps: str = knob("1", "comma list of request rates (requests/s); inf = all at once (ignored with "
                       "--calibrate, which derives one)")
  policies: str = knob("fcfs,rotasched", "comma list of scheduling policies")
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
  hardware: Optional[str] = knob(None, "hardware label in results (default: the JAX device kind)",
                                 none_as="")
  progress: bool = knob(True, "progress bars")

  def __post_init__(self):
    if not self.policy_names:
      raise ValueError("no policies given")
    if self.repeats < 1 or self.num_requests < 1:
      raise ValueError("repeats and num_requests must be >= 1")
    if any(not (r > 0) for r in self.rps_values):
      raise ValueError(f"rps values must be > 0 (inf allowed), got {self.rps}")
    if not self.drift_tolerance > 1.0 or not self.cpu_share_tolerance > 1.0:
      raise ValueError(f"drift_tolerance and cpu_share_tolerance must be > 1, got {self.drift_tolerance}, "
                       f"{self.cpu_share_tolerance}")
    self.variants  # parses --vary (ValueError on a bad item)

  def make_workload(self, tokenizer, rps: float, *, max_total_len: int, vocab_size: int):
    """This sweep's workload at ``rps``: the same requests at every rate (only the arrivals differ)."""
    from superinfer_jax.workload import make_workload  # pylint: disable=import-outside-toplevel
    return make_workload(self.dataset, tokenizer, num_requests=self.num_requests, rps=rps, seed=self.seed,
                         process=self.arrival_process, burstiness=self.burstiness, max_total_len=max_total_len,
                         max_prompt_len=self.max_prompt_len, max_output_len=self.max_output_len,
                         min_output_len=self.min_output_len, synthetic_prompt_len=self.synthetic_prompt_len,
                         synthetic_output_len=self.synthetic_output_len, vocab_size=vocab_size)

  @property
  def policy_names(self) -> list[str]:
    return [p.strip() for p in self.policies.split(",") if p.strip()]

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


def _hardware_label() -> str:
  import jax  # pylint: disable=import-outside-toplevel
  d = jax.devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', d.platform)}"


def _model_label(model: str) -> str:
  return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model


def fresh_output_dir(path: str) -> None:
  """Creates ``path``; an earlier run's non-empty directory is moved to ``<path>.prev-<time>`` first
  (nothing is overwritten or lost)."""
  if os.path.isdir(path) and os.listdir(path):
    moved = f"{os.path.normpath(path)}.prev-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(path, moved)
    print(f"[run] moved the earlier results in {path} to {moved}", flush=True)
  os.makedirs(path, exist_ok=True)


def _warm_up(model_tuple, engine_config, workload, progress: bool) -> tuple[int, list[float], float]:
  """Compiles the step shapes a run will hit and measures the step time: the job's prompts, all at t=0,
  short outputs, the same pool. Returns (device pool size in blocks, wall time of each step, this process's
  CPU seconds per wall second while stepping)."""
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  engine = LLMEngine(model_tuple, engine_config)
  engine.precompile_rotation()
  engine.precompile_steps()
  t = time.perf_counter()
  for s in workload:
    engine.add_request(s.prompt_token_ids, SamplingParams(max_tokens=min(s.output_len, 24), ignore_eos=True))
  timer = StepTimer()
  while engine.has_unfinished():
    timer.step(engine)
  steps = timer.step_times_s
  if progress:
    print(f"[warm-up] {len(workload)} requests, {len(steps)} steps, {engine.num_compiled_shapes()} compiled "
          f"step shapes, {time.perf_counter() - t:.1f} s", flush=True)
  return engine.num_device_blocks, (steps[2:] if len(steps) > 6 else steps), timer.cpu_share  # 2 fill the pipe


def run_sweep(spec: SweepSpec, engine_config, *, model_tuple=None,
              on_engine: Optional[Callable[[Any, str], None]] = None, freeze_heap: bool = False) -> list[dict[str, Any]]:
  """Runs every (policy, variant, rps, repeat) of ``spec`` with ``engine_config`` (policy overridden).

  ``model_tuple`` = (cfg, params, tokenizer) skips loading ``spec.model`` (tests pass tiny models).
  ``on_engine(engine, label)`` is called with each timed run's engine (not the warm-up's), in run order,
  before it serves anything (``sim/validation.py`` records every step through it).
  ``freeze_heap``: once the model is loaded, before the first engine, freeze what the process holds
  (``util.freeze_heap``: the cyclic collector's full passes then skip the imports, weights and tokenizer,
  ~600k objects); the sweep's engines stay collectable. For processes that run one sweep
  (``scripts/run_experiment.py``); tests leave it off.
  Returns the results rows (also appended to ``<output_dir>/results.jsonl``).
  """
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  variants = spec.variants
  for v in variants:
    apply_variant(engine_config, v)  # fail before any work on a bad --vary
  fresh_output_dir(spec.output_dir)
  if model_tuple is None:
    from superinfer_jax.model import load_model, load_tokenizer  # pylint: disable=import-outside-toplevel
    from superinfer_jax.parallel.tensor_parallel import make_tensor_parallel  # pylint: disable=import-outside-toplevel
    tp = make_tensor_parallel(engine_config.tensor_parallel_size)
    if tp is None:
      cfg, params = load_model(spec.model, dtype=engine_config.model.dtype)
    else:   # loaded in host memory and sharded once; every engine of the sweep reuses the shards
      cfg, params = tp.load_model(spec.model, dtype=engine_config.model.dtype)
      _, params = tp.prepare(cfg, params)
    try:
      tokenizer = load_tokenizer(spec.model)
    except FileNotFoundError:
      if spec.dataset != "synthetic":
        raise
      tokenizer = None  # synthetic prompts are token ids; outputs then carry no text
    model_tuple = (cfg, params, tokenizer)
  if freeze_heap:
    util.freeze_heap()
  cfg, _, tokenizer = model_tuple
  max_len = min(engine_config.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
  # A request must fit the device pool on its own (the engine refuses it otherwise).
  if engine_config.num_device_blocks:
    max_len = min(max_len, engine_config.num_device_blocks * engine_config.block_size)
  hardware = spec.hardware or _hardware_label()
  results_path = os.path.join(spec.output_dir, "results.jsonl")

  def workload_at(rps: float):
    return spec.make_workload(tokenizer, rps, max_total_len=max_len, vocab_size=cfg.vocab_size)

  rps_values = spec.rps_values
  base = workload_at(rps_values[0])   # the same requests at every rate (arrivals differ)
  policies = spec.policy_names
  warm_steps: list[float] = []
  warm_cpu_share = None
  if spec.warmup or spec.calibrate:
    n, warm_steps, warm_cpu_share = _warm_up(model_tuple, apply_variant(engine_config.replace(policy=policies[0]), variants[0]),
                             base, spec.progress)
    engine_config = engine_config.replace(num_device_blocks=n)
    gc.collect()
  calibration = None
  if spec.calibrate:
    prompt_lens, output_lens = [s.prompt_len for s in base], [s.output_len for s in base]
    saturated = calib.saturated_steps(
        prompt_lens, output_lens, scheduler_config=engine_config.scheduler,
        num_device_blocks=engine_config.num_device_blocks,
        num_host_blocks=engine_config.num_host_blocks if engine_config.num_host_blocks is not None else 0,
        block_size=engine_config.block_size)
    calibration = calib.derive(
        warm_steps, prompt_lens, output_lens, num_steps_saturated=saturated,
        pool_tokens=engine_config.num_device_blocks * engine_config.block_size, load_factor=spec.load_factor,
        ttft_slo_steps=spec.ttft_slo_steps, tbt_slo_steps=spec.tbt_slo_steps, loadavg_1m=loadavg_1m())
    print(calibration.explain(), flush=True)
    rps_values = [calibration.rps]
    engine_config = engine_config.replace(ttft_slo=calibration.ttft_slo_s, tbt_slo=calibration.tbt_slo_s)
  ref_step = float(sorted(warm_steps)[len(warm_steps) // 2]) if warm_steps else None
  with open(os.path.join(spec.output_dir, "config.json"), "w") as f:
    sweep = dict(dataclasses.asdict(spec), policies=policies, rps=spec.rps_values)  # lists, as parsed
    json.dump({"sweep": sweep, "engine": engine_config.as_flat_dict(),
               "model_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else str(cfg),
               "hardware": hardware, "rps": rps_values, "variants": variants,
               "calibration": calibration.as_dict() if calibration else None,
               "warmup_step_s": ref_step, "warmup_cpu_per_wall": warm_cpu_share}, f, indent=2, default=str)
  workloads = {rps: workload_at(rps) for rps in rps_values}
  rows = []
  run_index = 0
  for rps in rps_values:
    arms = [(p, v) for p in policies for v in variants]
    for repeat, (policy, variant) in calib.interleaved_order(arms, spec.repeats):
      label = variant_label(policy, variant)
      config = apply_variant(engine_config.replace(policy=policy), variant)
      engine = LLMEngine(model_tuple, config)
      if on_engine is not None:
        on_engine(engine, label)
      # A pool sized from free device memory is pinned after the first engine: later engines must not
      # size theirs from what an earlier engine's cache left free (every policy gets the same pool).
      engine_config = engine_config.replace(num_device_blocks=engine.num_device_blocks)
      if spec.warmup:
        engine.precompile_rotation()   # no-ops when the process-wide jit caches already hold them
        engine.precompile_steps()
      rep_tag = f" #{repeat + 1}" if spec.repeats > 1 else ""
      res = replay_workload(engine, workloads[rps], desc=f"{label} @ {rps:.3g} rps{rep_tag}",
                            progress=spec.progress, time_limit_s=spec.time_limit_s)
      st = res.engine_stats
      drift = calib.step_drift(res.step_times_s, ref_step) if ref_step else None
      cpu_share = res.cpu_share
      cpu_drift = cpu_share / warm_cpu_share if cpu_share is not None and warm_cpu_share else None
      perturbed = (calib.is_perturbed(drift, spec.drift_tolerance)
                   or (cpu_drift is not None and cpu_drift < 1.0 / spec.cpu_share_tolerance))
      steps_sorted = sorted(res.step_times_s)
      extra = {"num_device_blocks": engine.num_device_blocks, "num_host_blocks": engine.num_host_blocks,
               "block_size": config.block_size, "tensor_parallel_size": config.tensor_parallel_size,
               "rotations_in": st["rotations_in"],
               "blocks_out": st["blocks_out"], "blocks_writeback": st["blocks_writeback"],
               "blocks_in": st["blocks_in"], "steps": st["steps"], "round_trips": st["round_trips"],
               "contended_steps": st["contended_steps"], "rotations_per_step": st["rotations_per_step"],
               "mean_residency_steps": st["mean_residency_steps"],
               "host_time_share": st["host_time_share"], "step_compilations_during_run": res.compilations[0],
               "rotation_compilations_during_run": res.compilations[1],
               "num_rejected": len(res.rejected), "timed_out": res.timed_out,
               "base_policy": policy, "variant": variant or None, "repeat": repeat, "run_index": run_index,
               "step_time_p50_s": steps_sorted[len(steps_sorted) // 2] if steps_sorted else None,
               "step_time_p90_s": steps_sorted[int(0.9 * (len(steps_sorted) - 1))] if steps_sorted else None,
               "warmup_step_s": ref_step, "step_time_drift": drift,
               "perturbed": perturbed, "cpu_per_wall": cpu_share, "cpu_share_drift": cpu_drift,
               "loadavg_1m_start": res.loadavg_1m[0], "loadavg_1m_end": res.loadavg_1m[1],
               "pipeline": config.pipeline, "attention": config.model.attention, "dtype": config.model.dtype,
               "transfer_mode": config.rotation.transfer_mode, "min_residency": config.scheduler.min_residency,
               "proactive_swap_budget": config.scheduler.proactive_swap_budget,
               "writeback": config.scheduler.writeback}
      flat = config.as_flat_dict()
      extra.update({name: flat[name] for name in variant})   # the variant's settings as applied
      if calibration is not None:
        extra.update(calibrated=True, load_factor=calibration.load_factor,
                     ttft_slo_steps=calibration.ttft_slo_steps, tbt_slo_steps=calibration.tbt_slo_steps)
      row = results_row(
          res.timelines, engine="real", model=_model_label(spec.model), hardware=hardware, policy=label,
          rps=rps, ttft_slo_s=config.scheduler.ttft_slo, tbt_slo_s=config.scheduler.tbt_slo,
          num_rotations=st["rotations_out"], swap_out_bytes=st["bytes_out"], swap_in_bytes=st["bytes_in"],
          num_recompute_preemptions=st["recompute_preemptions"], duration_s=res.duration_s, extra=extra)
      append_results_row(results_path, row)
      write_timelines(os.path.join(spec.output_dir, requests_filename(
          label, rps, repeat if spec.repeats > 1 else None)), res.timelines)
      rows.append(row)
      run_index += 1
      del engine, res     # free this engine's device cache and host pool before the next one
      gc.collect()
      if spec.progress:
        flag = ("  PERTURBED: step times or CPU share drifted from the warm-up's (another process?)"
                if row["perturbed"] else "")
        print(f"[{label} @ {rps:.3g} rps{rep_tag}] finished {row['num_finished']}/{row['num_requests']}, "
              f"SLO attainment {row['slo_attainment']:.2f}, rotations {row['num_rotations']}, step p50 "
              f"{_ms(row['step_time_p50_s'])} (x{drift or float('nan'):.2f} of warm-up){flag}", flush=True)
  return rows


def _ms(s: Optional[float]) -> str:
  return "-" if s is None else f"{1e3 * s:.0f} ms"


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
