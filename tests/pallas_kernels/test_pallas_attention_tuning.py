"""Tuning table of the ragged paged attention kernel: loading, keys, selection precedence, and interpret-mode
correctness of every block geometry the repository's table holds (a new entry is tested automatically)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_tuning as tuning
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.attention_traffic import traffic
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.testing import make_ragged_batch, tolerance

F32_TOL = tolerance(jnp.float32)
KEY_ARGS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16, decode=True)


def _entry(card="nvidia-h200", context_bucket=2048, batch_bucket=32, mode="decode", **config):
  key = dict(card=card, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16,
             mode=mode, context_bucket=context_bucket, batch_bucket=batch_bucket)
  return {"key": key, "config": config or dict(blocks_per_iter=4, num_splits=2), "meta": {"ms": 1.0}}


def _write(path, entries):
  path.write_text(json.dumps({"version": 1, "entries": entries}))
  return str(path)


def test_repository_table_loads_and_every_entry_is_well_formed():
  table = tuning.load_table()
  assert table["version"] == 1
  for e in table["entries"]:
    assert e["key"]["card"] == tuning.normalize_card(e["key"]["card"])
    assert e["key"]["context_bucket"] == tuning.pow2_bucket(e["key"]["context_bucket"])
    assert "command" in e["meta"] and e["meta"]["ms"] > 0


def test_bad_entry_is_rejected(tmp_path):
  bad = _entry(blocks_per_iter=4, block_m=64)
  with pytest.raises(ValueError, match="unknown tunables"):
    tuning.load_table(_write(tmp_path / "t.json", [bad]))


def test_card_normalisation_and_buckets():
  assert tuning.normalize_card("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
  assert tuning.normalize_card(" NVIDIA  H200 ") == "nvidia-h200"
  assert [tuning.pow2_bucket(n) for n in (0, 1, 3, 2048, 2049)] == [1, 1, 4, 2048, 4096]
  key = tuning.make_key(device_kind="NVIDIA H200", max_blocks=129, num_seqs=33, **KEY_ARGS)
  assert key["card"] == "nvidia-h200" and key["context_bucket"] == 4096 and key["batch_bucket"] == 64


def test_select_exact_nearest_and_fallbacks(tmp_path):
  path = _write(tmp_path / "t.json", [_entry(context_bucket=2048, blocks_per_iter=2),
                                      _entry(context_bucket=8192, blocks_per_iter=8)])
  key = tuning.make_key(device_kind="NVIDIA H200", max_blocks=128, num_seqs=32, **KEY_ARGS)
  exact = tuning.select(key, path)
  assert exact.reason == "exact" and exact.config == {"blocks_per_iter": 2}
  far = tuning.select(dict(key, context_bucket=16384), path)
  assert far.reason == "nearest" and far.config == {"blocks_per_iter": 8}
  assert tuning.select(dict(key, card="nvidia-h100-80gb-hbm3"), path).config == {}
  assert "no entry for card" in tuning.select(dict(key, card="x"), path).reason
  assert "head config" in tuning.select(dict(key, num_kv_heads=4), path).reason
  assert "empty or absent" in tuning.select(key, str(tmp_path / "missing.json")).reason


def test_write_entry_replaces_the_same_key(tmp_path):
  path = str(tmp_path / "t.json")
  e = _entry()
  tuning.write_entry(e["key"], {"blocks_per_iter": 2}, {"ms": 2.0}, path)
  tuning.write_entry(e["key"], {"blocks_per_iter": 4}, {"ms": 1.0}, path)
  entries = tuning.load_table(path)["entries"]
  assert len(entries) == 1 and entries[0]["config"] == {"blocks_per_iter": 4}


def test_select_config_precedence_explicit_over_table_over_auto(tmp_path):
  path = _write(tmp_path / "t.json", [_entry(blocks_per_iter=2, num_splits=4, num_warps=8)])
  args = dict(num_tokens=32, num_seqs=32, max_blocks=128, num_q_heads=32, num_kv_heads=8, head_dim=128,
              block_size=16, kv_dtype=jnp.bfloat16, decode=True, interpret=False, table_path=path)
  auto, why = rpa.select_config(device_kind="cpu", **args)
  assert why.reason.startswith("default") and auto.blocks_per_iter == 4   # auto_config: 64 keys per step
  cfg, why = rpa.select_config(device_kind="NVIDIA H200", **args)
  assert why.reason == "exact" and (cfg.blocks_per_iter, cfg.num_splits, cfg.num_warps) == (2, 4, 8)
  cfg, why = rpa.select_config(device_kind="NVIDIA H200", overrides=dict(num_splits=1, num_warps=None), **args)
  assert (cfg.blocks_per_iter, cfg.num_splits, cfg.num_warps) == (2, 1, 8) and "explicit" in why.reason


def test_kernel_picks_the_table_entry_at_trace_time(tmp_path, monkeypatch):
  """A table entry for this (CPU) device changes the launched kernel; results stay the reference's."""
  rng = np.random.default_rng(5)
  seqs = [(1, 33), (1, 17), (1, 48)]
  batch = make_ragged_batch(rng, seqs, num_tokens=3, num_seqs=3, max_blocks=4, block_size=16, num_q_heads=4,
                            num_kv_heads=2, head_dim=16)
  key = tuning.make_key(device_kind=jax.devices()[0].device_kind, num_q_heads=4, num_kv_heads=2, head_dim=16,
                        dtype="float32", block_size=16, decode=True, max_blocks=4, num_seqs=3)
  path = str(tmp_path / "t.json")
  tuning.write_entry(key, {"blocks_per_iter": 1, "num_splits": 3}, {"ms": 1.0}, path)
  monkeypatch.setenv(tuning.TABLE_ENV, path)
  args = (batch.q, batch.kv_cache, 0, batch.block_tables, batch.context_lens)
  jaxpr = str(jax.make_jaxpr(lambda *a: rpa.paged_decode_attention(*a, scale=0.25))(*args))
  assert "_p3" in jaxpr                                          # the entry's split-K factor was launched
  got = rpa.paged_decode_attention(*args, scale=0.25)
  want = ragged_paged_attention_reference(*batch.args(0), scale=0.25)   # no padding: q[b] = sequence b
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=F32_TOL)
  overridden = str(jax.make_jaxpr(lambda *a: rpa.paged_decode_attention(*a, scale=0.25, num_splits=1))(*args))
  assert "_p3" not in overridden and "_p1" in overridden


