"""Checkpoint conversion (``scripts/convert_checkpoint.py``): any loadable model -> an orbax dir.

Orchestration lives here rather than in ``loaders/orbax_io`` so that loaders never import ``api``.
"""
from __future__ import annotations

import os

from superinfer_jax.model.api import load_model
from superinfer_jax.model.config import ModelConfig
from superinfer_jax.model.loaders.orbax_io import save_orbax
from superinfer_jax.model.tokenizer import load_tokenizer, save_tokenizer


def convert_to_orbax(src: str, dst: str, dtype: str = "float32") -> ModelConfig:
  """Loads a model (HF dir, GGUF, built-in name) and writes it, with its tokenizer if any, to ``dst``."""
  if os.path.exists(dst) and os.listdir(dst):
    raise FileExistsError(f"output {dst} exists and is not empty")
  cfg, params = load_model(src, dtype)
  try:
    tok = load_tokenizer(src)
  except FileNotFoundError:
    tok = None
  save_orbax(dst, cfg, params)
  if tok is not None:
    save_tokenizer(tok, dst)
  return cfg
