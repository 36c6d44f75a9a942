"""Compile the kernel's Triton IR to a CUDA cubin without a GPU (needs the `triton` package).

``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` only checks Pallas -> Triton IR. This module goes
one step further: it captures the Triton IR (TTIR) that Pallas emits and runs Triton's own compiler on it for
a chosen GPU target (default sm_90 = H100/H200), which catches Triton-level failures (layouts, shared memory,
dot shapes) on a CPU machine. Triton's compile pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas) runs on the
host; no driver is touched.

  python -m pallas_kernels.triton_check          # compiles a few representative configs, prints smem use

Uses private JAX internals (``jax._src.pallas.triton``); raises ``TritonCheckUnavailable`` when they or the
``triton`` package are missing, so callers can skip.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

# H100/H200 (sm_90) dynamic shared memory limit per block.
SM90_MAX_SMEM = 227 * 1024


class TritonCheckUnavailable(RuntimeError):
  pass


@dataclasses.dataclass
class CompiledKernel:
  name: str
  shared_bytes: int
  num_warps: int
  num_stages: int
  uses_async_copy: bool
  ptx_lines: int


def capture_ttir(fn: Callable, *args: Any) -> list[str]:
  """Triton IR modules (text, no debug info) of every pallas_call in ``fn(*args)``, lowered for CUDA."""
  try:
    from jax._src.pallas.triton import pallas_call_registration as pcr
  except ImportError as e:  # pragma: no cover
    raise TritonCheckUnavailable(f"no Pallas Triton lowering in this JAX: {e}") from e
  lowering = getattr(pcr, "lowering", None)
  orig = getattr(lowering, "lower_jaxpr_to_triton_module", None)
  if orig is None:
    raise TritonCheckUnavailable("jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module not found")
  captured: list[str] = []

  def capture(*a, **k):
    result = orig(*a, **k)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  lowering.lower_jaxpr_to_triton_module = capture
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    lowering.lower_jaxpr_to_triton_module = orig
  return captured


def compile_ttir(ttir: str, *, arch: int = 90, num_warps: int = 4, num_stages: int = 2) -> CompiledKernel:
  """Compiles one TTIR module with Triton for ``sm_{arch}``."""
  try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import compile as triton_compile
  except ImportError as e:
    raise TritonCheckUnavailable(f"triton not importable: {e}") from e
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ttir)
    kernel = triton_compile(path, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
  ttgir = kernel.asm.get("ttgir", "")
  return CompiledKernel(name=kernel.metadata.name, shared_bytes=int(kernel.metadata.shared),
                        num_warps=num_warps, num_stages=num_stages,
                        uses_async_copy="async_copy_global_to_local" in ttgir,
                        ptx_lines=kernel.asm.get("ptx", "").count("\n"))


def attention_args(dtype, *, num_tokens: int, num_seqs: int, max_blocks: int, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, block_size: int, num_layers: int = 2):
  """Abstract arguments of the attention contract for tracing."""
  sds = jax.ShapeDtypeStruct
  num_blocks = num_seqs * max_blocks + 1
  return (sds((num_tokens, num_q_heads, head_dim), dtype),
          sds((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype), sds((), jnp.int32),
          sds((num_seqs, max_blocks), jnp.int32), sds((num_seqs,), jnp.int32), sds((num_seqs + 1,), jnp.int32))


# (name, dtype, T, S, MB, Hq, Hkv, D, BS, kernel kwargs)
REPRESENTATIVE: Sequence[tuple] = (
    ("decode_llama8b_bf16", jnp.bfloat16, 64, 64, 512, 32, 8, 128, 16, dict(decode=True, num_splits=4)),
    ("decode_llama8b_bf16_128keys", jnp.bfloat16, 64, 64, 512, 32, 8, 128, 16,
     dict(decode=True, num_splits=4, blocks_per_iter=8)),
    ("decode_llama8b_f32", jnp.float32, 64, 64, 512, 32, 8, 128, 16, dict(decode=True, num_splits=2)),
    ("prefill_llama8b_bf16", jnp.bfloat16, 512, 4, 128, 32, 8, 128, 16, dict()),
    ("prefill_smollm2_f32_bs32", jnp.float32, 256, 4, 64, 9, 3, 64, 32, dict()),
)


def check_representative(arch: int = 90, configs: Sequence[tuple] = REPRESENTATIVE,
                         launch: Sequence[tuple[int, int]] = ((4, 2),)) -> list[tuple[str, CompiledKernel]]:
  """Lowers and compiles the kernel for each representative config; raises on any Triton failure."""
  from pallas_kernels.ragged_paged_attention import ragged_paged_attention
  out = []
  for name, dtype, t, s, mb, hq, hkv, d, bs, kw in configs:
    args = attention_args(dtype, num_tokens=t, num_seqs=s, max_blocks=mb, num_q_heads=hq, num_kv_heads=hkv,
                          head_dim=d, block_size=bs)
    fn = functools.partial(ragged_paged_attention, scale=d ** -0.5, interpret=False, **kw)
    modules = capture_ttir(fn, *args)
    if len(modules) != 1:
      raise AssertionError(f"{name}: expected one pallas_call, captured {len(modules)}")
    for warps, stages in launch:
      out.append((name, compile_ttir(modules[0], arch=arch, num_warps=warps, num_stages=stages)))
  return out


if __name__ == "__main__":
  for cfg_name, k in check_representative(launch=((4, 2), (4, 3), (8, 2))):
    print(f"{cfg_name:32s} warps {k.num_warps} stages {k.num_stages}: smem {k.shared_bytes:7d} B "
          f"async_copy={k.uses_async_copy} ptx_lines={k.ptx_lines}")
