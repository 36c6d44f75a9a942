"""Ragged paged attention kernel (Pallas) vs the jnp reference.

On CPU the kernel runs in interpret mode; on a GPU (JAX_PLATFORMS unset/cuda) the same tests run the compiled
Triton kernel. Shapes are small and fixed per test so that each test compiles only a few variants.
"""
import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention as rpa_mod
from pallas_kernels.ragged_paged_attention import paged_decode_attention, ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.testing import make_ragged_batch, to_jax_paged_layout

from pallas_kernels.testing import tolerance  # noqa: E402

F32_TOL = tolerance("float32")
pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator

TOL = {jnp.float32: tolerance(jnp.float32), jnp.bfloat16: tolerance(jnp.bfloat16)}   # from the matmul precision


def _check(batch, dtype, layer=1, **kw):
  scale = batch.q.shape[-1] ** -0.5
  want = ragged_paged_attention_reference(*batch.args(layer), scale=scale)
  got = ragged_paged_attention(*batch.args(layer), scale=scale, **kw)
  assert got.shape == want.shape and got.dtype == want.dtype
  got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.all(np.isfinite(got32))
  np.testing.assert_allclose(got32, want32, atol=TOL[dtype], rtol=TOL[dtype])
  # Padding tokens (at or past query_start_loc[S]) are exactly zero.
  end = int(batch.query_start_loc[-1])
  assert not np.any(got32[end:])
  return got


# Real sequences as (q_len, context_len); (0, 0) = padding sequence. With block size 16:
#  decode at len 1 and at a block boundary, a chunk starting mid-block, a full prefill, a chunk ending exactly
#  on a block boundary, padding sequences in the middle.
MIXED = [(1, 1), (5, 21), (0, 0), (1, 33), (17, 17), (1, 16), (0, 0), (9, 48)]

