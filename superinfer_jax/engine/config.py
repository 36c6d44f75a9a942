"""Engine configuration, per-request sampling parameters, output types, and the shared absl flags.

No JAX import here: scripts (and the simulator) can build configs without touching the device.

* ``EngineConfig`` — one object for the whole engine: KV pools (device blocks or a fraction of device
  memory; host blocks or GiB), block size, scheduling policy and its parameters, token budget, max
  sequences, attention backend, dtype, pipeline on/off. ``validate()`` raises a clear ``ValueError``.
* ``define_engine_flags()`` / ``engine_config_from_flags()`` — the absl flags every script shares
  (``scripts/generate.py``, ``scripts/run_experiment.py``).
* ``SamplingParams`` — max_tokens, temperature, top_p, top_k, seed, stop token ids, stop strings,
  ignore_eos; ``validate()`` raises ``ValueError`` naming the bad field.
* ``RequestOutput`` — what ``LLMEngine.step()`` returns per request and step: new token ids, text delta,
  per-token timestamps, finish reason.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

# Policy names the scheduler package registers (PAPER.md §2-3). The authoritative list is
# ``superinfer_jax.sched``'s registry when it exposes one; this is the fallback.
KNOWN_POLICIES = ("fcfs", "fcfs_swap", "wf", "sf", "rotasched", "rotasched_strict", "rotasched_code", "edf")
ATTENTION_BACKENDS = ("auto", "reference", "pallas")  # auto: pallas on GPU, reference on CPU
DTYPES = ("float32", "bfloat16")
ROTATION_MODES = ("duplex", "merged", "naive")

FINISH_STOP = "stop"        # eos token, a stop token id or a stop string
FINISH_LENGTH = "length"    # max_tokens reached (or the model's context is full)
FINISH_ABORT = "abort"      # aborted by the caller
FINISH_ERROR = "error"      # the request could not be served (e.g. it can never fit the device pool)
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR)


def registered_policies() -> tuple[str, ...]:
  """Policy names accepted by the scheduler (its registry if it has one, else ``KNOWN_POLICIES``)."""
  try:
    from superinfer_jax.sched.policies import POLICIES  # pylint: disable=import-outside-toplevel
  except ImportError:
    return KNOWN_POLICIES
  return tuple(POLICIES)


@dataclasses.dataclass
class EngineConfig:
  """Configuration of one ``LLMEngine``.

  Device pool: ``num_device_blocks`` usable blocks (the array holds one more, block 0 = padding), or, if it
  is None, ``device_memory_fraction`` of the device memory left after the weights (needs a backend that
  reports memory; on CPU give ``num_device_blocks``). Host pool: ``num_host_blocks`` blocks, or
  ``host_gib`` GiB if that is None; 0 disables rotation (policies then fall back to recompute).
  """
  num_device_blocks: Optional[int] = 256
  device_memory_fraction: float = 0.9
  num_host_blocks: Optional[int] = 1024
  host_gib: float = 4.0
  block_size: int = 16
  policy: str = "rotasched"
  alpha: float = 3.0
  beta_f: float = 0.5
  beta_b: float = 0.0
  ttft_slo: float = 5.0             # seconds
  tbt_slo: float = 0.1              # seconds
  proactive_swap_budget: int = 2400  # B_xfer, blocks per step
  max_num_batched_tokens: int = 512
  max_num_seqs: int = 64
  max_model_len: Optional[int] = None  # None: the model's max positions
  attention: str = "auto"
  dtype: str = "float32"
  pipeline: bool = True
  rotation_mode: str = "duplex"        # DuplexKV mode: "duplex" | "merged" | "naive" (Table 1 ablation)
  rotation_min_bucket: int = 1         # smallest block bucket of the rotation gather/scatter kernels
  rotation_max_bucket: int = 16        # most blocks per gather/scatter launch (compile time grows with it)
  seed: int = 0                       # seeds requests that give no seed of their own
  # Shape-bucket floors of the ragged batch (tokens T, sequences S = logit rows R, block-table width MB);
  # each is rounded up to a power of two. Raising them trades padding compute for fewer compilations
  # (tests set them to the maxima so a run compiles one shape).
  token_bucket_floor: int = 8
  seq_bucket_floor: int = 1
  blocks_bucket_floor: int = 4

  def validate(self) -> "EngineConfig":
    """Raises ``ValueError`` naming the first bad field; returns self."""
    def positive_int(name, allow_none=False, allow_zero=False):
      v = getattr(self, name)
      if v is None and allow_none:
        return
      if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"EngineConfig.{name} must be a {'non-negative' if allow_zero else 'positive'} "
                         f"int, got {v!r}")
    positive_int("num_device_blocks", allow_none=True)
    positive_int("num_host_blocks", allow_none=True, allow_zero=True)
    positive_int("block_size")
    positive_int("max_num_batched_tokens")
    positive_int("max_num_seqs")
    positive_int("max_model_len", allow_none=True)
    positive_int("proactive_swap_budget", allow_zero=True)
    positive_int("token_bucket_floor")
    positive_int("seq_bucket_floor")
    positive_int("blocks_bucket_floor")
    if not 0.0 < self.device_memory_fraction <= 1.0:
      raise ValueError(f"EngineConfig.device_memory_fraction must be in (0, 1], got "
                       f"{self.device_memory_fraction!r}")
    if not self.host_gib >= 0.0:
      raise ValueError(f"EngineConfig.host_gib must be >= 0, got {self.host_gib!r}")
    for name in ("alpha", "beta_f", "beta_b", "ttft_slo", "tbt_slo"):
      v = getattr(self, name)
      if not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"EngineConfig.{name} must be a finite number, got {v!r}")
    if self.ttft_slo <= 0 or self.tbt_slo <= 0:
      raise ValueError(f"EngineConfig SLOs must be > 0, got ttft_slo={self.ttft_slo}, tbt_slo={self.tbt_slo}")
    policies = registered_policies()
    if self.policy not in policies:
      raise ValueError(f"unknown scheduling policy {self.policy!r}; choose one of {sorted(policies)}")
    if self.attention not in ATTENTION_BACKENDS:
      raise ValueError(f"unknown attention backend {self.attention!r}; choose one of {ATTENTION_BACKENDS}")
    if self.rotation_mode not in ROTATION_MODES:
      raise ValueError(f"unknown rotation mode {self.rotation_mode!r}; choose one of {ROTATION_MODES}")
    positive_int("rotation_min_bucket")
    positive_int("rotation_max_bucket")
    if self.rotation_max_bucket & (self.rotation_max_bucket - 1):
      raise ValueError(f"EngineConfig.rotation_max_bucket must be a power of two, got {self.rotation_max_bucket}")
    if self.dtype not in DTYPES:
      raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {DTYPES}")
    return self


@dataclasses.dataclass
class SamplingParams:
  """Per-request sampling and stopping parameters (OpenAI / vLLM meanings).

  temperature 0 is greedy. top_k 0 (or -1) disables top-k; top_p 1 disables top-p. ``seed`` None: the
  engine derives one from its own seed and the request id (still reproducible run to run).
  Stop strings are searched in the detokenized output; the text is cut before the stop string and the
  finish reason is "stop" (token ids still include the token that completed the stop string).
  """
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: Optional[int] = None
  stop_token_ids: Sequence[int] = ()
  stop: Sequence[str] = ()
  ignore_eos: bool = False

  def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
    """Raises ``ValueError`` naming the bad field; normalises sequences to tuples; returns self."""
    if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
      raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
    if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
        or self.temperature < 0):
      raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
      raise ValueError(f"SamplingParams.top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
    if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                  or not 0 <= self.seed < 2**32):
      raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**32), got {self.seed!r}")
    if isinstance(self.stop, str):
      self.stop = (self.stop,)
    self.stop = tuple(self.stop)
    for s in self.stop:
      if not isinstance(s, str) or not s:
        raise ValueError(f"SamplingParams.stop entries must be non-empty strings, got {s!r}")
    self.stop_token_ids = tuple(self.stop_token_ids)
    for t in self.stop_token_ids:
      if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
        raise ValueError(f"SamplingParams.stop_token_ids entry {t!r} is not a token id"
                         + (f" in [0, {vocab_size})" if vocab_size is not None else ""))
    return self


@dataclasses.dataclass
class RequestOutput:
  """New output of one request produced by one engine step (or the final accumulated output).

  ``token_ids`` are the tokens new in this output; ``timestamps[i]`` is the clock time (seconds) at which
  ``token_ids[i]`` was read back from the device. ``text`` is the matching text delta (may lag a token
  behind when a multi-byte character is incomplete, and holds back text that could start a stop string).
  ``finish_reason`` is None while the request runs, else one of ``FINISH_REASONS``; ``error`` says why
  for "error".
  """
  request_id: str
  token_ids: list[int]
  text: str
  timestamps: list[float]
  finished: bool = False
  finish_reason: Optional[str] = None
  prompt_token_ids: Optional[list[int]] = None
  error: Optional[str] = None


@dataclasses.dataclass
class CompletionOutput:
  """The whole result of one request, as ``LLMEngine.generate`` returns it."""
  request_id: str
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str
  finish_reason: Optional[str]
  timestamps: list[float]
  arrival_time: float


# ----------------------------------------------------------------------------------------------- flags

def define_engine_flags(flag_values=None) -> None:
  """Defines the engine's absl flags (idempotent per FlagValues). Defaults come from ``EngineConfig``."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flags.FLAGS if flag_values is None else flag_values
  if "num_device_blocks" in fv:
    return
  d = EngineConfig()
  flags.DEFINE_integer("num_device_blocks", d.num_device_blocks,
                       "usable device KV blocks (0: use --device_memory_fraction)", flag_values=fv)
  flags.DEFINE_float("device_memory_fraction", d.device_memory_fraction,
                     "fraction of free device memory for the KV pool when --num_device_blocks=0",
                     flag_values=fv)
  flags.DEFINE_integer("num_host_blocks", d.num_host_blocks,
                       "host (pinned) KV blocks (-1: use --host_gib; 0: no rotation)", flag_values=fv)
  flags.DEFINE_float("host_gib", d.host_gib, "host pool size in GiB when --num_host_blocks=-1",
                     flag_values=fv)
  flags.DEFINE_integer("block_size", d.block_size, "tokens per KV block", flag_values=fv)
  flags.DEFINE_string("policy", d.policy, f"scheduling policy ({', '.join(KNOWN_POLICIES)}, ...)",
                      flag_values=fv)
  flags.DEFINE_float("alpha", d.alpha, "RotaSched alpha (rotary VLT weight)", flag_values=fv)
  flags.DEFINE_float("beta_f", d.beta_f, "RotaSched beta_F (waiting grace, x TTFT SLO)", flag_values=fv)
  flags.DEFINE_float("beta_b", d.beta_b, "RotaSched beta_B (rotary grace, x TBT SLO)", flag_values=fv)
  flags.DEFINE_float("ttft_slo", d.ttft_slo, "TTFT SLO in seconds", flag_values=fv)
  flags.DEFINE_float("tbt_slo", d.tbt_slo, "TBT SLO in seconds", flag_values=fv)
  flags.DEFINE_integer("proactive_swap_budget", d.proactive_swap_budget,
                       "B_xfer: blocks rotated per step at most", flag_values=fv)
  flags.DEFINE_integer("max_num_batched_tokens", d.max_num_batched_tokens, "token budget per step",
                       flag_values=fv)
  flags.DEFINE_integer("max_num_seqs", d.max_num_seqs, "max sequences per step", flag_values=fv)
  flags.DEFINE_integer("max_model_len", 0, "max tokens per request (0: the model's max positions)",
                       flag_values=fv)
  flags.DEFINE_enum("attention", d.attention, list(ATTENTION_BACKENDS), "attention backend",
                    flag_values=fv)
  flags.DEFINE_enum("dtype", d.dtype, list(DTYPES), "weights / KV dtype", flag_values=fv)
  flags.DEFINE_bool("pipeline", d.pipeline, "overlap planning + transfers of step k+1 with step k",
                    flag_values=fv)
  flags.DEFINE_integer("engine_seed", d.seed, "seed for requests that give none", flag_values=fv)
  flags.DEFINE_enum("rotation_mode", d.rotation_mode, list(ROTATION_MODES),
                    "DuplexKV transfer mode (duplex | merged | naive)", flag_values=fv)
  flags.DEFINE_integer("rotation_max_bucket", d.rotation_max_bucket,
                       "most blocks per rotation gather/scatter launch (power of two)", flag_values=fv)
  flags.DEFINE_integer("rotation_min_bucket", d.rotation_min_bucket,
                       "smallest block bucket of the rotation kernels", flag_values=fv)
  flags.DEFINE_integer("token_bucket_floor", d.token_bucket_floor, "min token bucket of a step",
                       flag_values=fv)
  flags.DEFINE_integer("seq_bucket_floor", d.seq_bucket_floor, "min sequence bucket of a step",
                       flag_values=fv)
  flags.DEFINE_integer("blocks_bucket_floor", d.blocks_bucket_floor, "min block-table width bucket",
                       flag_values=fv)


