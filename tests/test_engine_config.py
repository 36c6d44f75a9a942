"""EngineConfig validation and the shared absl engine flags (no JAX needed)."""
import pytest
from absl import flags

from superinfer_jax.engine.config import EngineConfig, define_engine_flags, engine_config_from_flags


def _parse(args):
  fv = flags.FlagValues()
  define_engine_flags(fv)
  define_engine_flags(fv)   # idempotent
  fv(["prog"] + args)
  return engine_config_from_flags(fv)


def test_flags_build_config():
  c = _parse(["--num_device_blocks=100", "--num_host_blocks=-1", "--host_gib=2", "--block_size=8",
              "--policy=fcfs_swap", "--alpha=1.5", "--proactive_swap_budget=16", "--nopipeline",
              "--attention=pallas", "--dtype=bfloat16", "--max_model_len=512", "--rotation_mode=merged"])
  assert (c.num_device_blocks, c.num_host_blocks, c.host_gib, c.block_size) == (100, None, 2.0, 8)
  assert (c.policy, c.alpha, c.proactive_swap_budget, c.pipeline) == ("fcfs_swap", 1.5, 16, False)
  assert (c.attention, c.dtype, c.max_model_len, c.rotation_mode) == ("pallas", "bfloat16", 512, "merged")
  d = _parse([])
  assert d == EngineConfig()


def test_flags_reject_unknown_policy():
  with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'.*rotasched"):
    _parse(["--policy=lifo"])


@pytest.mark.parametrize("kw,field", [
    (dict(num_device_blocks=0), "num_device_blocks"), (dict(num_host_blocks=-1), "num_host_blocks"),
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"), (dict(device_memory_fraction=1.5), "fraction"),
    (dict(ttft_slo=0.0), "SLO"), (dict(alpha=float("nan")), "alpha"), (dict(dtype="int8"), "dtype"),
    (dict(rotation_mode="fast"), "rotation mode"), (dict(attention="flash"), "attention"),
])
def test_config_validation(kw, field):
  with pytest.raises(ValueError, match=field):
    EngineConfig(**kw).validate()
