"""Simulator vs the real engine on one workload, with the step cost fitted from the real run's own steps.

``scripts/simulate.py --validate`` (same flags as ``scripts/run_experiment.py``, plus the simulator's):

1. Runs ``experiment.real_sweep.run_sweep`` (the real sweep, unchanged) into ``<output_dir>/real``, with every
   timed run's ``LLMEngine`` handed to a ``StepRecorder`` through ``run_sweep``'s ``on_engine`` hook: the
   engine's ``step_observer`` stamps each plan's time, the completion time and the batch the plan formed, and
   the pool from ``LLMEngine.scheduler_stats()`` (nothing of the scheduler's internals).
2. For each timed run, fits the cost model's step formula (``calibration.fit_step_model``) to that run's
   back-to-back steps (``points_from_records``: a step whose plan was made at most ``max_gap_s`` after the
   previous step completed, i.e. no idle wait in between; its period = completion minus the previous
   completion, the step time the simulator charges, host work included) and writes the ``--hardware``
   profile with those three numbers replaced (``refit_profile``; sources say so) to
   ``<output_dir>/profile-<label>.json``. The link (copy) numbers stay the calibrated ones.
3. Simulates each run's policy with its run's profile (``<output_dir>/sim-<label>``) and, for reference, all
   policies with ``--hardware`` as given (``<output_dir>/sim-calibrated``), and prints the comparison.

Why fit from the run itself: the box is shared, and other processes change the step time by up to 2x between
a calibration and the run (docs/simulator.md, "Validation"). The fitted profile takes the machine's speed
*during* the run; what is still compared is everything the simulator predicts from it: queueing, the
scheduler's choices under the simulated clock, prefill versus decode costs, copies, and the tails.
No JAX at import (the real sweep imports it when it runs).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any, Callable, Optional, Sequence

from superinfer_jax.sim import calibration as cal
from superinfer_jax.sim import cost as cost_lib


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One completed step of a real engine: when its plan was made and when it completed (engine clock, s),
  the batch (``(num_new_tokens, num_computed_tokens)`` per seq), the blocks it copied each way, and, as
  fractions of the device pool read when the step completed, the blocks resident (``occupancy``) and those
  plus the blocks every queued request needs (``kv_demand``: above 1 = more live KV than the pool holds;
  the simulator's ``SimResult`` fields of the same names), and the engine's cumulative KV copy time and its
  exposed part so far (``LLMEngine.transfer_report``: ``copy_time_s``, ``blocked_time_s``, seconds). Each of
  these four is None in records saved without it."""
  plan_time: float
  done_time: float
  seqs: tuple[tuple[int, int], ...]
  blocks_out: int
  blocks_in: int
  occupancy: Optional[float] = None
  kv_demand: Optional[float] = None
  copy_time_s: Optional[float] = None
  blocked_time_s: Optional[float] = None


class StepRecorder:
  """Records every step of the engines ``attach``ed to it: ``engines`` is a list of (label, records)."""

  def __init__(self):
    self.engines: list[tuple[str, list[StepRecord]]] = []

  def attach(self, engine, label: str) -> list[StepRecord]:
    """Sets ``engine.step_observer`` (it must be unset) to append a ``StepRecord`` per completed plan."""
    if engine.step_observer is not None:
      raise ValueError("the engine already has a step observer")
    records: list[StepRecord] = []

    def observe(plan, now):
      copies = engine.transfer_report()
      st = engine.scheduler_stats()
      pool = st.device_blocks
      used = pool - st.free_device_blocks
      records.append(StepRecord(
          plan_time=float(plan.time), done_time=float(now),
          seqs=tuple((s.num_new_tokens, s.num_computed_tokens) for s in plan.scheduled),
          blocks_out=len(plan.swap_out) + len(plan.writeback), blocks_in=len(plan.swap_in),
          occupancy=used / pool if pool else None,
          kv_demand=(used + st.demand_blocks) / pool if pool else None,
          copy_time_s=copies.get("copy_time_s"), blocked_time_s=copies.get("exposed_time_s")))

    engine.step_observer = observe
    self.engines.append((label, records))
    return records


