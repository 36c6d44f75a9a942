"""Public entry points: ``load_model``, ``score``, ``greedy_generate`` (all through the paged step)."""
from __future__ import annotations

import os
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from superinfer_jax.model.batch import build_batch
from superinfer_jax.model.config import ModelConfig
from superinfer_jax.model.forward import init_kv_cache, step
from superinfer_jax.model.loaders import gguf_loader, hf, orbax_io
from superinfer_jax.model.params import check_dtype
from superinfer_jax.model.paths import BUILTIN_MODELS, resolve_model_path
from superinfer_jax.util import cdiv, next_power_of_2

DEFAULT_CHUNK_SIZE = 128


def load_model(path_or_name: str, dtype: str = "float32") -> tuple[ModelConfig, Any]:
  """Loads ``(cfg, params)`` from an HF dir, a ``.gguf`` file, an orbax dir or a built-in name.

  Args:
    path_or_name: ``smollm2-135m``; an HF directory (``config.json`` + ``*.safetensors``, sharded or not);
      a GGUF file; or a directory written by ``scripts/convert_checkpoint.py``.
    dtype: "float32" or "bfloat16": dtype of the params (and the natural KV-cache dtype).
  Returns:
    ``(cfg, params)``; params is a pytree of ``jax.Array`` (see ``superinfer_jax.model.params``).
  Raises:
    FileNotFoundError for a missing path; ConfigError, UnsupportedModelError or WeightLoadError naming
    the problem otherwise. Nothing is returned half-loaded.
  """
  check_dtype(dtype)
  path, kind = _locate(path_or_name)
  if kind == "orbax":
    return orbax_io.load_orbax(path, dtype)
  if kind == "hf":
    return hf.load_hf_dir(path, dtype)
  return gguf_loader.load_gguf(path, dtype)


def load_model_config(path_or_name: str) -> ModelConfig:
  """Only the ``ModelConfig`` of what ``load_model`` would load (no weights read): for sizing up front."""
  path, kind = _locate(path_or_name)
  if kind == "orbax":
    return orbax_io.read_orbax_config(path)[0]
  if kind == "hf":
    return hf.read_hf_config(path)
  return gguf_loader.read_config(path)


def _locate(path_or_name: str) -> tuple[str, str]:
  """(resolved path, "orbax" | "hf" | "gguf"); FileNotFoundError / ValueError as ``load_model`` documents."""
  path = resolve_model_path(path_or_name)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no model at {path!r} (not a path; built-in names: {BUILTIN_MODELS})")
  if os.path.isdir(path):
    if orbax_io.is_orbax_dir(path):
      return path, "orbax"
    if hf.is_hf_dir(path):
      return path, "hf"
    raise FileNotFoundError(f"{path} is neither an HF model dir (config.json) nor an orbax checkpoint "
                            f"({orbax_io.CONFIG_FILE})")
  if path.endswith(".gguf"):
    return path, "gguf"
  raise ValueError(f"{path}: unknown model file type (expected a .gguf file or a directory)")


def validate_token_ids(cfg: ModelConfig, token_ids: Sequence[int], extra_positions: int = 0) -> np.ndarray:
  """Token ids as int32 numpy; ValueError if empty, out of vocab, or longer than the max positions."""
  ids = np.asarray(token_ids)
  if ids.ndim != 1 or ids.size == 0:
    raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
  bad = np.flatnonzero((ids < 0) | (ids >= cfg.vocab_size))
  if bad.size:
    raise ValueError(f"token id {int(ids[bad[0]])} at index {int(bad[0])} is out of vocab "
                     f"[0, {cfg.vocab_size})")
  total = ids.size + extra_positions
  if total > cfg.max_position_embeddings:
    raise ValueError(f"sequence of {total} tokens exceeds max positions {cfg.max_position_embeddings}")
  return ids.astype(np.int32)


