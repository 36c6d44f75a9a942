"""Model configuration: one frozen, hashable dataclass read from HF, GGUF or this repo's JSON files.

``ModelConfig`` is a static jit argument of the forward pass, so it holds only hashable values (ints,
floats, strings, tuples). Three sources build it:

* ``ModelConfig.from_hf_dict(config_json)``  an HF ``config.json`` (transformers 4.x or 5.x spelling);
* ``ModelConfig.from_gguf_fields(fields)``    a GGUF file's ``llama.*`` / ``qwen2.*`` metadata;
* ``ModelConfig.from_dict(d)`` / ``load_config(name_or_path)``  this repo's ``configs/models/*.json``,
  whose keys are exactly the dataclass fields (unknown or missing keys raise ``ConfigError``).

Families: ``llama`` (Llama-2/3/3.x, SmolLM2; HF ``mistral`` is read as ``llama``: same architecture),
``qwen2`` (q/k/v projections with bias) and ``mixtral`` (Llama attention + a top-k routed mixture of SwiGLU
experts). Rope scaling types ``linear`` / ``dynamic`` / ``llama3`` and sliding-window attention (Mistral /
Mixtral ``sliding_window``, Qwen2 ``use_sliding_window`` + ``max_window_layers``) are config fields; any
other rope type raises ``UnsupportedModelError`` naming it. See docs/models.md.

The HF and GGUF field mappings live in ``config_hf.py`` / ``config_gguf.py``, the errors in
``config_fields.py`` (re-exported here), the memory estimate in ``memory.py``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from superinfer_jax.kv import layout
from superinfer_jax.model.config_fields import ROPE_TYPES, ConfigError, UnsupportedModelError, as_id_tuple
from superinfer_jax.model.config_gguf import gguf_config_kwargs
from superinfer_jax.model.config_hf import hf_config_kwargs
from superinfer_jax.model.memory import MemoryEstimate

DTYPE_NAMES = ("float32", "bfloat16")  # weights / KV / activations (model.params.DTYPES maps them)
SUPPORTED_FAMILIES = ("llama", "qwen2", "mixtral")
KNOWN_FAMILIES = SUPPORTED_FAMILIES
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "configs", "models")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only Llama-family transformer. Hashable (static jit arg).

  Invariants (checked in ``__post_init__``): all sizes positive; ``num_heads % num_kv_heads == 0``;
  ``head_dim`` even (RoPE rotates half-dims); ``family`` in ``KNOWN_FAMILIES``; ``qkv_bias`` is True for
  ``qwen2``; MoE fields are set exactly for ``mixtral`` (``1 <= num_experts_per_token <= num_experts``).

  Rope scaling (transformers' definitions, ``modeling_rope_utils``):
    ``rope_type`` "default" | "linear" (inv_freq / factor) | "dynamic" (NTK: the base grows with the
    sequence length past ``rope_original_max_positions``) | "llama3" (Llama-3.1 band-wise: wavelengths
    above ``original / low_freq_factor`` divided by ``factor``, below ``original / high_freq_factor`` kept,
    smooth in between). ``rope_original_max_positions`` is the pre-training context (0 for "default" /
    "linear"). ``max_position_embeddings`` is the usable context: for "linear" / "dynamic" it is the HF
    value times ``factor`` (as vLLM does), for "llama3" HF's value (already the extended context).
  Sliding window: ``sliding_window`` W > 0 makes the layers in ``sliding_window_layers`` attend only to the
  last W positions (keys ``pos - W < k <= pos``); 0 = no window (and no window layers).
  """
  family: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  max_position_embeddings: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  num_experts: int = 0
  num_experts_per_token: int = 0
  name: str = ""
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 0
  sliding_window: int = 0
  sliding_window_layers: tuple[int, ...] = ()

  def __post_init__(self):
    if self.family not in KNOWN_FAMILIES:
      raise UnsupportedModelError(
          f"model family {self.family!r} is not supported; known families: {KNOWN_FAMILIES}")
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_position_embeddings"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"ModelConfig.{f} must be a positive int, got {v!r}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim {self.head_dim} must be even for RoPE")
    if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
      raise ConfigError(f"rope_theta ({self.rope_theta}) and rms_norm_eps ({self.rms_norm_eps}) must be > 0")
    if self.family == "qwen2" and not self.qkv_bias:
      raise ConfigError("family 'qwen2' has q/k/v bias: qkv_bias must be True")
    if (self.num_experts or self.num_experts_per_token) and self.family != "mixtral":
      raise ConfigError(f"num_experts is only meaningful for family 'mixtral', not {self.family!r}")
    if self.family == "mixtral" and not 1 <= self.num_experts_per_token <= self.num_experts:
      raise ConfigError(f"mixtral needs 1 <= num_experts_per_token ({self.num_experts_per_token}) <= "
                        f"num_experts ({self.num_experts})")
    for f in ("eos_token_ids", "sliding_window_layers"):
      if not isinstance(getattr(self, f), tuple):
        object.__setattr__(self, f, tuple(int(x) for x in getattr(self, f)))
    self._check_rope()
    self._check_window()

  def _check_rope(self) -> None:
    if self.rope_type not in ROPE_TYPES:
      raise UnsupportedModelError(f"rope scaling type {self.rope_type!r} is not supported "
                                  f"(supported: {ROPE_TYPES})")
    if self.rope_type == "default":
      if self.rope_factor != 1.0 or self.rope_original_max_positions:
        raise ConfigError("rope_type 'default' takes no rope_factor / rope_original_max_positions")
      return
    if not self.rope_factor >= 1.0:
      raise ConfigError(f"rope_factor must be >= 1 for rope_type {self.rope_type!r}, got {self.rope_factor}")
    if self.rope_type in ("dynamic", "llama3") and not 0 < self.rope_original_max_positions:
      raise ConfigError(f"rope_type {self.rope_type!r} needs rope_original_max_positions > 0")
    if self.rope_type == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
      raise ConfigError(f"llama3 rope needs 0 < low_freq_factor ({self.rope_low_freq_factor}) < "
                        f"high_freq_factor ({self.rope_high_freq_factor})")

  def _check_window(self) -> None:
    w, layers = self.sliding_window, self.sliding_window_layers
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
      raise ConfigError(f"sliding_window must be an int >= 0 (0 = none), got {w!r}")
    if bool(w) != bool(layers):
      raise ConfigError(f"sliding_window {w} and sliding_window_layers {layers} must be set together")
    if any(not 0 <= i < self.num_layers for i in layers) or list(layers) != sorted(set(layers)):
      raise ConfigError(f"sliding_window_layers {layers} must be distinct increasing layer ids "
                        f"in [0, {self.num_layers})")

  # ---- derived ------------------------------------------------------------------------------------
  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def is_supported(self) -> bool:
    return self.family in SUPPORTED_FAMILIES

  def check_supported(self) -> None:
    """Raises ``UnsupportedModelError`` unless the forward pass / weight loaders implement this family."""
    if not self.is_supported:
      raise UnsupportedModelError(
          f"model family {self.family!r} ({self.name or 'unnamed'}) is not supported by the model code "
          f"(supported: {SUPPORTED_FAMILIES}); its config is usable for sizing only")

  def layer_windows(self) -> tuple[int, ...] | None:
    """Per-layer sliding window (0 = full attention for that layer), or None when no layer slides."""
    if not self.sliding_window:
      return None
    on = set(self.sliding_window_layers)
    return tuple(self.sliding_window if i in on else 0 for i in range(self.num_layers))

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def kv_spec(self, block_size: int, dtype: str = "float32",
              kv_layout: str = layout.BLOCK_FIRST) -> layout.KVCacheSpec:
    """The paged KV-cache spec for this model: ``[NB, L, 2, block_size, num_kv_heads, head_dim]``."""
    return layout.KVCacheSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                              head_dim=self.head_dim, block_size=block_size, dtype=dtype, layout=kv_layout)

  def num_params(self) -> int:
    """Parameter count (experts included for MoE)."""
    h, f, L = self.hidden_size, self.intermediate_size, self.num_layers
    attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
    if self.qkv_bias:
      attn += self.q_size + 2 * self.kv_size
    mlp = 3 * h * f * max(1, self.num_experts) + (h * self.num_experts if self.num_experts else 0)
    embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
    return embed + L * (attn + mlp + 2 * h) + h

  def active_params(self) -> int:
    """Parameters one token's forward multiplies by (MoE: only its ``num_experts_per_token`` experts)."""
    if not self.is_moe:
      return self.num_params()
    unused = self.num_experts - self.num_experts_per_token
    return self.num_params() - self.num_layers * unused * 3 * self.hidden_size * self.intermediate_size

  def memory_estimate(self, dtype: str = "bfloat16", block_size: int = 16) -> "MemoryEstimate":
    """Device bytes of the weights and of one KV block, for ``dtype`` weights and KV cache."""
    spec = self.kv_spec(block_size, dtype)
    return MemoryEstimate(weight_bytes=self.num_params() * spec.itemsize, kv_block_bytes=spec.block_bytes,
                          block_size=block_size, dtype=dtype)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["eos_token_ids"] = list(self.eos_token_ids)
    d["sliding_window_layers"] = list(self.sliding_window_layers)
    return d

  # ---- constructors -------------------------------------------------------------------------------
  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    """Strict: keys must be dataclass fields; required fields must be present."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
      raise ConfigError(f"unknown model config field(s) {unknown}; known: {sorted(fields)}")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in d]
    if missing:
      raise ConfigError(f"model config is missing required field(s) {missing}")
    kwargs = dict(d)
    for f in ("eos_token_ids", "sliding_window_layers"):
      if f in kwargs:
        kwargs[f] = as_id_tuple(kwargs[f])
    for f in ("rope_theta", "rms_norm_eps", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
      if f in kwargs:
        kwargs[f] = float(kwargs[f])
    return cls(**kwargs)

  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any], name: str = "") -> "ModelConfig":
    """From an HF ``config.json`` dict (Llama, Mistral, Qwen2, Mixtral ``*ForCausalLM``; transformers 4/5).

    ``ConfigError`` for a missing required field, ``UnsupportedModelError`` for an architecture not
    implemented here (see ``config_hf.hf_config_kwargs``)."""
    return cls(**hf_config_kwargs(d, name))

  @classmethod
  def from_gguf_fields(cls, meta: Mapping[str, Any], *, tie_word_embeddings: bool,
                       name: str = "") -> "ModelConfig":
    """From decoded GGUF metadata (``{key: python value}``). Tying is read off the tensor list by the caller."""
    return cls(**gguf_config_kwargs(meta, tie_word_embeddings=tie_word_embeddings, name=name))


def builtin_config_names() -> list[str]:
  """Names of the JSON configs under ``configs/models/`` (without ``.json``)."""
  if not os.path.isdir(CONFIGS_DIR):
    return []
  return sorted(f[:-5] for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))


def read_config_json(path: str) -> dict:
  """The JSON object in ``path``; ``ConfigError`` if it cannot be read or is not an object."""
  try:
    with open(path) as f:
      d = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"cannot read model config {path}: {e}") from e
  if not isinstance(d, dict):
    raise ConfigError(f"model config {path} is not a JSON object")
  return d


def load_config(name_or_path: str) -> ModelConfig:
  """A config from ``configs/models/<name>.json``, a JSON file path, or an HF model dir / config.json.

  A JSON file in this repo's format has the dataclass fields as keys; a file with ``model_type`` is read as
  an HF config.
  """
  path = name_or_path
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  elif not os.path.exists(path):
    path = os.path.join(CONFIGS_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
      raise ConfigError(f"no model config {name_or_path!r}: not a file, not a dir, not one of "
                        f"{builtin_config_names()}")
  d = read_config_json(path)
  if "model_type" in d:
    return ModelConfig.from_hf_dict(d, name=os.path.basename(os.path.dirname(os.path.abspath(path))))
  return ModelConfig.from_dict(d)
