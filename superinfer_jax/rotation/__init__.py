"""DuplexKV rotation engine: pinned-host KV block pool, batched full-duplex transfers (PAPER.md §4)."""
from superinfer_jax.rotation.duplexkv import (DUPLEX, MERGED, MODES, NAIVE, DuplexKV, TransferStats,
                                              bucket_size, read_device_block)

__all__ = ["DUPLEX", "MERGED", "MODES", "NAIVE", "DuplexKV", "TransferStats", "bucket_size",
           "read_device_block"]
