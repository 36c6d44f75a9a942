"""KV-cache layouts: the one place that knows how a paged KV cache is shaped.

Canonical layout (the paper's DuplexKV *block-first* layout, docs/paper.md §4.2):

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
               axis 2 is K (0) / V (1)

One block (all layers, K and V) is one contiguous segment of ``block_bytes`` bytes, so a rotation moves
one segment per block. Block id ``PADDING_BLOCK`` (0) is reserved: padding tokens write their K/V there and
padding entries of block tables point at it; it is never handed to a request.

The *layer-first* layout (vLLM's, ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``) exists
only for the transfer ablation (docs/paper.md Table 1): one contiguous segment there is one layer's K (or V) of one
block, so a block needs ``2 * num_layers`` segments.

Pure Python (no JAX): shared by the model, the rotation engine, the block manager and the simulator.
"""
from __future__ import annotations

import dataclasses

from superinfer_jax.util import cdiv

PADDING_BLOCK = 0
BLOCK_FIRST = "block_first"
LAYER_FIRST = "layer_first"
LAYOUTS = (BLOCK_FIRST, LAYER_FIRST)

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


# ``blocks_for(num_tokens, block_size)``: the blocks of ``block_size`` tokens that hold ``num_tokens`` tokens (block
# ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``); ``blocks_for(0, 16) == 0``, ``blocks_for(17, 16)
# == 2``. The one definition of a request's block count: ``util.cdiv`` itself (no wrapper call on the hot paths
# that use it). ``KVCacheSpec.blocks_for_tokens`` and ``BlockManager.blocks_for_tokens`` are its method forms; a
# hot path that inlines it says so.
blocks_for = cdiv


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
  """Shape of a paged KV cache. Hashable: usable as a static jit argument."""
  num_layers: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  dtype: str = "float32"
  layout: str = BLOCK_FIRST

  def __post_init__(self):
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
      v = getattr(self, name)
      if not isinstance(v, int) or v <= 0:
        raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {v!r}")
    if self.dtype not in _ITEMSIZE:
      raise ValueError(f"KVCacheSpec.dtype {self.dtype!r} not one of {sorted(_ITEMSIZE)}")
    if self.layout not in LAYOUTS:
      raise ValueError(f"KVCacheSpec.layout {self.layout!r} not one of {LAYOUTS}")

  @property
  def itemsize(self) -> int:
    return _ITEMSIZE[self.dtype]

  def shape(self, num_blocks: int) -> tuple[int, ...]:
    """Array shape of a cache (device pool or host pool) holding ``num_blocks`` blocks."""
    L, H, D, B = self.num_layers, self.num_kv_heads, self.head_dim, self.block_size
    if self.layout == BLOCK_FIRST:
      return (num_blocks, L, 2, B, H, D)
    return (L, 2, num_blocks, B, H, D)

  @property
  def block_axis(self) -> int:
    return 0 if self.layout == BLOCK_FIRST else 2

  @property
  def block_bytes(self) -> int:
    """Bytes of one block: all layers, K and V."""
    return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

  @property
  def segment_bytes(self) -> int:
    """Bytes of one contiguous segment a block is made of in this layout."""
    if self.layout == BLOCK_FIRST:
      return self.block_bytes
    return self.block_bytes // (2 * self.num_layers)

  @property
  def segments_per_block(self) -> int:
    return self.block_bytes // self.segment_bytes

  def blocks_for_tokens(self, num_tokens: int) -> int:
    return blocks_for(num_tokens, self.block_size)
