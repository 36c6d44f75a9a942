"""``ModelConfig`` fields from a GGUF file's metadata (``llama.*`` / ``qwen2.*`` keys, llama.cpp's names).

``gguf_config_kwargs`` maps decoded metadata to ``ModelConfig`` keyword arguments; it never builds the
config itself (``ModelConfig.from_gguf_fields`` does, and checks the invariants).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from superinfer_jax.model.config_fields import ConfigError, UnsupportedModelError, as_id_tuple, opt_int

GGUF_ARCHS = ("llama", "qwen2")   # llama.cpp writes Mixtral as "llama" with llama.expert_count > 0


def gguf_config_kwargs(meta: Mapping[str, Any], *, tie_word_embeddings: bool,
                       name: str = "") -> dict[str, Any]:
  """``ModelConfig`` keyword arguments for decoded GGUF metadata (``{key: python value}``).

  Tying is read off the tensor list by the caller. ``ConfigError``: a required key is missing;
  ``UnsupportedModelError``: an architecture or rope scaling type not implemented here."""
  arch = meta.get("general.architecture")
  if arch is None:
    raise ConfigError("GGUF metadata has no 'general.architecture'")
  if arch not in GGUF_ARCHS:
    raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: {GGUF_ARCHS}")

  def get(key, default=dataclasses.MISSING):
    full = f"{arch}.{key}"
    if full in meta:
      return meta[full]
    if default is dataclasses.MISSING:
      raise ConfigError(f"GGUF metadata is missing required field {full!r}")
    return default

  num_heads = int(get("attention.head_count"))
  hidden = int(get("embedding_length"))
  vocab = meta.get(f"{arch}.vocab_size")
  if vocab is None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
      raise ConfigError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    vocab = len(tokens)
  eos = meta.get("tokenizer.ggml.eos_token_id")
  experts = int(get("expert_count", 0) or 0)
  scaling = str(get("rope.scaling.type", "none") or "none")
  rope: dict[str, Any] = {}
  if scaling == "linear":
    rope = dict(rope_type="linear", rope_factor=float(get("rope.scaling.factor")))
  elif scaling != "none":
    raise UnsupportedModelError(f"GGUF rope scaling type {scaling!r} is not supported (only linear)")
  return dict(
      family="mixtral" if experts else arch,
      vocab_size=int(vocab),
      hidden_size=hidden,
      intermediate_size=int(get("feed_forward_length")),
      num_layers=int(get("block_count")),
      num_heads=num_heads,
      num_kv_heads=int(get("attention.head_count_kv", num_heads)),
      head_dim=int(get("attention.key_length", hidden // num_heads)),
      max_position_embeddings=int(get("context_length")),
      rope_theta=float(get("rope.freq_base", 10000.0)),
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
      tie_word_embeddings=tie_word_embeddings,
      qkv_bias=arch == "qwen2",
      bos_token_id=opt_int(meta.get("tokenizer.ggml.bos_token_id")),
      eos_token_ids=as_id_tuple(eos),
      num_experts=experts,
      num_experts_per_token=int(get("expert_used_count", 0) or 0) if experts else 0,
      name=name or str(meta.get("general.name", "")),
      **rope,
  )
