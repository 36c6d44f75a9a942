"""Tensor parallelism on a CPU mesh: TP=2/4 logits equal TP=1's, weights and KV really sharded, host copies of
a rotated block hold every shard's slice, generate.py at TP=2 under rotation gives TP=1's tokens, and the
sharded engine step lowers for a 2-device CUDA mesh.

JAX fixes its CPU device count when it starts, and this pytest worker's JAX already runs on one device, so
the multi-device work runs in a child process (``python tests/parallel/test_tensor_parallel.py CHILD OUT_DIR`` with
``JAX_NUM_CPU_DEVICES=4``) that only computes and saves raw results (logits, shard shapes, block contents);
every assertion is made here, against values computed independently (TP=1 logits, shapes from the config).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_DEVICES = 4
# (family, HF overrides): Llama 4 query / 2 KV heads (TP=2 splits KV heads, TP=4 replicates each twice);
# Qwen2 12 / 3 (3 is a multiple of neither 2 nor 4: stored KV heads lcm(3, tp) = 6 and 12).
MODELS = {
    "llama": ("llama", dict()),
    "qwen2": ("qwen2", dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=3)),
    # The other families: Mixtral MoE (4 experts, top-2: experts split by F inside each expert, router
    # replicated) and Qwen2 with a 12-token window on layer 1 (the window reaches every shard's attention).
    "mixtral": ("mixtral", dict()),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
}
TPS = (1, 2, 4)


def child_env(num_devices: int) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(num_devices),
             PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))  # the library and tests/support
  env.pop("XLA_FLAGS", None)
  return env


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("tp_child"))
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "CHILD", out], env=child_env(NUM_DEVICES),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
  with open(os.path.join(out, "facts.json")) as f:
    facts = json.load(f)
  arrays = dict(np.load(os.path.join(out, "arrays.npz")))
  return facts, arrays


# ---------------------------------------------------------------------------------------------- asserts

@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_score_logits_match_tp1(child_results, model, tp):
  _, arrays = child_results
  want = arrays[f"score/{model}/tp1"]
  got = arrays[f"score/{model}/tp{tp}"]
  assert got.shape == want.shape and want.shape[0] == 40
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  # The logits are not degenerate: a wrong head mapping would move them by far more than the tolerance.
  assert np.abs(want).max() > 1e-2


def test_tp_pallas_backend_per_shard_matches(child_results):
  _, arrays = child_results
  got = arrays["score/llama/tp2_pallas"]
  assert got.shape[0] == 20
  np.testing.assert_allclose(got, arrays["score/llama/tp1"][:20], atol=1e-4, rtol=0)


def test_tp_stored_kv_heads(child_results):
  facts, _ = child_results
  assert facts["stored_kv_heads"] == {"llama/tp1": 2, "llama/tp2": 2, "llama/tp4": 4,
                                      "qwen2/tp1": 3, "qwen2/tp2": 6, "qwen2/tp4": 12,
                                      "mixtral/tp1": 2, "mixtral/tp2": 2, "mixtral/tp4": 4,
                                      "qwen2_window/tp1": 2, "qwen2_window/tp2": 2, "qwen2_window/tp4": 4}


@pytest.mark.parametrize("key", ["llama/tp2", "llama/tp4", "qwen2/tp2", "qwen2/tp4", "mixtral/tp2"])
def test_weights_and_kv_are_sharded_one_over_tp_per_device(child_results, key):
  facts, _ = child_results
  tp = int(key.split("tp")[1])
  rec = facts["placement"][key]
  sharded = set(rec["sharded"])
  # Every Megatron leaf of these configs is divisible by tp: all of them are sharded, norms are not.
  expected_sharded = {"embed", "layers/wq", "layers/wk", "layers/wv", "layers/wo", "layers/w_gate",
                      "layers/w_up", "layers/w_down"}
  expected_sharded |= {"lm_head"} if "lm_head" in rec["leaves"] else set()
  expected_sharded |= {"layers/bq", "layers/bk", "layers/bv"} if key.startswith("qwen2") else set()
  assert sharded == expected_sharded
  for path, leaf in rec["leaves"].items():
    total = int(np.prod(leaf["shape"])) * leaf["itemsize"]
    assert leaf["num_shards"] == tp and len(set(leaf["devices"])) == tp, path
    for nbytes in leaf["device_bytes"]:
      assert nbytes == (total // tp if path in expected_sharded else total), (path, nbytes, total)
  # Sharded weight bytes per device = 1/tp of the sharded weights.
  sharded_total = sum(int(np.prod(rec["leaves"][p]["shape"])) * rec["leaves"][p]["itemsize"] for p in sharded)
  per_dev = [sum(rec["leaves"][p]["device_bytes"][i] for p in sharded) for i in range(tp)]
  assert per_dev == [sharded_total // tp] * tp
  # KV cache: [NB, L, 2, BS, Hkv', D], every device 1/tp of it, split on the head axis.
  kv = rec["kv_cache"]
  assert kv["num_shards"] == tp and len(set(kv["devices"])) == tp
  total = int(np.prod(kv["shape"])) * kv["itemsize"]
  assert kv["device_bytes"] == [total // tp] * tp
  assert all(s == kv["shape"][:4] + [kv["shape"][4] // tp, kv["shape"][5]] for s in kv["shard_shapes"])
  # Memory sizing per device divides free device memory by this device's slice of a block; the host pool
  # of this (only) process holds every slice.
  assert rec["device_block_bytes"] * kv["shape"][0] == kv["device_bytes"][0]
  assert rec["host_block_bytes"] * kv["shape"][0] == total


def test_moe_experts_split_inside_each_expert(child_results):
  """Mixtral at TP=2: every device holds every expert, half of each expert's F (columns of w_gate / w_up,
  rows of w_down); the router is whole on every device."""
  facts, _ = child_results
  leaves = facts["placement"]["mixtral/tp2"]["leaves"]
  L, E, H, F = leaves["layers/w_gate"]["shape"]
  assert E == 4 and L == 2
  assert leaves["layers/w_gate"]["shard_shapes"] == [[L, E, H, F // 2]] * 2
  assert leaves["layers/w_up"]["shard_shapes"] == [[L, E, H, F // 2]] * 2
  assert leaves["layers/w_down"]["shard_shapes"] == [[L, E, F // 2, H]] * 2
  assert leaves["layers/router"]["shard_shapes"] == [[L, H, E]] * 2


def test_rotated_block_host_copy_holds_every_shard(child_results):
  facts, arrays = child_results
  rot = facts["rotation"]
  tp = rot["tp"]
  assert rot["host_memory_kind"] in ("pinned_host", "unpinned_host")
  assert rot["num_shards"] == tp and len(set(rot["shard_devices"])) == tp
  assert rot["shard_memory_kinds"] == [rot["host_memory_kind"]] * tp
  block = arrays["rotation/device_block"]                   # [L, 2, BS, Hkv', D] as written on device
  H = block.shape[3]
  for s in range(tp):
    # Shard s in host memory is exactly device s's heads of the block.
    np.testing.assert_array_equal(arrays[f"rotation/host_shard{s}"], block[:, :, :, s * H // tp:(s + 1) * H // tp])
  np.testing.assert_array_equal(arrays["rotation/host_block"], block)
  np.testing.assert_array_equal(arrays["rotation/swapped_in"], block)      # H2D back into another device block
  # Byte counters count every shard: a whole block of the TP model.
  assert rot["bytes_out"] == rot["block_bytes"] == block.nbytes
  assert rot["staging_is_block_sharding"]


def test_sharded_step_lowers_for_a_two_device_cuda_mesh(child_results):
  """The engine's jitted step on a 2-device mesh, Pallas attention compiled (not interpreted), lowered for
  CUDA on CPU. Lowering needs no GPU; compiling (and so the SPMD partitioning into all-reduces) does, so
  the check is on the lowered module: Triton kernel inside one shard_map region, the cache argument
  sharded on its KV-head axis over a 2-device "tp" mesh."""
  facts, _ = child_results
  low = facts["cuda_lowering"]
  assert low["has_triton"]
  assert low["manual_regions"] >= 1
  assert low["mesh_tp2"]
  assert low["cache_arg_sharded_on_heads"]


def test_generate_script_tp2_under_rotation_matches_tp1(tiny_model_dir):
  """generate.py --tensor_parallel_size=2 (two CPU devices) gives TP=1's greedy tokens under rotation."""
  rng = np.random.default_rng(0)
  prompts = [",".join(map(str, rng.integers(3, 128, n))) for n in (21, 34, 27, 40, 18, 30)]
  outs, stats = {}, {}
  for tp in (1, 2):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), f"--model={tiny_model_dir}", "--json",
           "--stats", "--max_tokens=24", "--ignore_eos", "--policy=rotasched", "--num_device_blocks=12",
           "--num_host_blocks=64", "--attention=reference", f"--tensor_parallel_size={tp}"]
    cmd += [f"--prompt_token_ids={p}" for p in prompts]
    proc = subprocess.run(cmd, env=child_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    outs[tp] = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    stats[tp] = json.loads(proc.stderr.strip().splitlines()[-1])
  assert len(outs[1]) == len(prompts) and all(len(r["token_ids"]) == 24 for r in outs[1])
  assert [r["token_ids"] for r in outs[2]] == [r["token_ids"] for r in outs[1]]
  for tp in (1, 2):   # under rotation pressure: KV went to host memory and back
    assert stats[tp]["rotations_out"] > 0 and stats[tp]["blocks_in"] > 0, stats[tp]


def test_run_experiment_records_tp_degree(tiny_model_dir, tmp_path):
  """results.jsonl rows of a TP=2 sweep say so (and the sweep completes on the 2-device mesh)."""
  out = str(tmp_path / "run")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "run_experiment.py"), f"--model={tiny_model_dir}",
         "--dataset=synthetic", "--num_requests=4", "--rps=40", "--policies=rotasched",
         "--synthetic_prompt_len=uniform:20,40", "--synthetic_output_len=uniform:8,12",
         "--num_device_blocks=10", "--num_host_blocks=64", "--block_size=8", "--attention=reference",
         "--ttft_slo=1", "--tbt_slo=1", "--nowarmup", "--tensor_parallel_size=2", f"--output_dir={out}",
         "--noprogress"]
  proc = subprocess.run(cmd, env=child_env(2), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-6000:]
  with open(os.path.join(out, "results.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert len(rows) == 1 and rows[0]["tensor_parallel_size"] == 2
  assert rows[0]["num_finished"] == rows[0]["num_requests"] == 4


def test_make_mesh_rejects_bad_sizes():
  from superinfer_jax.parallel.mesh import make_mesh
  with pytest.raises(ValueError, match=">= 1"):
    make_mesh(0)
  with pytest.raises(ValueError, match="JAX_NUM_CPU_DEVICES"):
    make_mesh(64)


def test_stored_kv_heads_rule():
  from superinfer_jax.parallel.sharding import stored_kv_heads
  assert stored_kv_heads(32, 8, 4) == 8          # divides: no replication
  assert stored_kv_heads(32, 8, 16) == 16        # fewer KV heads than devices: each stored twice
  assert stored_kv_heads(12, 3, 4) == 12         # neither divides: lcm
  with pytest.raises(ValueError, match="query heads"):
    stored_kv_heads(9, 3, 2)
  with pytest.raises(ValueError, match="whole KV heads"):
    stored_kv_heads(4, 3, 2)                     # lcm(3, 2) = 6 does not divide 4


def test_replicate_kv_heads_keeps_gqa_mapping():
  """Stored KV head j' is original head j' // r, so query head i still reads original head i // G."""
  from superinfer_jax.model.config import ModelConfig
  from superinfer_jax.parallel.sharding import replicate_kv_heads, tp_model_config
  cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=4, intermediate_size=4, num_layers=1,
                    num_heads=12, num_kv_heads=3, head_dim=2, max_position_embeddings=8)
  wk = np.arange(4 * 6, dtype=np.float32).reshape(1, 4, 6)          # [L, H, Hkv*D]: head j = cols 2j, 2j+1
  params = {"embed": np.zeros((8, 4), np.float32), "layers": {"wk": wk, "wv": wk + 100}}
  out = replicate_kv_heads(params, cfg, 4)
  cfg_tp = tp_model_config(cfg, 4)
  assert cfg_tp.num_kv_heads == 12 and out["layers"]["wk"].shape == (1, 4, 24)
  r, G, G_tp = 4, 4, cfg_tp.num_heads // cfg_tp.num_kv_heads
  stored = out["layers"]["wk"].reshape(1, 4, 12, 2)
  orig = wk.reshape(1, 4, 3, 2)
  for i in range(cfg.num_heads):
    np.testing.assert_array_equal(stored[:, :, i // G_tp], orig[:, :, i // G])
  for j in range(12):
    np.testing.assert_array_equal(stored[:, :, j], orig[:, :, j // r])
  np.testing.assert_array_equal(out["layers"]["wv"], out["layers"]["wk"] + 100)
  np.testing.assert_array_equal(out["embed"], params["embed"])


# -------------------------------------------------------------------------------------------- the child

def _placement(arr) -> dict:
  shards = arr.addressable_shards
  return {"shape": list(arr.shape), "itemsize": int(arr.dtype.itemsize), "num_shards": len(shards),
          "devices": [s.device.id for s in shards], "device_bytes": [int(s.data.nbytes) for s in shards],
          "shard_shapes": [list(s.data.shape) for s in shards]}


def _child(out_dir: str) -> None:
  import jax

  from superinfer_jax.model import load_model, score
  from support.tiny_models import save_tiny_hf_model
  from superinfer_jax.parallel import sharding as sh
  from superinfer_jax.parallel.tensor_parallel import make_tensor_parallel
  from superinfer_jax.rotation import DuplexKV

  assert jax.device_count() == NUM_DEVICES, jax.devices()
  arrays, facts = {}, {"stored_kv_heads": {}, "placement": {}}
  ids = np.random.default_rng(0).integers(0, 128, 40)
  tps = {tp: make_tensor_parallel(tp) for tp in TPS}
  for name, (family, overrides) in MODELS.items():
    path = tempfile.mkdtemp()
    save_tiny_hf_model(path, family, **overrides)
    cfg, params = load_model(path)
    for tp in TPS:
      arrays[f"score/{name}/tp{tp}"] = score(params, cfg, ids, attention="reference", chunk_size=16,
                                             tensor_parallel=tps[tp])
      facts["stored_kv_heads"][f"{name}/tp{tp}"] = sh.stored_kv_heads(cfg.num_heads, cfg.num_kv_heads, tp)
      if tp == 1:
        continue
      cfg_tp, placed = tps[tp].prepare(cfg, params)
      cache = tps[tp].init_kv_cache(cfg_tp, 9, 16)
      report = sh.sharding_report(placed, tp)
      leaves = {"/".join(str(k.key) for k in path_): _placement(leaf)
                for path_, leaf in jax.tree_util.tree_flatten_with_path(placed)[0]}
      facts["placement"][f"{name}/tp{tp}"] = {"sharded": report["sharded"], "leaves": leaves,
                                              "kv_cache": _placement(cache),
                                              "device_block_bytes": tps[tp].device_block_bytes(cfg_tp.kv_spec(16)),
                                              "host_block_bytes": tps[tp].host_block_bytes(cfg_tp.kv_spec(16))}
    if name == "llama":
      # Pallas (interpret mode on CPU) per shard, on a 20-token prefix (row i depends on tokens <= i only).
      arrays["score/llama/tp2_pallas"] = score(params, cfg, ids[:20], attention="pallas", chunk_size=16,
                                               tensor_parallel=tps[2])

      # Rotation of one block of a TP=2 cache: D2H to host block 3, then H2D into device block 5.
      tp2 = tps[2]
      cfg_tp = tp2.model_config(cfg)
      spec = cfg_tp.kv_spec(16)
      cache = tp2.init_kv_cache(cfg_tp, 8, 16)
      data = np.random.default_rng(1).standard_normal(spec.shape(8)).astype(np.float32)
      cache = jax.device_put(data, cache.sharding)
      kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
      kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
      dk = DuplexKV(spec, 4, host_memory_kind=kind, sharding=tp2.block_sharding)
      staged = dk.gather(cache, [2])[0]
      cache = dk.issue(cache, swap_out=[(2, 3)])
      dk.wait()
      host = dk._host[3]                   # pylint: disable=protected-access
      shards = sorted(host.addressable_shards, key=lambda s: s.device.id)
      for s, shard in enumerate(shards):
        arrays[f"rotation/host_shard{s}"] = np.asarray(shard.data)
      arrays["rotation/device_block"] = data[2]
      arrays["rotation/host_block"] = dk.read_host_block(3)
      cache = dk.issue(cache, swap_in=[(3, 5)])
      arrays["rotation/swapped_in"] = np.asarray(cache)[5]
      facts["rotation"] = {
          "tp": 2, "host_memory_kind": kind, "num_shards": len(shards),
          "shard_devices": [s.device.id for s in shards],
          "shard_memory_kinds": [s.data.sharding.memory_kind for s in shards],
          "bytes_out": dk.stats.bytes_out, "block_bytes": spec.block_bytes,
          # The device staging copy is already split by heads: the D2H moves each device's slice only.
          "staging_is_block_sharding": staged.sharding.is_equivalent_to(tp2.block_sharding, staged.ndim)}

  facts["cuda_lowering"] = _cuda_lowering(tps[2])
  np.savez(os.path.join(out_dir, "arrays.npz"), **arrays)
  with open(os.path.join(out_dir, "facts.json"), "w") as f:
    json.dump(facts, f)


def _cuda_lowering(tp) -> dict:
  """Lowers the engine's jitted step (``runner._jit_step``) for CUDA over ``tp``'s 2-device mesh."""
  import functools
  import re

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding

  from pallas_kernels.ragged_paged_attention import ragged_paged_attention
  from superinfer_jax.engine import model_runner as engine_lib
  from superinfer_jax.engine import packing
  from superinfer_jax.model.config import ModelConfig
  from superinfer_jax.model.params import param_shapes
  from superinfer_jax.parallel import sharding as sh

  cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=512)
  cfg_tp = tp.model_config(cfg)
  is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
  params = jax.tree_util.tree_map_with_path(
      lambda p, s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(
          tp.mesh, sh.leaf_spec(str(p[-1].key), s, tp.size))), param_shapes(cfg_tp), is_leaf=is_shape)
  T, S, MB, R = 16, 4, 4, 4
  cache = jax.ShapeDtypeStruct(cfg_tp.kv_spec(16, "bfloat16").shape(32), jnp.bfloat16,
                               sharding=NamedSharding(tp.mesh, sh.KV_CACHE_SPEC))
  dims = (T, S, MB, R)
  size = max(stop for _, stop in packing.offsets(dims).values())
  packed = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=tp.replicated)
  prev_tokens = jax.ShapeDtypeStruct((R,), jnp.int32, sharding=tp.replicated)
  attn = tp.attention(functools.partial(ragged_paged_attention, interpret=False))
  leaves, params_def = jax.tree.flatten(params)
  lowered = engine_lib._jit_step.trace(  # pylint: disable=protected-access
      tuple(leaves), cache, packed, prev_tokens, None, dims=dims, mode="greedy", num_logprobs=0, cfg=cfg_tp,
      attention=attn,
      params_def=params_def, logits_sharding=tp.replicated).lower(lowering_platforms=("cuda",))
  txt = lowered.as_text()
  main = next(line for line in txt.splitlines() if "func.func public @main" in line)
  cache_shape = "x".join(map(str, cache.shape))
  at = main.find(f"tensor<{cache_shape}xbf16>")
  cache_arg = main[at:at + 200] if at >= 0 else ""    # the argument's type and its sharding attribute
  return {
      "has_triton": "triton" in txt,
      "manual_regions": txt.count("sdy.manual_computation") + txt.count("SPMDFullToShardShape"),
      "mesh_tp2": bool(re.search(r'"tp"\s*=\s*2', txt)) or "devices=[1,1,1,1,2" in txt,
      "cache_arg_sharded_on_heads": ('[{}, {}, {}, {}, {"tp"}, {}]' in cache_arg
                                     or "devices=[1,1,1,1,2,1]" in cache_arg),
  }


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "CHILD":
  sys.path.insert(0, ROOT)
  _child(sys.argv[2])
