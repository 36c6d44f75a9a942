#!/usr/bin/env python
"""Measures this machine's real engine and writes a hardware profile for the simulator (issue 10 item 5).

  python scripts/calibrate.py                                   # SmolLM2-135M f32 -> configs/hardware/cpu.json
  python scripts/calibrate.py --model=/path/to/tiny_hf_dir --decode_batches=1,2 --decode_contexts=16 \
      --prefill_chunks=16,64 --transfer_blocks=1,4 --output=/tmp/tiny.json

Step time over batch tokens and context (decode batches x contexts, prefill chunk sizes; warm-up, median of
repeats) on ``LLMEngine``, and ``DuplexKV.issue()`` transfer time over blocks; fits the cost model's
efficiency factors, per-step overhead and the link curve (``superinfer_jax/sim/calibration.py``); writes the
profile with every number's source = this exact command and the date. The engine flags are the engine's
(``EngineConfig``); the defaults here are those of ``configs/experiments/main.flags`` (f32, block 16, 8 seqs,
256 batched tokens, bucket floors 8 / 32), so the profile describes the engine as the main job runs it.
See docs/simulator.md.
"""
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from absl import app, flags  # noqa: E402

from superinfer_jax import configtree  # noqa: E402
from superinfer_jax.sweep import SweepSpec  # noqa: E402
from superinfer_jax.engine.config import define_engine_flags, engine_config_from_flags  # noqa: E402

configtree.define_flags(SweepSpec, only={"model"})   # --model: the model the engine loads
flags.DEFINE_string("output", "configs/hardware/cpu.json", "where the profile JSON goes")
flags.DEFINE_string("name", "cpu", "the profile's name (the results' hardware label)")
# A 4 x 3 decode grid + 4 prefill sizes (16 points): a coarser grid fits the large-batch long-context decode
# low, and the simulator's TTFT inherits that error.
flags.DEFINE_list("decode_batches", ["1", "2", "4", "8"], "decode batch sizes")
flags.DEFINE_list("decode_contexts", ["32", "96", "160"], "decode prompt / context lengths (tokens)")
flags.DEFINE_list("prefill_chunks", ["32", "64", "128", "256"],
                  "prefill sizes (tokens; <= --max_num_batched_tokens)")
flags.DEFINE_list("transfer_blocks", ["1", "4", "16"], "blocks per direction per DuplexKV.issue()")
flags.DEFINE_list("naive_blocks", ["1", "4"], "blocks per direction for naive mode (the small-segment point; "
                                              "empty: skip)")
flags.DEFINE_integer("warmup", 2, "untimed steps / repeats first (compilation)")
flags.DEFINE_integer("repeats", 5, "timed steps / repeats (the median is kept)")
flags.DEFINE_bool("pad_to_buckets", True, "fit (and have the simulator charge) the engine's padded step shapes "
                                         "(bucketed T, S, block-table width): on a CPU the step is compute-bound "
                                         "even at decode, so padding sets its cost")
flags.DEFINE_bool("precompile", True, "compile every step bucket before timing (LLMEngine.precompile_steps)")
define_engine_flags()
FLAGS = flags.FLAGS

CALIBRATE_DEFAULTS = dict(dtype="float32", block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                          seq_bucket_floor=8, blocks_bucket_floor=32, num_device_blocks=128, num_host_blocks=64)
for _name, _value in CALIBRATE_DEFAULTS.items():
  flags.FLAGS.set_default(_name, _value)


