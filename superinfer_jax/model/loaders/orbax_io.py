"""Orbax checkpoint of (config, params [, tokenizer]) — what ``scripts/convert_checkpoint.py`` writes
(via ``superinfer_jax.model.convert.convert_to_orbax``).

Directory layout::

  <dir>/model_config.json     ModelConfig fields + {"dtype": "float32" | "bfloat16"}
  <dir>/params/               orbax StandardCheckpointer tree (see superinfer_jax.model.params)
  <dir>/tokenizer.json, tokenizer_config.json   (optional)

Restore is exact: the arrays come back bit-identical in the saved dtype (cast only if another is asked).
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax

from superinfer_jax.model.config import ConfigError, ModelConfig
from superinfer_jax.model.params import DTYPES, WeightLoadError, check_dtype, check_param_shapes, param_shapes

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"


def is_orbax_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG_FILE))


def save_orbax(path: str, cfg: ModelConfig, params: Any) -> None:
  """Writes config + params under ``path`` (created; must not already hold a checkpoint)."""
  import orbax.checkpoint as ocp
  check_param_shapes(cfg, params, source="save_orbax")
  dtypes = {str(x.dtype) for x in jax.tree.leaves(params)}
  if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
    raise ValueError(f"params must all have one dtype of {sorted(DTYPES)}, got {sorted(dtypes)}")
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(path, PARAMS_DIR), params)
  ckptr.wait_until_finished()
  d = cfg.to_dict()
  d["dtype"] = dtypes.pop()
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(d, f, indent=2)


def read_orbax_config(path: str) -> tuple[ModelConfig, str]:
  p = os.path.join(path, CONFIG_FILE)
  try:
    with open(p) as f:
      d = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"cannot read {p}: {e}") from e
  saved_dtype = d.pop("dtype", None)
  if saved_dtype not in DTYPES:
    raise ConfigError(f"{p}: 'dtype' must be one of {sorted(DTYPES)}, got {saved_dtype!r}")
  return ModelConfig.from_dict(d), saved_dtype


def load_orbax(path: str, dtype: str = "float32") -> tuple[ModelConfig, Any]:
  """(cfg, params) from an orbax dir; WeightLoadError if the checkpoint is missing, corrupt or mis-shaped."""
  import orbax.checkpoint as ocp
  check_dtype(dtype)
  path = os.path.abspath(path)
  cfg, saved_dtype = read_orbax_config(path)
  cfg.check_supported()
  params_dir = os.path.join(path, PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise WeightLoadError(f"{path}: orbax checkpoint has no {PARAMS_DIR}/ directory")
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, DTYPES[saved_dtype], sharding=sharding),
                        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  try:
    params = ocp.StandardCheckpointer().restore(params_dir, target)
  except Exception as e:  # orbax / tensorstore raise many types for a corrupt or mismatched checkpoint
    raise WeightLoadError(f"{path}: cannot restore orbax params ({type(e).__name__}: {e})") from e
  check_param_shapes(cfg, params, source=path)
  if dtype != saved_dtype:
    params = jax.tree.map(lambda x: x.astype(DTYPES[dtype]), params)
  jax.block_until_ready(params)
  return cfg, params
