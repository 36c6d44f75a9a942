"""Step cost model: a roofline per model step from the model's shape and the batch the plan really formed.

Units: bytes, FLOPs, seconds; bandwidths in GB/s (1e9 B/s), compute in TFLOP/s (1e12 FLOP/s). Pure
functions over frozen dataclasses (no JAX, no numpy).

For one step whose batch holds sequences ``i`` with ``n_i`` new tokens on top of ``c_i`` computed ones
(``ScheduledSeq.num_new_tokens`` / ``num_computed_tokens``; context after the step ``c_i + n_i``)::

  T        = sum n_i                                  tokens in the step
  S        = number of sequences                      (one logits row each: the LM head runs on S rows)
  ctx      = sum (c_i + n_i)                          KV tokens attention reads
  pairs    = sum (n_i * c_i + n_i * (n_i + 1) / 2)    (query, key) pairs under the causal mask

  weight bytes = itemsize * (L * (attn + norms + router) + L * X(T) * expert + lm_head + final norm)
                 X(T) = experts touched per layer: 1 for a dense model; for MoE with E experts and top-k
                 routing, the expected number of distinct experts T tokens route to, E * (1 - (1 - k/E)^T)
                 (each token picks k of E; a given expert is missed by all T tokens with prob (1-k/E)^T)
  KV bytes     = kv_bytes_per_token * (ctx + T)       read every context token once, write the new ones
  FLOPs        = 2 * T * L * (attn + router + k * expert) + 2 * S * lm_head + 4 * pairs * H_q * D * L
  TP = p       : bytes and FLOPs / p (weights and KV heads are sharded), plus 2 all-reduces per layer of
                 T * hidden * itemsize bytes, each latency + (2 (p-1)/p) * bytes / link bandwidth (ring)
  time         = max(bytes / (HBM * mem_eff), FLOPs / (peak * flop_eff)) + all-reduce time + step overhead

The input embedding is a gather of T rows (not read in full); a tied embedding is read once as the LM head.
Activations, norms' FLOPs and sampling are left out (small next to the terms above), and attention reads
each sequence's KV once per step (a prefill's query tiles re-reading it from cache are not charged).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from superinfer_jax.util import next_power_of_2

GB = 1e9
TFLOP = 1e12


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """The shape numbers the cost model needs (parameters are counts, not bytes)."""
  name: str
  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  itemsize: int                 # bytes per weight / KV element at the run's dtype
  attn_params: int              # per layer: q, k, v, o projections (+ q/k/v bias)
  norm_params: int              # per layer: two RMSNorm weights
  router_params: int            # per layer: the MoE gate (0 for a dense model)
  expert_params: int            # per layer and expert: gate, up, down projections (the MLP of a dense model)
  num_experts: int              # 1 for a dense model
  experts_per_token: int        # 1 for a dense model
  lm_head_params: int
  tied_embeddings: bool

  @classmethod
  def from_model_config(cls, cfg, dtype: str = "bfloat16", name: str = "") -> "ModelProfile":
    """From a ``model.config.ModelConfig`` (``load_config``); ``dtype`` sets the bytes per element."""
    itemsize = cfg.kv_spec(1, dtype).itemsize  # ValueError for an unknown dtype
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if cfg.qkv_bias else 0)
    e = cfg.num_experts or 0
    k = cfg.num_experts_per_token or 0
    if e and not 1 <= k <= e:
      raise ValueError(f"model {cfg.name!r}: num_experts_per_token must be in [1, {e}], got {k}")
    return cls(name=name or cfg.name, num_layers=cfg.num_layers, hidden_size=h, num_heads=cfg.num_heads,
               num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
               itemsize=itemsize, attn_params=attn, norm_params=2 * h,
               router_params=h * e, expert_params=3 * h * cfg.intermediate_size, num_experts=max(1, e),
               experts_per_token=max(1, k), lm_head_params=cfg.vocab_size * h,
               tied_embeddings=bool(cfg.tie_word_embeddings))

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 1

  @property
  def kv_bytes_per_token(self) -> int:
    """K and V of one token over all layers (bytes)."""
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

  @property
  def layer_dense_params(self) -> int:
    """Per-layer parameters every step reads whatever the routing: attention, norms, router."""
    return self.attn_params + self.norm_params + self.router_params

  def weight_bytes(self, experts_touched: float | None = None) -> float:
    """Bytes of weights one step reads with ``experts_touched`` experts per layer (default: all of them)."""
    x = self.num_experts if experts_touched is None else experts_touched
    return self.itemsize * (self.num_layers * (self.layer_dense_params + x * self.expert_params)
                            + self.lm_head_params + self.hidden_size)

  def total_weight_bytes(self) -> float:
    """Bytes the weights occupy in device memory (all experts; the input embedding too when untied)."""
    embed = 0 if self.tied_embeddings else self.lm_head_params
    return self.weight_bytes() + self.itemsize * embed

  def active_params_per_token(self) -> int:
    """Matmul parameters one token passes through in the layers (LM head excluded)."""
    return self.num_layers * (self.attn_params + self.router_params + self.experts_per_token * self.expert_params)


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """What the cost model needs of one step's batch (see the module docstring)."""
  num_tokens: int = 0           # T
  num_seqs: int = 0             # S
  context_tokens: int = 0       # sum of c_i + n_i
  attn_pairs: float = 0.0       # causal (query, key) pairs


