"""Attention benchmark and tuner: Pallas ragged paged attention vs the jnp reference vs JAX's paged_attention.

On a GPU the kernels are compiled (Triton); on CPU everything runs in Pallas interpret mode with small shapes
(a smoke test, not a measurement). Achieved bandwidth = the K/V bytes a step must read / time, and its
fraction of the card's HBM peak (``PEAK_BW``). Layout conversion for JAX's kernel happens outside the timed
region. Every case also prints the kernel's traffic analysis (``pallas_kernels.attention_traffic``): bytes it
moves vs bytes it must read, programs, rows, pipeline depth; and which tuning-table entry it used and why.

  python scripts/bench_attention.py --json_out=out/bench_attention.json
  python scripts/bench_attention.py --tune --tune_budget_s=170 --context_lens=2048,8192   # GPU: sweep, write table
  python scripts/bench_attention.py --tune --dry_run --json_out=/tmp/b.json               # CPU: the same path, tiny
  python scripts/bench_attention.py --traffic_only --batch_sizes=32,64 --context_lens=2048,8192 --num_q_heads=32 \
      --num_kv_heads=8 --head_dim=128 --dtype=bfloat16 --mixed_prefill_chunks=8 --mixed_chunk_tokens=512 \
      --mixed_decode_rows=56 --mixed_context=2048                                        # analysis, any backend

Cases: decode batches (``--batch_sizes`` x ``--context_lens``, one query per sequence) and one mixed step
(``--mixed_prefill_chunks`` chunks of ``--mixed_chunk_tokens`` tokens ending at ``--mixed_context`` plus
``--mixed_decode_rows`` decode rows at that context; JAX's kernel is decode-only, so no ratio there).

``--tune`` first sweeps a bounded candidate set of tunables per case (``tune_candidates``), each timed with few
iterations, within ``--tune_budget_s`` seconds (cases left when it runs out keep their old entry), and writes
each case's fastest config into the tuning table (``--tune_table``; default the repository's table, or
``<json_out dir>/ragged_paged_attention.json`` with ``--dry_run``) with the card, command and timings in the
entry's ``meta``. The benchmark then runs with the table (the kernel reads it at trace time).

JSON: {"device", "platform", "jax_version", "interpret", "peak_gbps", "config", "jax_paged_available",
"results": [{"impl", "mode", "batch", "context", "ms", "gbps", "frac_peak", "speedup_vs_jax", "max_abs_err",
"kv_bytes", "tuning", "traffic"} or {..., "error"}], "tune": [{"mode", "batch", "context", "config", "ms"}
or {..., "error"}], "tune_written": [entry keys], "tune_table", "elapsed_s"}; rewritten after every case.
"""
from __future__ import annotations

import dataclasses
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

from pallas_kernels import attention_config  # noqa: E402
from pallas_kernels import attention_traffic  # noqa: E402
from pallas_kernels import attention_tuning  # noqa: E402
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
flags.DEFINE_integer("num_splits", None, "Override the kernel's split-K factor (default: table / auto).")
flags.DEFINE_integer("blocks_per_iter", None, "Override the kernel's KV blocks per loop step.")
flags.DEFINE_integer("num_warps", None, "Override Triton num_warps.")
flags.DEFINE_integer("num_stages", None, "Override Triton num_stages.")
flags.DEFINE_boolean("tune", False, "Sweep the kernel's tunables per case and write the best into the table.")
flags.DEFINE_float("tune_budget_s", 170.0, "Wall-clock budget of the --tune sweep (all cases together).")
flags.DEFINE_integer("tune_iters", 10, "Timed calls per --tune candidate (after two warm-up calls).")
flags.DEFINE_string("tune_table", None, "Tuning table --tune writes and the bench reads (default: the "
                    "repository's table; with --dry_run next to --json_out).")
