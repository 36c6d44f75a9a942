"""Policy x variant x RPS sweeps on the simulator (``scripts/simulate.py`` is a thin flag wrapper).

The same sweep as ``experiment.real_sweep.run_sweep`` (its ``SweepSpec`` flags, ``--vary``, the output layout:
``results.jsonl`` with ``engine="sim"``, ``requests-<label>-<rps>.jsonl``, ``config.json``, plots), with the
model step and the KV copies timed by the cost model instead of run. ``--vary`` may also sweep the
simulator's own settings (``SimConfig``: ``swap_bandwidth_gbps``, ``trace``...); the hardware profile is the
sweep's ``hardware`` (``sim.config.profile_name``).

Differences from the real sweep, on purpose:
  * ``--calibrate``, ``--warmup`` and the drift tolerances are ignored: nothing is measured (a note is
    printed for ``--calibrate``); give ``--rps``, ``--ttft_slo`` and ``--tbt_slo``.
  * A run is deterministic, so each (policy, variant, rps) runs once whatever ``--repeats`` says.
  * Pools: ``--num_device_blocks`` unset (0) sizes the device pool from the profile's HBM
    (``device_memory_fraction`` x HBM minus the weights, per GPU); ``--num_host_blocks`` unset sizes the
    host pool as ``--host_gib``.
  * Token counts of the real datasets come from the model's tokenizer when one can be loaded for
    ``--model``, else from SmolLM2's (the only tokenizer packaged offline): a stand-in for the GPU models'
    own tokenizers, whose counts differ by some tens of percent.
  * ``--time_limit_s`` is virtual time.
Host-side only: no JAX, and nothing of the real-run harness (``experiment``); the sweep spec is ``superinfer_jax.sweep``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

from superinfer_jax.sweep import (SweepSpec, fresh_output_dir, apply_variant,  # noqa: F401
                                  finish_report, variant_label)
from superinfer_jax.metrics.results import RESULTS_SCHEMA, append_results_row, results_row
from superinfer_jax.metrics.timeline import requests_filename, write_timelines
from superinfer_jax.model.config import load_config
from superinfer_jax.metrics.prefix_cache import prefix_cache_columns
from superinfer_jax.sim.contention_load import contention_rps, contention_summary, load_columns
from superinfer_jax.sim.config import SimConfig, profile_name
from superinfer_jax.sim.cost import Buckets, ModelProfile, device_pool_blocks
from superinfer_jax.sim.event_loop import RooflineCost, derived_counters, simulate
from superinfer_jax.sim.profiles import load_hardware_profile

GIB = 1 << 30
STANDIN_TOKENIZER = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class RunSetup:
  """Everything one simulated run is built from (resolved: pools sized, profiles loaded)."""
  engine_config: Any
  sim_config: SimConfig
  hardware: Any          # profiles.HardwareProfile, with the bandwidth override applied
  model: ModelProfile
  cost: RooflineCost


def model_profile(sim_config: SimConfig, model: str, dtype: str):
  """(``ModelConfig``, the cost model's ``ModelProfile`` at ``dtype``) of ``--model_profile`` (or ``--model``)."""
  name = sim_config.model_profile or model
  cfg = load_config(name)
  label = os.path.basename(os.path.normpath(name)) if os.path.exists(name) else name
  return cfg, ModelProfile.from_model_config(cfg, dtype=dtype, name=label)


def resolve_run(engine_config, sim_config: SimConfig, model: str, hardware: Optional[str]) -> RunSetup:
  """Loads the profiles (``hardware``: ``SweepSpec.hardware``, None for ``DEFAULT_HARDWARE``), sizes unset
  pools from the hardware profile, builds the cost model."""
  hw = load_hardware_profile(profile_name(hardware)).with_swap_bandwidth(sim_config.swap_bandwidth_gbps)
  cfg, mp = model_profile(sim_config, model, engine_config.model.dtype)
  spec = cfg.kv_spec(engine_config.block_size, engine_config.model.dtype, engine_config.rotation.kv_layout)
  tp = engine_config.tensor_parallel_size
  if tp > 1 and mp.num_kv_heads % tp:
    raise ValueError(f"tensor_parallel_size {tp} does not divide the {mp.num_kv_heads} KV heads of {mp.name}")
  changes = {}
  if engine_config.num_device_blocks is None:
    changes["num_device_blocks"] = device_pool_blocks(
        mp, hw, spec.block_bytes, memory_fraction=engine_config.device_memory_fraction,
        tensor_parallel_size=tp)
  if engine_config.num_host_blocks is None:
    changes["num_host_blocks"] = int(engine_config.host_gib * GIB // spec.block_bytes)
  if changes:
    engine_config = engine_config.replace(**changes)
  cost = RooflineCost(mp, hw, spec, engine_config.rotation.transfer_mode, tensor_parallel_size=tp,
                      fixed_step_s=sim_config.fixed_step_s, buckets=Buckets.of(engine_config))
  return RunSetup(engine_config=engine_config, sim_config=sim_config, hardware=hw, model=mp, cost=cost)


def split_variant(variant: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
  """(engine settings, simulator settings) of a ``--vary`` combination; ``ValueError`` for unknown names."""
  sim_names = {f.name for f in dataclasses.fields(SimConfig)}
  return ({k: v for k, v in variant.items() if k not in sim_names},
          {k: v for k, v in variant.items() if k in sim_names})


def validate_variants(spec: SweepSpec, engine_config, sim_config: SimConfig) -> None:
  """``ValueError`` if a ``--vary`` item names an unknown setting or a value of the wrong type."""
  for v in spec.variants:
    eng_v, sim_v = split_variant(v)
    apply_variant(engine_config, eng_v)
    apply_variant(sim_config, sim_v)


def read_sim_trace(spec: SweepSpec, sim_config: SimConfig, max_total_len: Optional[int] = None):
  """(``Workload``, ``TraceInfo``) of ``--trace`` under the sweep's length filters: window ``--seed`` of
  ``--num_requests`` requests (seed k starts at request k x num_requests, so seeds are disjoint windows of
  the trace; lengths only, no token ids; a Mooncake trace's requests keep their ``block_ids``, so
  ``RequestSpec.derived_block_ids(block_size)`` gives a prefix cache the engine's block hashes). Requests
  over ``max_total_len`` follow ``--trace_context_rule`` (drop | clip, counted in the ``TraceInfo``).
  ``workload.TraceError`` (a ``ValueError``) for a bad file or a window past the trace's end."""
  from superinfer_jax.workload.traces import read_trace  # pylint: disable=import-outside-toplevel
  return read_trace(sim_config.trace, num_requests=spec.num_requests, max_prompt_len=spec.max_prompt_len,
                    max_output_len=spec.max_output_len, min_output_len=spec.min_output_len,
                    context_len=max_total_len, context_rule=sim_config.trace_context_rule, token_ids=False,
                    seed=spec.seed, start=spec.seed * spec.num_requests)


class CountingTokenizer:
  """A tokenizer's ``encode`` memoised by text (the simulator only counts tokens: every ``--rps`` value and
  every figure part re-reads the same prompts, and encoding them is most of a sweep's set-up time)."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._ids: dict[str, list[int]] = {}

  def encode(self, text: str) -> list[int]:
    ids = self._ids.get(text)
    if ids is None:
      from superinfer_jax.model.tokenizer import encode_text  # pylint: disable=import-outside-toplevel
      ids = self._ids[text] = encode_text(self.tokenizer, text)
    return list(ids)

  def decode(self, ids, **kwargs) -> str:
    return self.tokenizer.decode(ids, **kwargs)

  def __getattr__(self, name):
    """Everything else (``chat_template``, ``bos_id``, ``eos_ids``, ``backend``: what the multi-turn
    workload's chat template reads) is the wrapped tokenizer's."""
    if name == "tokenizer":
      raise AttributeError(name)
    return getattr(self.tokenizer, name)


_TOKENIZERS: dict[str, tuple[CountingTokenizer, bool]] = {}   # model -> (tokenizer, is the stand-in)


def _tokenizer(spec: SweepSpec, log):
  """The (memoised, process-wide) token counter of ``spec.model``, or the stand-in's when it has none."""
  if spec.dataset == "synthetic":
    return None
  if spec.model not in _TOKENIZERS:
    from superinfer_jax.model.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
    try:
      _TOKENIZERS[spec.model] = (CountingTokenizer(load_tokenizer(spec.model)), False)
    except (FileNotFoundError, OSError, ValueError):
      if STANDIN_TOKENIZER not in _TOKENIZERS:
        _TOKENIZERS[STANDIN_TOKENIZER] = (CountingTokenizer(load_tokenizer(STANDIN_TOKENIZER)), False)
      _TOKENIZERS[spec.model] = (_TOKENIZERS[STANDIN_TOKENIZER][0], True)
  tok, standin = _TOKENIZERS[spec.model]
  if standin:
    log(f"[sim] no tokenizer for {spec.model!r}: token counts come from {STANDIN_TOKENIZER}'s tokenizer "
        f"(a stand-in; see docs/simulator.md)")
  return tok


def _workloads(spec: SweepSpec, sim_config: SimConfig, mcfg, max_len: int, log, base=None):
  """Where the sweep's requests come from: ``(rps values, workload_at(rps) -> Workload, time_scale)``. With
  ``sim_config.trace``, the trace (lengths scaled, at most ``max_len`` tokens) at its recorded arrivals (the
  one rps is its mean rate) or rescaled to each rps (``time_scale[rps]`` records the factor, filled as
  ``workload_at`` is called), ``trace_extra`` the context rule's counts for every row; or, with
  ``trace_arrivals="contention"``, at the one rate ``sim/contention_load.py`` finds for the window with the run
  setup ``base`` (its columns in ``trace_extra``); else ``spec``'s synthetic workload at each rps, lengths
  scaled."""
  rps_values = spec.rps_values
  scale = sim_config.length_scale
  time_scale: dict[float, float] = {}   # rps -> factor the trace's arrival times were multiplied by
  trace_extra: dict[str, Any] = {}
  if sim_config.trace:
    from superinfer_jax.workload.traces import rescale_factor, rescale_to_rps  # pylint: disable=import-outside-toplevel
    trace_w, info = read_sim_trace(spec, sim_config, max_total_len=max_len)
    trace_w = trace_w.scale_lengths(scale, max_len)
    log(f"[sim] trace {info.path} ({info.format}): {info.kept} requests of {info.rows} rows "
        f"({info.skipped_zero} with 0 tokens, {info.filtered} outside the length filters), "
        f"{info.duration_s:.1f} s recorded, mean {info.mean_rps:.3g} rps")
    log(f"[sim] trace context rule {info.context_rule} at {info.context_len} tokens: {info.context_dropped} "
        f"requests dropped, {info.context_clipped} clipped")
    trace_extra = dict(trace_context_rule=info.context_rule, trace_context_len=info.context_len,
                       trace_context_dropped=info.context_dropped, trace_context_clipped=info.context_clipped)
    if sim_config.trace_arrivals == "contention":
      load = contention_rps(trace_w, base.engine_config, base.cost, sim_config.load_target, info.mean_rps,
                            time_limit_s=spec.time_limit_s)
      log(f"[sim] load set by contention: {load.rps:.4g} rps gives fcfs (no prefix caching) a P99 live KV demand "
          f"of {load.kv_demand_p99:.3g} x the pool (target {load.target:g}; {len(load.probes)} probes)")
      if not 0.8 * load.target <= load.kv_demand_p99 <= 1.25 * load.target:
        log(f"[sim] WARNING: the target was not reached (the window is too small or too large for the pool); "
            f"its rows carry load_kv_demand_p99 = {load.kv_demand_p99:.3g}")
      if spec.rps != SweepSpec.rps:
        log("[sim] --rps is ignored with --trace_arrivals=contention (each window's rate is searched)")
      rps_values = [load.rps]
      trace_extra.update(load_columns(load))

      def workload_at(rps: float):
        time_scale[rps] = rescale_factor(trace_w, rps)
        return rescale_to_rps(trace_w, rps)
    elif sim_config.trace_arrivals == "recorded":
      if spec.rps != SweepSpec.rps:
        log("[sim] --rps is ignored with --trace_arrivals=recorded (the trace's own arrivals are replayed)")
      rps_values = [round(info.mean_rps, 6) if math.isfinite(info.mean_rps) else math.inf]

      def workload_at(rps: float):
        return trace_w
    else:
      def workload_at(rps: float):
        time_scale[rps] = rescale_factor(trace_w, rps)
        return rescale_to_rps(trace_w, rps)
  else:
    tokenizer = _tokenizer(spec, log)

    def workload_at(rps: float):
      w = spec.make_workload(tokenizer, rps, max_total_len=max_len, vocab_size=mcfg.vocab_size)
      return w.scale_lengths(scale, max_len)
  return rps_values, workload_at, time_scale, trace_extra


def run_sim_sweep(spec: SweepSpec, engine_config, sim_config: SimConfig, *, log=print,
                  row_tags: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
  """Simulates every (policy, variant, rps) of ``spec``; returns the rows (also in ``results.jsonl``).
  ``row_tags`` are added to every row (``figures`` names the figure and its part)."""
  variants = spec.variants
  validate_variants(spec, engine_config, sim_config)   # fail before any work on a bad --vary
  if spec.calibrate:
    log("[sim] --calibrate is ignored by the simulator (nothing to measure): the load is --rps and the SLOs "
        "are --ttft_slo / --tbt_slo")
  if spec.repeats > 1:
    log(f"[sim] a simulated run is deterministic: each (policy, variant, rps) runs once, not {spec.repeats} times")
  base = resolve_run(engine_config, sim_config, spec.model, spec.hardware)
  mcfg = load_config(sim_config.model_profile or spec.model)
  max_len = min(base.engine_config.model.max_model_len or mcfg.max_position_embeddings,
                mcfg.max_position_embeddings,
                base.engine_config.num_device_blocks * base.engine_config.block_size)
  scale = sim_config.length_scale
  rps_values, workload_at, time_scale, trace_extra = _workloads(spec, sim_config, mcfg, max_len, log, base)
  if scale != 1.0:
    log(f"[sim] every prompt and output length is scaled by {scale:g} (--length_scale)")

  fresh_output_dir(spec.output_dir)
  results_path = os.path.join(spec.output_dir, "results.jsonl")
  with open(os.path.join(spec.output_dir, "config.json"), "w") as f:
    sweep = dict(dataclasses.asdict(spec), policies=spec.policy_names, rps=rps_values)
    json.dump({"engine_kind": "sim", "sweep": sweep, "engine": base.engine_config.as_flat_dict(),
               "sim": sim_config.as_flat_dict(), "hardware": dataclasses.asdict(base.hardware),
               "model_profile": dataclasses.asdict(base.model), "rps": rps_values, "variants": variants,
               "max_total_len": max_len}, f, indent=2, default=str)
  rows = []
  run_index = 0
  for rps in rps_values:
    requests = workload_at(rps)
    for policy, variant in spec.arms:
      label = variant_label(policy, variant)
      eng_v, sim_v = split_variant(variant)
      setup = resolve_run(apply_variant(engine_config.replace(policy=policy), eng_v),
                          apply_variant(sim_config, sim_v), spec.model, spec.hardware)
      res = simulate(requests, setup.engine_config, setup.cost, progress=spec.progress,
                     desc=f"{label} @ {rps:.3g} rps", time_limit_s=spec.time_limit_s,
                     prefix_content=setup.sim_config.prefix_content)
      row = _row(spec, setup, res, label, policy, variant, rps, run_index)
      if rps in time_scale:
        row["trace_time_scale"] = time_scale[rps]
      row.update(trace_extra)
      row.update(row_tags or {})
      append_results_row(results_path, row)
      write_timelines(os.path.join(spec.output_dir, requests_filename(label, rps)), res.timelines)
      rows.append(row)
      run_index += 1
      if spec.progress:
        log(f"[{label} @ {rps:.3g} rps] finished {row['num_finished']}/{row['num_requests']}, SLO attainment "
            f"{row['slo_attainment']:.2f}, rotations {row['num_rotations']} ({row['rotations_per_step']:.2f}"
            f"/step), exposed transfer {row['exposed_transfer_s']:.3f} s of {row['duration_s']:.1f} s "
            f"simulated, {res.wall_s:.1f} s wall")
  return rows


def _row(spec: SweepSpec, setup: RunSetup, res, label: str, policy: str, variant: dict, rps: float,
         run_index: int) -> dict[str, Any]:
  cfg = setup.engine_config
  c = res.counters
  steps = sorted(res.step_times_s)
  extra = {
      "num_device_blocks": cfg.num_device_blocks, "num_host_blocks": cfg.num_host_blocks,
      "block_size": cfg.block_size, "block_bytes": setup.cost.block_bytes,
      "rotations_in": c["rotations_in"], "blocks_out": c["blocks_out"],
      "blocks_writeback": c["blocks_writeback"], "blocks_in": c["blocks_in"], "steps": c["plans"],
      "model_steps": c["model_steps"], "round_trips": c["round_trips"],
      "contended_steps": c["contended_steps"], "kv_contended_steps": c["kv_contended_steps"],
      "kv_contended_share": c["kv_contended_steps"] / max(c["plans"], 1),
      **contention_summary(res.occupancy, res.kv_demand), "dropped_seqs": c["dropped_seqs"],
      "transfer_s": c["transfer_s"], "exposed_transfer_s": c["exposed_transfer_s"],
      "exposed_transfer_share": c["exposed_transfer_s"] / res.duration_s,
      "exposed_transfer_per_step_s": c["exposed_transfer_s"] / max(c["model_steps"], 1),
      "step_time_p50_s": steps[len(steps) // 2] if steps else None,
      "step_time_p90_s": steps[int(0.9 * (len(steps) - 1))] if steps else None,
      "num_rejected": len(res.rejected), "timed_out": res.timed_out, "sim_wall_s": res.wall_s,
      "base_policy": policy, "variant": variant or None, "run_index": run_index,
      "pipeline": cfg.pipeline, "dtype": cfg.model.dtype, "transfer_mode": cfg.rotation.transfer_mode,
      "kv_layout": cfg.rotation.kv_layout, "min_residency": cfg.scheduler.min_residency,
      "proactive_swap_budget": cfg.scheduler.proactive_swap_budget, "writeback": cfg.scheduler.writeback,
      "enable_prefix_caching": cfg.scheduler.enable_prefix_caching,
      "host_prefix_cache": cfg.scheduler.host_prefix_cache, "prefix_content": setup.sim_config.prefix_content,
      "max_num_seqs": cfg.scheduler.max_num_seqs,
      "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
      "hardware_profile": setup.hardware.name, "model_profile": setup.model.name,
      "link": setup.hardware.link.name, "swap_bandwidth_gbps": setup.hardware.link.plateau_gbps,
      "tensor_parallel_size": setup.engine_config.tensor_parallel_size,
      "fixed_step_s": setup.sim_config.fixed_step_s or None,
      "dataset": setup.sim_config.trace or spec.dataset,
      "trace_arrivals": setup.sim_config.trace_arrivals if setup.sim_config.trace else None,
      "length_scale": setup.sim_config.length_scale, "seed": spec.seed,
  }
  extra.update(derived_counters(c))
  extra.update(prefix_cache_columns(c.get("prefix_cache", {}), cfg.block_size))
  flat = {**cfg.as_flat_dict(), **setup.sim_config.as_flat_dict()}
  extra.update({name: flat[name] for name in variant if name not in RESULTS_SCHEMA})   # as applied
  return results_row(
      res.timelines, engine="sim", model=setup.model.name, hardware=setup.hardware.name, policy=label,
      rps=rps, ttft_slo_s=cfg.scheduler.ttft_slo, tbt_slo_s=cfg.scheduler.tbt_slo,
      num_rotations=c["rotations_out"], swap_out_bytes=c["swap_out_bytes"], swap_in_bytes=c["swap_in_bytes"],
      num_recompute_preemptions=c["recompute_preemptions"], duration_s=res.duration_s, extra=extra)


def report(output_dir: str, rows) -> str:
  """Plots + the comparison table (``sweep.finish_report``)."""
  return finish_report(output_dir, rows)


__all__ = ["RunSetup", "contention_summary", "model_profile", "read_sim_trace", "resolve_run", "run_sim_sweep", "report", "split_variant",
           "validate_variants"]