def batch_shape(seqs: Iterable) -> BatchShape:
  """``BatchShape`` of a step from its ``ScheduledSeq``s (anything with ``num_new_tokens`` and
  ``num_computed_tokens``)."""
  return pairs_shape((q.num_new_tokens, q.num_computed_tokens) for q in seqs)


def pairs_shape(seqs: Iterable[tuple[int, int]]) -> BatchShape:
  """``BatchShape`` of a step from ``(num_new_tokens, num_computed_tokens)`` per sequence."""
  t = s = ctx = 0
  pairs = 0
  for n, c in seqs:
    t += n
    s += 1
    ctx += c + n
    pairs += n * c + n * (n + 1) // 2
  return BatchShape(num_tokens=t, num_seqs=s, context_tokens=ctx, attn_pairs=float(pairs))


@dataclasses.dataclass(frozen=True)
class Buckets:
  """The engine's shape buckets (``EngineConfig``: block size and the floors of T, S and the block-table
  width; ``model/batch.py`` rounds each up to a power of two over its floor)."""
  block_size: int
  token_floor: int
  seq_floor: int
  blocks_floor: int

  @classmethod
  def of(cls, engine_config) -> "Buckets":
    return cls(engine_config.block_size, engine_config.token_bucket_floor, engine_config.seq_bucket_floor,
               engine_config.blocks_bucket_floor)


