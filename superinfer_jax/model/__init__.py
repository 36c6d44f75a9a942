"""Functional Llama-family model over the paged block-first KV cache.

Public API::

  cfg, params = load_model(path_or_name, dtype="float32")
  logits = score(params, cfg, token_ids, attention="reference", chunk_size=None, block_size=16)
  new_ids = greedy_generate(params, cfg, token_ids, max_new_tokens)
  batch, num_rows = build_batch(seqs, block_size)            # host-side numpy, bucketed shapes
  logits, kv_cache = step(params, kv_cache, batch, cfg, attention)   # jitted forward, cache donated
  tok = load_tokenizer(path_or_name); ids = encode_text(tok, text)

The names below are imported on first access, so ``superinfer_jax.model.tokenizer`` (which the JAX-free
workload package uses) can be imported without pulling in JAX through ``api`` / ``forward``.

Imports between the submodules (acyclic, checked by tests/model/test_model_imports.py)::

  convert   -> api, config, loaders.orbax_io, tokenizer
  api       -> batch, config, forward, params, paths, loaders.{gguf_loader, hf, orbax_io}
  forward   -> attention, batch, config, moe, params
  tokenizer -> paths; loaders.gguf_loader only inside tokenizer_from_gguf (it imports JAX)
  loaders.* -> config, params (hf also -> loaders.safetensors_io); never api, tokenizer or convert
  params    -> config
  config    -> config_fields, config_gguf, config_hf, memory
  config_gguf, config_hf -> config_fields
  paths, config_fields, memory, sampling_params, batch, attention, moe, testing: no other model module
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

# Exported name -> the submodule that defines it.
_EXPORTS = {
    "greedy_generate": "api", "load_model": "api", "score": "api", "validate_token_ids": "api",
    "get_attention_backend": "attention",
    "BatchInputs": "batch", "bucket": "batch", "build_batch": "batch",
    "ConfigError": "config", "ModelConfig": "config", "UnsupportedModelError": "config",
    "load_config": "config",
    "forward": "forward", "init_kv_cache": "forward", "step": "forward",
    "WeightLoadError": "params",
    "Tokenizer": "tokenizer", "encode_text": "tokenizer", "load_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
  from superinfer_jax.model.api import greedy_generate, load_model, score, validate_token_ids
  from superinfer_jax.model.attention import get_attention_backend
  from superinfer_jax.model.batch import BatchInputs, bucket, build_batch
  from superinfer_jax.model.config import ConfigError, ModelConfig, UnsupportedModelError, load_config
  from superinfer_jax.model.forward import forward, init_kv_cache, step
  from superinfer_jax.model.params import WeightLoadError
  from superinfer_jax.model.tokenizer import Tokenizer, encode_text, load_tokenizer


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
  """Keeps ``superinfer_jax.model.forward`` the function, as the eager imports did.

  Importing the submodule ``model.forward`` binds it on this package under the same name; the package
  exports the function ``forward`` defined in it, so that binding is redirected to the function.
  """

  def __setattr__(self, name: str, value) -> None:
    if (isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name
        and value.__name__ == f"{__name__}.{name}"):
      value = getattr(value, name)
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
