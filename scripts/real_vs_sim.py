"""Real vs simulated on one run: the real sweep, the simulator fitted to it, and one side-by-side table.

Used by ``scripts/run_experiment.py --simulate`` (``configs/experiments/gpu.flags``); script-level glue because
it drives both the real-run harness (``experiment``) and the simulator (``sim``), which sit at the same layer.

``real_vs_sim(spec, engine_config, ...)`` into ``spec.output_dir``:
  1. the real sweep, every step recorded (``experiment.sim_validation.run_real``: ``real/``, ``steps-*.json``); with
     ``--calibrate`` its load and SLOs come from the measured step time (``real/config.json``);
  2. the simulator at that same load, SLOs, pools and requests (``experiment.sim_validation.compare``): each run's step
     cost fitted to that run's own steps on this machine and engine build (``sim-<policy>-rep<k>/``), and every
     policy again with the profile as given (``sim-calibrated/``);
  3. ``real_vs_sim.table.md`` / ``real_vs_sim.json``: per policy, real next to simulated (fitted; the profile's run in
     a second table): SLO attainment, P99 TTFT, P99 TBT pooled and per-request worst gap, rotations out, bytes
     moved both ways, contended steps, P99 live KV demand over the pool, KV copy time and its exposed part
     (real: ``TransferStats`` copy / host-blocked time; simulated: the cost model's copy time and the part
     that outlasts the step it overlaps);
  4. ``occupancy.png`` (device blocks held by running requests over time) and ``rotations_per_step.png``, real
     vs simulated (``metrics.occupancy``, from the timelines, so both are measured alike; the real panels add
     the block manager's own count per step), and ``transfer_split.png`` (copy time hidden vs exposed, per
     policy, real and simulated bars).

Random weights (``random_model``): a model config's shape with random parameters; prompts are tokenized by
``FoldedTokenizer`` (the simulator's stand-in tokenizer, ids folded into the model's vocabulary), so the real
run and the simulator count the same lengths.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Optional

from superinfer_jax.metrics import occupancy as occ
from superinfer_jax.metrics.timeline import read_timelines, requests_filename
from superinfer_jax.experiment import sim_validation as validation
from superinfer_jax.sim.config import SimConfig
from superinfer_jax.sim.sim_sweep import STANDIN_TOKENIZER

# (row key, column title, scale, format): what the table puts side by side.
COLUMNS = (("slo_attainment", "SLO %", 100.0, "{:.1f}"), ("ttft_p99_s", "P99 TTFT ms", 1e3, "{:.0f}"),
           ("tbt_p99_s", "P99 TBT ms", 1e3, "{:.0f}"), ("tbt_worst_p99_s", "P99 worst gap ms", 1e3, "{:.0f}"),
           ("num_rotations", "rotations", 1.0, "{:.0f}"), ("bytes_moved", "MB moved", 1e-6, "{:.1f}"),
           ("contended_steps", "contended steps", 1.0, "{:.0f}"),
           ("kv_demand_p99", "P99 KV demand / pool", 1.0, "{:.2f}"),
           ("transfer_s", "copy ms", 1e3, "{:.0f}"), ("exposed_transfer_s", "exposed copy ms", 1e3, "{:.0f}"))
# Which card's packaged profile (configs/hardware/) ``--sim_profile=auto`` starts from, by JAX device kind.
CARD_PROFILES = (("GH200", "gh200"), ("H200", "h200"), ("H100", "h200"), ("A100", "a100-80gb"))


class FoldedTokenizer:
  """Token ids of ``STANDIN_TOKENIZER`` (the simulator's stand-in) modulo ``vocab_size``: the lengths the
  simulator counts, as ids any model shape accepts. Only the lengths mean anything; ``decode`` is empty text."""

  def __init__(self, vocab_size: int):
    from superinfer_jax.model.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
    self.vocab_size = int(vocab_size)
    self._tok = load_tokenizer(STANDIN_TOKENIZER)

  def encode(self, text: str) -> list[int]:
    from superinfer_jax.model.tokenizer import encode_text  # pylint: disable=import-outside-toplevel
    return [i % self.vocab_size for i in encode_text(self._tok, text)]

  def decode(self, ids, **kwargs) -> str:
    del ids, kwargs
    return ""


def random_model(name: str, dtype: str, seed: int = 0):
  """(cfg, random params of its shape in ``dtype`` on the default device, ``FoldedTokenizer``) for a model
  config name or path (``model.load_config``)."""
  import jax  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model import load_config  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.params import init_random_params  # pylint: disable=import-outside-toplevel
  cfg = load_config(name)
  params = jax.jit(lambda k: init_random_params(cfg, k, dtype=dtype))(jax.random.key(seed))
  return cfg, params, FoldedTokenizer(cfg.vocab_size)


def auto_profile(device_kind: str) -> str:
  """The packaged hardware profile for a JAX device kind (``cpu`` for anything not listed)."""
  return next((p for card, p in CARD_PROFILES if card.lower() in device_kind.lower()), "cpu")


def _cells(row: dict[str, Any], records=None) -> dict[str, Optional[float]]:
  """``COLUMNS`` of one results row; a real row's demand and copy times come from its step ``records``
  (an engine without a host pool copies nothing: 0 s)."""
  out = {k: row.get(k) for k, *_ in COLUMNS}
  out["bytes_moved"] = int(row.get("swap_out_bytes") or 0) + int(row.get("swap_in_bytes") or 0)
  if records is not None:
    out["kv_demand_p99"] = _p99(r.kv_demand for r in records)
    last = records[-1] if records else None
    out["transfer_s"] = float(last.copy_time_s or 0.0) if last else 0.0
    out["exposed_transfer_s"] = min(out["transfer_s"], float(last.blocked_time_s or 0.0)) if last else 0.0
  return out


def _p99(xs) -> Optional[float]:
  xs = sorted(x for x in xs if x is not None)
  return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else None


def table_entries(output_dir: str, res: validation.ValidationResult) -> list[dict[str, Any]]:
  """Per real run: its label and the ``COLUMNS`` of the real run, its fitted simulation and the profile's."""
  entries = []
  for row in res.real_rows:
    label = f"{row['policy']}-rep{row.get('repeat') or 0}".replace("-rep", "#")
    _, records = validation.load_records(validation.steps_path(output_dir, row))
    sim = res.sim_rows[label]
    prof = res.calibrated_rows.get(row["policy"])
    entries.append({"policy": row["policy"], "run": label,
                    "real": _cells(row, records), "sim": _cells(sim),
                    "sim_profile": _cells(prof) if prof else None,
                    "real_timed_out": bool(row.get("timed_out")), "sim_timed_out": bool(sim.get("timed_out"))})
  return entries


def format_table(entries: list[dict[str, Any]], sim_key: str = "sim") -> str:
  """Markdown: a row per run, each ``COLUMNS`` cell "real / simulated" (``sim_key``: sim or sim_profile); a run
  that hit ``--time_limit_s`` (real or simulated) is labelled so."""
  lines = ["| policy | " + " | ".join(f"{title} real / sim" for _, title, *_ in COLUMNS) + " |",
           "|---|" + "---|" * len(COLUMNS)]

  def cell(v, scale, fmt):
    return "–" if v is None else fmt.format(v * scale)

  for e in entries:
    sim = e.get(sim_key) or {}
    cells = [f"{cell(e['real'].get(k), s, f)} / {cell(sim.get(k), s, f)}" for k, _, s, f in COLUMNS]
    late = e.get("real_timed_out") or e.get("sim_timed_out")
    lines.append(f"| {e['run']}{' (time limit hit)' if late else ''} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _timelines(directory: str, policy: str, rps: float, repeat: Optional[int]):
  path = os.path.join(directory, requests_filename(policy, rps, repeat))
  return read_timelines(path) if os.path.exists(path) else []


def write_plots(output_dir: str, res: validation.ValidationResult, entries: list[dict[str, Any]], *,
                block_size: int, repeats: int) -> list[str]:
  """``occupancy.png``, ``rotations_per_step.png`` and ``transfer_split.png`` (module docstring, step 4) from
  the timelines and the table's ``entries``; returns their paths."""
  occupancy, rotations = {}, {}
  pool = None
  for row in res.real_rows:
    label = f"{row['policy']}-rep{row.get('repeat') or 0}".replace("-rep", "#")
    sim = res.sim_rows[label]
    pool = row.get("num_device_blocks") or pool
    real_tl = _timelines(os.path.join(output_dir, "real"), row["policy"], row["rps"],
                         row.get("repeat") if repeats > 1 else None)
    sim_dir = os.path.join(output_dir, f"sim-{row['policy']}-rep{row.get('repeat') or 0}")
    sim_tl = _timelines(sim_dir, sim["policy"], sim["rps"], None)
    _, records = validation.load_records(validation.steps_path(output_dir, row))
    t0 = occ.run_start(real_tl)
    recorded = [(r.done_time - t0, r.occupancy * pool) for r in records if r.occupancy is not None and pool]
    occupancy[label] = {"real": occ.occupancy_series(real_tl, block_size),
                        "sim": occ.occupancy_series(sim_tl, block_size)}
    if recorded:
      occupancy[label]["real (block manager)"] = tuple(zip(*recorded))
    rotations[label] = {"real": occ.rotation_steps(real_tl), "sim": occ.rotation_steps(sim_tl)}
  split = {e["run"]: {src: (max(0.0, e[src]["transfer_s"] - e[src]["exposed_transfer_s"]),
                            e[src]["exposed_transfer_s"])
                      for src in ("real", "sim")} for e in entries}
  return [occ.plot_occupancy(occupancy, os.path.join(output_dir, "occupancy.png"), pool_blocks=pool),
          occ.plot_rotations_per_step(rotations, os.path.join(output_dir, "rotations_per_step.png")),
          occ.plot_transfer_split(split, os.path.join(output_dir, "transfer_split.png"))]


def _sim_inputs(spec, engine_config):
  """(spec, engine config) for the simulator: the real sweep's load, SLOs and pool as it ran them."""
  with open(os.path.join(spec.output_dir, "real", "config.json"), encoding="utf-8") as f:
    snap = json.load(f)
  calib = snap.get("calibration")
  rps = snap["rps"]
  if len(rps) != 1:
    raise ValueError(f"real vs sim compares one load; the sweep ran {rps}")
  slos = (dict(ttft_slo=calib["ttft_slo_s"], tbt_slo=calib["tbt_slo_s"]) if calib else {})
  cfg = engine_config.replace(num_device_blocks=int(snap["engine"]["num_device_blocks"]), **slos)
  return dataclasses.replace(spec, rps=repr(float(rps[0])), calibrate=False), cfg, calib


def real_vs_sim(spec, engine_config, *, sim_profile: str, command: str, model_tuple=None,
                log: Callable[[str], None] = print) -> dict[str, Any]:
  """Steps 1-4 of the module docstring into ``spec.output_dir`` (moved aside first if not empty). Returns the
  JSON written to ``real_vs_sim.json`` (``entries``, ``markdown``, ``plots``, ``calibration``, ``command``)."""
  validation.run_real(spec, engine_config, model_tuple=model_tuple)
  s_spec, s_cfg, calib = _sim_inputs(spec, engine_config)
  res = validation.compare(dataclasses.replace(s_spec, hardware=sim_profile), s_cfg, SimConfig(), command=command,
                           log=log)
  out = spec.output_dir
  entries = table_entries(out, res)
  head = [f"`{command}`", ""]
  if calib:
    head += [f"load {calib['rps']:.4g} req/s ({calib['load_factor']:g} x capacity), TTFT SLO "
             f"{calib['ttft_slo_s']:.3g} s, TBT SLO {calib['tbt_slo_s']:.3g} s, from a {1e3 * calib['step_s']:.1f} ms "
             f"median step measured here", ""]
  md = "\n".join(head + ["Simulator fitted to each run's own steps:", "", format_table(entries), "",
                         f"Simulator with profile {sim_profile} as given:", "", format_table(entries, "sim_profile"),
                         "", "P50 / P99 TTFT and TBT " + res.table.splitlines()[-1] + " (validation.txt)", ""])
  plots = write_plots(out, res, entries, block_size=engine_config.block_size, repeats=spec.repeats)
  doc = {"command": command, "sim_profile": sim_profile, "calibration": calib, "entries": entries,
         "columns": [k for k, *_ in COLUMNS], "markdown": md, "plots": plots,
         "fits": [{"run": label, "mem_gbps": f.mem_gbps, "flop_tflops": f.flop_tflops, "overhead_s": f.overhead_s,
                   "points": n} for label, f, n in res.fits]}
  with open(os.path.join(out, "real_vs_sim.table.md"), "w", encoding="utf-8") as f:
    f.write(md)
  with open(os.path.join(out, "real_vs_sim.json"), "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=1)
  return doc


__all__ = ["COLUMNS", "FoldedTokenizer", "auto_profile", "format_table", "random_model", "real_vs_sim",
           "table_entries", "write_plots"]
