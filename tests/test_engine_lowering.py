"""The engine's jitted step lowered for CUDA (on this CPU box): nothing in it makes the host wait.

With the unrolled layer loop (the default) the step lowered for the ``cuda`` platform holds no while loop, no
conditional (XLA:GPU reads a loop's or a conditional's predicate on the host), no host callback and no CPU
custom call; the scan layout does hold a while loop (so the check can fail). And every input the step is called
with is already a device array: the packed host buffer is put on the device before the call.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from superinfer_jax.engine import EngineConfig, SamplingParams, packing, runner as runner_lib
from superinfer_jax.engine.engine import LLMEngine
from superinfer_jax.engine.sampling import SAMPLING_MODES
from superinfer_jax.model import load_config
from superinfer_jax.model.params import init_random_params

pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator

# Custom calls a GPU step may hold: the Pallas Triton kernel and XLA's own sharding markers.
GPU_CUSTOM_CALLS = {"__gpu$xla.gpu.triton", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}


def _lower_for_cuda(layer_loop: str, mode: str, processing_entries: int = 0, num_logprobs: int = 0) -> str:
  """The step's StableHLO for CUDA; ``processing_entries`` > 0 adds a logit-processing buffer of that many
  entries per row, ``num_logprobs`` the logprobs output."""
  cfg = load_config("tiny-llama")
  params = jax.eval_shape(lambda: runner_lib.step_layout(init_random_params(cfg, jax.random.key(0)), cfg,
                                                         layer_loop, False))
  leaves, params_def = jax.tree.flatten(params)
  dims = (16, 4, 4, 4)
  size = max(stop for _, stop in packing.offsets(dims).values())
  cache = jax.ShapeDtypeStruct(cfg.kv_spec(16, "bfloat16").shape(32), jnp.bfloat16)
  attn = functools.partial(ragged_paged_attention, interpret=False)
  processing = (jax.ShapeDtypeStruct((dims[3], 4 * processing_entries + 3), jnp.int32) if processing_entries
                else None)
  lowered = runner_lib._jit_step.trace(   # pylint: disable=protected-access
      tuple(leaves), cache, jax.ShapeDtypeStruct((size,), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32),
      processing, dims=dims, mode=mode, num_logprobs=num_logprobs, cfg=cfg, attention=attn,
      params_def=params_def).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_unrolled_step_for_cuda_has_no_loop_conditional_or_host_call(mode):
  txt = _lower_for_cuda("unrolled", mode)
  assert "__gpu$xla.gpu.triton" in txt                          # the Pallas kernel, lowered for the GPU
  assert not re.search(r"stablehlo\.(while|case|if)\b", txt), "a loop or conditional in the GPU step"
  targets = set(re.findall(r"call_target_name\s*=\s*\"([^\"]+)\"", txt))
  targets |= set(re.findall(r"stablehlo\.custom_call\s*@([\w$.]+)", txt))
  assert targets <= GPU_CUSTOM_CALLS, targets - GPU_CUSTOM_CALLS  # no host callback, no CPU custom call
  assert "callback" not in txt


def test_step_with_logit_processing_and_logprobs_for_cuda_has_no_loop_or_conditional():
  txt = _lower_for_cuda("unrolled", "filtered", processing_entries=16, num_logprobs=20)
  assert "scatter" in txt                                       # the penalties' counts, scattered into [R, V]
  assert not re.search(r"stablehlo\.(while|case|if)\b", txt), "a loop or conditional in the GPU step"
  assert "callback" not in txt


def test_scan_step_for_cuda_has_a_while_loop():
  assert re.search(r"stablehlo\.while\b", _lower_for_cuda("scan", "greedy"))


def test_unrolled_is_the_default_layer_loop():
  assert EngineConfig().layer_loop == "unrolled"


def test_step_inputs_are_device_arrays_before_the_call(tiny_model_dir, monkeypatch):
  seen = []
  real = runner_lib._jit_step   # pylint: disable=protected-access

  def spy(*args, **kwargs):
    seen.append([type(a) for a in jax.tree.leaves(args)])
    return real(*args, **kwargs)

  monkeypatch.setattr(runner_lib, "_jit_step", spy)
  eng = LLMEngine(tiny_model_dir, EngineConfig.create(num_device_blocks=32, num_host_blocks=0))
  out = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
  assert len(out[0].token_ids) == 4 and seen
  for types in seen:
    assert all(issubclass(t, jax.Array) for t in types), [t for t in types if not issubclass(t, jax.Array)]
    assert not any(issubclass(t, np.ndarray) for t in types)
