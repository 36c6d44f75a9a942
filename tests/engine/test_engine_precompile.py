"""precompile_steps / precompile_rotation: after them a rotating serving run compiles nothing new, and
the outputs are those of an engine that never precompiled (the dummy batches only touch block 0)."""
from superinfer_jax.engine.config import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from superinfer_jax.rotation import kernels
from test_engine_utils import random_params, tiny_config

BS = 4
MAX_POS = 96   # a config no other test uses: its step compilations start from zero


def _engine(model):
  cfg, params = model
  return LLMEngine((cfg, params, None), EngineConfig.create(
      num_device_blocks=12, num_host_blocks=64, block_size=BS, policy="rotasched", ttft_slo=1e-3,
      tbt_slo=1e-3, max_num_batched_tokens=32, max_num_seqs=4, token_bucket_floor=8, seq_bucket_floor=4,
      blocks_bucket_floor=MAX_POS // BS, rotation_max_bucket=8))


def _prompts():
  return [[3 + (7 * i + j) % 100 for j in range(5 + 3 * i)] for i in range(6)]


def test_precompile_then_rotating_run_compiles_nothing():
  cfg = tiny_config(max_pos=MAX_POS, eos=(2,))
  model = (cfg, random_params(cfg, seed=3))
  params = SamplingParams(max_tokens=12, ignore_eos=True)
  eng = _engine(model)
  before = eng.num_compiled_shapes()
  n_steps = eng.precompile_steps()
  assert n_steps - before >= 3            # token buckets 8, 16, 32 at the sequence / block floors
  eng.precompile_rotation()
  rot = kernels.compiled_variants()
  out = eng.generate(_prompts(), params)
  assert eng.stats.rotations_out > 0 and eng.stats.rotations_in > 0
  assert eng.num_compiled_shapes() == n_steps     # nothing new for the model step
  assert kernels.compiled_variants() == rot       # nothing new for the rotation kernels
  eng.check_invariants()
  plain = _engine(model).generate(_prompts(), params)   # never precompiled (shares the jit caches)
  assert [o.token_ids for o in out] == [o.token_ids for o in plain]
