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
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from superinfer_jax.kv import layout

DTYPE_NAMES = ("float32", "bfloat16")  # weights / KV / activations (model.params.DTYPES maps them)
SUPPORTED_FAMILIES = ("llama", "qwen2", "mixtral")
KNOWN_FAMILIES = SUPPORTED_FAMILIES
# HF ``model_type`` -> family (Mistral is Llama with a sliding window).
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "mixtral": "mixtral"}
GGUF_ARCHS = ("llama", "qwen2")   # llama.cpp writes Mixtral as "llama" with llama.expert_count > 0
# ``rope_type`` values the forward implements (transformers' names); ``default`` is plain RoPE.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
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
        kwargs[f] = _as_id_tuple(kwargs[f])
    for f in ("rope_theta", "rms_norm_eps", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
      if f in kwargs:
        kwargs[f] = float(kwargs[f])
    return cls(**kwargs)

  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any], name: str = "") -> "ModelConfig":
    """From an HF ``config.json`` dict (Llama, Mistral, Qwen2, Mixtral ``*ForCausalLM``; transformers 4/5)."""
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
    return cls(
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
        eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
        num_experts=d.get("num_local_experts", 0) if moe else 0,
        num_experts_per_token=d.get("num_experts_per_tok", 0) if moe else 0,
        name=name or d.get("_name_or_path", "") or "",
        sliding_window=window,
        sliding_window_layers=window_layers,
        **rope,
    )

  @classmethod
  def from_gguf_fields(cls, meta: Mapping[str, Any], *, tie_word_embeddings: bool,
                       name: str = "") -> "ModelConfig":
    """From decoded GGUF metadata (``{key: python value}``). Tying is read off the tensor list by the caller."""
    arch = meta.get("general.architecture")
    if arch is None:
      raise ConfigError("GGUF metadata has no 'general.architecture'")
    if arch not in GGUF_ARCHS:
      raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: {GGUF_ARCHS}")

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
    experts = int(get("expert_count", 0) or 0)
    scaling = str(get("rope.scaling.type", "none") or "none")
    rope: dict[str, Any] = {}
    if scaling == "linear":
      rope = dict(rope_type="linear", rope_factor=float(get("rope.scaling.factor")))
    elif scaling != "none":
      raise UnsupportedModelError(f"GGUF rope scaling type {scaling!r} is not supported (only linear)")
    return cls(
        family="mixtral" if experts else arch,
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
        num_experts=experts,
        num_experts_per_token=int(get("expert_used_count", 0) or 0) if experts else 0,
        name=name or str(meta.get("general.name", "")),
        **rope,
    )


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """What a model needs in device memory before any request: weights, plus KV per cache block."""
  weight_bytes: int
  kv_block_bytes: int
  block_size: int
  dtype: str

  @property
  def kv_bytes_per_token(self) -> float:
    return self.kv_block_bytes / self.block_size

  def blocks_that_fit(self, device_bytes: float, reserve_bytes: float = 0.0) -> int:
    """KV blocks that fit next to the weights in ``device_bytes`` (minus ``reserve_bytes``); may be <= 0."""
    return int((device_bytes - reserve_bytes - self.weight_bytes) // self.kv_block_bytes)

  def describe(self, num_blocks: int | None = None) -> str:
    """One line: weights + KV per block (and the total with ``num_blocks`` device blocks)."""
    gib = 2.0 ** 30
    line = (f"memory estimate ({self.dtype}): weights {self.weight_bytes / gib:.3f} GiB + KV "
            f"{self.kv_block_bytes / 2**20:.4f} MiB per block of {self.block_size} tokens "
            f"({self.kv_bytes_per_token / 1024:.2f} KiB per token)")
    if num_blocks is not None:
      total = self.weight_bytes + num_blocks * self.kv_block_bytes
      line += f"; with {num_blocks} device blocks: {total / gib:.3f} GiB"
    return line


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