def points_from_records(records: Sequence[StepRecord], *, max_gap_s: float = 0.02,
                        buckets: Optional[cost_lib.Buckets] = None) -> list[cal.StepPoint]:
  """``StepPoint``s of the back-to-back steps of one run (module docstring, step 2): step k counts if it
  ran something and its plan was made no later than ``max_gap_s`` after step k-1 completed. With
  ``buckets`` the shapes are the engine's padded ones (``cost.padded_shape``; a ``pad_to_buckets`` profile)."""
  points = []
  for prev, r in zip(records, records[1:]):
    if not r.seqs or r.plan_time > prev.done_time + max_gap_s:
      continue
    period = r.done_time - prev.done_time
    if period <= 0:
      continue
    tokens = sum(n for n, _ in r.seqs)
    kind = "decode" if tokens == len(r.seqs) else "mixed"
    shape = cost_lib.padded_shape(r.seqs, buckets) if buckets is not None else cost_lib.pairs_shape(r.seqs)
    points.append(cal.StepPoint(kind, len(r.seqs), tokens, 0, shape, period))
  return points


def refit_profile(base: dict[str, Any], fit: cal.StepFit, *, name: str, source: str) -> dict[str, Any]:
  """``base`` (a profile JSON dict) with its step numbers (mem / flop efficiency at the base's peaks, raised
  where the fit exceeds them, and the overhead) from ``fit``; each new number's source is ``source``."""
  d = copy.deepcopy(base)
  d["name"] = name
  d["description"] = f"{base.get('description', '')}; step cost refitted: {source}"
  hbm = max(float(d["hbm_bandwidth_gbps"]["value"]), fit.mem_gbps)
  peak = max(float(d["peak_tflops"]["value"]), fit.flop_tflops)
  d["hbm_bandwidth_gbps"]["value"] = round(hbm, 4)
  d["peak_tflops"]["value"] = round(peak, 6)
  d["mem_efficiency"] = {"value": round(min(1.0, fit.mem_gbps / hbm), 6),
                         "source": f"{source}: effective {fit.mem_gbps:.3f} GB/s"}
  d["flop_efficiency"] = {"value": round(min(1.0, fit.flop_tflops / peak), 6),
                          "source": f"{source}: effective {fit.flop_tflops * 1e3:.2f} GFLOP/s"}
  d["step_overhead_s"] = {"value": round(fit.overhead_s, 6), "source": f"{source}: fitted overhead"}
  from superinfer_jax.sim.profiles import profile_from_dict  # pylint: disable=import-outside-toplevel
  profile_from_dict(d, path=f"<refit {name}>")
  return d


COMPARED = (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("tbt_p50_s", "TBT p50"),
            ("tbt_p99_s", "TBT p99"))


def comparison(pairs: Sequence[tuple[str, dict[str, Any], dict[str, Any]]], *, tolerance: float = 0.25) -> tuple[str, int, int]:
  """(markdown table, percentiles within ``tolerance``, percentiles compared) of (label, real row, sim row)."""
  lines = ["| run | " + " | ".join(f"{name} real / sim ms" for _, name in COMPARED) + " | SLO% real / sim |",
           "|---|" + "---|" * (len(COMPARED) + 1)]
  ok = n = 0
  for label, real, sim in pairs:
    cells = []
    for key, _ in COMPARED:
      a, b = real.get(key), sim.get(key)
      if a is None or b is None or a <= 0:
        cells.append("–")
        continue
      rel = b / a - 1.0
      n += 1
      ok += abs(rel) <= tolerance
      cells.append(f"{a * 1e3:.0f} / {b * 1e3:.0f} ({rel * 100:+.0f}%{'' if abs(rel) <= tolerance else ' ✗'})")
    cells.append(f"{100 * real['slo_attainment']:.1f} / {100 * sim['slo_attainment']:.1f}")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return "\n".join(lines), ok, n


