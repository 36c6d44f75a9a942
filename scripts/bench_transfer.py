r"""Host<->device KV transfer benchmark: DuplexKV's naive / merged / duplex modes (docs/paper.md Table 1).

Two sweeps, each timed per direction (``d2h``, ``h2d``) and with both directions at once (``duplex``):

1. ``segments``: N contiguous segments of one size (``--min_segment_kb`` ... ``--max_segment_mb``, doubling),
   ``--total_mb`` per direction (at most ``--max_segments`` segments), moved with the same JAX primitives
   the engine uses: ``naive`` = one blocking ``device_put`` per segment; ``merged`` = one batched
   ``device_put`` per direction, directions one after the other; ``duplex`` = both batches issued together.
   On GPU the same bytes are also copied by torch (pinned host tensors, ``copy_(non_blocking=True)`` on
   one stream per direction): mode ``torch``.
2. KV block shapes of real models (bf16, block 16): the ``DuplexKV`` engine itself (``issue()`` with
   swap-outs and/or swap-ins of ``--kv_blocks`` blocks), in each mode and layout.

``--json`` prints one JSON object per measurement:
``{"mode", "direction", "segment_bytes", "total_bytes", "gbps", ...}`` where ``total_bytes`` counts both
directions for ``duplex`` (so ``gbps`` is the aggregate), plus ``case``, ``layout``, ``framework``,
``seconds`` (median), ``segments`` and, for the engine, ``engine_bytes`` (bytes its counters saw per rep).

``--table1`` instead prints the paper's Table 1 for this machine (``rotation/link_bench.py``, docs/duplexkv.md).

CPU (seconds):  python scripts/bench_transfer.py --json --max_segment_mb=0.25 --total_mb=1 --reps=1 \
                  --models=smollm2-135m --kv_blocks=2
GPU (device_check.sh):  python scripts/bench_transfer.py --json --max_segment_mb=64
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

from superinfer_jax.kv.layout import KVCacheSpec
from superinfer_jax.rotation import MODES, DuplexKV
from superinfer_jax.rotation.link_bench import (blocks_that_fit, format_table1, measure_table1, median_time,
                                                time_torch)

FLAGS = flags.FLAGS
flags.DEFINE_bool("json", False, "Print one JSON object per measurement (else a table).")
flags.DEFINE_float("min_segment_kb", 64, "Smallest segment of the segment sweep (KiB).")
flags.DEFINE_float("max_segment_mb", 64, "Largest segment of the segment sweep (MiB); bounds the sweep.")
flags.DEFINE_float("total_mb", 1024, "Bytes per direction per segment-sweep measurement (MiB).")
flags.DEFINE_integer("max_segments", 2048, "At most this many segments per segment-sweep measurement.")
flags.DEFINE_list("modes", ["naive", "merged", "duplex"], "Transfer modes of the sweeps (any of "
                  f"{', '.join(MODES)}); --table1 runs every mode.")
flags.DEFINE_list("models", ["smollm2-135m", "llama3-8b", "qwen2.5-32b"], "KV block shapes (empty: none).")
flags.DEFINE_list("kv_layouts", ["block_first", "layer_first"], "Cache layouts for the KV-shape sweep.")
flags.DEFINE_integer("kv_blocks", 128, "Blocks per direction per KV-shape measurement.")
flags.DEFINE_integer("naive_max_blocks", 16, "Naive mode moves at most this many blocks (it is slow).")
flags.DEFINE_integer("reps", 5, "Timed repetitions per measurement (the median is reported).")
flags.DEFINE_integer("warmup", 1, "Untimed repetitions first (compilation, allocator warm-up).")
flags.DEFINE_bool("torch", True, "On GPU, also time torch pinned-memory copies of the same bytes.")
flags.DEFINE_float("time_budget_s", 100, "Skip the remaining measurements after this many seconds.")
flags.DEFINE_bool("table1", False, "Instead of the sweeps: the paper's Table 1 (every mode moving --table1_tokens "
                  "of --table1_model KV each way, block-first bf16, beside torch pinned copies on a GPU).")
flags.DEFINE_string("table1_model", "qwen2.5-32b", "KV shape of --table1 (a key of MODELS).")
flags.DEFINE_integer("table1_tokens", 32768, "Tokens per direction of --table1 (the paper's 32768), cut to what "
                     "half the device memory holds (the report says so).")
flags.DEFINE_string("table1_out", "", "--table1 also writes <this>.table.md and <this>.json.")

# (layers, kv heads, head dim) of the KV caches in docs/paper.md §5; block 16, bf16.
MODELS = {
    "smollm2-135m": (30, 3, 64),
    "llama3-8b": (32, 8, 128),
    "qwen2.5-32b": (64, 8, 128),
}
_T0 = time.perf_counter()


def _out_of_time() -> bool:
  return time.perf_counter() - _T0 > FLAGS.time_budget_s


def _emit(rows: list, **row) -> None:
  row["gbps"] = round(row["total_bytes"] / row["seconds"] / 1e9, 3) if row["seconds"] > 0 else float("inf")
  row["seconds"] = round(row["seconds"], 6)
  rows.append(row)
  if FLAGS.json:
    print(json.dumps(row), flush=True)
  else:
    print(f"{row['framework']:6s} {row['case']:13s} {row['layout']:11s} {row['mode']:7s} {row['direction']:7s} "
          f"seg {row['segment_bytes'] / 2**20:9.3f} MiB  total {row['total_bytes'] / 2**20:9.1f} MiB  "
          f"{row['gbps']:8.2f} GB/s", flush=True)


def _time(fn) -> float:
  return median_time(fn, FLAGS.reps, FLAGS.warmup)


# ------------------------------------------------------------------------------------------ segment sweep
def _segment_sizes() -> list[int]:
  sizes, s = [], int(FLAGS.min_segment_kb * 1024)
  while s <= FLAGS.max_segment_mb * 2**20:
    sizes.append(s)
    s *= 2
  return sizes


def _jax_segment_sweep(rows: list, dev_sh, host_sh, seg: int) -> int:
  n = int(max(1, min(FLAGS.max_segments, FLAGS.total_mb * 2**20 // seg)))
  host_np = [np.full((seg,), i % 251, np.uint8) for i in range(n)]
  dev_src = jax.device_put(host_np, dev_sh)
  host_src = jax.device_put(host_np, host_sh)
  jax.block_until_ready((dev_src, host_src))
  del host_np

  def d2h():
    jax.block_until_ready(jax.device_put(dev_src, host_sh))

  def h2d():
    jax.block_until_ready(jax.device_put(host_src, dev_sh))

  def naive(srcs, sh):
    for x in srcs:
      jax.device_put(x, sh).block_until_ready()

  def both():
    a = jax.device_put(dev_src, host_sh)
    b = jax.device_put(host_src, dev_sh)
    jax.block_until_ready((a, b))

  plans = {
      "naive": {"d2h": lambda: naive(dev_src, host_sh), "h2d": lambda: naive(host_src, dev_sh),
                "duplex": lambda: (naive(dev_src, host_sh), naive(host_src, dev_sh))},
      "merged": {"d2h": d2h, "h2d": h2d, "duplex": lambda: (d2h(), h2d())},
      "duplex": {"duplex": both},
  }
  for mode in FLAGS.modes:
    for direction, fn in plans[mode].items():
      if _out_of_time():
        return n
      nbytes = n * seg * (2 if direction == "duplex" else 1)
      _emit(rows, framework="jax", case="segments", layout="-", mode=mode, direction=direction,
            segment_bytes=seg, total_bytes=nbytes, segments=n, seconds=_time(fn))
  return n


def _torch_cuda():
  if not FLAGS.torch:
    return None
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return torch if torch.cuda.is_available() else None


def _torch_sweep(rows: list, torch, seg: int, n: int, case: str = "segments") -> None:
  """Torch baseline: n segments of seg bytes, pinned host tensors, one stream per direction."""
  if _out_of_time():
    return
  times = time_torch(torch, seg, n, FLAGS.reps, FLAGS.warmup)
  for direction, seconds in times.items():
    direction = "duplex" if direction == "both" else direction
    nbytes = n * seg * (2 if direction == "duplex" else 1)
    _emit(rows, framework="torch", case=case, layout="-", mode="torch", direction=direction,
          segment_bytes=seg, total_bytes=nbytes, segments=n, seconds=seconds)


# ------------------------------------------------------------------------------------------ KV shapes
def _kv_sweep(rows: list, model: str, layout: str, torch) -> None:
  layers, heads, dim = MODELS[model]
  spec = KVCacheSpec(layers, heads, dim, 16, "bfloat16", layout)
  for mode in FLAGS.modes:
    if _out_of_time():
      return
    n = FLAGS.kv_blocks if mode != "naive" else min(FLAGS.kv_blocks, FLAGS.naive_max_blocks)
    eng = DuplexKV(spec, 2 * n, mode=mode)
    # Committed to the device like a model step's output (an uncommitted array compiles other variants).
    cache = jax.device_put(jnp.zeros(spec.shape(2 * n + 1), jnp.bfloat16), jax.devices()[0])
    # Seed host blocks 0..n-1 (the swap-in sources) from device blocks 1..n.
    cache = eng.issue(cache, swap_out=[(1 + i, i) for i in range(n)])
    eng.wait()
    out_pairs = [(1 + i, n + i) for i in range(n)]          # device 1..n -> host n..2n-1
    in_pairs = [(i, n + 1 + i) for i in range(n)]           # host 0..n-1 -> device n+1..2n
    state = {"cache": cache}

    def run(swap_out, swap_in):
      state["cache"] = eng.issue(state["cache"], swap_out=swap_out, swap_in=swap_in)
      eng.wait()
      state["cache"].block_until_ready()

    seg = spec.block_bytes // (2 * layers) if mode == "naive" else spec.block_bytes
    plans = {"d2h": (out_pairs, []), "h2d": ([], in_pairs), "duplex": (out_pairs, in_pairs)}
    directions = ["duplex"] if mode == "duplex" else ["d2h", "h2d", "duplex"]
    for direction in directions:
      if _out_of_time():
        return
      so, si = plans[direction]
      b0 = eng.stats.bytes_out + eng.stats.bytes_in
      seconds = _time(lambda: run(so, si))  # pylint: disable=cell-var-from-loop
      reps = FLAGS.warmup + max(1, FLAGS.reps)
      engine_bytes = (eng.stats.bytes_out + eng.stats.bytes_in - b0) // reps
      _emit(rows, framework="jax", case=model, layout=layout, mode=mode, direction=direction,
            segment_bytes=seg, total_bytes=(len(so) + len(si)) * spec.block_bytes, segments=(len(so) + len(si))
            * spec.block_bytes // seg, seconds=seconds, engine_bytes=engine_bytes, blocks=len(so) + len(si))
    del eng, cache, state
  if torch is not None and layout == FLAGS.kv_layouts[0] and not _out_of_time():
    _torch_sweep(rows, torch, spec.block_bytes, FLAGS.kv_blocks, case=model)


def _table1(torch) -> None:
  """The paper's Table 1 on this machine (``rotation/link_bench.py``): prints and writes the report."""
  layers, heads, dim = MODELS[FLAGS.table1_model]
  spec = KVCacheSpec(layers, heads, dim, 16, "bfloat16", "block_first")
  n, note = blocks_that_fit(spec, FLAGS.table1_tokens)
  rows = measure_table1(spec, n, reps=FLAGS.reps, warmup=FLAGS.warmup, naive_max_blocks=FLAGS.naive_max_blocks,
                        torch=torch, out_of_time=_out_of_time)
  dev = jax.devices()[0]
  title = (f"Table 1 on {dev.device_kind} ({dev.platform}): {FLAGS.table1_model} KV, {n} blocks of "
           f"{spec.block_bytes / 2**20:.2f} MiB = {n * spec.block_bytes / 2**30:.3f} GiB each way"
           f"{'; ' + note if note else ''}; torch: {'pinned copies' if torch is not None else 'n/a'}")
  text = format_table1(rows, title)
  print(text, flush=True)
  if FLAGS.table1_out:
    with open(FLAGS.table1_out + ".table.md", "w", encoding="utf-8") as f:
      f.write(text)
    with open(FLAGS.table1_out + ".json", "w", encoding="utf-8") as f:
      json.dump({"title": title, "model": FLAGS.table1_model, "blocks": n, "block_bytes": spec.block_bytes,
                 "tokens_requested": FLAGS.table1_tokens, "note": note,
                 "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
  if FLAGS.json:
    for r in rows:
      print(json.dumps({"case": "table1", **dataclasses.asdict(r)}), flush=True)


def main(argv):
  del argv
  bad = set(FLAGS.modes) - set(MODES)
  if bad or set(FLAGS.models) - set(MODELS):
    sys.exit(f"unknown modes {sorted(bad)} or models {sorted(set(FLAGS.models) - set(MODELS))}")
  dev = jax.devices()[0]
  dev_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)
  host_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  torch = _torch_cuda() if dev.platform == "gpu" else None
  if not FLAGS.json:
    print(f"jax {jax.__version__} on {dev} ({dev.platform}); torch baseline: {torch is not None}")
  if FLAGS.table1:
    _table1(torch)
    return
  rows: list = []
  for seg in _segment_sizes():
    if _out_of_time():
      break
    n = _jax_segment_sweep(rows, dev_sh, host_sh, seg)
    if torch is not None and not _out_of_time():
      _torch_sweep(rows, torch, seg, n)
  for model in FLAGS.models:
    for layout in FLAGS.kv_layouts:
      if not _out_of_time():
        _kv_sweep(rows, model, layout, torch)
  if _out_of_time():
    print(f"time budget {FLAGS.time_budget_s}s reached: some measurements skipped", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
