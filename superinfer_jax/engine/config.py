"""Engine configuration, per-request sampling parameters, output types, and the shared absl flags.

No JAX import here: scripts (and the simulator) can build configs without touching the device.

* ``EngineConfig`` — the root of the one config tree: KV pools (device blocks or a fraction of device
  memory; host blocks or GiB), block size, pipeline, bucket floors, and the nested frozen
  ``SchedulerConfig`` (``sched/config.py``), ``RotationConfig`` (``rotation/config.py``) and
  ``ModelSettings`` (``model/settings.py``). Each setting is declared once (``configtree.knob``).
* ``define_engine_flags()`` / ``engine_config_from_flags()`` — the absl flags every script shares, generated
  from the tree's fields (one name, one default, one help text per setting).
* ``SamplingParams`` — max_tokens, temperature, top_p, top_k, seed, stop token ids, stop strings,
  ignore_eos; ``validate()`` raises ``ValueError`` naming the bad field.
* ``RequestOutput`` — what ``LLMEngine.step()`` returns per request and step: new token ids, text delta,
  per-token timestamps, finish reason.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

from superinfer_jax import configtree
from superinfer_jax.configtree import knob, subtree
from superinfer_jax.model.sampling_params import SamplingParams  # re-exported: defined below parallel/
from superinfer_jax.model.settings import ModelSettings
from superinfer_jax.rotation.config import RotationConfig
from superinfer_jax.sched.config import SchedulerConfig

FINISH_STOP = "stop"        # eos token, a stop token id or a stop string
FINISH_LENGTH = "length"    # max_tokens reached (or the model's context is full)
FINISH_ABORT = "abort"      # aborted by the caller
FINISH_ERROR = "error"      # the request could not be served (e.g. it can never fit the device pool)
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR)
LAYER_LOOPS = ("unrolled", "scan")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Configuration of one ``LLMEngine``: the KV pools and step shapes here, the rest in three subtrees.

  * ``scheduler``: ``sched.config.SchedulerConfig`` (policy, budgets, VLT knobs, SLOs, write-back, residency).
  * ``rotation``: ``rotation.config.RotationConfig`` (DuplexKV transfer mode, layout, kernel buckets).
  * ``model``: ``model.settings.ModelSettings`` (attention backend, dtype, context cap).

  Device pool: ``num_device_blocks`` usable blocks (the array holds one more, block 0 = padding), or, if it
  is None, ``device_memory_fraction`` of the device memory left after the weights (needs a backend that
  reports memory; on CPU give ``num_device_blocks``). Host pool: ``num_host_blocks`` blocks, or
  ``host_gib`` GiB if that is None; 0 disables rotation (policies then fall back to recompute).

  Frozen and validated at construction (``ValueError`` naming the field). Build one from flat setting
  names with ``EngineConfig.create(policy="fcfs", num_device_blocks=40)`` and derive one with
  ``cfg.replace(policy="rotasched")``; every setting is also a flag (``define_engine_flags``).
  """
  num_device_blocks: Optional[int] = knob(256, "usable device KV blocks (unset: --device_memory_fraction)",
                                          none_as=0)
  device_memory_fraction: float = knob(0.9, "fraction of free device memory for the KV pool when "
                                            "--num_device_blocks is unset")
  num_host_blocks: Optional[int] = knob(1024, "host (pinned) KV blocks (0: no rotation; unset: --host_gib)",
                                        none_as=-1)
  host_gib: float = knob(4.0, "host pool size in GiB when --num_host_blocks is unset")
  block_size: int = knob(16, "tokens per KV block")
  pipeline: bool = knob(True, "overlap planning + transfers of step k+1 with step k")
  zero_bubble: bool = knob(True, "with --pipeline: dispatch step k+1 before reading step k's ids, feeding "
                                 "the tokens k samples to k+1 on device (false: read k's ids, then dispatch)")
  seed: int = knob(0, "seed of requests that give none", flag="engine_seed")
  tensor_parallel_size: int = knob(1, "devices of the 1-D tensor-parallel mesh (weights and KV sharded by "
                                      "heads; docs/parallel.md)")
  layer_loop: str = knob("unrolled", "model layers unrolled (straight-line step: no while loop, each matmul "
                                     "reads its own weight buffer; compile time grows with the layers) or as a "
                                     "scan (one compiled layer body)", choices=LAYER_LOOPS)
  # Shape-bucket floors of the ragged batch (tokens T, sequences S = logit rows R, block-table width MB);
  # each is rounded up to a power of two. Raising them trades padding compute for fewer compilations.
  token_bucket_floor: int = knob(1, "smallest token bucket of a step")
  seq_bucket_floor: int = knob(1, "smallest sequence bucket of a step")
  blocks_bucket_floor: int = knob(4, "smallest block-table width bucket of a step")
  scheduler: SchedulerConfig = subtree(SchedulerConfig)
  rotation: RotationConfig = subtree(RotationConfig)
  model: ModelSettings = subtree(ModelSettings)

  def __post_init__(self):
    def check_int(name, allow_none=False, allow_zero=False):
      v = getattr(self, name)
      if v is None and allow_none:
        return
      if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"EngineConfig.{name} must be a {'non-negative' if allow_zero else 'positive'} "
                         f"int, got {v!r}")
    check_int("num_device_blocks", allow_none=True)
    check_int("num_host_blocks", allow_none=True, allow_zero=True)
    check_int("block_size")
    check_int("token_bucket_floor")
    check_int("seq_bucket_floor")
    check_int("blocks_bucket_floor")
    check_int("seed", allow_zero=True)
    check_int("tensor_parallel_size")
    configtree.check_choices(self)
    if not 0.0 < self.device_memory_fraction <= 1.0:
      raise ValueError(f"EngineConfig.device_memory_fraction must be in (0, 1], got "
                       f"{self.device_memory_fraction!r}")
    if not self.host_gib >= 0.0:
      raise ValueError(f"EngineConfig.host_gib must be >= 0, got {self.host_gib!r}")
    for name, cls in (("scheduler", SchedulerConfig), ("rotation", RotationConfig), ("model", ModelSettings)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"EngineConfig.{name} must be a {cls.__name__}, got {type(getattr(self, name))}")

  @classmethod
  def create(cls, **settings) -> "EngineConfig":
    """An ``EngineConfig`` from flat setting names (any level of the tree); unknown names raise TypeError."""
    return configtree.build(cls, settings)

  def replace(self, **settings) -> "EngineConfig":
    """A copy with the given flat settings changed (any level of the tree)."""
    return configtree.build(type(self), settings, base=self)

  def validate(self) -> "EngineConfig":
    """Configs validate at construction; kept so callers can chain it. Returns self."""
    return self

  def as_flat_dict(self) -> dict:
    """Every setting as ``name -> value`` (results rows, ``config.json``)."""
    return configtree.as_flat_dict(self)


