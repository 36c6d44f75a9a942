"""EngineConfig: one config tree, validation, and the absl flags generated from it (no JAX needed)."""
import dataclasses
import subprocess
import sys

import pytest
from absl import flags

from superinfer_jax import configtree
from superinfer_jax.engine.config import EngineConfig, define_engine_flags, engine_config_from_flags
from superinfer_jax.model.attention import attention_backend_names
from superinfer_jax.rotation.config import MODES, RotationConfig
from superinfer_jax.sched.config import SchedulerConfig
from superinfer_jax.sched.policies import POLICIES


def _parse(args):
  fv = flags.FlagValues()
  define_engine_flags(fv)
  define_engine_flags(fv)   # idempotent
  fv(["prog"] + args)
  return engine_config_from_flags(fv), fv


def test_flags_build_config():
  c, _ = _parse(["--num_device_blocks=100", "--num_host_blocks=-1", "--host_gib=2", "--block_size=8",
                 "--policy=fcfs_swap", "--alpha=1.5", "--proactive_swap_budget=16", "--nopipeline", "--nozero_bubble",
                 "--attention=pallas", "--dtype=bfloat16", "--max_model_len=512", "--transfer_mode=merged",
                 "--min_residency=3", "--nowriteback", "--proactive_recompute", "--beta_b=-10"])
  assert (c.num_device_blocks, c.num_host_blocks, c.host_gib, c.block_size) == (100, None, 2.0, 8)
  s = c.scheduler
  assert (s.policy, s.alpha, s.proactive_swap_budget, c.pipeline, c.zero_bubble) == ("fcfs_swap", 1.5, 16, False,
                                                                                   False)
  assert (s.min_residency, s.writeback, s.proactive_recompute, s.beta_b) == (3, False, True, -10.0)
  assert (c.model.attention, c.model.dtype, c.model.max_model_len) == ("pallas", "bfloat16", 512)
  assert c.rotation.transfer_mode == "merged"
  d, _ = _parse([])
  assert d == EngineConfig()


def test_one_name_one_default_one_help_per_setting():
  # Every leaf of the tree is a flag whose default and help come from the field, and no name repeats.
  _, fv = _parse([])
  index = configtree.flat_index(EngineConfig)
  for name, leaf in index.items():
    f = fv[leaf.flag_name]
    default = leaf.field.default if leaf.field.default is not dataclasses.MISSING else None
    expect = leaf.field.metadata.get("none_as") if default is None else default
    assert f.default == expect, name
    assert leaf.field.metadata["help"] in f.help, name
  # The scheduler's defaults are the engine's: there is one SchedulerConfig.
  assert EngineConfig().scheduler == SchedulerConfig()
  assert (SchedulerConfig().max_num_seqs, SchedulerConfig().max_num_batched_tokens) == (64, 512)


def test_choices_come_from_the_owning_packages():
  _, fv = _parse([])
  assert set(fv["policy"].parser.enum_values) == set(POLICIES)
  assert set(fv["transfer_mode"].parser.enum_values) == set(MODES)
  assert set(fv["attention"].parser.enum_values) == set(attention_backend_names())
  assert set(fv["kv_layout"].parser.enum_values) == {"block_first", "layer_first"}


def test_create_and_replace_route_flat_names():
  c = EngineConfig.create(policy="fcfs", num_device_blocks=40, transfer_mode="naive", dtype="bfloat16")
  assert (c.scheduler.policy, c.num_device_blocks, c.rotation.transfer_mode, c.model.dtype) == \
      ("fcfs", 40, "naive", "bfloat16")
  c2 = c.replace(alpha=1.0)
  assert c2.scheduler.alpha == 1.0 and c2.rotation is c.rotation and c.scheduler.alpha == 3.0
  with pytest.raises(TypeError, match="unknown setting"):
    EngineConfig.create(polcy="fcfs")
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.scheduler.alpha = 2.0  # type: ignore[misc]
  assert c.as_flat_dict()["transfer_mode"] == "naive"


def test_flags_reject_unknown_policy():
  with pytest.raises(flags.IllegalFlagValueError, match="rotasched"):
    _parse(["--policy=lifo"])
  with pytest.raises(ValueError, match="unknown value 'lifo'.*rotasched"):
    EngineConfig.create(policy="lifo")


@pytest.mark.parametrize("kw,field", [
    (dict(num_device_blocks=0), "num_device_blocks"), (dict(num_host_blocks=-1), "num_host_blocks"),
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"), (dict(device_memory_fraction=1.5), "fraction"),
    (dict(ttft_slo=0.0), "SLO"), (dict(alpha=float("nan")), "alpha"), (dict(dtype="int8"), "dtype"),
    (dict(transfer_mode="fast"), "transfer_mode"), (dict(attention="flash"), "attention"),
    (dict(min_residency=-1), "min_residency"), (dict(rotation_max_bucket=12), "power of two"),
    (dict(kv_layout="diagonal"), "kv_layout"), (dict(layer_loop="auto"), "layer_loop"),
])
def test_config_validation(kw, field):
  with pytest.raises(ValueError, match=field):
    EngineConfig.create(**kw)


def test_configs_import_no_jax():
  code = ("import sys; sys.modules['jax'] = None\n"
          "from superinfer_jax.engine.config import EngineConfig, define_engine_flags\n"
          "from absl import flags\n"
          "define_engine_flags(flags.FlagValues()); EngineConfig.create(policy='sf')\n")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_rotation_config_is_frozen_and_nested():
  assert isinstance(EngineConfig().rotation, RotationConfig)
  assert [leaf.path for leaf in configtree.leaves(EngineConfig) if leaf.field.name == "alpha"] == \
      [("scheduler", "alpha")]