def engine_config_from_flags(flag_values=None) -> EngineConfig:
  """Builds and validates an ``EngineConfig`` from parsed flags (see ``define_engine_flags``)."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  fv = flags.FLAGS if flag_values is None else flag_values
  return EngineConfig(
      num_device_blocks=fv.num_device_blocks or None,
      device_memory_fraction=fv.device_memory_fraction,
      num_host_blocks=None if fv.num_host_blocks < 0 else fv.num_host_blocks,
      host_gib=fv.host_gib,
      block_size=fv.block_size,
      policy=fv.policy,
      alpha=fv.alpha, beta_f=fv.beta_f, beta_b=fv.beta_b, ttft_slo=fv.ttft_slo, tbt_slo=fv.tbt_slo,
      proactive_swap_budget=fv.proactive_swap_budget,
      max_num_batched_tokens=fv.max_num_batched_tokens,
      max_num_seqs=fv.max_num_seqs,
      max_model_len=fv.max_model_len or None,
      attention=fv.attention, dtype=fv.dtype, pipeline=fv.pipeline, seed=fv.engine_seed,
      rotation_mode=fv.rotation_mode, rotation_min_bucket=fv.rotation_min_bucket,
      rotation_max_bucket=fv.rotation_max_bucket,
      token_bucket_floor=fv.token_bucket_floor, seq_bucket_floor=fv.seq_bucket_floor,
      blocks_bucket_floor=fv.blocks_bucket_floor,
  ).validate()
