"""ModelConfig: built-in configs, HF / GGUF / native parsing, hashability, KV spec, clear errors."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from superinfer_jax.kv.layout import KVCacheSpec
from superinfer_jax.model.config import (ConfigError, ModelConfig, UnsupportedModelError,
                                         builtin_config_names, load_config)

HF_LLAMA = {
    "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": [2, 3], "transformers_version": "5.0",
}


def test_builtin_configs_load_with_expected_shapes():
  names = builtin_config_names()
  for n in ("llama-3-8b", "qwen2.5-32b", "mixtral-8x7b", "smollm2-135m", "tiny-llama", "tiny-qwen2"):
    assert n in names
  llama = load_config("llama-3-8b")
  assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (32, 32, 8, 128)
  assert 7.9e9 < llama.num_params() < 8.1e9
  qwen = load_config("qwen2.5-32b")
  assert qwen.family == "qwen2" and qwen.qkv_bias
  assert 32.0e9 < qwen.num_params() < 33.5e9
  smol = load_config("smollm2-135m")
  assert smol.tie_word_embeddings and 134e6 < smol.num_params() < 135e6
  mixtral = load_config("mixtral-8x7b")
  assert 46e9 < mixtral.num_params() < 47.5e9 and not mixtral.is_supported


def test_mixtral_is_clearly_unsupported():
  with pytest.raises(UnsupportedModelError, match="mixtral"):
    load_config("mixtral-8x7b").check_supported()


def test_config_is_hashable_and_a_static_jit_arg():
  a, b = load_config("tiny-llama"), load_config("tiny-llama")
  assert a == b and hash(a) == hash(b)
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.num_layers = 3
  traces = []
  f = jax.jit(lambda x, cfg: (traces.append(1), x * cfg.num_layers)[1], static_argnums=1)
  assert float(f(jnp.ones(()), a)) == 2.0
  f(jnp.ones(()), b)
  assert len(traces) == 1


def test_kv_spec():
  cfg = load_config("smollm2-135m")
  spec = cfg.kv_spec(16, "bfloat16")
  assert isinstance(spec, KVCacheSpec)
  assert spec.shape(5) == (5, 30, 2, 16, 3, 64)
  assert spec.block_bytes == 2 * 30 * 16 * 3 * 64 * 2


def test_from_hf_dict_reads_both_rope_spellings_and_eos_lists():
  cfg = ModelConfig.from_hf_dict(HF_LLAMA)
  assert cfg.rope_theta == 500.0 and cfg.eos_token_ids == (2, 3) and cfg.head_dim == 16
  old = dict(HF_LLAMA)
  del old["rope_parameters"]
  old["rope_theta"] = 1234.0
  assert ModelConfig.from_hf_dict(old).rope_theta == 1234.0
  qwen = ModelConfig.from_hf_dict(dict(HF_LLAMA, model_type="qwen2"))
  assert qwen.qkv_bias


@pytest.mark.parametrize("change,error,match", [
    ({"model_type": "gpt2"}, UnsupportedModelError, "gpt2"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "gelu"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, UnsupportedModelError, "yarn"),
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias"),
    ({"num_hidden_layers": None}, ConfigError, "num_hidden_layers"),
    ({"num_key_value_heads": 3}, ConfigError, "multiple"),
])
def test_from_hf_dict_errors(change, error, match):
  with pytest.raises(error, match=match):
    ModelConfig.from_hf_dict(dict(HF_LLAMA, **change))


def test_native_config_unknown_and_missing_fields(tmp_path):
  d = load_config("tiny-llama").to_dict()
  with pytest.raises(ConfigError, match="unknown.*'rope_sclaing'"):
    ModelConfig.from_dict(dict(d, rope_sclaing=2.0))
  missing = dict(d)
  del missing["hidden_size"]
  with pytest.raises(ConfigError, match="missing.*hidden_size"):
    ModelConfig.from_dict(missing)
  p = tmp_path / "bad.json"
  p.write_text(json.dumps(dict(d, family="bert")))
  with pytest.raises(UnsupportedModelError, match="bert"):
    load_config(str(p))
  with pytest.raises(ConfigError, match="no model config"):
    load_config("no-such-model")
  assert ModelConfig.from_dict(d) == load_config("tiny-llama")


def test_from_gguf_fields():
  meta = {"general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
          "llama.embedding_length": 576, "llama.feed_forward_length": 1536, "llama.attention.head_count": 9,
          "llama.attention.head_count_kv": 3, "llama.rope.freq_base": 1e5,
          "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 49152,
          "tokenizer.ggml.eos_token_id": 2}
  cfg = ModelConfig.from_gguf_fields(meta, tie_word_embeddings=True)
  assert cfg.head_dim == 64 and cfg.eos_token_ids == (2,)
  smol = load_config("smollm2-135m")
  assert cfg.num_params() == smol.num_params()
  with pytest.raises(ConfigError, match="llama.block_count"):
    ModelConfig.from_gguf_fields({k: v for k, v in meta.items() if k != "llama.block_count"},
                                 tie_word_embeddings=True)
  with pytest.raises(UnsupportedModelError, match="falcon"):
    ModelConfig.from_gguf_fields(dict(meta, **{"general.architecture": "falcon"}), tie_word_embeddings=True)
