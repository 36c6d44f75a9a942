"""DuplexKV rotation engine: pinned-host KV block pool, batched full-duplex transfers (docs/duplexkv.md).

``RotationConfig`` and the mode names import without JAX; ``DuplexKV`` and the rest load JAX on first use.
"""
from superinfer_jax.rotation.config import DUPLEX, MERGED, MERGED_KERNEL, MODES, NAIVE, SERIAL_MODES, RotationConfig

_LAZY = {"DuplexKV": "duplexkv", "TransferStats": "stats", "bucket_size": "duplexkv",
         "read_device_block": "memory"}


def __getattr__(name):
  mod = _LAZY.get(name)
  if mod is None:
    raise AttributeError(f"module 'superinfer_jax.rotation' has no attribute {name!r}")
  import importlib  # pylint: disable=import-outside-toplevel
  return getattr(importlib.import_module(f"superinfer_jax.rotation.{mod}"), name)


__all__ = ["DUPLEX", "MERGED", "MERGED_KERNEL", "MODES", "NAIVE", "SERIAL_MODES", "DuplexKV", "RotationConfig",
           "TransferStats", "bucket_size", "read_device_block"]