class TokenLogprobs(NamedTuple):
  """The logprobs of one output token (``SamplingParams.logprobs``): its own log-probability under the
  log-softmax of the raw model logits, and the ``k`` most likely tokens as ``(token id, logprob)``,
  most likely first."""
  logprob: float
  top: list[tuple[int, float]]

  @classmethod
  def of_row(cls, values, ids, k: int) -> "TokenLogprobs":
    """From one row of a step's logprobs (``values [1 + K]``, ``ids [K]``, K >= k)."""
    return cls(float(values[0]), [(int(ids[j]), float(values[1 + j])) for j in range(k)])


@dataclasses.dataclass
class RequestOutput:
  """New output of one request produced by one engine step (or the final accumulated output).

  ``token_ids`` are the tokens new in this output; ``timestamps[i]`` is the clock time (seconds) at which
  ``token_ids[i]`` was read back from the device. ``text`` is the matching text delta (may lag a token
  behind when a multi-byte character is incomplete, and holds back text that could start a stop string).
  ``finish_reason`` is None while the request runs, else one of ``FINISH_REASONS``; ``error`` says why
  for "error". ``state_changes`` are the request's scheduling state changes since its last output, as
  ``(time, state)`` pairs in order, ``time`` being the clock reading the step's plan was made at and
  ``state`` one of "running" (admitted, or its KV rotated back in), "rotary" (KV rotated out to host
  memory), "preempted" (KV dropped, to be recomputed): what a timeline needs without reading the
  scheduler. ``logprobs`` (only when the request asked, ``SamplingParams.logprobs``): one ``TokenLogprobs``
  per token of ``token_ids``. ``num_cached_tokens``: prompt tokens whose KV its first admission found in the
  prefix cache (None until admitted; 0 with caching off).
  """
  request_id: str
  token_ids: list[int]
  text: str
  timestamps: list[float]
  finished: bool = False
  finish_reason: Optional[str] = None
  prompt_token_ids: Optional[list[int]] = None
  error: Optional[str] = None
  state_changes: list[tuple[float, str]] = dataclasses.field(default_factory=list)
  logprobs: Optional[list[TokenLogprobs]] = None
  num_cached_tokens: Optional[int] = None


@dataclasses.dataclass
class CompletionOutput:
  """The whole result of one request, as ``LLMEngine.generate`` returns it (``logprobs`` and
  ``num_cached_tokens`` as in ``RequestOutput``, for every output token)."""
  request_id: str
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str
  finish_reason: Optional[str]
  timestamps: list[float]
  arrival_time: float
  logprobs: Optional[list[TokenLogprobs]] = None
  num_cached_tokens: Optional[int] = None


# ----------------------------------------------------------------------------------------------- flags

def define_engine_flags(flag_values=None) -> None:
  """One absl flag per ``EngineConfig`` setting (generated from the fields; idempotent per FlagValues)."""
  configtree.define_flags(EngineConfig, flag_values)


def engine_config_from_flags(flag_values=None) -> EngineConfig:
  """Builds an ``EngineConfig`` from parsed flags (see ``define_engine_flags``); ``ValueError`` if bad."""
  return configtree.from_flags(EngineConfig, flag_values)