def _ints(name):
  try:
    vals = [int(v) for v in getattr(FLAGS, name)]
  except ValueError as e:
    raise ValueError(f"--{name}: {e}") from None
  if any(v < 1 for v in vals):
    raise ValueError(f"--{name} values must be >= 1, got {vals}")
  return vals


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from superinfer_jax.experiment import calibrate as measure  # pylint: disable=import-outside-toplevel
  from superinfer_jax.sim import calibration as cal  # pylint: disable=import-outside-toplevel
  from superinfer_jax.sim.cost import ModelProfile  # pylint: disable=import-outside-toplevel
  command = " ".join(["python scripts/calibrate.py"] + [shlex.quote(a) for a in sys.argv[1:]])
  try:
    config = engine_config_from_flags()
    batches, contexts = _ints("decode_batches"), _ints("decode_contexts")
    chunks, blocks = _ints("prefill_chunks"), _ints("transfer_blocks")
    naive = _ints("naive_blocks") if FLAGS.naive_blocks else []
    if FLAGS.warmup < 0 or FLAGS.repeats < 1:
      raise ValueError("--warmup must be >= 0 and --repeats >= 1")
    top = config.scheduler.max_num_batched_tokens
    if max(chunks) > top:
      raise ValueError(f"--prefill_chunks {max(chunks)} > --max_num_batched_tokens {top}: it would not be "
                       "one step")
    if max(batches) > config.scheduler.max_num_seqs:
      raise ValueError(f"--decode_batches {max(batches)} > --max_num_seqs {config.scheduler.max_num_seqs}")
  except ValueError as e:
    sys.exit(f"calibrate: {e}")
  t0 = time.perf_counter()
  import jax  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  print(f"[calibrate] {command}", flush=True)
  machine = measure.measure_machine()
  print(f"[calibrate] machine: read {machine['read_gbps']:.2f} GB/s, f32 matmul "
        f"{machine['matmul_tflops'] * 1e3:.1f} GFLOP/s", flush=True)
  try:
    engine = LLMEngine(FLAGS.model, config)
  except (ValueError, FileNotFoundError, OSError) as e:
    sys.exit(f"calibrate: cannot load {FLAGS.model!r}: {e}")
  need = max(batches) * engine.kv_spec.blocks_for_tokens(max(contexts) + FLAGS.warmup + FLAGS.repeats + 64)
  if need > engine.num_device_blocks:
    sys.exit(f"calibrate: the decode grid needs about {need} device blocks; --num_device_blocks is "
             f"{engine.num_device_blocks}")
  if FLAGS.precompile:
    t = time.perf_counter()
    engine.precompile_steps()
    print(f"[calibrate] precompiled the step buckets in {time.perf_counter() - t:.1f} s", flush=True)
  log = lambda s: print(s, flush=True)   # noqa: E731
  steps = measure.measure_steps(engine, decode_batches=batches, decode_contexts=contexts, prefill_chunks=chunks,
                                warmup=FLAGS.warmup, repeats=FLAGS.repeats, log=log)
  transfers = measure.measure_transfers(config, engine.model_config, block_counts=blocks,
                                        warmup=FLAGS.warmup, repeats=FLAGS.repeats, naive_blocks=naive, log=log)
  name = os.path.basename(os.path.normpath(FLAGS.model)) if os.path.exists(FLAGS.model) else FLAGS.model
  mp = ModelProfile.from_model_config(engine.model_config, dtype=config.model.dtype, name=name)
  if FLAGS.pad_to_buckets:
    from superinfer_jax.sim.cost import Buckets  # pylint: disable=import-outside-toplevel
    steps = cal.padded_points(steps, Buckets.of(config))
  step_fit = cal.fit_step_model(steps, mp)
  link_fit = cal.fit_link(transfers, engine.kv_spec.block_bytes)
  desc = (f"this machine running the real engine (JAX {config.model.dtype} on "
          f"{jax.default_backend()}), calibrated on {name} with block "
          f"{config.block_size}, max_num_seqs {config.scheduler.max_num_seqs}, max_num_batched_tokens "
          f"{top}, bucket floors tokens {config.token_bucket_floor} / seqs {config.seq_bucket_floor} / blocks "
          f"{config.blocks_bucket_floor}, pipeline {config.pipeline}, transfer_mode "
          f"{config.rotation.transfer_mode}; by scripts/calibrate.py")
  profile = cal.build_profile(name=FLAGS.name, description=desc, command=command, machine=machine,
                              step_fit=step_fit, link_fit=link_fit, model=mp,
                              block_bytes=engine.kv_spec.block_bytes, num_layers=engine.model_config.num_layers,
                              step_points=steps, memory_gb=measure.physical_memory_gb(),
                              pad_to_buckets=FLAGS.pad_to_buckets)
  out_dir = os.path.dirname(os.path.abspath(FLAGS.output))
  os.makedirs(out_dir, exist_ok=True)
  cal.write_profile(FLAGS.output, profile)
  print(f"[calibrate] step fit: {step_fit.mem_gbps:.2f} GB/s effective, {step_fit.flop_tflops * 1e3:.1f} "
        f"GFLOP/s effective, overhead {step_fit.overhead_s * 1e3:.2f} ms; errors "
        f"{', '.join(f'{e * 100:+.0f}%' for e in step_fit.rel_errors)}")
  print(f"[calibrate] link fit: D2H {link_fit.d2h_gbps:.2f} GB/s, H2D {link_fit.h2d_gbps:.2f} GB/s, duplex "
        f"{link_fit.duplex_cap_gbps:.2f} GB/s, launch {link_fit.launch_s * 1e3:.3f} ms; naive D2H "
        f"{link_fit.naive_d2h_gbps} / H2D {link_fit.naive_h2d_gbps} GB/s")
  print(f"[calibrate] wrote {FLAGS.output} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
  app.run(main)