def _fresh_cache(cfg: ModelConfig, params, num_tokens: int, block_size: int, tp=None):
  """A cache with blocks 1..nb for one sequence (block count bucketed to limit recompiles); sharded over
  ``tp``'s mesh when given (``tp``: a ``parallel.TensorParallel``, ``cfg`` its model config)."""
  nb = cdiv(num_tokens, block_size)
  num_blocks = next_power_of_2(nb) + 1
  dtype = "bfloat16" if params["embed"].dtype == jnp.bfloat16 else "float32"
  init = init_kv_cache if tp is None else tp.init_kv_cache
  return init(cfg, num_blocks, block_size, dtype), list(range(1, nb + 1))


def _on_mesh(tp, cfg: ModelConfig, params, attention):
  """``(cfg, params, attention, put)`` for the step: unchanged for ``tp=None``, else the tensor-parallel
  model (``parallel.TensorParallel.prepare``), its per-shard attention and the replicated batch put."""
  if tp is None:
    return cfg, params, attention, lambda batch: batch
  cfg, params = tp.prepare(cfg, params)
  return cfg, params, tp.attention(attention), tp.put_tree


def score(params, cfg: ModelConfig, token_ids: Sequence[int], attention: str = "auto",
          chunk_size: int | None = None, block_size: int = 16, tensor_parallel=None) -> np.ndarray:
  """Next-token logits ``[len(token_ids), vocab]`` float32 for every prefix, through the paged step.

  The prompt is prefilled into a fresh cache in chunks of ``chunk_size`` tokens (default 128); chunk k
  attends to the cached K/V of chunks < k. ``tensor_parallel``: a ``parallel.TensorParallel`` to run the
  step sharded over its mesh (``params`` as loaded, or already prepared by it).
  """
  ids = validate_token_ids(cfg, token_ids)
  chunk = chunk_size or DEFAULT_CHUNK_SIZE
  if chunk <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}")
  cfg, params, attention, put = _on_mesh(tensor_parallel, cfg, params, attention)
  cache, table = _fresh_cache(cfg, params, ids.size, block_size, tensor_parallel)
  out = []
  for start in range(0, ids.size, chunk):
    new = ids[start:start + chunk]
    batch, rows = build_batch([(new, start, table)], block_size, logits="all")
    logits, cache = step(params, cache, put(batch), cfg, attention)
    out.append(np.asarray(logits[:rows]))
  return np.concatenate(out, axis=0)


def greedy_generate(params, cfg: ModelConfig, token_ids: Sequence[int], max_new_tokens: int, *,
                    attention: str = "auto", chunk_size: int | None = None, block_size: int = 16,
                    stop_token_ids: Sequence[int] | None = None, tensor_parallel=None) -> list[int]:
  """Greedy continuation (argmax) of a prompt: chunked paged prefill, then one paged decode step per token.

  Stops after ``max_new_tokens`` or right after emitting a token in ``stop_token_ids`` (default: the
  config's EOS ids; pass ``()`` to never stop early). Returns the new token ids (stop token included).
  ``tensor_parallel``: as for ``score``.
  """
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
  ids = validate_token_ids(cfg, token_ids, extra_positions=max_new_tokens)
  stops = set(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
  chunk = chunk_size or DEFAULT_CHUNK_SIZE
  new_tokens: list[int] = []
  if max_new_tokens == 0:
    return new_tokens
  cfg, params, attention, put = _on_mesh(tensor_parallel, cfg, params, attention)
  cache, table = _fresh_cache(cfg, params, ids.size + max_new_tokens, block_size, tensor_parallel)
  logits = None
  for start in range(0, ids.size, chunk):
    batch, _ = build_batch([(ids[start:start + chunk], start, table)], block_size, logits="last")
    logits, cache = step(params, cache, put(batch), cfg, attention)
  while True:
    tok = int(jnp.argmax(logits[0]))
    new_tokens.append(tok)
    if len(new_tokens) >= max_new_tokens or tok in stops:
      return new_tokens
    computed = ids.size + len(new_tokens) - 1
    batch, _ = build_batch([([tok], computed, table)], block_size, logits="last")
    logits, cache = step(params, cache, put(batch), cfg, attention)
