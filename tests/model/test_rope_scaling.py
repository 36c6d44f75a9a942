"""Rope scaling (llama3 / linear / dynamic) against transformers: tiny random Llama / Qwen2 checkpoints with
``rope_parameters``, loaded through load_model and scored with prompts chunked across KV blocks."""
import numpy as np
import pytest

from superinfer_jax.model import ModelConfig, UnsupportedModelError, greedy_generate, load_model, score
from superinfer_jax.model.forward import rope_inv_freq
from support.tiny_models import save_tiny_hf_model, torch_greedy, torch_logits

TOL = 1e-4
BS = 8
# head_dim 16, theta 500: wavelengths 6.3 .. 1166, so with original context 64 and factors (1, 4) the
# llama3 bands "kept" (< 16), "smoothed" (16 .. 64: index 2) and "divided by factor" (> 64) are all populated.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _save(tmp_path, family, rope, **kw):
  path = str(tmp_path)
  model = save_tiny_hf_model(path, family, rope_parameters=dict(rope), **kw)
  cfg, params = load_model(path)
  return model, cfg, params


def test_llama3_inv_freq_matches_transformers(tmp_path):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  model, cfg, _ = _save(tmp_path, "llama", LLAMA3)
  want, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
  got = rope_inv_freq(cfg)
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
  base = 500.0 ** (-np.arange(0, 16, 2) / 16)
  assert np.isclose(got[0], base[0]) and np.isclose(got[-1], base[-1] / 8)   # kept / divided bands
  assert base[2] / 8 < got[2] < base[2]                                      # smoothed band


@pytest.mark.parametrize("attention", ["reference", "pallas"])
@pytest.mark.parametrize("family,rope", [
    ("llama", LLAMA3),
    ("llama", {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.5}),
    ("qwen2", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ("qwen2", dict(LLAMA3, rope_theta=1000.0)),
], ids=["llama-llama3", "llama-linear", "qwen2-linear", "qwen2-llama3"])
def test_static_rope_scaling_score_matches_transformers(tmp_path, family, rope, attention):
  model, cfg, params = _save(tmp_path, family, rope)
  assert cfg.rope_type == rope["rope_type"] and cfg.rope_factor == rope["factor"]
  ids = np.random.RandomState(4).randint(0, cfg.vocab_size, size=70)
  got = score(params, cfg, ids, attention=attention, chunk_size=23, block_size=BS)
  assert np.abs(got - torch_logits(model, ids)).max() < TOL


def test_dynamic_ntk_matches_transformers_one_chunk_and_cached_generation(tmp_path):
  """Dynamic NTK: past the original 32 positions the base grows with the sequence length. One forward of a
  45-token prompt and transformers' KV-cached greedy generation (each new token with the base of its own
  length) are both matched; within the original length it is plain RoPE, chunked or not."""
  rope = {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0}
  model, cfg, params = _save(tmp_path, "llama", rope, max_position_embeddings=32)
  assert (cfg.rope_original_max_positions, cfg.max_position_embeddings) == (32, 64)
  rng = np.random.RandomState(8)
  short = rng.randint(0, cfg.vocab_size, size=30)
  assert np.abs(score(params, cfg, short, chunk_size=7, block_size=BS) - torch_logits(model, short)).max() < TOL
  long = rng.randint(0, cfg.vocab_size, size=45)
  got = score(params, cfg, long, attention="reference", block_size=BS)        # one chunk
  model2, _, _ = _save(tmp_path / "fresh", "llama", rope, max_position_embeddings=32)  # HF's cache is stateful
  want = torch_logits(model2, long)
  assert np.abs(got - want).max() < TOL
  plain = load_model(str(tmp_path))[0].replace(rope_type="default", rope_factor=1.0, rope_original_max_positions=0)
  assert np.abs(score(params, plain, long, block_size=BS) - want).max() > 10 * TOL   # scaling mattered
  model3, _, _ = _save(tmp_path / "fresh3", "llama", rope, max_position_embeddings=32)
  prompt = rng.randint(0, cfg.vocab_size, size=26)
  want_tokens = torch_greedy(model3, prompt, 16)      # crosses position 32 while decoding
  assert greedy_generate(params, cfg, prompt, 16, attention="reference", block_size=BS,
                         stop_token_ids=()) == want_tokens


def test_unknown_rope_type_names_it(tmp_path):
  d = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
       "num_attention_heads": 2, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
  with pytest.raises(UnsupportedModelError, match="'yarn'"):
    ModelConfig.from_hf_dict(d)
