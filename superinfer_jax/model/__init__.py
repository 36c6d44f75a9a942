"""Functional Llama-family model over the paged block-first KV cache (see WORKSPACE_NOTES "Model step").

Public API::

  cfg, params = load_model(path_or_name, dtype="float32")
  logits = score(params, cfg, token_ids, attention="reference", chunk_size=None, block_size=16)
  new_ids = greedy_generate(params, cfg, token_ids, max_new_tokens)
  batch, num_rows = build_batch(seqs, block_size)            # host-side numpy, bucketed shapes
  logits, kv_cache = step(params, kv_cache, batch, cfg, attention)   # jitted forward, cache donated
"""
from superinfer_jax.model.api import greedy_generate, load_model, score, validate_token_ids
from superinfer_jax.model.attention import get_attention_backend
from superinfer_jax.model.batch import BatchInputs, bucket, build_batch
from superinfer_jax.model.config import (ConfigError, ModelConfig, UnsupportedModelError, load_config)
from superinfer_jax.model.forward import forward, init_kv_cache, step
from superinfer_jax.model.params import WeightLoadError
from superinfer_jax.model.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BatchInputs", "ConfigError", "ModelConfig", "Tokenizer", "UnsupportedModelError", "WeightLoadError",
    "bucket", "build_batch", "forward", "get_attention_backend", "greedy_generate", "init_kv_cache",
    "load_config", "load_model", "load_tokenizer", "score", "step", "validate_token_ids",
]
