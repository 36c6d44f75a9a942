"""HF checkpoint directory loader: ``config.json`` + ``*.safetensors`` (single file or sharded with an index)."""
from __future__ import annotations

import json
import os
from typing import Any

from superinfer_jax.model.config import ModelConfig, read_config_json
from superinfer_jax.model.loaders.safetensors_io import SafetensorsFile
from superinfer_jax.model.params import WeightLoadError, params_from_hf_tensors

INDEX_FILE = "model.safetensors.index.json"


def is_hf_dir(path: str) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def read_hf_config(path: str) -> ModelConfig:
  d = read_config_json(os.path.join(path, "config.json"))
  return ModelConfig.from_hf_dict(d, name=os.path.basename(os.path.abspath(path)))


def _safetensors_files(path: str) -> tuple[list[str], dict[str, str] | None]:
  """The shard files of an HF dir and, when sharded, the index's ``weight_map`` (name -> file)."""
  index_path = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
      raise WeightLoadError(f"{index_path}: corrupt index file: {e}") from e
    files = sorted(set(weight_map.values()))
    absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if absent:
      raise WeightLoadError(f"{path}: shard file(s) {absent} named in {INDEX_FILE} are missing")
    return files, weight_map
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise WeightLoadError(f"{path}: no *.safetensors files (and no {INDEX_FILE})")
  return files, None


def load_hf_dir(path: str, dtype: str = "float32") -> tuple[ModelConfig, Any]:
  """(cfg, params) from an HF directory. Raises ConfigError / UnsupportedModelError / WeightLoadError."""
  cfg = read_hf_config(path)
  cfg.check_supported()
  files, weight_map = _safetensors_files(path)
  opened = {f: SafetensorsFile(os.path.join(path, f)) for f in files}
  owner: dict[str, SafetensorsFile] = {}
  for f, st in opened.items():
    for name in st.names():
      if name in owner:
        raise WeightLoadError(f"{path}: tensor {name!r} appears in two shard files")
      owner[name] = st
  if weight_map is not None:
    not_in_files = sorted(n for n in weight_map if n not in owner)
    if not_in_files:
      raise WeightLoadError(f"{path}: tensors {not_in_files[:8]} listed in {INDEX_FILE} are not in their shards")
  params = params_from_hf_tensors(cfg, lambda n: owner[n].get(n), set(owner), dtype, source=path)
  return cfg, params
