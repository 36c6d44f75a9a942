"""Triton (the `test` extra pins the GPU image's 3.6.0) compiles the kernel for sm_90 (H100/H200) on CPU."""
from pallas_kernels import triton_check


def test_pallas_triton_compiles_for_sm90():
  configs = [c for c in triton_check.REPRESENTATIVE
             if c[0] in ("decode_llama8b_bf16", "prefill_llama8b_bf16", "decode_llama8b_f32")]
  compiled = triton_check.check_representative(arch=90, configs=configs)
  assert len(compiled) == len(configs)
  for name, k in compiled:
    assert k.shared_bytes <= triton_check.SM90_MAX_SMEM, (name, k)
    assert k.uses_async_copy, (name, k)   # the K/V loads are software-pipelined
