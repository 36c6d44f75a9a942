"""The engine's seams to the other packages (model, kv, sched, rotation), in one place.

Every call the engine makes into another package goes through a function here, so a contract change
(WORKSPACE_NOTES.md "Module contracts") is absorbed in one file.
"""
from __future__ import annotations

import time
import zlib
from typing import Any, Sequence


# ------------------------------------------------------------------------------------------------ model
def load_model(path_or_name: str, dtype: str):
  from superinfer_jax.model import load_model as _load  # pylint: disable=import-outside-toplevel
  return _load(path_or_name, dtype=dtype)


def load_tokenizer(path_or_name: str):
  """The model's tokenizer, or None when the model ships none (token-id prompts only)."""
  try:
    from superinfer_jax.model import load_tokenizer as _load  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  try:
    return _load(path_or_name)
  except (FileNotFoundError, ValueError, OSError):
    return None


def encode(tokenizer: Any, text: str) -> list[int]:
  from superinfer_jax.workload.types import encode_text  # pylint: disable=import-outside-toplevel
  return encode_text(tokenizer, text)


def eos_token_ids(cfg, tokenizer) -> set[int]:
  ids = set(getattr(cfg, "eos_token_ids", ()) or ())
  for attr in ("eos_ids", "eos_token_ids"):          # model.Tokenizer / other wrappers
    v = getattr(tokenizer, attr, None)
    if v:
      ids.update(int(x) for x in v)
  for attr in ("eos_id", "eos_token_id"):
    v = getattr(tokenizer, attr, None)
    if isinstance(v, int):
      ids.add(v)
  return ids


def init_kv_cache(cfg, num_blocks: int, block_size: int, dtype: str):
  """Zeroed, device-committed cache of ``num_blocks`` blocks (block 0 = padding): the model's own."""
  from superinfer_jax.model.forward import init_kv_cache as _init  # pylint: disable=import-outside-toplevel
  return _init(cfg, num_blocks, block_size, dtype)


def forward(params, kv_cache, batch, cfg, attention):
  from superinfer_jax.model.forward import forward as _fwd  # pylint: disable=import-outside-toplevel
  return _fwd(params, kv_cache, batch, cfg, attention)


def build_batch(seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]], block_size: int, config):
  """Numpy ``BatchInputs`` for ``seqs`` and, per sequence, the logits row holding its last token."""
  from superinfer_jax.model.batch import build_batch as _bb  # pylint: disable=import-outside-toplevel
  batch, _ = _bb(seqs, block_size, logits="last", token_floor=config.token_bucket_floor,
                 seq_floor=config.seq_bucket_floor, blocks_floor=config.blocks_bucket_floor,
                 rows_floor=config.seq_bucket_floor)
  return batch, list(range(len(seqs)))


def bucket(n: int, floor: int = 1) -> int:
  from superinfer_jax.model.batch import bucket as _bucket  # pylint: disable=import-outside-toplevel
  return _bucket(n, floor)


def num_logit_rows(batch) -> int:
  return int(batch.logits_indices.shape[0])


# --------------------------------------------------------------------------------------- kv / scheduler
def make_block_manager(num_device_blocks: int, num_host_blocks: int, block_size: int):
  from superinfer_jax.kv.block_manager import BlockManager  # pylint: disable=import-outside-toplevel
  return BlockManager(num_device_blocks, num_host_blocks, block_size)


class _WallClock:
  """Fallback wall clock (seconds, monotonic) used when the scheduler package has none."""

  def now(self) -> float:
    return time.monotonic()


def wall_clock():
  try:
    from superinfer_jax.sched.clock import WallClock  # pylint: disable=import-outside-toplevel
  except ImportError:
    return _WallClock()
  return WallClock()


def make_scheduler(config, block_manager, clock, max_model_len: int):
  """``sched.Scheduler`` with ``config.policy`` and the scheduler knobs of ``EngineConfig``."""
  del max_model_len  # the engine caps each request's max_tokens to the context itself
  from superinfer_jax.sched.scheduler import Scheduler, SchedulerConfig  # pylint: disable=import-outside-toplevel
  sc = SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                       proactive_swap_budget=config.proactive_swap_budget, alpha=config.alpha,
                       beta_b=config.beta_b, beta_f=config.beta_f, ttft_slo=config.ttft_slo,
                       tbt_slo=config.tbt_slo)
  return Scheduler(sc, block_manager, clock, policy=config.policy)


def make_sched_request(scheduler, request_id, prompt_token_ids, *, max_tokens, arrival_time, ttft_slo,
                       tbt_slo):
  """The scheduler's request object (a custom scheduler may provide ``new_request(**same kwargs)``)."""
  factory = getattr(scheduler, "new_request", None)
  if factory is not None:
    return factory(request_id=request_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
                   arrival_time=arrival_time, ttft_slo=ttft_slo, tbt_slo=tbt_slo)
  from superinfer_jax.sched.request import Request  # pylint: disable=import-outside-toplevel
  return Request(request_id, len(prompt_token_ids), max_tokens, arrival_time, ttft_slo=ttft_slo,
                 tbt_slo=tbt_slo)


def plan_field(plan, name: str):
  v = getattr(plan, name, None)
  return () if v is None else v


def plan_pairs(plan, name: str):
  """A plan's copy list (``swap_out``, ``writeback``, ``swap_in``) as a ``PairList``: the plan's own when it
  is one (no copy, no per-pair tuple), else built from its ``(src, dst)`` pairs (a custom scheduler's lists)."""
  from superinfer_jax.kv.pairs import PairList  # pylint: disable=import-outside-toplevel
  v = getattr(plan, name, None)
  if isinstance(v, PairList):
    return v
  return PairList(() if v is None else v)


def plan_has_work(plan) -> bool:
  return any(plan_field(plan, n) for n in ("scheduled", "swap_out", "swap_in", "writeback", "rotated_out",
                                           "rotated_in", "preempted"))


# ----------------------------------------------------------------------------------------------- rotation
def make_duplex(spec, num_host_blocks: int, config):
  """A ``DuplexKV`` over a ``num_host_blocks`` host pool (None without a host pool: nothing rotates)."""
  if num_host_blocks == 0:
    return None
  import jax  # pylint: disable=import-outside-toplevel
  from superinfer_jax.rotation import DuplexKV  # pylint: disable=import-outside-toplevel
  device = jax.local_devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
  return DuplexKV(spec, num_host_blocks, mode=config.rotation_mode, device=device, host_memory_kind=kind,
                  min_bucket=config.rotation_min_bucket, max_bucket=config.rotation_max_bucket)


# ----------------------------------------------------------------------------------------------- seeds
def derive_seed(engine_seed: int, request_id: str) -> int:
  """A 32-bit seed for a request that gave none: a stable hash of (engine seed, request id)."""
  return zlib.crc32(f"{engine_seed}:{request_id}".encode()) & 0xFFFFFFFF

