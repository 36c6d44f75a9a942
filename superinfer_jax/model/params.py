"""Parameter pytree of the functional model, and its construction from HF-named tensors.

Layout (layers stacked on a leading axis ``L`` so the forward scans over them; matrices are ``[in, out]``
so activations multiply on the left, ``x @ w``)::

  embed       [V, H]
  layers/
    attn_norm [L, H]
    wq        [L, H, Hq*D]      bq [L, Hq*D]   (qkv_bias only)
    wk        [L, H, Hkv*D]     bk [L, Hkv*D]  (qkv_bias only)
    wv        [L, H, Hkv*D]     bv [L, Hkv*D]  (qkv_bias only)
    wo        [L, Hq*D, H]
    mlp_norm  [L, H]
    w_gate    [L, H, F]         MoE (mixtral): [L, E, H, F]
    w_up      [L, H, F]         MoE: [L, E, H, F]
    w_down    [L, F, H]         MoE: [L, E, F, H]
    router    [L, H, E]         (MoE only)
  final_norm  [H]
  lm_head     [H, V]            (untied embeddings only; tied models use embed.T)

Every loader (HF safetensors, GGUF, orbax) funnels through ``params_from_hf_tensors`` or checks its result
with ``check_param_shapes``, so a shape mismatch between config and weights is caught in one place.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from superinfer_jax.model.config import DTYPE_NAMES, ModelConfig

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
assert tuple(DTYPES) == DTYPE_NAMES
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
  """Weights cannot be loaded: missing/unexpected tensor, shape mismatch, corrupt or truncated file."""


def check_dtype(dtype: str) -> Any:
  if dtype not in DTYPES:
    raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
  return DTYPES[dtype]


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
  """The expected shape of every parameter (same tree structure as the params)."""
  L, H, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  Q, KV = cfg.q_size, cfg.kv_size
  layers = {
      "attn_norm": (L, H), "wq": (L, H, Q), "wk": (L, H, KV), "wv": (L, H, KV), "wo": (L, Q, H),
      "mlp_norm": (L, H), "w_gate": (L, H, F), "w_up": (L, H, F), "w_down": (L, F, H),
  }
  if cfg.is_moe:
    E = cfg.num_experts
    layers.update(w_gate=(L, E, H, F), w_up=(L, E, H, F), w_down=(L, E, F, H), router=(L, H, E))
  if cfg.qkv_bias:
    layers.update(bq=(L, Q), bk=(L, KV), bv=(L, KV))
  shapes = {"embed": (V, H), "layers": layers, "final_norm": (H,)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head"] = (H, V)
  return shapes


def check_param_shapes(cfg: ModelConfig, params: Any, source: str = "params") -> None:
  """Raises ``WeightLoadError`` unless ``params`` has exactly the tree and shapes ``param_shapes(cfg)``."""
  expected = param_shapes(cfg)

  def walk(exp, got, prefix):
    if not isinstance(got, Mapping):
      raise WeightLoadError(f"{source}: {prefix or 'params'} should be a dict, got {type(got).__name__}")
    missing, unexpected = sorted(set(exp) - set(got)), sorted(set(got) - set(exp))
    if missing or unexpected:
      raise WeightLoadError(f"{source}: {prefix or 'params'} missing {missing}, unexpected {unexpected}")
    for k, v in exp.items():
      if isinstance(v, dict):
        walk(v, got[k], f"{prefix}{k}/")
      elif tuple(got[k].shape) != v:
        raise WeightLoadError(f"{source}: {prefix}{k} has shape {tuple(got[k].shape)}, config "
                              f"{cfg.name or cfg.family} expects {v}")
  walk(expected, params, "")


def _hf_layer_names(i: int, cfg: ModelConfig) -> dict[str, tuple]:
  """Our per-layer name -> (HF tensor name, transpose?) or, for MoE experts, a tuple of one such pair per
  expert (stacked on the expert axis). Mixtral names are the hub checkpoints' ``block_sparse_moe.*``."""
  p = f"model.layers.{i}."
  names: dict[str, tuple] = {
      "attn_norm": (p + "input_layernorm.weight", False),
      "wq": (p + "self_attn.q_proj.weight", True),
      "wk": (p + "self_attn.k_proj.weight", True),
      "wv": (p + "self_attn.v_proj.weight", True),
      "wo": (p + "self_attn.o_proj.weight", True),
      "mlp_norm": (p + "post_attention_layernorm.weight", False),
  }
  if cfg.is_moe:
    moe = p + "block_sparse_moe."
    names["router"] = (moe + "gate.weight", True)
    for ours, theirs in (("w_gate", "w1"), ("w_down", "w2"), ("w_up", "w3")):
      names[ours] = tuple((f"{moe}experts.{e}.{theirs}.weight", True) for e in range(cfg.num_experts))
  else:
    names.update(w_gate=(p + "mlp.gate_proj.weight", True), w_up=(p + "mlp.up_proj.weight", True),
                 w_down=(p + "mlp.down_proj.weight", True))
  if cfg.qkv_bias:
    names.update(bq=(p + "self_attn.q_proj.bias", False), bk=(p + "self_attn.k_proj.bias", False),
                 bv=(p + "self_attn.v_proj.bias", False))
  return names


