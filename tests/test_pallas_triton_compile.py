"""Triton compiles the kernel for sm_90 (H100/H200) on any machine: skipped when `triton` is not installed."""
import pytest

pytest.importorskip("triton")

from pallas_kernels import triton_check  # noqa: E402


def test_pallas_triton_compiles_for_sm90():
  configs = [c for c in triton_check.REPRESENTATIVE
             if c[0] in ("decode_llama8b_bf16", "prefill_llama8b_bf16", "decode_llama8b_f32")]
  try:
    compiled = triton_check.check_representative(arch=90, configs=configs)
  except triton_check.TritonCheckUnavailable as e:
    pytest.skip(str(e))
  assert len(compiled) == len(configs)
  for name, k in compiled:
    assert k.shared_bytes <= triton_check.SM90_MAX_SMEM, (name, k)
    assert k.uses_async_copy, (name, k)   # the K/V loads are software-pipelined