def median_unbiased(fit: cal.StepFit, points: Sequence[cal.StepPoint], model: cost_lib.ModelProfile) -> cal.StepFit:
  """``fit`` scaled in time by ``k = median(measured / predicted)`` (rates / k, overhead * k), so that half the
  steps run longer than predicted. The relative least squares of ``fit_step_model`` sit about 20% low on a
  busy machine's heavy-tailed step times, and queueing near saturation magnifies a service time that is
  20% short into a TTFT that is half the real one."""
  import statistics  # pylint: disable=import-outside-toplevel
  k = statistics.median(p.seconds / fit.predict(p.shape, model) for p in points)
  scaled = cal.StepFit(mem_gbps=fit.mem_gbps / k, flop_tflops=fit.flop_tflops / k, overhead_s=fit.overhead_s * k,
                       rel_errors=())
  return dataclasses.replace(scaled, rel_errors=tuple(scaled.predict(p.shape, model) / p.seconds - 1.0
                                                      for p in points))


def save_records(path: str, label: str, records: Sequence[StepRecord]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"run": label, "steps": [dataclasses.asdict(r) for r in records]}, f)


def load_records(path: str) -> tuple[str, list[StepRecord]]:
  with open(path, encoding="utf-8") as f:
    d = json.load(f)
  return d["run"], [StepRecord(plan_time=r["plan_time"], done_time=r["done_time"],
                               seqs=tuple(tuple(q) for q in r["seqs"]), blocks_out=r["blocks_out"],
                               blocks_in=r["blocks_in"], occupancy=r.get("occupancy"),
                               kv_demand=r.get("kv_demand"), copy_time_s=r.get("copy_time_s"),
                               blocked_time_s=r.get("blocked_time_s")) for r in d["steps"]]


@dataclasses.dataclass
class ValidationResult:
  real_rows: list[dict[str, Any]]
  fits: list[tuple[str, cal.StepFit, int]]           # (run label, fit, points)
  sim_rows: dict[str, dict[str, Any]]                 # run label -> sim row (its run's refitted profile)
  calibrated_rows: dict[str, dict[str, Any]]          # policy -> sim row with --hardware as given
  table: str


def _slug(row: dict[str, Any]) -> str:
  return f"{row['policy']}-rep{row.get('repeat') or 0}"


def steps_path(output_dir: str, row: dict[str, Any]) -> str:
  """Where ``run_real`` saved the step records of the real run ``row``."""
  return os.path.join(output_dir, f"steps-{_slug(row)}.json")


def run_real(spec, engine_config, *, model_tuple=None) -> list[dict[str, Any]]:
  """Step 1: the real sweep into ``<output_dir>/real`` (``output_dir`` fresh), its steps saved as
  ``<output_dir>/steps-<policy>-rep<k>.json`` (``steps_path``). ``model_tuple`` = (cfg, params, tokenizer)
  is handed to ``run_sweep`` (random weights; None: it loads ``spec.model``). Returns the real rows."""
  from superinfer_jax.experiment.real_sweep import fresh_output_dir, run_sweep  # pylint: disable=import-outside-toplevel
  out = spec.output_dir
  fresh_output_dir(out)
  recorder = StepRecorder()
  real_rows = run_sweep(dataclasses.replace(spec, output_dir=os.path.join(out, "real")), engine_config,
                        model_tuple=model_tuple, on_engine=lambda engine, _: recorder.attach(engine, engine.config.scheduler.policy))
  if len(recorder.engines) != len(real_rows):
    raise RuntimeError(f"{len(recorder.engines)} engines recorded for {len(real_rows)} results rows")
  for row, (policy, records) in zip(real_rows, recorder.engines):
    if policy != (row.get("base_policy") or row["policy"]):
      raise RuntimeError(f"recorded engine {policy!r} does not match results row {row['policy']!r}")
    save_records(steps_path(out, row), row["policy"], records)
  return real_rows