def _is_stacked(entry: tuple) -> bool:
  return isinstance(entry[0], tuple)


def expected_hf_names(cfg: ModelConfig) -> set[str]:
  names = {"model.embed_tokens.weight", "model.norm.weight"}
  if not cfg.tie_word_embeddings:
    names.add("lm_head.weight")
  for i in range(cfg.num_layers):
    for entry in _hf_layer_names(i, cfg).values():
      names.update(n for n, _ in (entry if _is_stacked(entry) else (entry,)))
  return names


def params_from_hf_tensors(cfg: ModelConfig, get_tensor: Callable[[str], np.ndarray], names: set[str],
                           dtype: str, source: str) -> dict[str, Any]:
  """Builds the stacked params from HF-named ``[out, in]`` tensors.

  Args:
    cfg: model config (must be a supported family).
    get_tensor: name -> numpy array (any float dtype; may be a lazy memmap view).
    names: every tensor name the source holds (to report missing / unexpected ones).
    dtype: "float32" or "bfloat16": dtype of the returned arrays.
    source: file or dir name for error messages.
  Returns:
    Params pytree of ``jax.Array`` (see module docstring). Raises ``WeightLoadError`` on any mismatch
    before any device array is created.
  """
  cfg.check_supported()
  np_dtype = check_dtype(dtype)
  expected = expected_hf_names(cfg)
  present = {n for n in names if not n.endswith(_IGNORED_SUFFIXES)}
  if cfg.tie_word_embeddings:
    present.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
  missing, unexpected = sorted(expected - present), sorted(present - expected)
  if missing or unexpected:
    raise WeightLoadError(f"{source}: tensors do not match config {cfg.name or cfg.family} "
                          f"({cfg.num_layers} layers): missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                          f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
  shapes = param_shapes(cfg)

  def fetch(hf_name, transpose, want_shape):
    t = np.asarray(get_tensor(hf_name))
    if t.dtype.kind not in "fV" and t.dtype != ml_dtypes.bfloat16:
      raise WeightLoadError(f"{source}: tensor {hf_name} has non-float dtype {t.dtype}")
    if transpose:
      if t.ndim != 2:
        raise WeightLoadError(f"{source}: tensor {hf_name} should be 2-D, has shape {t.shape}")
      t = t.T
    if tuple(t.shape) != tuple(want_shape):
      raise WeightLoadError(f"{source}: tensor {hf_name} has shape {tuple(t.shape)} "
                            f"({'transposed' if transpose else 'as stored'}), config expects {tuple(want_shape)}")
    return t.astype(np_dtype)

  host = {
      "embed": fetch("model.embed_tokens.weight", False, shapes["embed"]),
      "final_norm": fetch("model.norm.weight", False, shapes["final_norm"]),
      "layers": {},
  }
  if not cfg.tie_word_embeddings:
    host["lm_head"] = fetch("lm_head.weight", True, shapes["lm_head"])
  per_layer = [_hf_layer_names(i, cfg) for i in range(cfg.num_layers)]

  def fetch_entry(entry, want_shape):
    if _is_stacked(entry):   # one tensor per expert -> [E, ...]
      return np.stack([fetch(n, tr, want_shape[1:]) for n, tr in entry])
    return fetch(*entry, want_shape)

  for key, shape in shapes["layers"].items():
    host["layers"][key] = np.stack([fetch_entry(per_layer[i][key], shape[1:]) for i in range(cfg.num_layers)])
  return jax.tree.map(jnp.asarray, host)


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype: str = "float32", scale: float = 0.02):
  """Random params with the right shapes (norm weights 1): for tests and benchmarks of shapes only."""
  cfg.check_supported()
  shapes = param_shapes(cfg)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(leaves))
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
  out = []
  for k, s, p in zip(keys, leaves, paths):
    if "norm" in p:
      out.append(jnp.ones(s, DTYPES[dtype]))
    else:
      out.append((scale * jax.random.normal(k, s, jnp.float32)).astype(DTYPES[dtype]))
  return jax.tree.unflatten(treedef, out)
