"""``RotationConfig``: how DuplexKV moves KV blocks (transfer mode, layout, kernel buckets). No JAX.

* ``transfer_mode`` (docs/paper.md §4.3, Table 1; docs/duplexkv.md), the paper's ablation:

  - ``naive``: vLLM's per-layer, per-K/V, per-block copies, one at a time, each waited for;
  - ``merged`` ("merged segments"): one contiguous segment per block, but one gather launch and one copy
    per segment; D2H then H2D, each direction waited for;
  - ``merged_kernel`` ("merged kernels"): one gather/scatter launch for many block segments and one batched
    copy per direction; D2H then H2D, each direction waited for;
  - ``duplex`` (the default): as ``merged_kernel``, with both directions issued together and no waits, so
    they overlap each other and the model step.

* ``kv_layout``: ``block_first`` (one block = one contiguous segment, the paper's layout and the only one
  the model's attention reads) or ``layer_first`` (vLLM's: ``2 * L`` segments per block). The real engine
  runs block-first only and refuses ``layer_first`` with a clear error; ``scripts/bench_transfer.py``
  measures both layouts, and the simulator's transfer model takes either.
"""
from __future__ import annotations

import dataclasses

from superinfer_jax.configtree import check_choices, knob
from superinfer_jax.kv.layout import BLOCK_FIRST, LAYOUTS

DUPLEX = "duplex"
MERGED = "merged"
MERGED_KERNEL = "merged_kernel"
NAIVE = "naive"
MODES = (NAIVE, MERGED, MERGED_KERNEL, DUPLEX)
# Modes whose two directions run one after the other (each waited for before the next starts).
SERIAL_MODES = (NAIVE, MERGED, MERGED_KERNEL)


@dataclasses.dataclass(frozen=True)
class RotationConfig:
  transfer_mode: str = knob(DUPLEX, "DuplexKV transfer mode (the Table 1 ablation)", choices=MODES)
  kv_layout: str = knob(BLOCK_FIRST, "KV cache layout whose segments rotations move", choices=LAYOUTS)
  rotation_min_bucket: int = knob(1, "smallest block bucket of the rotation gather/scatter kernels")
  rotation_max_bucket: int = knob(16, "most blocks per rotation gather/scatter launch (a power of two; "
                                      "compile time grows with it)")

  def __post_init__(self):
    check_choices(self)
    for name in ("rotation_min_bucket", "rotation_max_bucket"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"RotationConfig.{name} must be an int >= 1, got {v!r}")
    if self.rotation_max_bucket & (self.rotation_max_bucket - 1):
      raise ValueError(f"RotationConfig.rotation_max_bucket must be a power of two, got "
                       f"{self.rotation_max_bucket}")
