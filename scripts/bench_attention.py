"""Decode attention benchmark: Pallas ragged paged attention vs the jnp reference vs JAX's paged_attention.

On a GPU the kernels are compiled (Triton); on CPU everything runs in Pallas interpret mode with small shapes
(a smoke test, not a measurement). For each (batch, context) the K/V of one layer are read once per call, so
achieved bandwidth = bytes of K/V read / time, and its fraction of the device's HBM peak (H200: 4.8 TB/s).
Layout conversion for JAX's kernel ([Hkv, NB, BS, D] pages) happens outside the timed region.

  python scripts/bench_attention.py --json_out=out/bench_attention.json
  python scripts/bench_attention.py --batch_sizes=32,64 --context_lens=2048,8192 --dtype=bfloat16

Flags left unset take backend defaults (GPU: Llama-3-8B-like heads 32/8, d 128, bf16, batch 32/64, context
2k/4k/8k, plus a 15-config tuning sweep at batch 32 / context 4k; CPU: tiny shapes). Expected GPU wall time
~1.5-2 min (mostly compiles). JSON: {"device", "platform", "jax_version", "interpret", "peak_gbps", "config",
"results": [{"impl", "batch", "context", "ms", "gbps", "frac_peak", "speedup_vs_jax", "max_abs_err",
"kv_bytes"} or {"impl", "batch", "context", "error"}], "tune": [{"config", "ms", "gbps", "frac_peak"}],
"elapsed_s"}; rewritten after every case.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import ragged_paged_attention as rpa  # noqa: E402
from pallas_kernels.reference import ragged_paged_attention_reference  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", None, "Decode batch sizes (default: GPU 32,64; CPU 2).")
flags.DEFINE_list("context_lens", None, "Context lengths in tokens (default: GPU 2048,4096,8192; CPU 40).")
flags.DEFINE_integer("num_q_heads", None, "Query heads (default: GPU 32; CPU 4).")
flags.DEFINE_integer("num_kv_heads", None, "KV heads (default: GPU 8; CPU 2).")
flags.DEFINE_integer("head_dim", None, "Head dim (default: GPU 128; CPU 64).")
flags.DEFINE_integer("block_size", 16, "Tokens per cache block.")
flags.DEFINE_string("dtype", None, "bfloat16 | float32 (default: GPU bfloat16; CPU float32).")
flags.DEFINE_integer("num_layers", 1, "Layers in the cache (one is read).")
flags.DEFINE_list("impls", ["pallas", "reference", "jax_paged"], "Implementations to time.")
flags.DEFINE_float("min_time_s", None, "Time each case for at least this long (default: GPU 0.2; CPU 0).")
flags.DEFINE_integer("max_iters", None, "At most this many timed calls per case (default: GPU 200; CPU 1).")
flags.DEFINE_integer("num_splits", None, "Override the kernel's split-K factor (default: auto).")
flags.DEFINE_integer("blocks_per_iter", None, "Override the kernel's KV blocks per loop step.")
flags.DEFINE_integer("num_warps", None, "Override Triton num_warps.")
flags.DEFINE_integer("num_stages", None, "Override Triton num_stages.")
flags.DEFINE_boolean("tune", None, "Also sweep kernel configs on one shape (default: on for GPU).")
flags.DEFINE_integer("tune_batch", 32, "Batch of the tuning sweep.")
flags.DEFINE_integer("tune_context", 4096, "Context of the tuning sweep.")
flags.DEFINE_boolean("check", True, "Compare each output with the reference (small extra cost).")
flags.DEFINE_string("json_out", None, "Write results as JSON here.")
flags.DEFINE_integer("seed", 0, "RNG seed.")
flags.DEFINE_integer("prefill_chunk", 0, "If > 0, also time a mixed ragged batch per (batch, context): batch-1 "
                     "decode sequences plus one prefill chunk of this many tokens ending at `context` "
                     "(pallas vs reference only).")

# HBM peak bandwidth by device kind substring (bytes/s).
PEAK_BW = [("H200", 4.8e12), ("GH200", 4.9e12), ("H100", 3.35e12), ("H800", 3.35e12), ("A100", 2.0e12),
           ("L40S", 0.864e12), ("B200", 8.0e12)]


def device_info():
  dev = jax.devices()[0]
  kind = getattr(dev, "device_kind", str(dev))
  peak = None
  if dev.platform == "gpu":
    for key, bw in sorted(PEAK_BW, key=lambda kv: -len(kv[0])):
      if key.lower() in kind.lower():
        peak = bw
        break
  return dev.platform, kind, peak


def _defaults(on_gpu: bool):
  if on_gpu:
    return dict(batch_sizes=[32, 64], context_lens=[2048, 4096, 8192], num_q_heads=32, num_kv_heads=8,
                head_dim=128, dtype="bfloat16", min_time_s=0.2, max_iters=200, tune=True)
  return dict(batch_sizes=[2], context_lens=[40], num_q_heads=4, num_kv_heads=2, head_dim=64,
              dtype="float32", min_time_s=0.0, max_iters=1, tune=False)


def _flag(name, defaults):
  v = getattr(FLAGS, name)
  if v is None:
    return defaults[name]
  if name in ("batch_sizes", "context_lens"):
    return [int(x) for x in v]
  return v


def make_decode_case(key, batch, context, *, hq, hkv, d, bs, layers, dtype):
  """Decode batch: every sequence has `context` tokens (incl. the query), blocks shuffled over the pool."""
  mb = -(-context // bs)
  nb = batch * mb + 1
  k1, k2, k3 = jax.random.split(key, 3)
  kv = jax.random.normal(k1, (nb, layers, 2, bs, hkv, d), jnp.float32).astype(dtype)
  q = jax.random.normal(k2, (batch, hq, d), jnp.float32).astype(dtype)
  perm = jax.random.permutation(k3, jnp.arange(1, nb, dtype=jnp.int32))
  block_tables = perm.reshape(batch, mb)
  context_lens = jnp.full((batch,), context, jnp.int32)
  return q, kv, block_tables, context_lens


def time_fn(fn, args, min_time_s, max_iters):
  """Seconds per call: back-to-back calls (async dispatch), blocked at the end. Compiles first."""
  out = fn(*args)
  jax.block_until_ready(out)
  out = fn(*args)  # second warm-up (autotuning / caches)
  jax.block_until_ready(out)
  n, total = 0, 0.0
  batch = 1
  while True:
    t0 = time.perf_counter()
    for _ in range(batch):
      out = fn(*args)
    jax.block_until_ready(out)
    total += time.perf_counter() - t0
    n += batch
    if total >= min_time_s or n >= max_iters:
      break
    batch = min(max_iters - n, max(1, int(batch * 2)))
  return total / n, out


def build_impls(names, *, scale, interpret, layer, kernel_kw):
  """name -> (jitted fn, args builder(q, kv, bt, ctx) -> args). Args built outside the timed region."""
  impls = {}
  if "pallas" in names:
    f = jax.jit(functools.partial(rpa.paged_decode_attention, scale=scale, interpret=interpret, **kernel_kw))
    impls["pallas"] = (f, lambda q, kv, bt, ctx: (q, kv, layer, bt, ctx))
  if "reference" in names:
    def ref(q, kv, bt, ctx):
      qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
      return ragged_paged_attention_reference(q, kv, layer, bt, ctx, qsl, scale=scale)
    impls["reference"] = (jax.jit(ref), lambda q, kv, bt, ctx: (q, kv, bt, ctx))
  if "jax_paged" in names:
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import paged_attention as pa
    except ImportError as e:  # pragma: no cover
      print(f"jax_paged unavailable: {e}")
    else:
      def prep(q, kv, bt, ctx):
        mb = bt.shape[1]
        k_splits = max(s for s in (16, 8, 4, 2, 1) if mb % s == 0)
        ppcb = max(p for p in (8, 4, 2, 1) if (mb // k_splits) % p == 0)
        k = jnp.transpose(kv[:, layer, 0], (2, 0, 1, 3))
        v = jnp.transpose(kv[:, layer, 1], (2, 0, 1, 3))
        fn = jax.jit(functools.partial(pa.paged_attention, block_h=16, pages_per_compute_block=ppcb,
                                       k_splits=k_splits, interpret=interpret))
        # JAX's kernel has no soft-max scale: scale q (outside the timed region, like the layout change).
        return fn, (q * jnp.asarray(scale, q.dtype), k, v, bt, ctx)
      impls["jax_paged"] = (None, prep)
  return impls


def run_case(impls, case, *, min_time_s, max_iters):
  """Times every implementation on one case; a failing one is reported (error) and the others still run."""
  q, kv, bt, ctx = case
  rows = {}
  for name, (fn, prep) in impls.items():
    try:
      if fn is None:
        fn, args = prep(q, kv, bt, ctx)
      else:
        args = prep(q, kv, bt, ctx)
      jax.block_until_ready(args)
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sec, out = time_fn(fn, args, min_time_s, max_iters)
      rows[name] = dict(sec=sec, out=out)
      del args
    except Exception as e:  # noqa: BLE001 - report and continue with the other implementations
      print(f"{name} FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
      rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:1000]}")
  return rows


def main(argv):
  del argv
  platform, kind, peak = device_info()
  on_gpu = platform == "gpu"
  defaults = _defaults(on_gpu)
  batch_sizes = _flag("batch_sizes", defaults)
  context_lens = _flag("context_lens", defaults)
  hq, hkv, d = _flag("num_q_heads", defaults), _flag("num_kv_heads", defaults), _flag("head_dim", defaults)
  dtype = jnp.dtype(_flag("dtype", defaults))
  min_time_s, max_iters = _flag("min_time_s", defaults), _flag("max_iters", defaults)
  tune = _flag("tune", defaults)
  bs, layers = FLAGS.block_size, FLAGS.num_layers
  interpret = rpa.default_interpret()
  scale = d ** -0.5
  layer = layers - 1
  kernel_kw = {k: getattr(FLAGS, k) for k in ("num_splits", "blocks_per_iter", "num_warps", "num_stages")
               if getattr(FLAGS, k) is not None}
  itemsize = dtype.itemsize
  print(f"device: {platform} ({kind}); jax {jax.__version__}; interpret={interpret}; "
        f"peak={peak / 1e9 if peak else None} GB/s; heads {hq}/{hkv} d {d} bs {bs} {dtype.name}")
  names = list(FLAGS.impls)
  impls = build_impls(names, scale=scale, interpret=interpret, layer=layer, kernel_kw=kernel_kw)
  key = jax.random.PRNGKey(FLAGS.seed)
  results = []
  tune_rows = []
  t_start = time.perf_counter()

  def write_json():
    """Rewritten after every case, so a timed-out run still leaves what it measured."""
    if not FLAGS.json_out:
      return
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
    payload = dict(device=kind, platform=platform, jax_version=jax.__version__, interpret=interpret,
                   peak_gbps=peak / 1e9 if peak else None,
                   config=dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype.name,
                               batch_sizes=batch_sizes, context_lens=context_lens, kernel_overrides=kernel_kw),
                   results=results, tune=tune_rows, elapsed_s=time.perf_counter() - t_start)
    with open(FLAGS.json_out, "w") as f:
      json.dump(payload, f, indent=1)
  header = f"{'batch':>6} {'context':>8} {'impl':>10} {'ms':>9} {'GB/s':>8} {'%peak':>6} {'vs jax':>7} {'err':>9}"
  print(header)
  print("-" * len(header))
  for batch in batch_sizes:
    for context in context_lens:
      key, sub = jax.random.split(key)
      case = make_decode_case(sub, batch, context, hq=hq, hkv=hkv, d=d, bs=bs, layers=layers, dtype=dtype)
      kv_bytes = batch * context * hkv * d * 2 * itemsize
      rows = run_case(impls, case, min_time_s=min_time_s, max_iters=max_iters)
      ref = rows.get("reference", {}).get("out")
      jax_sec = rows.get("jax_paged", {}).get("sec")
      for name, r in rows.items():
        if "error" in r:
          results.append(dict(impl=name, mode="decode", batch=batch, context=context, error=r["error"]))
          continue
        gbps = kv_bytes / r["sec"] / 1e9
        err = None
        if FLAGS.check and ref is not None and name != "reference":
          err = float(jnp.max(jnp.abs(r["out"].astype(jnp.float32) - ref.astype(jnp.float32))))
        res = dict(impl=name, mode="decode", batch=batch, context=context, ms=r["sec"] * 1e3, gbps=gbps,
                   frac_peak=(gbps * 1e9 / peak) if peak else None,
                   speedup_vs_jax=(jax_sec / r["sec"]) if jax_sec else None, max_abs_err=err,
                   kv_bytes=kv_bytes)
        results.append(res)
        fp = f"{100 * res['frac_peak']:6.1f}" if peak else f"{'-':>6}"
        vj = f"{res['speedup_vs_jax']:7.2f}" if jax_sec else f"{'-':>7}"
        es = f"{err:9.2e}" if err is not None else f"{'-':>9}"
        print(f"{batch:>6} {context:>8} {name:>10} {res['ms']:9.3f} {gbps:8.1f} {fp} {vj} {es}", flush=True)
      del case, rows
      write_json()
  if FLAGS.prefill_chunk > 0:
    print(f"\nmixed batches: (batch - 1) decode tokens + one {FLAGS.prefill_chunk}-token prefill chunk")
    for batch in batch_sizes:
      for context in context_lens:
        key, sub = jax.random.split(key)
        q, kv, bt, ctx = make_decode_case(sub, batch, context, hq=hq, hkv=hkv, d=d, bs=bs, layers=layers,
                                          dtype=dtype)
        chunk = min(FLAGS.prefill_chunk, context)
        q_lens = jnp.concatenate([jnp.ones((batch - 1,), jnp.int32), jnp.array([chunk], jnp.int32)])
        qsl = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
        qm = jax.random.normal(sub, (batch - 1 + chunk, hq, d), jnp.float32).astype(dtype)
        kv_bytes = batch * context * hkv * d * 2 * itemsize
        fns = {"reference": jax.jit(functools.partial(ragged_paged_attention_reference, scale=scale)),
               "pallas": jax.jit(functools.partial(rpa.ragged_paged_attention, scale=scale, interpret=interpret,
                                                   **kernel_kw))}
        outs = {}
        for name, f in fns.items():
          if name not in names:
            continue
          try:
            with warnings.catch_warnings():
              warnings.simplefilter("ignore")
              sec, outs[name] = time_fn(f, (qm, kv, layer, bt, ctx, qsl), min_time_s, max_iters)
          except Exception as e:  # noqa: BLE001
            results.append(dict(impl=name, mode="mixed", batch=batch, context=context, error=str(e)[:1000]))
            print(f"mixed {name} FAILED: {str(e)[:300]}")
            continue
          err = None
          if name != "reference" and "reference" in outs:
            err = float(jnp.max(jnp.abs(outs[name].astype(jnp.float32) - outs["reference"].astype(jnp.float32))))
          gbps = kv_bytes / sec / 1e9
          results.append(dict(impl=name, mode="mixed", batch=batch, context=context, prefill_chunk=chunk,
                              ms=sec * 1e3, gbps=gbps, frac_peak=(gbps * 1e9 / peak) if peak else None,
                              max_abs_err=err, kv_bytes=kv_bytes))
          es = f"{err:9.2e}" if err is not None else f"{'-':>9}"
          print(f"{batch:>6} {context:>8} {'mixed-' + name:>16} {sec * 1e3:9.3f} {gbps:8.1f} {es}", flush=True)
        write_json()
        del q, kv, bt, ctx, outs
  if tune and "pallas" in FLAGS.impls:
    key, sub = jax.random.split(key)
    case = make_decode_case(sub, FLAGS.tune_batch, FLAGS.tune_context, hq=hq, hkv=hkv, d=d, bs=bs,
                            layers=layers, dtype=dtype)
    kv_bytes = FLAGS.tune_batch * FLAGS.tune_context * hkv * d * 2 * itemsize
    print(f"\ntuning sweep: batch {FLAGS.tune_batch} context {FLAGS.tune_context}")
    configs = [dict(blocks_per_iter=max(1, keys // bs), num_splits=splits, num_warps=4, num_stages=2)
               for keys in (32, 64, 128) for splits in (1, 2, 4, 8)]
    configs += [dict(blocks_per_iter=max(1, 64 // bs), num_splits=4, num_warps=w, num_stages=st)
                for w, st in ((4, 3), (8, 2), (2, 2))]
    q, kv, bt, ctx = case
    for kw in configs:
      f = jax.jit(functools.partial(rpa.paged_decode_attention, scale=scale, interpret=interpret, **kw))
      try:
        with warnings.catch_warnings():
          warnings.simplefilter("ignore")
          sec, _ = time_fn(f, (q, kv, layer, bt, ctx), min(min_time_s, 0.1), max_iters)
      except Exception as e:  # keep sweeping; report the failure
        tune_rows.append(dict(config=kw, error=str(e)[:300]))
        print(f"  {kw}: FAILED {str(e)[:120]}")
        continue
      gbps = kv_bytes / sec / 1e9
      tune_rows.append(dict(config=kw, ms=sec * 1e3, gbps=gbps, frac_peak=(gbps * 1e9 / peak) if peak else None))
      print(f"  {kw}: {sec * 1e3:8.3f} ms {gbps:8.1f} GB/s", flush=True)
      write_json()
    ok = [r for r in tune_rows if "ms" in r]
    if ok:
      best = min(ok, key=lambda r: r["ms"])
      print(f"best: {best}")
  elapsed = time.perf_counter() - t_start
  print(f"total {elapsed:.1f} s")
  write_json()
  if FLAGS.json_out:
    print(f"wrote {FLAGS.json_out}")

if __name__ == "__main__":
  app.run(main)