CASES = [
    # (dtype, Hq, Hkv, D, BS, kwargs)
    (jnp.float32, 4, 4, 64, 16, {}),                            # MHA
    (jnp.float32, 8, 2, 64, 16, {}),                            # GQA 4
    (jnp.float32, 6, 2, 64, 32, {}),                            # GQA 3 (padded group), block 32
    (jnp.float32, 8, 1, 128, 16, dict(decode=True)),            # GQA 8, decode tiling on a mixed batch
    (jnp.float32, 8, 2, 64, 16, dict(num_splits=3, blocks_per_iter=1)),   # split-K on a mixed batch
    (jnp.float32, 4, 2, 64, 16, dict(tile_q=8, blocks_per_iter=2)),
    (jnp.bfloat16, 8, 2, 128, 16, {}),
    (jnp.bfloat16, 6, 2, 64, 32, dict(decode=True, num_splits=2)),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,kw", CASES)
def test_pallas_matches_reference_mixed_batch(dtype, hq, hkv, d, bs, kw):
  rng = np.random.default_rng(hq * 100 + hkv * 10 + bs)
  seqs = list(MIXED)
  rng.shuffle(seqs)
  batch = make_ragged_batch(rng, seqs, num_tokens=40, num_seqs=10, max_blocks=4 if bs == 16 else 2,
                            block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
  _check(batch, dtype, **kw)


def test_pallas_decode_batch_with_padding_and_splits():
  rng = np.random.default_rng(0)
  seqs = [(1, 1), (1, 63), (0, 0), (1, 64), (1, 17), (0, 0)]
  batch = make_ragged_batch(rng, seqs, num_tokens=4, num_seqs=8, max_blocks=4, block_size=16,
                            num_q_heads=8, num_kv_heads=2, head_dim=64)
  for kw in (dict(), dict(num_splits=4, blocks_per_iter=1)):
    _check(batch, jnp.float32, **kw)


def test_pallas_paged_decode_attention_entry_point():
  rng = np.random.default_rng(1)
  b, hq, hkv, d, bs, mb = 6, 8, 2, 64, 16, 4
  ctx = np.array([1, 64, 0, 23, 40, 16], np.int32)   # one padding sequence (context 0) in the middle
  seqs = [(int(c > 0), int(c)) for c in ctx]
  batch = make_ragged_batch(rng, seqs, num_tokens=b, num_seqs=b, max_blocks=mb, block_size=bs,
                            num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
  q = batch.q
  got = paged_decode_attention(q, batch.kv_cache, 0, batch.block_tables, batch.context_lens, scale=0.125,
                               num_splits=2, blocks_per_iter=1)
  # Reference: each sequence's single query is token b (padding sequences have an empty range there).
  qsl = jnp.arange(b + 1, dtype=jnp.int32)
  want = ragged_paged_attention_reference(q, batch.kv_cache, 0, batch.block_tables,
                                          jnp.maximum(batch.context_lens, 0), qsl, scale=0.125)
  want = jnp.where((batch.context_lens > 0)[:, None, None], want, 0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=F32_TOL)
  assert not np.any(np.asarray(got)[2])


def test_pallas_traced_layer_under_scan():
  """`layer` as a traced int32 scalar (the model scans over layers)."""
  rng = np.random.default_rng(2)
  batch = make_ragged_batch(rng, [(3, 20), (1, 5)], num_tokens=8, num_seqs=2, max_blocks=2, block_size=16,
                            num_q_heads=4, num_kv_heads=2, head_dim=64, num_layers=3)
  attn = functools.partial(ragged_paged_attention, scale=0.125)

  @jax.jit
  def run(q, kv, bt, ctx, qsl):
    def body(carry, layer):
      return carry, attn(q, kv, layer, bt, ctx, qsl)
    return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

  got = run(batch.q, batch.kv_cache, batch.block_tables, batch.context_lens, batch.query_start_loc)
  for layer in range(3):
    want = ragged_paged_attention_reference(*batch.args(layer), scale=0.125)
    np.testing.assert_allclose(np.asarray(got[layer]), np.asarray(want), atol=F32_TOL, rtol=F32_TOL)


def test_pallas_tile_metadata_covers_every_token_once():
  qsl = jnp.array([0, 1, 1, 20, 23, 23], jnp.int32)
  ctx = jnp.array([5, 0, 40, 3, 0], jnp.int32)
  t, tile_q = 32, 8
  meta, tok_tile, tok_row, valid = rpa_mod.tile_metadata(qsl, ctx, t, tile_q)
  meta = jax.tree.map(np.asarray, meta)
  seen = set()
  for tok in range(t):
    if not valid[tok]:
      assert tok >= 23
      continue
    i, r = int(tok_tile[tok]), int(tok_row[tok])
    assert (i, r) not in seen
    seen.add((i, r))
    assert meta.tok_start[i] + r == tok and r < meta.num_q[i]
  assert len(seen) == 23
  assert sum(meta.num_q) == 23
  # Position of the first query of sequence 2's second tile: 40 - 19 + 8.
  i = int(tok_tile[9])
  assert meta.seq[i] == 2 and meta.pos_start[i] == 40 - 19 + 8


# Hypothesis: random batch compositions at fixed shapes (one compilation per dtype).
H_T, H_S, H_MB, H_BS = 24, 5, 5, 16


@st.composite
def _compositions(draw):
  seqs, budget = [], H_T
  for _ in range(draw(st.integers(1, H_S))):
    kind = draw(st.sampled_from(["decode", "chunk", "pad"]))
    if kind == "pad" or budget == 0:
      seqs.append((0, 0))
      continue
    ctx = draw(st.integers(1, H_MB * H_BS))
    q_len = 1 if kind == "decode" else draw(st.integers(1, min(ctx, budget)))
    budget -= q_len
    seqs.append((q_len, ctx))
  return seqs


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(seqs=_compositions(), seed=st.integers(0, 2**16),
                  splits=st.sampled_from([1, 2]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_pallas_hypothesis_random_compositions(seqs, seed, splits, dtype):
  rng = np.random.default_rng(seed)
  batch = make_ragged_batch(rng, seqs, num_tokens=H_T, num_seqs=H_S, max_blocks=H_MB, block_size=H_BS,
                            num_q_heads=4, num_kv_heads=2, head_dim=64, num_blocks=H_S * H_MB + 3, dtype=dtype)
  _check(batch, dtype, num_splits=splits, tile_q=8)


def test_pallas_matches_jax_paged_attention_decode():
  """Numerical cross-check with JAX's own GPU paged_attention (interpret mode on CPU)."""
  from jax.experimental.pallas.ops.gpu import paged_attention as pa
  rng = np.random.default_rng(3)
  b, hq, hkv, d, bs, mb = 4, 8, 2, 64, 16, 4
  ctx = [1, 17, 64, 40]
  batch = make_ragged_batch(rng, [(1, c) for c in ctx], num_tokens=b, num_seqs=b, max_blocks=mb,
                            block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
  layer = 1
  k_pages, v_pages = to_jax_paged_layout(batch.kv_cache, layer)
  interpret = rpa_mod.default_interpret()
  # JAX's kernel applies no soft-max scale: pre-scale q.
  want = pa.paged_attention(batch.q * d ** -0.5, k_pages, v_pages, batch.block_tables, batch.context_lens,
                            block_h=16, pages_per_compute_block=2, k_splits=2, interpret=interpret)
  got = paged_decode_attention(batch.q, batch.kv_cache, layer, batch.block_tables, batch.context_lens,
                               scale=d ** -0.5, interpret=interpret)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,bs,kw", [
    (8, 2, 128, 16, dict()),                               # prefill tiling
    (32, 8, 128, 16, dict(decode=True, num_splits=4)),     # Llama-3-8B-like decode, split-K
    (9, 3, 64, 32, dict(decode=True)),                     # SmolLM2-like heads (group 3), block 32
])
def test_pallas_cuda_lowering_on_cpu(dtype, hq, hkv, d, bs, kw):
  """The Triton lowering for CUDA succeeds without a GPU (catches GPU lowering errors in CI)."""
  t, s, mb, nb, layers = 32, 8, 8, 40, 2
  sds = jax.ShapeDtypeStruct
  args = (sds((t, hq, d), dtype), sds((nb, layers, 2, bs, hkv, d), dtype), sds((), jnp.int32),
          sds((s, mb), jnp.int32), sds((s,), jnp.int32), sds((s + 1,), jnp.int32))
  f = functools.partial(ragged_paged_attention, scale=d ** -0.5, interpret=False, **kw)
  lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "triton" in text


def test_pallas_f32_queries_over_bf16_cache():
  rng = np.random.default_rng(4)
  batch = make_ragged_batch(rng, [(4, 20), (1, 9)], num_tokens=8, num_seqs=2, max_blocks=2, block_size=16,
                            num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  batch.q = batch.q.astype(jnp.float32)
  got = _check(batch, jnp.bfloat16)
  assert got.dtype == jnp.float32


def test_pallas_auto_config_heuristics():
  common = dict(num_q_heads=32, num_kv_heads=8, block_size=16)
  # Decode on GPU (compiled): 16-row tiles, split-K to fill the SMs, >= 4 KV steps per split.
  cfg = rpa_mod.auto_config(num_tokens=32, num_seqs=32, max_blocks=128, decode=True, interpret=False, **common)
  assert (cfg.tile_q, cfg.group_p, cfg.rows) == (4, 4, 16)
  assert cfg.blocks_per_iter * 16 == 64 and cfg.num_splits > 1
  assert cfg.num_splits * 4 <= -(-128 // cfg.blocks_per_iter)
  # Short contexts do not split below 4 steps; interpret mode never splits by default.
  assert rpa_mod.auto_config(num_tokens=32, num_seqs=32, max_blocks=4, decode=True, interpret=False,
                             **common).num_splits == 1
  assert rpa_mod.auto_config(num_tokens=32, num_seqs=32, max_blocks=128, decode=True, interpret=True,
                             **common).num_splits == 1
  # Prefill: 64-row tiles; f32 caches take half the keys per step.
  cfg = rpa_mod.auto_config(num_tokens=512, num_seqs=4, max_blocks=128, decode=False, interpret=False,
                            itemsize=4, **common)
  assert cfg.rows == 64 and cfg.blocks_per_iter * 16 == 32
  # Group 3 pads to 4; MQA-like group 32 keeps >= 16 rows.
  assert rpa_mod.auto_config(num_tokens=8, num_seqs=8, max_blocks=4, num_q_heads=9, num_kv_heads=3, block_size=32,
                             decode=True, interpret=True).rows == 16
  assert rpa_mod.auto_config(num_tokens=8, num_seqs=8, max_blocks=4, num_q_heads=32, num_kv_heads=1,
                             block_size=16, decode=True, interpret=True).rows == 32


def test_pallas_compiled_config_validation():
  rng = np.random.default_rng(5)
  batch = make_ragged_batch(rng, [(2, 5)], num_tokens=4, num_seqs=1, max_blocks=1, block_size=16,
                            num_q_heads=2, num_kv_heads=2, head_dim=64)
  with pytest.raises(ValueError, match="power of two"):   # 3 rows cannot feed a Triton dot
    ragged_paged_attention(*batch.args(0), scale=0.1, interpret=False, tile_q=3)
  with pytest.raises(ValueError, match="not a multiple"):
    ragged_paged_attention(batch.q[:, :1], batch.kv_cache, 0, batch.block_tables, batch.context_lens,
                           batch.query_start_loc, scale=0.1)
