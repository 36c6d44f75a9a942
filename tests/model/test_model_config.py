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
  assert 46e9 < mixtral.num_params() < 47.5e9 and mixtral.is_supported and mixtral.is_moe
  # Mixtral-8x7B's published "12.9B active parameters per token" (2 of 8 experts).
  assert 12.8e9 < mixtral.active_params() < 13.0e9
  assert llama.active_params() == llama.num_params()
  llama31 = load_config("llama-3.1-8b")
  assert (llama31.rope_type, llama31.rope_factor, llama31.rope_original_max_positions) == ("llama3", 8.0, 8192)
  assert llama31.max_position_embeddings == 131072 and llama31.num_params() == llama.num_params()


def test_memory_estimate_is_weights_plus_kv_per_block():
  mixtral = load_config("mixtral-8x7b")
  est = mixtral.memory_estimate("bfloat16", block_size=16)
  assert est.weight_bytes == 2 * mixtral.num_params()                    # ~93 GB of bf16 weights
  assert est.kv_block_bytes == 2 * 32 * 16 * 8 * 128 * 2 == mixtral.kv_spec(16, "bfloat16").block_bytes
  assert est.kv_bytes_per_token == 128 * 1024
  assert est.blocks_that_fit(80 * 2**30) < 0 < est.blocks_that_fit(141e9)   # not on one A100-80GB; on an H200
  assert est.blocks_that_fit(141e9) == int((141e9 - est.weight_bytes) // est.kv_block_bytes)
  assert "GiB" in est.describe() and "per block of 16 tokens" in est.describe()
  f32 = load_config("tiny-llama").memory_estimate("float32", 4)
  assert f32.weight_bytes == 4 * load_config("tiny-llama").num_params()


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
    ({"rope_parameters": None, "rope_scaling": {"type": "longrope", "factor": 2.0}}, UnsupportedModelError,
     "longrope"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, ConfigError, "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear"}}, ConfigError, "factor"),
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias"),
    ({"num_hidden_layers": None}, ConfigError, "num_hidden_layers"),
    ({"num_key_value_heads": 3}, ConfigError, "multiple"),
])
def test_from_hf_dict_errors(change, error, match):
  with pytest.raises(error, match=match):
    ModelConfig.from_hf_dict(dict(HF_LLAMA, **change))


def test_from_hf_dict_rope_scaling_and_sliding_window():
  l3 = ModelConfig.from_hf_dict(dict(HF_LLAMA, max_position_embeddings=1024, rope_parameters={
      "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 128}))
  assert (l3.rope_type, l3.rope_factor, l3.rope_original_max_positions, l3.max_position_embeddings) == (
      "llama3", 8.0, 128, 1024)
  old = dict(HF_LLAMA, rope_theta=10.0, rope_scaling={"type": "linear", "factor": 2.0})   # 4.x spelling
  del old["rope_parameters"]
  lin = ModelConfig.from_hf_dict(old)
  assert (lin.rope_type, lin.rope_factor, lin.rope_theta, lin.max_position_embeddings) == ("linear", 2.0, 10.0, 512)
  dyn = ModelConfig.from_hf_dict(dict(HF_LLAMA, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                                  "rope_theta": 1e4}))
  assert (dyn.rope_original_max_positions, dyn.max_position_embeddings) == (256, 1024)
  # Qwen2: the window applies to layers >= max_window_layers, only with use_sliding_window.
  q = dict(HF_LLAMA, model_type="qwen2", num_hidden_layers=4, sliding_window=16, max_window_layers=1)
  assert ModelConfig.from_hf_dict(q).layer_windows() is None
  qs = ModelConfig.from_hf_dict(dict(q, use_sliding_window=True))
  assert qs.sliding_window_layers == (1, 2, 3) and qs.layer_windows() == (0, 16, 16, 16)
  typed = dict(q, use_sliding_window=True, layer_types=["sliding_attention", "full_attention"] * 2)
  assert ModelConfig.from_hf_dict(typed).sliding_window_layers == (0, 2)
  mistral = ModelConfig.from_hf_dict(dict(HF_LLAMA, model_type="mistral", sliding_window=32))
  assert mistral.family == "llama" and mistral.layer_windows() == (32, 32)
  assert ModelConfig.from_hf_dict(dict(HF_LLAMA, model_type="mistral", sliding_window=4096)).layer_windows() is None
  mix = ModelConfig.from_hf_dict(dict(HF_LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2))
  assert (mix.family, mix.num_experts, mix.num_experts_per_token) == ("mixtral", 4, 2)
  with pytest.raises(ConfigError, match="num_experts_per_token"):
    ModelConfig.from_hf_dict(dict(HF_LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=5))
  d = qs.to_dict()
  assert d["sliding_window_layers"] == [1, 2, 3] and ModelConfig.from_dict(json.loads(json.dumps(d))) == qs
  with pytest.raises(ConfigError, match="together"):
    qs.replace(sliding_window=0)
  with pytest.raises(UnsupportedModelError, match="'su'"):
    qs.replace(rope_type="su")


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
