"""Tiny random HF Llama / Qwen2 (transformers, fp32) vs the paged JAX forward: score, decode, ragged batches."""
import jax
import numpy as np
import pytest

from superinfer_jax.model import build_batch, forward, init_kv_cache, load_model, score, step
from superinfer_jax.model.batch import bucket
from support.tiny_models import save_tiny_hf_model, torch_logits

TOL = 1e-4
BS = 8  # block size: prompts below cross several block boundaries


@pytest.fixture(scope="module", params=[
    ("llama", False, None),         # untied, single safetensors file
    ("qwen2", True, None),          # q/k/v bias, tied embeddings
    ("llama", True, "40KB"),        # tied, sharded save with an index file
], ids=["llama-untied", "qwen2-tied", "llama-tied-sharded"])
def tiny(request, tmp_path_factory):
  family, tied, shard = request.param
  path = str(tmp_path_factory.mktemp(f"{family}_{tied}"))
  model = save_tiny_hf_model(path, family, tied=tied, max_shard_size=shard)
  cfg, params = load_model(path)
  assert cfg.family == family and cfg.tie_word_embeddings == tied
  return model, cfg, params, path


@pytest.mark.parametrize("length,chunk", [(1, None), (13, 5), (37, 16), (37, 37)])
def test_score_matches_transformers(tiny, length, chunk):
  model, cfg, params, _ = tiny
  ids = np.random.RandomState(length).randint(0, cfg.vocab_size, size=length)
  got = score(params, cfg, ids, chunk_size=chunk, block_size=BS)
  assert got.shape == (length, cfg.vocab_size) and got.dtype == np.float32
  ref = torch_logits(model, ids)
  assert np.abs(got - ref).max() < TOL


def test_token_by_token_decode_equals_score(tiny):
  _, cfg, params, _ = tiny
  ids = np.random.RandomState(1).randint(0, cfg.vocab_size, size=21)
  full = score(params, cfg, ids, block_size=BS)
  cache = init_kv_cache(cfg, num_blocks=8, block_size=BS)
  table = [5, 2, 7]                                  # non-contiguous, out-of-order blocks
  rows = []
  for i, tok in enumerate(ids):
    batch, n = build_batch([([int(tok)], i, table)], BS)
    logits, cache = step(params, cache, batch, cfg, "reference")
    rows.append(np.asarray(logits[:n])[0])
  np.testing.assert_allclose(np.stack(rows), full, atol=1e-5, rtol=0)


def test_bfloat16_load_and_score(tiny):
  model, cfg, _, path = tiny
  cfg16, params16 = load_model(path, dtype="bfloat16")
  assert cfg16 == cfg
  assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(params16))
  ids = np.random.RandomState(3).randint(0, cfg.vocab_size, size=11)
  ref = torch_logits(model, ids)
  got = score(params16, cfg, ids, block_size=BS)
  assert got.dtype == np.float32
  err = np.abs(got - ref).max()
  assert TOL < err < 0.05 * max(1.0, np.abs(ref).max())   # bf16 really ran, and stayed close


def test_ragged_mixed_batches_match_score_and_compile_boundedly(tmp_path):
  """Several sequences in one step (prefill chunks + decode tokens mixed, paged non-contiguously)."""
  save_tiny_hf_model(str(tmp_path), "llama", seed=3)
  cfg, params = load_model(str(tmp_path))
  rng = np.random.RandomState(7)
  prompts = [rng.randint(0, cfg.vocab_size, size=n).tolist() for n in (3, 19, 9, 30)]
  decode_steps, chunk = 4, 8
  free = list(rng.permutation(np.arange(1, 32)))
  tables = [[int(free.pop()) for _ in range(6)] for _ in prompts]
  cache = init_kv_cache(cfg, num_blocks=32, block_size=BS)
  traces = []

  def counted(params, kv_cache, batch, cfg, attention):
    traces.append(jax.tree.map(np.shape, batch))
    return forward(params, kv_cache, batch, cfg, attention)

  counted_step = jax.jit(counted, static_argnums=(3, 4), donate_argnums=1)
  seqs = [list(p) for p in prompts]
  done = [0] * len(prompts)                  # tokens already in the cache
  last_rows = {i: [] for i in range(len(prompts))}
  shapes = set()
  num_steps = 0
  while any(d < len(p) + decode_steps for d, p in zip(done, prompts)):
    active, batch_seqs = [], []
    for i, s in enumerate(seqs):
      if done[i] >= len(prompts[i]) + decode_steps:
        continue
      if done[i] == len(s):                   # needs its next token sampled from the last logits
        continue
      new = s[done[i]:done[i] + chunk]
      active.append((i, len(new)))
      batch_seqs.append((new, done[i], tables[i]))
    batch, rows = build_batch(batch_seqs, BS, token_floor=8, seq_floor=4, blocks_floor=4, rows_floor=4)
    shapes.add((batch.token_ids.shape[0], batch.block_tables.shape, batch.logits_indices.shape[0]))
    num_steps += 1
    logits, cache = counted_step(params, cache, batch, cfg, "reference")
    logits = np.asarray(logits[:rows])
    for r, (i, n) in enumerate(active):
      done[i] += n
      if done[i] >= len(prompts[i]):          # prompt fully in: this row predicts the next token
        last_rows[i].append((done[i] - 1, logits[r]))
        if len(seqs[i]) < len(prompts[i]) + decode_steps:
          seqs[i].append(int(logits[r].argmax()))
  for i, rows_i in last_rows.items():
    full = score(params, cfg, seqs[i], block_size=BS)
    assert len(rows_i) == decode_steps + 1
    for pos, row in rows_i:
      assert np.abs(row - full[pos]).max() < TOL, (i, pos)
  # One compilation per distinct bucketed shape: T in {8, 16, 32} x MB in {4, 8}; S and R fixed by floors.
  assert len(traces) == len(shapes) <= 6
  assert num_steps >= 2 * len(shapes)
  assert all(bucket(s[0]) == s[0] for s in shapes)
