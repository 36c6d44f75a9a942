"""Loaders: GGUF (q/k un-permutation, quantized), orbax via scripts/convert_checkpoint.py, tokenizer dirs."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from superinfer_jax.model import load_model, score
from superinfer_jax.model.loaders.gguf_loader import unpermute_qk_rows
from support.tiny_models import (llama_cpp_permute, save_tiny_hf_model, torch_logits,
                                          write_gguf_from_hf_model)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BS = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_llama"))
  return save_tiny_hf_model(path, "llama", seed=11), path


def test_unpermute_inverts_llama_cpp_permute():
  w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
  p = llama_cpp_permute(w, 8)
  assert not np.array_equal(p, w)
  np.testing.assert_array_equal(unpermute_qk_rows(p, 8), w)


@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8_0"])
def test_gguf_matches_transformers(tiny_llama, tmp_path, q8):
  model, _ = tiny_llama
  path = str(tmp_path / "tiny.gguf")
  write_gguf_from_hf_model(path, model, quantize_q8=q8)
  cfg, params = load_model(path)
  assert cfg.num_kv_heads == 2 and cfg.rope_theta == 500.0 and not cfg.tie_word_embeddings
  ids = np.random.RandomState(0).randint(0, cfg.vocab_size, size=19)
  err = np.abs(score(params, cfg, ids, block_size=BS) - torch_logits(model, ids)).max()
  assert err < (2e-2 if q8 else 1e-4)


def test_convert_checkpoint_script_round_trip(tiny_llama, tmp_path):
  _, hf_dir = tiny_llama
  out = str(tmp_path / "orbax")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "convert_checkpoint.py"),
                         f"--input={hf_dir}", f"--output={out}", "--dtype=float32"],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  cfg, params = load_model(hf_dir)
  cfg2, params2 = load_model(out)
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  ids = [3, 1, 4, 1, 5, 9, 2, 6]
  np.testing.assert_array_equal(score(params2, cfg2, ids, block_size=BS), score(params, cfg, ids, block_size=BS))
  cfg16, params16 = load_model(out, dtype="bfloat16")
  assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(params16))


def test_convert_refuses_non_empty_output(tiny_llama, tmp_path):
  from superinfer_jax.model.convert import convert_to_orbax
  _, hf_dir = tiny_llama
  (tmp_path / "junk").write_text("x")
  with pytest.raises(FileExistsError, match="not empty"):
    convert_to_orbax(hf_dir, str(tmp_path))
