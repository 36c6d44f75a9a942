"""GGUF loader: metadata -> ModelConfig, tensors dequantized with ``gguf.quants.dequantize``.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so that its RoPE (adjacent-pair
rotation) matches HF's half-split rotation; ``unpermute_qk_rows`` undoes that (the same map transformers'
GGUF loader applies), so the weights come out in HF layout and share ``params_from_hf_tensors``.

Mixtral (llama.cpp: architecture ``llama`` with ``llama.expert_count``): the router ``blk.N.ffn_gate_inp``
and the experts either merged (``blk.N.ffn_{gate,up,down}_exps``, ``[E, out, in]``; current llama.cpp) or
one tensor per expert (``blk.N.ffn_{gate,up,down}.E``; older files) map to the HF names
``block_sparse_moe.gate`` / ``block_sparse_moe.experts.E.w{1,3,2}``.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any

import numpy as np

from superinfer_jax.model.config import ModelConfig
from superinfer_jax.model.params import WeightLoadError, params_from_hf_tensors

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_MOE_W = {"gate": "w1", "down": "w2", "up": "w3"}
_MERGED_EXPERTS_RE = re.compile(r"^ffn_(gate|down|up)_exps\.weight$")
_SPLIT_EXPERT_RE = re.compile(r"^ffn_(gate|down|up)\.(\d+)\.weight$")


def _hf_names(t, cfg: ModelConfig) -> list[tuple[str, int | None]]:
  """The HF tensor name(s) a GGUF tensor provides, with the expert index for a merged expert tensor."""
  m = _BLOCK_RE.match(t.name)
  if m is None:
    return [(_GLOBAL_NAMES.get(t.name, f"<gguf:{t.name}>"), None)]   # unknown: reported as unexpected
  layer, rest = m.group(1), m.group(2)
  moe = f"model.layers.{layer}.block_sparse_moe."
  if cfg.is_moe:
    if rest == "ffn_gate_inp.weight":
      return [(moe + "gate.weight", None)]
    if mm := _MERGED_EXPERTS_RE.match(rest):
      return [(f"{moe}experts.{e}.{_MOE_W[mm.group(1)]}.weight", e) for e in range(cfg.num_experts)]
    if mm := _SPLIT_EXPERT_RE.match(rest):
      return [(f"{moe}experts.{mm.group(2)}.{_MOE_W[mm.group(1)]}.weight", None)]
  if rest in _LAYER_NAMES:
    return [(f"model.layers.{layer}.{_LAYER_NAMES[rest]}", None)]
  return [(f"<gguf:{t.name}>", None)]


def open_gguf(path: str):
  """``gguf.GGUFReader`` for ``path``; a corrupt or truncated file raises WeightLoadError.

  Readers are cached per (path, size, mtime): parsing the metadata of a real vocabulary takes seconds and
  ``load_model`` + ``load_tokenizer`` both need it. The reader memory-maps the file read-only.
  """
  try:
    st = os.stat(path)
  except OSError as e:
    raise WeightLoadError(f"{path}: cannot open GGUF file: {e}") from e
  return _open_gguf_cached(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf_cached(path: str, size: int, mtime_ns: int):
  del size, mtime_ns  # cache key only
  import gguf
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError, IndexError, struct/memmap errors on bad files
    raise WeightLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e


def field_value(field) -> Any:
  """A GGUF metadata field as a Python value (str, int, float, list)."""
  return field.contents()


def gguf_metadata(reader, keys_prefixes=("general.", "tokenizer.ggml.bos", "tokenizer.ggml.eos")) -> dict:
  """Scalar metadata of the model (architecture keys plus the few tokenizer ids the config needs)."""
  meta = {}
  arch = field_value(reader.fields["general.architecture"]) if "general.architecture" in reader.fields else None
  for k, f in reader.fields.items():
    if k.startswith(keys_prefixes) or (arch and k.startswith(arch + ".")):
      meta[k] = field_value(f)
  if arch and f"{arch}.vocab_size" not in meta and "tokenizer.ggml.tokens" in reader.fields:
    meta[f"{arch}.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
  return meta


def unpermute_qk_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's ``permute``: rows grouped (head, pair, 2) -> HF's (head, 2, half) order."""
  rows = w.shape[0]
  if rows % (2 * n_head):
    raise WeightLoadError(f"q/k tensor with {rows} rows cannot be split into {n_head} heads of pairs")
  half = rows // n_head // 2
  return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_config(path: str, reader=None) -> ModelConfig:
  reader = reader or open_gguf(path)
  meta = gguf_metadata(reader)
  tied = not any(t.name == "output.weight" for t in reader.tensors)
  return ModelConfig.from_gguf_fields(meta, tie_word_embeddings=tied, name=os.path.basename(path))


def load_gguf(path: str, dtype: str = "float32") -> tuple[ModelConfig, Any]:
  """(cfg, params) from a GGUF file (llama incl. Mixtral / qwen2; any quantization gguf can dequantize)."""
  import gguf
  reader = open_gguf(path)
  cfg = read_config(path, reader)
  cfg.check_supported()
  size = os.path.getsize(path)
  tensors = {t.name: t for t in reader.tensors}
  by_hf_name: dict[str, tuple[str, int | None]] = {}   # HF name -> (GGUF name, expert index of a merged one)
  for t in reader.tensors:
    if t.data_offset + t.n_bytes > size:
      raise WeightLoadError(f"{path}: truncated GGUF file: tensor {t.name} ends past the end of the file")
    for hf_name, expert in _hf_names(t, cfg):
      by_hf_name[hf_name] = (t.name, expert)

  @functools.lru_cache(maxsize=1)   # a merged expert tensor is read once for its E experts
  def dequantized(name: str) -> np.ndarray:
    t = tensors[name]
    try:
      w = gguf.quants.dequantize(np.asarray(t.data).view(np.ndarray), t.tensor_type)
    except Exception as e:
      raise WeightLoadError(f"{path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}") from e
    w = np.asarray(w, dtype=np.float32)
    want = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
    if w.shape != want:
      raise WeightLoadError(f"{path}: tensor {t.name} dequantized to {w.shape}, header says {want}")
    return w

  def get(hf_name: str) -> np.ndarray:
    name, expert = by_hf_name[hf_name]
    t = tensors[name]
    w = dequantized(name)
    if expert is not None:
      if w.ndim != 3 or w.shape[0] != cfg.num_experts:
        raise WeightLoadError(f"{path}: merged expert tensor {t.name} has shape {w.shape}, expected "
                              f"[{cfg.num_experts}, out, in]")
      return w[expert]
    if cfg.family not in ("llama", "mixtral"):  # only llama.cpp's LlamaModel converter permutes q/k
      return w
    if ".attn_q." in t.name:
      w = unpermute_qk_rows(w, cfg.num_heads)
    elif ".attn_k." in t.name:
      w = unpermute_qk_rows(w, cfg.num_kv_heads)
    return w

  params = params_from_hf_tensors(cfg, get, set(by_hf_name), dtype, source=path)
  return cfg, params