# Block geometries under test: the kernel's default and every entry of the repository's table.
GEOMETRIES = [("default", "decode", 16, {}), ("default", "mixed", 16, {})] + [
    (f"{e['key']['card']}/{e['key']['mode']}/ctx{e['key']['context_bucket']}/b{e['key']['batch_bucket']}",
     e["key"]["mode"], e["key"]["block_size"],
     {k: v for k, v in e["config"].items() if k in ("tile_q", "blocks_per_iter", "num_splits")})
    for e in tuning.load_table()["entries"]]


@pytest.mark.parametrize("name,mode,block_size,geometry", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_table_geometry_matches_reference(name, mode, block_size, geometry, group):
  """Odd lengths, partial last blocks and steps, a padding sequence, GQA 1/4/8, with and without a window."""
  del name
  bs = block_size
  hkv, d = 2, 16
  hq = hkv * group
  if mode == "decode":
    ctx = [1, 2 * bs + 1, 0, 3 * bs - 1]
    seqs = [(int(c > 0), c) for c in ctx]
    num_tokens = len(seqs)
  else:
    seqs = [(1, 1), (bs + 3, 2 * bs + 5), (0, 0), (1, 3 * bs - 1), (7, 7)]
    num_tokens = 40
  rng = np.random.default_rng(group * 10 + bs)
  batch = make_ragged_batch(rng, seqs, num_tokens=num_tokens, num_seqs=len(seqs), max_blocks=3, block_size=bs,
                            num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
  for window in (None, bs + 1):
    if mode == "decode":   # q[b] is sequence b's query (the reference sees one query per sequence)
      qsl = jnp.arange(len(seqs) + 1, dtype=jnp.int32)
      want = ragged_paged_attention_reference(batch.q, batch.kv_cache, 1, batch.block_tables,
                                              batch.context_lens, qsl, scale=0.25, window=window)
      want = jnp.where((batch.context_lens > 0)[:, None, None], want, 0)
      got = rpa.paged_decode_attention(batch.q, batch.kv_cache, 1, batch.block_tables, batch.context_lens,
                                       scale=0.25, window=window, **geometry)
    else:
      want = ragged_paged_attention_reference(*batch.args(1), scale=0.25, window=window)
      got = rpa.ragged_paged_attention(*batch.args(1), scale=0.25, window=window, **geometry)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=F32_TOL)


def _cfg(**kw):
  base = dict(tile_q=4, group_p=4, blocks_per_iter=4, num_splits=1, num_warps=4, num_stages=2)
  return rpa.KernelConfig(**dict(base, **kw))


def test_traffic_reads_each_kv_byte_once_per_kv_head_group():
  """Decode: KV read once per sequence and kv head whatever the query heads; partial steps round up."""
  common = dict(num_kv_heads=8, head_dim=128, block_size=16, itemsize=2, decode_layout=True)
  seqs = [(1, 2048)] * 32
  t4 = traffic(seqs, cfg=_cfg(), num_q_heads=32, **common)
  t1 = traffic(seqs, cfg=_cfg(tile_q=16, group_p=1), num_q_heads=8, **common)
  assert t4["required_kv"] == 32 * 2048 * 8 * 128 * 2 * 2 == t4["read_kv"] == t1["read_kv"]
  assert t4["programs"] == 32 * 8 and t4["real_rows"] == 4
  odd = traffic([(1, 2049)], cfg=_cfg(), num_q_heads=32, **common)
  assert odd["read_kv"] == (2048 + 64) * 8 * 128 * 2 * 2          # one more whole 64-key step
  split = traffic(seqs, cfg=_cfg(num_splits=4), num_q_heads=32, **common)
  assert split["read_kv"] == t4["read_kv"] and split["programs"] == 4 * t4["programs"]
  assert split["write_out"] > t4["write_out"]                     # f32 partials and their merge


def test_traffic_mixed_prefill_tiles_reread_the_causal_prefix():
  common = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, itemsize=2, decode_layout=False)
  one = traffic([(512, 2048)], cfg=_cfg(tile_q=512 // 4 * 4, group_p=4), **common)
  many = traffic([(512, 2048)], cfg=_cfg(tile_q=16, group_p=4), **common)
  assert one["kv_reread_factor"] == 1.0
  assert many["active_tiles"] == 32 and many["kv_reread_factor"] > 20
