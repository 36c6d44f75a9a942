"""Every jitted entry point of the GPU path lowered for CUDA (on this CPU box): nothing in it makes the host wait.

Entry points: the engine step in each sampling mode, with and without logit processing and logprobs; the
rotation kernels (block gather / scatter); the Pallas attention kernel in decode and mixed shapes; the MoE layer
through the Pallas grouped matmul. Each lowered module (``assert_gpu_ready``) holds no host callback and no CPU
custom call, its Pallas kernels are Triton custom calls (the GPU backend), and its donated cache is aliased to an
output (updated in place). With the unrolled layer loop (the default) the step holds no while loop and no
conditional either (XLA:GPU reads a loop's or a conditional's predicate on the host); the scan layout does hold
a while loop (so the check can fail). And every input the step is called with is already a device array: the
packed host buffer is put on the device before the call.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.grouped_matmul as grouped_matmul_lib
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from superinfer_jax.engine import EngineConfig, SamplingParams, model_runner as runner_lib, packing
from superinfer_jax.engine.engine import LLMEngine
from superinfer_jax.engine.sampling import SAMPLING_MODES
from superinfer_jax.model import load_config
from superinfer_jax.model import moe as moe_lib
from superinfer_jax.model.params import init_random_params
from superinfer_jax.rotation import kernels as rotation_kernels

pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator

TRITON_CALL = "__gpu$xla.gpu.triton"
# Custom calls a GPU module may hold: the Pallas Triton kernel and XLA's own sharding markers.
GPU_CUSTOM_CALLS = {TRITON_CALL, "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}


def _custom_call_targets(txt: str) -> set:
  targets = set(re.findall(r"call_target_name\s*=\s*\"([^\"]+)\"", txt))
  return targets | set(re.findall(r"stablehlo\.custom_call\s*@([\w$.]+)", txt))


def _aliased_argument_types(txt: str) -> list:
  """The tensor types of the main function's arguments that are donated into an output (``tf.aliasing_output``,
  or ``jax.buffer_donor`` when the output is matched later)."""
  main = next(line for line in txt.splitlines() if "func.func public @main" in line)
  args = re.findall(r"%arg\d+: (tensor<[^>]*>)( \{[^}]*\})?", main)
  return [t for t, attrs in args if "tf.aliasing_output" in attrs or "jax.buffer_donor" in attrs]


def assert_gpu_ready(txt: str, *, pallas: bool, donated_type: str = None, loops_allowed: bool = False) -> None:
  """What the GPU needs of one lowered module: no host callback and no custom call but the GPU's own; a Triton
  custom call where ``pallas`` (the Pallas kernel lowered for the GPU, not interpreted); the argument of
  ``donated_type`` (a ``tensor<...>`` type) aliased to an output; and, unless ``loops_allowed``, no while loop
  or conditional."""
  assert "callback" not in txt, "a host callback in the GPU module"
  targets = _custom_call_targets(txt)
  assert targets <= GPU_CUSTOM_CALLS, targets - GPU_CUSTOM_CALLS   # no CPU custom call
  assert (TRITON_CALL in targets) == pallas, targets
  if donated_type is not None:
    assert donated_type in _aliased_argument_types(txt), (donated_type, _aliased_argument_types(txt))
  if not loops_allowed:
    assert not re.search(r"stablehlo\.(while|case|if)\b", txt), "a loop or conditional in the GPU module"


CACHE_TYPE = "tensor<32x2x2x16x2x16xbf16>"   # the step's KV pool below: 32 blocks of tiny-llama's shape, bf16


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
@pytest.mark.parametrize("processing_entries,num_logprobs", [(0, 0), (16, 0), (0, 20), (16, 20)])
def test_unrolled_step_for_cuda_is_gpu_ready(mode, processing_entries, num_logprobs):
  txt = _lower_for_cuda("unrolled", mode, processing_entries, num_logprobs)
  assert_gpu_ready(txt, pallas=True, donated_type=CACHE_TYPE)
  if processing_entries:
    assert "scatter" in txt                                     # the penalties' counts, scattered into [R, V]


def test_scan_step_for_cuda_has_a_while_loop():
  txt = _lower_for_cuda("scan", "greedy")
  assert re.search(r"stablehlo\.while\b", txt)
  with pytest.raises(AssertionError, match="loop or conditional"):
    assert_gpu_ready(txt, pallas=True, donated_type=CACHE_TYPE)


@pytest.mark.parametrize("layout,block_axis", [("block_first", 0), ("layer_first", 2)])
def test_rotation_kernels_for_cuda_are_gpu_ready(layout, block_axis):
  """The block gather (a plain copy out), the scatter into the donated cache (in place) and the naive mode's
  segment split / join."""
  cfg = load_config("tiny-llama")
  spec = cfg.kv_spec(16, "bfloat16", kv_layout=layout)
  cache = jax.ShapeDtypeStruct(spec.shape(32), jnp.bfloat16)
  assert spec.block_axis == block_axis
  ids = jax.ShapeDtypeStruct((4,), jnp.int32)
  block = jax.ShapeDtypeStruct((cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
  cuda = dict(lowering_platforms=("cuda",))
  gather = rotation_kernels.gather_blocks.trace(cache, ids, block_axis=block_axis).lower(**cuda).as_text()
  assert_gpu_ready(gather, pallas=False)
  scatter = rotation_kernels.scatter_blocks.trace(cache, ids, (block,) * 4, block_axis=block_axis).lower(**cuda)
  cache_type = "tensor<" + "x".join(map(str, spec.shape(32))) + "xbf16>"
  assert_gpu_ready(scatter.as_text(), pallas=False, donated_type=cache_type)
  segments = rotation_kernels.split_block.trace(block)   # the naive mode's per-(layer, K/V) segments, and back
  joined = rotation_kernels.join_block.trace(tuple(jax.ShapeDtypeStruct(block.shape[2:], jnp.bfloat16)
                                                   for _ in range(2 * cfg.num_layers)))
  for traced in (segments, joined):
    assert_gpu_ready(traced.lower(**cuda).as_text(), pallas=False)


@pytest.mark.parametrize("num_tokens,shape", [(8, "decode"), (48, "mixed")])
def test_pallas_attention_for_cuda_is_gpu_ready(num_tokens, shape):
  """Decode (one query per sequence) and mixed (prefill chunks beside decodes) shapes of the attention kernel."""
  del shape
  sds = jax.ShapeDtypeStruct
  seqs, max_blocks = 8, 8
  args = (sds((num_tokens, 4, 16), jnp.bfloat16), sds((32, 2, 2, 16, 2, 16), jnp.bfloat16), sds((), jnp.int32),
          sds((seqs, max_blocks), jnp.int32), sds((seqs,), jnp.int32), sds((seqs + 1,), jnp.int32))
  attn = functools.partial(ragged_paged_attention, scale=0.25, interpret=False)
  assert_gpu_ready(jax.jit(attn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(), pallas=True)


def test_moe_layer_through_the_grouped_matmul_for_cuda_is_gpu_ready(monkeypatch):
  """The MoE layer as a GPU runs it (``moe.default_impl`` is the Pallas kernel there, compiled, not
  interpreted): the router, the tile layout and the Pallas grouped matmul, lowered for CUDA."""
  monkeypatch.setattr(moe_lib, "default_impl", lambda: "pallas")
  monkeypatch.setattr(grouped_matmul_lib, "default_interpret", lambda: False)
  sds = jax.ShapeDtypeStruct
  hidden, ffn, experts = 64, 128, 4
  layer = {"router": sds((hidden, experts), jnp.bfloat16), "w_gate": sds((experts, hidden, ffn), jnp.bfloat16),
           "w_up": sds((experts, hidden, ffn), jnp.bfloat16), "w_down": sds((experts, ffn, hidden), jnp.bfloat16)}
  moe = jax.jit(functools.partial(moe_lib.moe_mlp, k=2))
  txt = moe.trace(sds((32, hidden), jnp.bfloat16), layer).lower(lowering_platforms=("cuda",)).as_text()
  assert_gpu_ready(txt, pallas=True)


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
