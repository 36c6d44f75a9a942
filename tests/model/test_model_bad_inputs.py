"""Bad input -> a clear exception naming the problem; nothing half-loaded is returned."""
import json
import os
import shutil

import numpy as np
import pytest

from superinfer_jax.model import (ConfigError, UnsupportedModelError, WeightLoadError, get_attention_backend,
                                  greedy_generate, init_kv_cache, load_config, load_model, score)
from superinfer_jax.model.forward import forward
from superinfer_jax.model.batch import build_batch
from superinfer_jax.model.loaders.orbax_io import save_orbax
from support.tiny_models import save_tiny_hf_model, write_gguf_from_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny"))
  model = save_tiny_hf_model(path, "llama", seed=5)
  cfg, params = load_model(path)
  return model, path, cfg, params


def _copy(src, tmp_path, name="m"):
  dst = str(tmp_path / name)
  shutil.copytree(src, dst)
  return dst


def _edit_config(path, **changes):
  p = os.path.join(path, "config.json")
  with open(p) as f:
    d = json.load(f)
  for k, v in changes.items():
    if v is None:
      d.pop(k, None)
    else:
      d[k] = v
  with open(p, "w") as f:
    json.dump(d, f)


def test_shape_mismatch_config_vs_weights(tiny, tmp_path):
  path = _copy(tiny[1], tmp_path)
  _edit_config(path, intermediate_size=100)
  with pytest.raises(WeightLoadError, match=r"mlp\..*_proj\.weight has shape .* config expects"):
    load_model(path)


def test_layer_count_mismatch_names_missing_tensors(tiny, tmp_path):
  path = _copy(tiny[1], tmp_path)
  _edit_config(path, num_hidden_layers=3)
  with pytest.raises(WeightLoadError, match=r"missing \['model\.layers\.2\."):
    load_model(path)


def test_missing_config_field(tiny, tmp_path):
  path = _copy(tiny[1], tmp_path)
  _edit_config(path, vocab_size=None)
  with pytest.raises(ConfigError, match="vocab_size"):
    load_model(path)


@pytest.mark.parametrize("model_type", ["gpt2", "gemma"])
def test_unsupported_architecture(tiny, tmp_path, model_type):
  path = _copy(tiny[1], tmp_path)
  _edit_config(path, model_type=model_type)
  with pytest.raises(UnsupportedModelError, match=model_type):
    load_model(path)


def test_mixtral_dir_without_expert_tensors_is_rejected(tiny, tmp_path):
  path = _copy(tiny[1], tmp_path)
  _edit_config(path, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
  with pytest.raises(WeightLoadError, match="block_sparse_moe"):
    load_model(path)


def test_truncated_safetensors(tiny, tmp_path):
  path = _copy(tiny[1], tmp_path)
  f = os.path.join(path, "model.safetensors")
  size = os.path.getsize(f)
  with open(f, "r+b") as fh:
    fh.truncate(size // 2)
  with pytest.raises(WeightLoadError, match="truncated"):
    load_model(path)


def test_corrupt_safetensors_header(tiny, tmp_path):
  path = _copy(tiny[1], tmp_path)
  f = os.path.join(path, "model.safetensors")
  with open(f, "r+b") as fh:
    fh.write(b"\xff" * 8)
  with pytest.raises(WeightLoadError, match="corrupt"):
    load_model(path)


def test_missing_shard(tmp_path):
  path = str(tmp_path / "sharded")
  save_tiny_hf_model(path, "llama", max_shard_size="40KB")
  shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  os.remove(os.path.join(path, shards[1]))
  with pytest.raises(WeightLoadError, match=f"{shards[1]}.*missing"):
    load_model(path)


def test_truncated_gguf(tiny, tmp_path):
  path = str(tmp_path / "t.gguf")
  write_gguf_from_hf_model(path, tiny[0])
  with open(path, "r+b") as fh:
    fh.truncate(os.path.getsize(path) - 1000)
  with pytest.raises(WeightLoadError, match="truncated"):
    load_model(path)


def test_orbax_config_mismatch_and_missing_params(tiny, tmp_path):
  _, _, cfg, params = tiny
  out = str(tmp_path / "ckpt")
  save_orbax(out, cfg, params)
  p = os.path.join(out, "model_config.json")
  d = json.load(open(p))
  json.dump(dict(d, hidden_size=32), open(p, "w"))
  with pytest.raises(WeightLoadError, match="orbax"):
    load_model(out)
  json.dump(dict(d, hidden_sise=64), open(p, "w"))
  with pytest.raises(ConfigError, match="hidden_sise"):
    load_model(out)
  json.dump(d, open(p, "w"))
  shutil.rmtree(os.path.join(out, "params"))
  with pytest.raises(WeightLoadError, match="params"):
    load_model(out)


def test_missing_path_and_bad_dtype(tmp_path):
  with pytest.raises(FileNotFoundError, match="no model"):
    load_model(str(tmp_path / "nope"))
  with pytest.raises(ValueError, match="float16"):
    load_model("smollm2-135m", dtype="float16")
  with pytest.raises(FileNotFoundError, match="neither"):
    load_model(str(tmp_path))


def test_token_ids_out_of_vocab_and_too_long(tiny):
  _, _, cfg, params = tiny
  with pytest.raises(ValueError, match=r"token id 128 at index 1 is out of vocab \[0, 128\)"):
    score(params, cfg, [1, 128, 3])
  with pytest.raises(ValueError, match="out of vocab"):
    score(params, cfg, [-1])
  with pytest.raises(ValueError, match="exceeds max positions 256"):
    score(params, cfg, np.ones(257, np.int32))
  with pytest.raises(ValueError, match="exceeds max positions 256"):
    greedy_generate(params, cfg, np.ones(250, np.int32), max_new_tokens=10)
  with pytest.raises(ValueError, match="non-empty"):
    score(params, cfg, [])


def test_unknown_attention_backend(tiny):
  _, _, cfg, params = tiny
  with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
    get_attention_backend("flash")
  with pytest.raises(ValueError, match="flash"):
    score(params, cfg, [1, 2, 3], attention="flash")


def test_init_kv_cache_needs_padding_block(tiny):
  cfg = tiny[2]
  with pytest.raises(ValueError, match="padding"):
    init_kv_cache(cfg, 1, 16)
  assert init_kv_cache(cfg, 3, 16).shape == (3, 2, 2, 16, 2, 16)
