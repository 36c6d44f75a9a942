"""``ModelConfig`` fields from a Hugging Face ``config.json`` (transformers 4.x or 5.x spelling).

``hf_config_kwargs`` maps the HF dict to ``ModelConfig`` keyword arguments; it never builds the config
itself (``ModelConfig.from_hf_dict`` does, and checks the invariants). Families: HF ``llama``, ``mistral``
(read as ``llama`` with a sliding window), ``qwen2``, ``mixtral``.
"""
from __future__ import annotations

from typing import Any, Mapping

from superinfer_jax.model.config_fields import ROPE_TYPES, ConfigError, UnsupportedModelError, as_id_tuple

# HF ``model_type`` -> family (Mistral is Llama with a sliding window).
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "mixtral": "mixtral"}


def hf_config_kwargs(d: Mapping[str, Any], name: str = "") -> dict[str, Any]:
  """``ModelConfig`` keyword arguments for an HF ``config.json`` dict (Llama, Mistral, Qwen2, Mixtral
  ``*ForCausalLM``; transformers 4/5). ``ConfigError``: a required field is missing;
  ``UnsupportedModelError``: the architecture, activation, bias or rope scaling is not implemented here."""
  model_type = d.get("model_type")
  if model_type is None:
    raise ConfigError("HF config has no 'model_type' field")
  if model_type not in HF_MODEL_TYPES:
    raise UnsupportedModelError(
        f"HF model_type {model_type!r} is not supported; supported: {sorted(HF_MODEL_TYPES)}")
  family = HF_MODEL_TYPES[model_type]
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
  missing = [k for k in required if d.get(k) is None]
  if missing:
    raise ConfigError(f"HF config ({model_type}) is missing required field(s) {missing}")
  act = d.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu' / SwiGLU)")
  if d.get("mlp_bias"):
    raise UnsupportedModelError("mlp_bias=True is not supported")
  if family != "qwen2" and d.get("attention_bias"):
    raise UnsupportedModelError(f"{model_type} with attention_bias=True (bias on q/k/v/o) is not supported")
  num_layers = d["num_hidden_layers"]
  num_heads = d["num_attention_heads"]
  head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
  rope = _hf_rope_fields(d)
  max_pos = d.get("max_position_embeddings", 2048)
  if rope["rope_type"] in ("linear", "dynamic"):
    max_pos = int(max_pos * rope["rope_factor"])
  window, window_layers = _hf_sliding_window(d, model_type, num_layers, max_pos)
  moe = family == "mixtral"
  return dict(
      family=family,
      vocab_size=d["vocab_size"],
      hidden_size=d["hidden_size"],
      intermediate_size=d["intermediate_size"],
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=d.get("num_key_value_heads") or num_heads,
      head_dim=head_dim,
      max_position_embeddings=max_pos,
      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      qkv_bias=family == "qwen2",
      bos_token_id=d.get("bos_token_id"),
      eos_token_ids=as_id_tuple(d.get("eos_token_id")),
      num_experts=d.get("num_local_experts", 0) if moe else 0,
      num_experts_per_token=d.get("num_experts_per_tok", 0) if moe else 0,
      name=name or d.get("_name_or_path", "") or "",
      sliding_window=window,
      sliding_window_layers=window_layers,
      **rope,
  )


def _hf_rope_fields(d: Mapping[str, Any]) -> dict[str, Any]:
  """Rope fields of ModelConfig from HF ``rope_parameters`` (5.x) / ``rope_scaling`` + ``rope_theta`` (4.x)."""
  rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
  if any(isinstance(v, Mapping) for v in rope.values()):
    raise UnsupportedModelError(f"per-layer-type rope parameters {sorted(rope)} are not supported")
  rope_type = rope.get("rope_type", rope.get("type")) or "default"
  if rope_type not in ROPE_TYPES:
    raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
  if rope.get("partial_rotary_factor", 1.0) != 1.0 or d.get("partial_rotary_factor", 1.0) != 1.0:
    raise UnsupportedModelError("partial_rotary_factor != 1 (partial RoPE) is not supported")
  out: dict[str, Any] = {"rope_type": rope_type,
                         "rope_theta": float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))}
  if rope_type == "default":
    return out
  if rope.get("factor") is None:
    raise ConfigError(f"rope scaling {rope_type!r} has no 'factor'")
  out["rope_factor"] = float(rope["factor"])
  if rope.get("attention_factor", 1.0) != 1.0:
    raise UnsupportedModelError(f"rope attention_factor {rope['attention_factor']} != 1 is not supported")
  if rope_type == "dynamic":   # transformers' NTK formula uses the config's max_position_embeddings
    out["rope_original_max_positions"] = int(d.get("max_position_embeddings", 2048))
  elif rope_type == "llama3":
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if rope.get(k) is None]
    if missing:
      raise ConfigError(f"llama3 rope scaling is missing {missing}")
    out.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
               rope_high_freq_factor=float(rope["high_freq_factor"]),
               rope_original_max_positions=int(rope.get("original_max_position_embeddings")
                                               or d.get("original_max_position_embeddings")
                                               or d.get("max_position_embeddings", 2048)))
  return out


def _hf_sliding_window(d: Mapping[str, Any], model_type: str, num_layers: int,
                       max_positions: int) -> tuple[int, tuple[int, ...]]:
  """(window, layers that use it) as transformers decides: HF ``layer_types`` when present, else Qwen2's
  ``use_sliding_window`` + layers ``>= max_window_layers``, Mistral / Mixtral ``sliding_window`` on all.
  A window at least as long as the usable context is dropped (it never cuts anything)."""
  window = d.get("sliding_window")
  if model_type == "llama" or (model_type == "qwen2" and not d.get("use_sliding_window")):
    window = None   # LlamaConfig has no window; Qwen2's applies only with use_sliding_window
  if not window or int(window) >= max_positions:
    return 0, ()
  layer_types = d.get("layer_types")
  if layer_types is not None:
    if len(layer_types) != num_layers:
      raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
      raise UnsupportedModelError(f"layer types {unknown} are not supported")
    layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
  elif model_type == "qwen2":
    layers = tuple(range(int(d.get("max_window_layers", 28)), num_layers))
  else:
    layers = tuple(range(num_layers))
  return (int(window), layers) if layers else (0, ())