def padded_shape(seqs: Iterable[tuple[int, int]], buckets: Buckets) -> BatchShape:
  """``BatchShape`` of the padded step the engine runs for ``seqs`` = ``(num_new, num_computed)`` pairs:
  ``T_b`` tokens and ``S_b`` sequences, each sequence attending over the whole ``MB_b * block_size`` of its
  padded block table (KV read ``S_b * MB_b * block_size`` tokens, ``T_b * MB_b * block_size`` pairs)."""
  t = s = mb = 0
  bs = buckets.block_size
  for n, c in seqs:
    t += n
    s += 1
    mb = max(mb, -(-(c + n) // bs))
  if s == 0:
    return BatchShape()
  tb = next_power_of_2(max(t, buckets.token_floor, 1))
  sb = next_power_of_2(max(s, buckets.seq_floor, 1))
  kv = next_power_of_2(max(mb, buckets.blocks_floor, 1)) * bs
  return BatchShape(num_tokens=tb, num_seqs=sb, context_tokens=max(sb * kv - tb, 0), attn_pairs=float(tb * kv))


def expected_experts(num_experts: int, experts_per_token: int, num_tokens: int) -> float:
  """Expected distinct experts (per layer) that ``num_tokens`` tokens route to under uniform top-k routing:
  ``E * (1 - (1 - k / E) ** T)``; ``E`` (all) for a dense model (E = 1), 0 for no tokens."""
  if num_tokens <= 0:
    return 0.0
  if num_experts <= 1:
    return float(num_experts)
  return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** num_tokens)


@dataclasses.dataclass(frozen=True)
class StepCost:
  """One step's roofline terms (bytes, FLOPs, seconds) and its time."""
  weight_bytes: float
  kv_bytes: float
  flops: float
  memory_s: float
  compute_s: float
  allreduce_s: float
  overhead_s: float
  experts_touched: float

  @property
  def time_s(self) -> float:
    return max(self.memory_s, self.compute_s) + self.allreduce_s + self.overhead_s

  @property
  def bound(self) -> str:
    return "memory" if self.memory_s >= self.compute_s else "compute"


def step_cost(shape: BatchShape, model: ModelProfile, hw, tensor_parallel_size: int = 1) -> StepCost:
  """The roofline of one step (module docstring). ``hw`` is a ``profiles.HardwareProfile``."""
  p = tensor_parallel_size
  if p < 1:
    raise ValueError(f"tensor_parallel_size must be >= 1, got {p}")
  T = shape.num_tokens
  x = expected_experts(model.num_experts, model.experts_per_token, T) if model.is_moe else 1.0
  wbytes = model.weight_bytes(x) / p
  kvbytes = model.kv_bytes_per_token * (shape.context_tokens + T) / p
  flops = (2.0 * T * model.active_params_per_token() + 2.0 * shape.num_seqs * model.lm_head_params
           + 4.0 * shape.attn_pairs * model.num_heads * model.head_dim * model.num_layers) / p
  memory_s = (wbytes + kvbytes) / (hw.hbm_bandwidth_gbps * GB * hw.mem_efficiency)
  compute_s = flops / (hw.peak_tflops * TFLOP * hw.flop_efficiency)
  allreduce_s = 0.0
  if p > 1:
    msg = T * model.hidden_size * model.itemsize
    one = hw.tp_latency_s + (2.0 * (p - 1) / p) * msg / (hw.tp_bandwidth_gbps * GB)
    allreduce_s = 2 * model.num_layers * one
  return StepCost(weight_bytes=wbytes, kv_bytes=kvbytes, flops=flops, memory_s=memory_s,
                  compute_s=compute_s, allreduce_s=allreduce_s, overhead_s=hw.step_overhead_s,
                  experts_touched=x)


def step_time(shape: BatchShape, model: ModelProfile, hw, tensor_parallel_size: int = 1) -> float:
  """Seconds of one model step (``step_cost(...).time_s``)."""
  return step_cost(shape, model, hw, tensor_parallel_size).time_s


def device_pool_blocks(model: ModelProfile, hw, block_bytes: int, *, memory_fraction: float = 0.9,
                       tensor_parallel_size: int = 1) -> int:
  """Device KV blocks that fit: ``(HBM * fraction - weights / p) * p / block_bytes`` (each of the ``p`` GPUs
  holds 1/p of the weights and of every block). ``ValueError`` if the weights alone do not fit."""
  p = tensor_parallel_size
  free = hw.hbm_capacity_gb * GB * memory_fraction - model.total_weight_bytes() / p
  if free <= 0:
    raise ValueError(f"{model.name}: {model.total_weight_bytes() / p / GB:.1f} GB of weights per GPU do not "
                     f"fit {memory_fraction:g} x {hw.hbm_capacity_gb:g} GB of {hw.name} at TP={p}")
  return int(free * p // block_bytes)
