"""Model configuration: one frozen, hashable dataclass read from HF, GGUF or this repo's JSON files.

``ModelConfig`` is a static jit argument of the forward pass, so it holds only hashable values (ints,
floats, strings, tuples). Three sources build it:

* ``ModelConfig.from_hf_dict(config_json)``  an HF ``config.json`` (transformers 4.x or 5.x spelling);
* ``ModelConfig.from_gguf_fields(fields)``    a GGUF file's ``llama.*`` / ``qwen2.*`` metadata;
* ``ModelConfig.from_dict(d)`` / ``load_config(name_or_path)``  this repo's ``configs/models/*.json``,
  whose keys are exactly the dataclass fields (unknown or missing keys raise ``ConfigError``).

Families: ``llama`` (Llama-2/3, SmolLM2) and ``qwen2`` (q/k/v projections with bias). ``mixtral`` configs
load (for sizing: KV spec, parameter counts) but the model code rejects them with ``UnsupportedModelError``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from superinfer_jax.kv import layout

DTYPE_NAMES = ("float32", "bfloat16")  # weights / KV / activations (model.params.DTYPES maps them)
SUPPORTED_FAMILIES = ("llama", "qwen2")
KNOWN_FAMILIES = SUPPORTED_FAMILIES + ("mixtral",)
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "configs", "models")


class ConfigError(ValueError):
  """A config is missing a field, has an unknown field, or a field has a bad value."""


class UnsupportedModelError(ValueError):
  """The architecture (family, activation, rope scaling, ...) is not implemented here."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only Llama-family transformer. Hashable (static jit arg).

  Invariants (checked in ``__post_init__``): all sizes positive; ``num_heads % num_kv_heads == 0``;
  ``head_dim`` even (RoPE rotates half-dims); ``family`` in ``KNOWN_FAMILIES``; ``qkv_bias`` is True for
  ``qwen2``; MoE fields are non-zero only for ``mixtral``.
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
    if not isinstance(self.eos_token_ids, tuple):
      object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

  # ---- derived ------------------------------------------------------------------------------------
  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  @property
  def is_supported(self) -> bool:
    return self.family in SUPPORTED_FAMILIES

  def check_supported(self) -> None:
    """Raises ``UnsupportedModelError`` unless the forward pass / weight loaders implement this family."""
    if not self.is_supported:
      raise UnsupportedModelError(
          f"model family {self.family!r} ({self.name or 'unnamed'}) is not supported by the model code "
          f"(supported: {SUPPORTED_FAMILIES}); its config is usable for sizing only")

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

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["eos_token_ids"] = list(self.eos_token_ids)
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
    if "eos_token_ids" in kwargs:
      kwargs["eos_token_ids"] = _as_id_tuple(kwargs["eos_token_ids"])
    for f in ("rope_theta", "rms_norm_eps"):
      if f in kwargs:
        kwargs[f] = float(kwargs[f])
    return cls(**kwargs)

  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any], name: str = "") -> "ModelConfig":
    """From an HF ``config.json`` dict (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MixtralForCausalLM``)."""
    model_type = d.get("model_type")
    if model_type is None:
      raise ConfigError("HF config has no 'model_type' field")
    if model_type not in KNOWN_FAMILIES:
      raise UnsupportedModelError(
          f"HF model_type {model_type!r} is not supported; supported: {SUPPORTED_FAMILIES}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if d.get(k) is None]
    if missing:
      raise ConfigError(f"HF config ({model_type}) is missing required field(s) {missing}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu' / SwiGLU)")
    if d.get("mlp_bias"):
      raise UnsupportedModelError("mlp_bias=True is not supported")
    if model_type == "llama" and d.get("attention_bias"):
      raise UnsupportedModelError("llama with attention_bias=True (bias on q/k/v/o) is not supported")
    if model_type == "qwen2" and d.get("use_sliding_window"):
      raise UnsupportedModelError("qwen2 with use_sliding_window=True is not supported")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
      raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported (only plain RoPE)")
    rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    num_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
    eos = d.get("eos_token_id")
    return cls(
        family=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(eos),
        num_experts=d.get("num_local_experts", 0) if model_type == "mixtral" else 0,
        num_experts_per_token=d.get("num_experts_per_tok", 0) if model_type == "mixtral" else 0,
        name=name or d.get("_name_or_path", "") or "",
    )

  @classmethod
  def from_gguf_fields(cls, meta: Mapping[str, Any], *, tie_word_embeddings: bool,
                       name: str = "") -> "ModelConfig":
    """From decoded GGUF metadata (``{key: python value}``). Tying is read off the tensor list by the caller."""
    arch = meta.get("general.architecture")
    if arch is None:
      raise ConfigError("GGUF metadata has no 'general.architecture'")
    if arch not in SUPPORTED_FAMILIES:
      raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_FAMILIES}")

    def get(key, default=dataclasses.MISSING):
      full = f"{arch}.{key}"
      if full in meta:
        return meta[full]
      if default is dataclasses.MISSING:
        raise ConfigError(f"GGUF metadata is missing required field {full!r}")
      return default

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
      tokens = meta.get("tokenizer.ggml.tokens")
      if tokens is None:
        raise ConfigError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
      vocab = len(tokens)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return cls(
        family=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=tie_word_embeddings,
        qkv_bias=arch == "qwen2",
        bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=_as_id_tuple(eos),
        name=name or str(meta.get("general.name", "")),
    )


def _opt_int(v):
  return None if v is None else int(v)


def _as_id_tuple(v) -> tuple[int, ...]:
  if v is None:
    return ()
  if isinstance(v, (list, tuple)):
    return tuple(int(x) for x in v)
  return (int(v),)


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