flags.DEFINE_boolean("dry_run", False, "CPU smoke run: tiny shapes in interpret mode through every stage.")
flags.DEFINE_boolean("traffic_only", False, "Print each case's kernel config and traffic analysis; time nothing.")
flags.DEFINE_boolean("check", True, "Compare each output with the reference (small extra cost).")
flags.DEFINE_string("json_out", None, "Write results as JSON here.")
flags.DEFINE_integer("seed", 0, "RNG seed.")
flags.DEFINE_integer("mixed_prefill_chunks", None, "Mixed case: prefill chunks (default: GPU 8; CPU 2; 0 = off).")
flags.DEFINE_integer("mixed_chunk_tokens", None, "Mixed case: tokens per prefill chunk (default: GPU 512; CPU 8).")
flags.DEFINE_integer("mixed_decode_rows", None, "Mixed case: decode rows (default: GPU 56; CPU 3).")
flags.DEFINE_integer("mixed_context", None, "Mixed case: context of every sequence (default: GPU 2048; CPU 40).")

# HBM peak bandwidth by device-kind substring (bytes/s); the longest matching substring wins.
PEAK_BW = [("H200", 4.8e12), ("GH200", 4.9e12), ("H100", 3.35e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12),
           ("H800", 3.35e12), ("A100", 2.0e12), ("L40S", 0.864e12), ("B200", 8.0e12)]
# The jnp reference gathers every token's context (f32 K and V); above this many bytes a case skips it.
REFERENCE_GATHER_LIMIT = 8e9
JAX_PAGED_NOTE = "JAX's paged_attention is decode-only (one query per sequence)"


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
                head_dim=128, dtype="bfloat16", min_time_s=0.2, max_iters=200, mixed_prefill_chunks=8,
                mixed_chunk_tokens=512, mixed_decode_rows=56, mixed_context=2048)
  return dict(batch_sizes=[2], context_lens=[40], num_q_heads=4, num_kv_heads=2, head_dim=64,
              dtype="float32", min_time_s=0.0, max_iters=1, mixed_prefill_chunks=2, mixed_chunk_tokens=8,
              mixed_decode_rows=3, mixed_context=40)


def _flag(name, defaults):
  v = getattr(FLAGS, name)
  if v is None:
    return defaults[name]
  if name in ("batch_sizes", "context_lens"):
    return [int(x) for x in v]
  return v


