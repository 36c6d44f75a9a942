"""Device memory a model needs before any request: its weights, plus KV bytes per cache block. No JAX."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """What a model needs in device memory before any request: weights, plus KV per cache block."""
  weight_bytes: int
  kv_block_bytes: int
  block_size: int
  dtype: str

  @property
  def kv_bytes_per_token(self) -> float:
    return self.kv_block_bytes / self.block_size

  def blocks_that_fit(self, device_bytes: float, reserve_bytes: float = 0.0) -> int:
    """KV blocks that fit next to the weights in ``device_bytes`` (minus ``reserve_bytes``); may be <= 0."""
    return int((device_bytes - reserve_bytes - self.weight_bytes) // self.kv_block_bytes)

  def describe(self, num_blocks: int | None = None) -> str:
    """One line: weights + KV per block (and the total with ``num_blocks`` device blocks)."""
    gib = 2.0 ** 30
    line = (f"memory estimate ({self.dtype}): weights {self.weight_bytes / gib:.3f} GiB + KV "
            f"{self.kv_block_bytes / 2**20:.4f} MiB per block of {self.block_size} tokens "
            f"({self.kv_bytes_per_token / 1024:.2f} KiB per token)")
    if num_blocks is not None:
      total = self.weight_bytes + num_blocks * self.kv_block_bytes
      line += f"; with {num_blocks} device blocks: {total / gib:.3f} GiB"
    return line