def compare(spec, engine_config, sim_config, *, command: str, log: Callable[[str], None] = print,
            max_gap_s: float = 0.02) -> ValidationResult:
  """Steps 2-3 from what ``run_real`` left in ``spec.output_dir`` (rerunnable: the real run is not)."""
  from superinfer_jax.metrics.results import read_results  # pylint: disable=import-outside-toplevel
  from superinfer_jax.sim.profiles import load_hardware_profile, resolve_profile_path  # pylint: disable=import-outside-toplevel
  from superinfer_jax.sim.config import profile_name  # pylint: disable=import-outside-toplevel
  from superinfer_jax.sim.sim_sweep import model_profile, run_sim_sweep  # pylint: disable=import-outside-toplevel
  out = spec.output_dir
  real_rows = read_results(os.path.join(out, "real", "results.jsonl"))
  hardware = profile_name(spec.hardware)
  with open(resolve_profile_path(hardware), encoding="utf-8") as f:
    base = json.load(f)
  _, mp = model_profile(sim_config, spec.model, engine_config.model.dtype)
  buckets = cost_lib.Buckets.of(engine_config) if load_hardware_profile(hardware).pad_to_buckets else None
  fits, sim_rows, pairs = [], {}, []
  for row in real_rows:
    slug = _slug(row)
    label = slug.replace("-rep", "#")
    _, records = load_records(steps_path(out, row))
    points = points_from_records(records, max_gap_s=max_gap_s, buckets=buckets)
    fit = median_unbiased(cal.fit_step_model(points, mp), points, mp)
    fits.append((label, fit, len(points)))
    prof = refit_profile(base, fit, name=f"{base['name']}-refit-{slug}", source=(
        f"fit of t = max(bytes/(hbm*mem_eff), flops/(peak*flop_eff)) + overhead to the {len(points)} "
        f"back-to-back step periods of the real run {label} of `{command}` ({out}/real), scaled to a median "
        f"error of 0"))
    prof_path = os.path.join(out, f"profile-{slug}.json")
    cal.write_profile(prof_path, prof)
    errs = sorted(fit.rel_errors)
    log(f"[validate] {label}: {len(points)} steps fitted: {fit.mem_gbps:.2f} GB/s, {fit.flop_tflops * 1e3:.1f} "
        f"GFLOP/s, overhead {fit.overhead_s * 1e3:.1f} ms; error p10 / p50 / p90 {errs[len(errs) // 10]:+.0%} / "
        f"{errs[len(errs) // 2]:+.0%} / {errs[9 * len(errs) // 10]:+.0%}")
    s_spec = dataclasses.replace(spec, policies=row["policy"], vary="",   # the label keeps its variant
                                 output_dir=os.path.join(out, f"sim-{slug}"), repeats=1, hardware=prof_path)
    sim_row = run_sim_sweep(s_spec, engine_config, sim_config, log=log)[0]
    sim_rows[label] = sim_row
    pairs.append((f"{label} (in-run fit)", row, sim_row))
  cal_rows = run_sim_sweep(dataclasses.replace(spec, vary="", repeats=1,
                                               output_dir=os.path.join(out, "sim-calibrated")),
                           engine_config, sim_config, log=log)
  calibrated = {r["policy"]: r for r in cal_rows}
  for row in real_rows:
    if row["policy"] in calibrated:
      pairs.append((f"{_slug(row).replace('-rep', '#')} (profile {hardware})", row,
                    calibrated[row["policy"]]))
  table, ok, n = comparison(pairs)
  n_fit = 4 * len(real_rows)
  ok_fit = comparison(pairs[:len(real_rows)])[1]
  summary = (f"{table}\n\nwithin 25%: {ok_fit} of {n_fit} with the in-run fit, {ok - ok_fit} of {n - n_fit} with "
             f"profile {hardware}")
  with open(os.path.join(out, "validation.txt"), "w", encoding="utf-8") as f:
    f.write(f"`{command}`\n\n{summary}\n")
  return ValidationResult(real_rows=real_rows, fits=fits, sim_rows=sim_rows, calibrated_rows=calibrated,
                          table=summary)


def validate(spec, engine_config, sim_config, *, command: str, log: Callable[[str], None] = print,
             max_gap_s: float = 0.02) -> ValidationResult:
  """Steps 1-3 of the module docstring into ``spec.output_dir``; returns the rows, fits and table."""
  run_real(spec, engine_config)
  return compare(spec, engine_config, sim_config, command=command, log=log, max_gap_s=max_gap_s)


__all__ = ["StepRecord", "StepRecorder", "ValidationResult", "compare", "comparison", "load_records",
           "median_unbiased", "points_from_records", "refit_profile", "run_real",
           "save_records", "steps_path", "validate"]