def _shuffled_cache(key, seqs, *, hkv, d, bs, layers, dtype):
  """KV cache and block tables for ``seqs`` [(q_len, context)], blocks shuffled over the pool (0 = pad)."""
  mb = max(-(-ctx // bs) for _, ctx in seqs)
  nb = len(seqs) * mb + 1
  k1, k3 = jax.random.split(key)
  kv = jax.random.normal(k1, (nb, layers, 2, bs, hkv, d), jnp.float32).astype(dtype)
  perm = jax.random.permutation(k3, jnp.arange(1, nb, dtype=jnp.int32))
  return kv, perm.reshape(len(seqs), mb)


def make_decode_case(key, batch, context, *, hq, hkv, d, bs, layers, dtype):
  """Decode batch: every sequence has `context` tokens (incl. the query). Returns (q, kv, bt, ctx)."""
  kq, kc = jax.random.split(key)
  kv, bt = _shuffled_cache(kc, [(1, context)] * batch, hkv=hkv, d=d, bs=bs, layers=layers, dtype=dtype)
  q = jax.random.normal(kq, (batch, hq, d), jnp.float32).astype(dtype)
  return q, kv, bt, jnp.full((batch,), context, jnp.int32)


def mixed_seqs(chunks, chunk_tokens, decode_rows, context):
  """[(q_len, context)] of the mixed step: prefill chunks ending at `context`, then decode rows."""
  return [(min(chunk_tokens, context), context)] * chunks + [(1, context)] * decode_rows


def make_mixed_case(key, seqs, *, hq, hkv, d, bs, layers, dtype):
  """Ragged batch of ``seqs``. Returns (q [T, Hq, D], kv, bt, ctx, query_start_loc)."""
  kq, kc = jax.random.split(key)
  kv, bt = _shuffled_cache(kc, seqs, hkv=hkv, d=d, bs=bs, layers=layers, dtype=dtype)
  q_lens = jnp.array([q for q, _ in seqs], jnp.int32)
  qsl = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
  q = jax.random.normal(kq, (int(q_lens.sum()), hq, d), jnp.float32).astype(dtype)
  return q, kv, bt, jnp.array([c for _, c in seqs], jnp.int32), qsl


def time_fn(fn, args, min_time_s, max_iters):
  """Seconds per call: back-to-back calls (async dispatch), blocked at the end. Two warm-up calls first."""
  for _ in range(2):
    out = fn(*args)
    jax.block_until_ready(out)
  n, total, batch = 0, 0.0, 1
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


def import_jax_paged():
  """JAX's GPU paged_attention module, or (None, why) where this jax lacks it."""
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      from jax.experimental.pallas.ops.gpu import paged_attention as pa  # pylint: disable=import-outside-toplevel
    return pa, None
  except ImportError as e:
    return None, f"{type(e).__name__}: {e}"


def build_impls(names, *, scale, interpret, layer, kernel_kw):
  """name -> (jitted fn or None, args builder(q, kv, bt, ctx)); a None fn means the builder returns
  (fn, args). Args are built outside the timed region."""
  impls = {}
  if "pallas" in names:
    f = jax.jit(functools.partial(rpa.paged_decode_attention, scale=scale, interpret=interpret, **kernel_kw))
    impls["pallas"] = (f, lambda q, kv, bt, ctx: (q, kv, layer, bt, ctx))
  if "reference" in names:
    def ref(q, kv, bt, ctx):
      qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
      return ragged_paged_attention_reference(q, kv, layer, bt, ctx, qsl, scale=scale)
    impls["reference"] = (jax.jit(ref), lambda q, kv, bt, ctx: (q, kv, bt, ctx))
  pa, why = import_jax_paged()
  if "jax_paged" in names and pa is None:
    print(f"jax_paged unavailable: {why}")
  elif "jax_paged" in names:
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
  rows = {}
  for name, (fn, prep) in impls.items():
    try:
      if fn is None:
        fn, args = prep(*case)
      else:
        args = prep(*case)
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


def tune_candidates(mode: str, on_gpu: bool):
  """Bounded sweep of the tunables, in two phases: (tiling) candidates with num_warps 4 / num_stages 2, then
  (num_warps, num_stages) variants of the phase-one winner. Returns (phase one list, phase two list)."""
  if not on_gpu:   # interpret mode: only the tiling changes anything; two candidates keep the smoke fast
    tiling = [dict(blocks_per_iter=1), dict(blocks_per_iter=2)]
    return tiling, [dict(num_warps=4, num_stages=2)]
  if mode == "decode":
    tiling = [dict(blocks_per_iter=b, num_splits=p) for b in (2, 4, 8) for p in (1, 2, 4, 8)]
  else:
    tiling = [dict(tile_q=t, blocks_per_iter=b) for t in (4, 8, 16, 32) for b in (2, 4, 8)]
  launch = [dict(num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))]
  return [dict(c, num_warps=4, num_stages=2) for c in tiling], launch


def tune_case(make_fn, args, mode, *, on_gpu, iters, deadline, log):
  """Times the candidates of ``tune_candidates`` on one case until ``deadline`` (perf_counter seconds).
  make_fn(**tunables) -> jitted fn. Returns (best tunables or None, [timing rows])."""
  rows = []

  def timed(cfg):
    if time.perf_counter() > deadline:
      return None
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sec, _ = time_fn(make_fn(**cfg), args, 0.0, iters)
    except Exception as e:  # noqa: BLE001 - an invalid candidate is reported and skipped
      rows.append(dict(config=cfg, error=f"{type(e).__name__}: {str(e)[:300]}"))
      return None
    rows.append(dict(config=cfg, ms=sec * 1e3))
    log(f"  {cfg}: {sec * 1e3:.4f} ms")
    return sec
  tiling, launch = tune_candidates(mode, on_gpu)
  best, best_sec = None, float("inf")
  for cfg in tiling:
    sec = timed(cfg)
    if sec is not None and sec < best_sec:
      best, best_sec = cfg, sec
  if best is None:
    return None, rows
  base = {k: v for k, v in best.items() if k not in ("num_warps", "num_stages")}
  for lc in launch:
    cfg = dict(base, **lc)
    if cfg == best:
      continue
    sec = timed(cfg)
    if sec is not None and sec < best_sec:
      best, best_sec = cfg, sec
  return dict(best, ms=best_sec * 1e3), rows


class Bench:
  """Shapes, flags and the JSON payload of one run."""

  def __init__(self):
    self.platform, self.kind, self.peak = device_info()
    self.on_gpu = self.platform == "gpu"
    d = _defaults(self.on_gpu)
    self.batch_sizes, self.context_lens = _flag("batch_sizes", d), _flag("context_lens", d)
    self.hq, self.hkv, self.d = _flag("num_q_heads", d), _flag("num_kv_heads", d), _flag("head_dim", d)
    self.dtype = jnp.dtype(_flag("dtype", d))
    self.min_time_s, self.max_iters = _flag("min_time_s", d), _flag("max_iters", d)
    self.mixed = [_flag(n, d) for n in ("mixed_prefill_chunks", "mixed_chunk_tokens", "mixed_decode_rows",
                                        "mixed_context")]
    self.bs, self.layers = FLAGS.block_size, FLAGS.num_layers
    self.layer = self.layers - 1
    self.interpret = rpa.default_interpret()
    self.scale = self.d ** -0.5
    self.kernel_kw = {k: getattr(FLAGS, k) for k in attention_tuning.TUNABLES
                      if getattr(FLAGS, k, None) is not None}
    self.shape_kw = dict(hq=self.hq, hkv=self.hkv, d=self.d, bs=self.bs, layers=self.layers, dtype=self.dtype)
    self.t_start = time.perf_counter()
    pa, why = import_jax_paged()
    self.payload = dict(device=self.kind, platform=self.platform, jax_version=jax.__version__,
                        interpret=self.interpret, peak_gbps=self.peak / 1e9 if self.peak else None,
                        jax_paged_available=pa is not None, jax_paged_unavailable_reason=why,
                        config=dict(num_q_heads=self.hq, num_kv_heads=self.hkv, head_dim=self.d,
                                    block_size=self.bs, dtype=self.dtype.name, batch_sizes=self.batch_sizes,
                                    context_lens=self.context_lens, mixed=self.mixed,
                                    kernel_overrides=self.kernel_kw),
                        results=[], tune=[], tune_written=[], tune_table=attention_tuning.table_path())

  def write_json(self):
    """Rewritten after every case, so a timed-out run still leaves what it measured."""
    if not FLAGS.json_out:
      return
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json_out)), exist_ok=True)
    self.payload["elapsed_s"] = time.perf_counter() - self.t_start
    with open(FLAGS.json_out, "w", encoding="utf-8") as f:
      json.dump(self.payload, f, indent=1)

  def mixed_seqs(self):
    chunks, tokens, rows, ctx = self.mixed
    return mixed_seqs(chunks, tokens, rows, ctx) if chunks > 0 or rows > 0 else []

  def cases(self):
    """[(mode, batch, context, seqs)] in run order."""
    out = [("decode", b, c, [(1, c)] * b) for b in self.batch_sizes for c in self.context_lens]
    seqs = self.mixed_seqs()
    if seqs:
      out.append(("mixed", len(seqs), self.mixed[3], seqs))
    return out

  def choice(self, mode, seqs, max_blocks, interpret=None):
    """(KernelConfig, TuningChoice) the kernel uses for this case (interpret: default this run's mode)."""
    num_tokens = sum(q for q, _ in seqs)
    return rpa.select_config(num_tokens=num_tokens, num_seqs=len(seqs), max_blocks=max_blocks,
                             num_q_heads=self.hq, num_kv_heads=self.hkv, head_dim=self.d, block_size=self.bs,
                             kv_dtype=self.dtype, decode=mode == "decode",
                             interpret=self.interpret if interpret is None else interpret,
                             overrides=self.kernel_kw)

  def traffic(self, mode, seqs, cfg):
    cores = attention_config._num_gpu_cores() if self.on_gpu else 132
    return attention_traffic.traffic(seqs, cfg=cfg, num_q_heads=self.hq, num_kv_heads=self.hkv,
                                     head_dim=self.d, block_size=self.bs, itemsize=self.dtype.itemsize,
                                     decode_layout=mode == "decode", num_cores=cores)

  def kernel_fn(self, mode, **tunables):
    fn = rpa.paged_decode_attention if mode == "decode" else rpa.ragged_paged_attention
    return jax.jit(functools.partial(fn, scale=self.scale, interpret=self.interpret, **tunables))

  def make_case(self, key, mode, batch, context, seqs):
    if mode == "decode":
      return make_decode_case(key, batch, context, **self.shape_kw)
    return make_mixed_case(key, seqs, **self.shape_kw)

  def kernel_args(self, mode, case):
    q, kv, bt, ctx = case[:4]
    return (q, kv, self.layer, bt, ctx) if mode == "decode" else (q, kv, self.layer, bt, ctx, case[4])

  def tune(self, key):
    """--tune: sweep every case within the budget, write each winner into the table."""
    deadline = self.t_start + FLAGS.tune_budget_s
    for mode, batch, context, seqs in self.cases():
      if time.perf_counter() > deadline:
        print(f"tune budget spent; {mode} batch {batch} context {context} keeps its table entry")
        break
      key, sub = jax.random.split(key)
      case = self.make_case(sub, mode, batch, context, seqs)
      print(f"\ntune {mode} batch {batch} context {context}", flush=True)
      best, rows = tune_case(functools.partial(self.kernel_fn, mode), self.kernel_args(mode, case), mode,
                             on_gpu=self.on_gpu, iters=FLAGS.tune_iters, deadline=deadline, log=print)
      self.payload["tune"] += [dict(r, mode=mode, batch=batch, context=context) for r in rows]
      if best is not None:
        ms = best.pop("ms")
        _, choice = self.choice(mode, seqs, case[2].shape[1])
        kv_bytes = sum(c for _, c in seqs) * self.hkv * self.d * 2 * self.dtype.itemsize
        meta = dict(device_kind=self.kind, command=" ".join(sys.argv), jax_version=jax.__version__, ms=ms,
                    gbps=kv_bytes / ms / 1e6, candidates_timed=sum("ms" in r for r in rows),
                    frac_peak=(kv_bytes / ms / 1e-3 / self.peak) if self.peak else None)
        attention_tuning.write_entry(choice.key, best, meta)
        self.payload["tune_written"].append(dict(key=choice.key, config=best, meta=meta))
        print(f"best {best}: {ms:.4f} ms -> {attention_tuning.table_path()}", flush=True)
      self.write_json()
      del case
    return key

  def record(self, name, r, *, mode, batch, context, kv_bytes, ref, jax_sec, extra):
    if "error" in r:
      self.payload["results"].append(dict(impl=name, mode=mode, batch=batch, context=context, error=r["error"]))
      return
    gbps = kv_bytes / r["sec"] / 1e9
    err = None
    if FLAGS.check and ref is not None and name != "reference":
      err = float(jnp.max(jnp.abs(r["out"].astype(jnp.float32) - ref.astype(jnp.float32))))
    res = dict(impl=name, mode=mode, batch=batch, context=context, ms=r["sec"] * 1e3, gbps=gbps,
               frac_peak=(gbps * 1e9 / self.peak) if self.peak else None,
               speedup_vs_jax=(jax_sec / r["sec"]) if jax_sec else None, max_abs_err=err, kv_bytes=kv_bytes,
               **(extra if name == "pallas" else {}))
    self.payload["results"].append(res)
    fp = f"{100 * res['frac_peak']:6.1f}" if self.peak else f"{'-':>6}"
    vj = f"{res['speedup_vs_jax']:7.2f}" if jax_sec else f"{'-':>7}"
    es = f"{err:9.2e}" if err is not None else f"{'-':>9}"
    print(f"{mode:>6} {batch:>6} {context:>8} {name:>10} {res['ms']:9.3f} {gbps:8.1f} {fp} {vj} {es}", flush=True)

  def traffic_report(self):
    """--traffic_only: the compiled kernel's config and traffic analysis of every case, from shapes alone (no
    arrays; on a CPU with 132 SMs assumed, as on an H100 SXM / H200)."""
    for mode, batch, context, seqs in self.cases():
      cfg, choice = self.choice(mode, seqs, -(-context // self.bs), interpret=False)
      t = self.traffic(mode, seqs, cfg)
      print(f"{mode} batch {batch} context {context}: {cfg} ({choice.reason})\n  "
            f"{attention_traffic.format_traffic(t)}")
      self.payload["results"].append(dict(impl="pallas", mode=mode, batch=batch, context=context,
                                          kernel_config=dataclasses.asdict(cfg), tuning_reason=choice.reason,
                                          traffic=t))

  def bench(self, key):
    names = list(FLAGS.impls)
    impls = build_impls(names, scale=self.scale, interpret=self.interpret, layer=self.layer,
                        kernel_kw=self.kernel_kw)
    header = (f"{'mode':>6} {'batch':>6} {'context':>8} {'impl':>10} {'ms':>9} {'GB/s':>8} {'%peak':>6} "
              f"{'vs jax':>7} {'err':>9}")
    print("\n" + header + "\n" + "-" * len(header))
    for mode, batch, context, seqs in self.cases():
      key, sub = jax.random.split(key)
      case = self.make_case(sub, mode, batch, context, seqs)
      cfg, choice = self.choice(mode, seqs, case[2].shape[1])
      traffic = self.traffic(mode, seqs, cfg)
      print(f"  kernel: {cfg} ({choice.reason}); {attention_traffic.format_traffic(traffic)}")
      extra = dict(tuning=dict(reason=choice.reason, entry_key=choice.entry_key, config=choice.config,
                               kernel_config=dataclasses.asdict(cfg)),
                   traffic=traffic)
      if mode == "mixed":
        extra["speedup_vs_jax_note"] = JAX_PAGED_NOTE
        mixed_impls = {n: (self.kernel_fn("mixed", **self.kernel_kw), lambda *c: self.kernel_args("mixed", c))
                       for n in names if n == "pallas"}
        gather = case[0].shape[0] * case[2].shape[1] * self.bs * self.hkv * self.d * 4 * 2
        if "reference" in names and gather > REFERENCE_GATHER_LIMIT:
          extra["reference_skipped"] = f"the jnp reference would gather {gather / 1e9:.1f} GB"
          print(f"  mixed reference skipped: {extra['reference_skipped']}")
        elif "reference" in names:
          mixed_impls["reference"] = (jax.jit(functools.partial(ragged_paged_attention_reference,
                                                                scale=self.scale)),
                                      lambda *c: self.kernel_args("mixed", c))
        rows = run_case(mixed_impls, case, min_time_s=self.min_time_s, max_iters=self.max_iters)
      else:
        rows = run_case(impls, case, min_time_s=self.min_time_s, max_iters=self.max_iters)
      ref = rows.get("reference", {}).get("out")
      jax_sec = rows.get("jax_paged", {}).get("sec")
      kv_bytes = traffic["required_kv"]
      for name, r in rows.items():
        self.record(name, r, mode=mode, batch=batch, context=context, kv_bytes=kv_bytes, ref=ref,
                    jax_sec=jax_sec, extra=extra)
      del case, rows
      self.write_json()


def main(argv):
  del argv
  if FLAGS.tune_table:
    os.environ[attention_tuning.TABLE_ENV] = os.path.abspath(FLAGS.tune_table)
  elif FLAGS.dry_run and FLAGS.tune:   # a smoke run never rewrites the repository's table
    base = os.path.dirname(os.path.abspath(FLAGS.json_out)) if FLAGS.json_out else os.getcwd()
    os.environ[attention_tuning.TABLE_ENV] = os.path.join(base, "ragged_paged_attention.json")
  b = Bench()
  if FLAGS.dry_run and b.on_gpu:
    raise app.UsageError("--dry_run is the CPU smoke run (set JAX_PLATFORMS=cpu)")
  print(f"device: {b.platform} ({b.kind}); jax {jax.__version__}; interpret={b.interpret}; "
        f"peak={b.peak / 1e9 if b.peak else None} GB/s; heads {b.hq}/{b.hkv} d {b.d} bs {b.bs} {b.dtype.name}; "
        f"table {attention_tuning.table_path()}")
  key = jax.random.PRNGKey(FLAGS.seed)
  if FLAGS.traffic_only:
    b.traffic_report()
    b.write_json()
    return
  if FLAGS.tune:
    key = b.tune(key)
  b.bench(key)
  print(f"total {time.perf_counter() - b.t_start:.1f} s")
  b.write_json()
  if FLAGS.json_out:
    print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
  app.run(main)
