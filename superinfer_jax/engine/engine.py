"""LLMEngine: the serving step loop (continuous batching, chunked prefill, rotation, on-device sampling).

One engine step (docs/architecture.md "One engine step"):

  1. ``Scheduler.schedule()`` reads the clock and the block manager and returns a ``StepPlan``: sequences
     with token counts (chunked prefill under a token budget), requests rotated out / in, preempted.
  2. ``DuplexKV.issue(cache, swap_out, writeback, swap_in)`` gathers the D2H blocks (rotation + eager
     write-back) from the cache returned by the last dispatched step, starts their copy to pinned host,
     and scatters the H2D blocks into the (donated) cache. Gather-before-scatter makes reusing a block
     freed by a swap-out in the same step safe.
  3. ``build_batch`` (numpy) packs the ragged batch; ONE explicit transfer moves it (and the per-row
     sampling parameters) to the device, inside the jitted call (``LLMEngine._call_step``); the jitted step runs the model on the donated cache and
     samples on device (``engine/sampling.py``).
  4. Only the sampled token ids come back (one explicit ``jax.device_get``); stop checks (eos unless
     ignore_eos, stop token ids, stop strings, max_tokens, context length) run on the host;
     ``Scheduler.on_step_done`` is told the new tokens and finished requests; outputs carry timestamps.

Three loops (``EngineConfig.pipeline`` and ``zero_bubble``):

* zero-bubble (pipeline and zero_bubble on, the default; on-device token feedback): with step k in flight,
  the host plans step k+1 with ``schedule(lookahead=True)`` (requests in flight are assumed to gain one
  token), issues its transfers and dispatches it at once: the token each continuing sequence needs is the
  one step k is sampling, and step k+1 takes it from step k's device output (``packing.feed_tokens``), so
  the device never waits for the host to read ids. Only then does the host read step k's ids (stop checks,
  outputs), one step behind. A request that stopped at step k was already in step k+1: the token step k+1
  computed for it is discarded (``EngineStats.discarded_tokens``) and its blocks, freed when step k's stop
  was seen, are reused only by steps dispatched later (which overwrite before they read, in device order).
* pipelined (pipeline on, zero_bubble off; the ablation): plan and issue k+1 while k runs, then read k's
  ids, drop requests that finished at k from plan k+1 ("reschedule"; ``rescheduled_drops``), then
  dispatch k+1 with its tokens from the host. The device idles from the end of k until that dispatch.
* sync (pipeline off): each step plans, issues, dispatches and reads back in sequence.

All three give the same tokens and the same timestamp rule, and none makes an implicit transfer (tested
under ``jax.transfer_guard("disallow")``). The host builds a step's inputs in a persistent buffer
(``engine/host_batch.py``): a decode step of the same sequences updates it in place.

Timestamps come from the injected clock (default ``WallClock``); a token's timestamp is the clock time at
which its step's ids were read back.

Counters (``LLMEngine.stats``, ``EngineStats``): steps, rotations out/in, blocks and bytes out (swap-out +
eager write-back) and in, recompute preemptions, lookahead slots dropped, tokens discarded, and host time
by phase, with ``host_time_share`` (host busy / step wall time) and ``exposed_host_share`` (host time
between reading step k and dispatching step k+1, a host-timer bound on the device's wait; 0 in the
zero-bubble loop, which dispatches k+1 first). The device's real idle time per step is measured from
timestamps by ``engine/idle_probe.py`` (``LLMEngine.idle_probe``; ``scripts/bench_engine.py``).

Not thread-safe: one thread drives ``add_request`` / ``abort`` / ``step`` (a server funnels requests into
that thread).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Any, Iterator, Optional, Sequence, Union

import jax
import numpy as np

from superinfer_jax.engine import packing
from superinfer_jax.engine import sampling as sampling_lib
from superinfer_jax.engine.host_batch import HostBatch, SeqInput
from superinfer_jax.engine.config import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, CompletionOutput,
                                          EngineConfig, RequestOutput, SamplingParams)
from superinfer_jax.engine.detokenizer import IncrementalDetokenizer
from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.layout import BLOCK_FIRST
from superinfer_jax.model import load_model, load_tokenizer
from superinfer_jax.model.batch import bucket
from superinfer_jax.model.forward import forward, init_kv_cache
from superinfer_jax.model import dense_pack
from superinfer_jax.model.fused import fuse_projections, transpose_mlp, unroll_layers
from superinfer_jax.model.tokenizer import encode_text
from superinfer_jax.parallel import distributed
from superinfer_jax.parallel.tensor_parallel import make_tensor_parallel
from superinfer_jax.parallel.mesh import free_device_bytes
from superinfer_jax.rotation import DuplexKV
from superinfer_jax.sched import Request, Scheduler, WallClock
from superinfer_jax.sched.protocol import SchedulerProtocol
from superinfer_jax.util import set_thread_nice, set_thread_realtime

PromptType = Union[str, Sequence[int]]


def _tokenizer_or_none(path_or_name: str):
  """The model's tokenizer, or None when the model ships none (token-id prompts only)."""
  try:
    return load_tokenizer(path_or_name)
  except (FileNotFoundError, ValueError, OSError):
    return None


def _eos_token_ids(cfg, tokenizer) -> set[int]:
  """End-of-sequence ids from the model config and the tokenizer (``model.Tokenizer`` or an HF one)."""
  ids = set(getattr(cfg, "eos_token_ids", ()) or ())
  for attr in ("eos_ids", "eos_token_ids"):
    v = getattr(tokenizer, attr, None)
    if v:
      ids.update(int(x) for x in v)
  for attr in ("eos_id", "eos_token_id"):
    v = getattr(tokenizer, attr, None)
    if isinstance(v, int):
      ids.add(v)
  return ids


class RequestError(ValueError):
  """A request was rejected at ``add_request`` (empty / too long prompt, can never fit, bad params)."""


@dataclasses.dataclass
class EngineStats:
  """Counters since the engine started. Bytes use the KV spec's block size (all layers, K and V)."""
  steps: int = 0
  model_steps: int = 0
  tokens_scheduled: int = 0
  tokens_generated: int = 0
  rotations_out: int = 0
  rotations_in: int = 0
  blocks_out: int = 0            # D2H blocks of rotations (swap-out)
  blocks_writeback: int = 0      # D2H blocks of eager write-back
  blocks_in: int = 0             # H2D blocks
  bytes_out: int = 0             # D2H bytes (swap-out + write-back)
  bytes_in: int = 0
  round_trips: int = 0           # rotated out and back in within one step (rotasched_code)
  recompute_preemptions: int = 0
  contended_steps: int = 0       # steps planned under memory contention (rotation considered)
  residency_steps: int = 0       # sum over rotations out of the steps the request had been resident
  rescheduled_drops: int = 0     # lookahead slots dropped because the request finished
  discarded_tokens: int = 0      # zero-bubble: tokens computed for a request that had stopped a step before
  batch_rebuilds: int = 0        # steps whose host inputs were rebuilt (the rest were updated in place)
  step_time_s: float = 0.0       # wall time spent inside step()
  host_time_s: float = 0.0       # ... of which not blocked waiting for sampled tokens
  wait_time_s: float = 0.0       # ... blocked in device_get of the sampled ids
  # Host time by phase (seconds): plan (scheduler), issue (DuplexKV), dispatch (build_batch + device_put +
  # jitted call), process (stop checks, detokenization, on_step_done).
  schedule_time_s: float = 0.0
  issue_time_s: float = 0.0
  dispatch_time_s: float = 0.0
  process_time_s: float = 0.0
  # CPU time of the host thread in dispatch: on a CPU backend the device's compute threads share the cores,
  # so dispatch's wall time includes waiting for a core; this is the host's own work.
  dispatch_cpu_time_s: float = 0.0
  # Host time the device sits idle for in the loop: from reading step k's ids to dispatching step k+1
  # (pipelined: process + dispatch; the plan and transfers of k+1 are hidden behind step k; zero-bubble:
  # none, k+1 is dispatched before k's ids are read).
  exposed_host_time_s: float = 0.0

  @property
  def rotations_per_step(self) -> float:
    """Rotations out per planned step."""
    return self.rotations_out / self.steps if self.steps else 0.0

  @property
  def mean_residency_steps(self) -> Optional[float]:
    """Mean steps a request stayed RUNNING before it was rotated out (None: no rotation)."""
    return self.residency_steps / self.rotations_out if self.rotations_out else None

  @property
  def host_time_share(self) -> float:
    """Share of step() wall time the host spends working (not blocked on the device)."""
    return self.host_time_s / self.step_time_s if self.step_time_s > 0 else 0.0

  @property
  def exposed_host_share(self) -> float:
    """Share of step() wall time the device waits for the host (upper bound; see exposed_host_time_s)."""
    return self.exposed_host_time_s / self.step_time_s if self.step_time_s > 0 else 0.0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["host_time_share"] = self.host_time_share
    d["rotations_per_step"] = self.rotations_per_step
    d["mean_residency_steps"] = self.mean_residency_steps
    d["exposed_host_share"] = self.exposed_host_share
    return d


@dataclasses.dataclass
class _Req:
  """Engine-side state of one request."""
  request_id: str
  prompt_token_ids: list[int]
  params: SamplingParams
  seed: int
  max_total_len: int             # prompt + output tokens allowed (max_tokens and context capped)
  arrival_time: float
  detok: Optional[IncrementalDetokenizer]
  output_token_ids: list[int] = dataclasses.field(default_factory=list)
  timestamps: list[float] = dataclasses.field(default_factory=list)
  text: str = ""
  finish_reason: Optional[str] = None
  error: Optional[str] = None
  # Streaming cursor: outputs not yet returned by step().
  pending_tokens: list[int] = dataclasses.field(default_factory=list)
  pending_times: list[float] = dataclasses.field(default_factory=list)
  pending_text: str = ""
  pending_states: list[tuple[float, str]] = dataclasses.field(default_factory=list)
  reported_final: bool = False
  # (temperature, top_k (0 = off), top_p, seed): the per-row sampling parameters of its steps (fixed).
  sampling: tuple[float, int, float, int] = dataclasses.field(init=False)

  def __post_init__(self):
    p = self.params
    self.sampling = (p.temperature, max(p.top_k, 0), p.top_p, self.seed)

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  def all_tokens_len(self) -> int:
    return len(self.prompt_token_ids) + len(self.output_token_ids)

  def token_at(self, i: int) -> int:
    p = len(self.prompt_token_ids)
    return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

  def tokens(self, start: int, stop: int) -> list[int]:
    p = len(self.prompt_token_ids)
    if stop <= p:
      return self.prompt_token_ids[start:stop]
    if start >= p:
      return self.output_token_ids[start - p:stop - p]
    return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]


@dataclasses.dataclass
class _InFlight:
  """A dispatched model step whose sampled ids are not read yet."""
  plan: Any
  tokens: jax.Array                      # [N] int32 on device (N = LLMEngine.out_rows; row i = logits row i)
  rows: dict[str, int]                   # request id -> logits row, for each sequence that samples
  scheduled: list[str]                   # request ids in the step
  read_time: float = 0.0                 # perf_counter() when its ids were read back
  probe_step: int = -1                   # the idle probe's index of this step


def _dense_backend(settings, cfg, layer_loop: str, single_device: bool) -> str:
  """What ``ModelSettings.dense`` resolves to for this engine: ``cpu_kernel`` or ``xla``. ``auto`` takes the
  kernel on XLA:CPU for an unrolled, single-device, packable model (``dense_pack.packable``) where it builds (else
  ``xla``, logged with why); ``cpu_kernel`` asked for where it cannot apply raises ``ValueError`` /
  ``RuntimeError`` with the reason."""
  if settings.dense == "xla":
    return "xla"
  from pallas_kernels import cpu_dense  # pylint: disable=import-outside-toplevel
  reasons = []
  if jax.default_backend() != "cpu":
    reasons.append(f"the backend is {jax.default_backend()}, not cpu")
  if layer_loop != "unrolled":
    reasons.append("the layers run as a scan (--layer_loop=unrolled needed)")
  if not single_device:
    reasons.append("tensor parallel")
  if not dense_pack.packable(cfg, settings.dtype):
    reasons.append(f"the model is not packable (MoE, dtype {settings.dtype}, or an output size not a multiple "
                   f"of {dense_pack.LANES})")
  if not reasons and cpu_dense.build_error() is not None:
    reasons.append(f"the kernel does not build: {cpu_dense.build_error()}")
  if not reasons:
    return "cpu_kernel"
  if settings.dense == "cpu_kernel":
    raise ValueError(f"--dense=cpu_kernel cannot be used here: {'; '.join(reasons)}")
  if jax.default_backend() == "cpu":
    logging.getLogger(__name__).info("dense 'auto' uses XLA's dots: %s", "; ".join(reasons))
  return "xla"


def _step_fn(params, kv_cache, packed, prev_tokens, *, dims, cfg, attention, logits_sharding=None,
             params_def=None, vocab_major_min_rows=0, dense_max_rows=0):
  """Model forward on the donated cache + on-device sampling. Returns (tokens[N] int32, kv_cache).

  ``params``: the weights pytree, or (with ``params_def``, its static treedef) the tuple of its leaves:
  the jitted call then flattens a flat tuple instead of nested dicts (the unrolled CPU layout has ~150
  leaves, each dict sorted per call). ``packed`` is the step's one int32 buffer (``engine/packing.py``)
  with batch dims ``dims`` (static); ``prev_tokens`` [N] the previous step's sampled ids (on device), read
  where the buffer's feed says so. The R sampled ids are padded with zeros to N, so every step's output
  can be the next one's input. ``logits_sharding`` (tensor parallel): the vocab-sharded logits are
  gathered to it before sampling. ``vocab_major_min_rows`` (static; 0: never): steps with at least this many
  logit rows have ``forward`` return logits as ``[vocab, rows]`` (``logits_layout="vocab"``); sampling reads
  either layout and gives the same tokens.
  """
  if params_def is not None:
    params = jax.tree.unflatten(params_def, params)
  batch, samp, feed = packing.unpack(packed, dims)
  batch = batch._replace(token_ids=packing.feed_tokens(batch.token_ids, feed, prev_tokens))
  rows = batch.logits_indices.shape[0]
  # The cpu_dense head gives [rows, vocab]: its steps keep that layout.
  on_kernel = dense_pack.on_kernel(batch.token_ids.shape[0], dense_max_rows)
  logits_layout = "vocab" if 0 < vocab_major_min_rows <= rows and not on_kernel else "rows"
  logits, kv_cache = forward(params, kv_cache, batch, cfg, attention, logits_layout=logits_layout,
                             dense_max_rows=dense_max_rows)
  if logits_sharding is not None:
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
  tokens = sampling_lib.sample(logits, *samp, vocab_major=logits_layout == "vocab")
  return jax.numpy.zeros_like(prev_tokens).at[:tokens.shape[0]].set(tokens), kv_cache


def _guard_state():
  """jax's host->device transfer-guard setting (a ``State`` whose ``value`` is None, "allow", "log",
  "disallow", ...; thread-local contexts included), or None where this jax version keeps it elsewhere."""
  try:
    from jax._src import config as jax_config  # pylint: disable=import-outside-toplevel
    state = jax_config.transfer_guard_host_to_device
    state.value  # pylint: disable=pointless-statement
    return state
  except Exception:  # pylint: disable=broad-except
    return None


_H2D_GUARD = _guard_state()
_NO_GUARD = contextlib.nullcontext()  # reusable: the step call's context when no transfer guard applies


def _host_to_device_allowed() -> bool:
  """True when host->device transfers are allowed without a log line (jax's default), so the step's numpy
  buffer can go into the jitted call without entering ``transfer_guard_host_to_device("allow")``."""
  return _H2D_GUARD is not None and _H2D_GUARD.value in (None, "allow")


# One jit for all engines in the process (cfg and attention static), so engines built on the same model and
# bucket floors share compilations.
_jit_step = jax.jit(_step_fn, static_argnames=("dims", "cfg", "attention", "logits_sharding", "params_def",
                                               "vocab_major_min_rows", "dense_max_rows"),
                    donate_argnums=(1,))


class LLMEngine:
  """In-process serving engine. See the module docstring for the step loop.

  Args:
    model: a model path / name accepted by ``load_model`` (HF dir, .gguf, orbax dir, ``smollm2-135m``), or a
      tuple ``(cfg, params)`` / ``(cfg, params, tokenizer)``.
    config: ``EngineConfig`` (validated here; a bad value -> ``ValueError`` at startup).
    clock: object with ``now() -> float`` seconds (default: the scheduler package's ``WallClock``).
    tokenizer: overrides the tokenizer loaded with the model (None: load it when ``model`` is a path;
      with ``(cfg, params)`` and no tokenizer, prompts must be token ids and outputs have no text).
    scheduler_factory: ``(scheduler_config, block_manager, clock) -> SchedulerProtocol`` to plug in a
      custom scheduler (default: ``sched.Scheduler`` with ``config.scheduler.policy``).
    idle_probe: optional ``engine.idle_probe.DeviceIdleProbe`` told of every dispatch and read-back (also
      settable later as ``engine.idle_probe``).
  """

  @property
  def params(self):
    """The weights pytree the step runs on (the step passes its leaves, ``_param_leaves``)."""
    return self._params

  @params.setter
  def params(self, params) -> None:
    self._params = params
    leaves, self._params_def = jax.tree.flatten(params)
    self._param_leaves = tuple(leaves)

  def __init__(self, model: Any, config: Optional[EngineConfig] = None, clock: Any = None,
               tokenizer: Any = None, scheduler_factory: Any = None, idle_probe: Any = None):
    self.config = config = (config or EngineConfig())
    if config.rotation.kv_layout != BLOCK_FIRST:
      raise ValueError(f"kv_layout={config.rotation.kv_layout!r}: the engine's attention reads a block-first "
                       "cache; the layer-first layout is measured by scripts/bench_transfer.py and modelled "
                       "by the simulator")
    # Tensor parallelism (superinfer_jax/parallel): None at tensor_parallel_size=1 (single device).
    self.tp = make_tensor_parallel(config.tensor_parallel_size)
    if isinstance(model, (tuple, list)):
      if len(model) == 3:
        cfg, params, tok = model
      elif len(model) == 2:
        (cfg, params), tok = model, None
      else:
        raise ValueError("model tuple must be (cfg, params) or (cfg, params, tokenizer)")
      params = jax.device_put(params) if self.tp is None else params
    else:
      cfg, params = (load_model if self.tp is None else self.tp.load_model)(model, dtype=config.model.dtype)
      tok = _tokenizer_or_none(model) if tokenizer is None else None
    run_cfg = cfg   # the config the step runs with (tensor parallel: KV heads replicated as needed)
    if self.tp is not None:
      run_cfg, params = self.tp.prepare(cfg, params)
    self.model_config = cfg
    self.layer_loop = config.layer_loop
    if self.layer_loop == "auto":
      self.layer_loop = "unrolled" if jax.default_backend() == "cpu" else "scan"
    if self.layer_loop == "unrolled":
      # Unrolled (CPU): every leaf is a jit argument, so fuse q|k|v and gate|up first (model/fused.py;
      # 272 -> 152 leaves for SmolLM2), keep the norms stacked (unroll_layers: -> 123), and store the dense
      # MLP's weights [out, in] (transpose_mlp: XLA CPU's 16-64-row products run faster against them; engine
      # decode ~5% faster at batch 16, ~2% at 64, batch 1 within noise). Tensor-parallel params stay unfused:
      # their specs shard each.
      self.params = unroll_layers(transpose_mlp(fuse_projections(params, run_cfg)) if self.tp is None else params)
    else:
      self.params = params
    self.dense_backend = _dense_backend(config.model, run_cfg, self.layer_loop, self.tp is None)
    if self.dense_backend == "cpu_kernel":
      # Decode-sized steps run the projections on the C++ kernel over one packed copy (model/dense_pack.py).
      self.params = dict(self.params, dense_packed=jax.device_put(dense_pack.pack_params(self.params, run_cfg)))
    self.tokenizer = tokenizer if tokenizer is not None else tok
    self.eos_token_ids = frozenset(_eos_token_ids(cfg, self.tokenizer))
    self.max_model_len = min(config.model.max_model_len or cfg.max_position_embeddings,
                             cfg.max_position_embeddings)
    self.clock = clock if clock is not None else WallClock()
    self.replica = distributed.replicated_schedule(self.clock)   # multi-process: shared clock, plan digest
    if self.replica is not None:
      self.clock = self.replica
    self.kv_spec = run_cfg.kv_spec(config.block_size, dtype=config.model.dtype)
    self.num_device_blocks = self._device_blocks()
    self.num_host_blocks = self._host_blocks()
    self.block_manager = BlockManager(self.num_device_blocks, self.num_host_blocks, config.block_size)
    self.scheduler: SchedulerProtocol = (scheduler_factory or Scheduler)(
        config.scheduler, self.block_manager, self.clock)
    if self.replica is not None:
      self.scheduler = self.replica.wrap(self.scheduler)
    self.kv_cache = (init_kv_cache if self.tp is None else self.tp.init_kv_cache)(
        run_cfg, self.num_device_blocks + 1, config.block_size, config.model.dtype)
    self.duplex = self._make_duplex()
    # Logits as [vocab, rows] for buckets of >= 8 rows on CPU, where XLA's W_out . x^T plus a greedy argmax
    # over axis 0 is faster than [rows, vocab] (docs/platform.md); [rows, vocab] elsewhere (GPUs: not
    # measured yet).
    self._step_kwargs = dict(cfg=run_cfg, attention=config.model.attention,
                             vocab_major_min_rows=8 if jax.default_backend() == "cpu" else 0,
                             dense_max_rows=config.model.dense_max_rows if self.dense_backend == "cpu_kernel" else 0)
    if self.tp is not None:
      self._step_kwargs.update(attention=self.tp.attention(config.model.attention),
                               logits_sharding=self.tp.replicated)
    # Rows of every step's sampled-ids output: the largest logits bucket a plan can have.
    self.out_rows = bucket(config.scheduler.max_num_seqs, config.seq_bucket_floor)
    self._no_tokens = self._put(np.zeros(self.out_rows, np.int32), commit=True)
    # Start each step's sampled-ids read-back at dispatch (accelerators; see _dispatch).
    self._early_readback = self._no_tokens.devices().pop().platform != "cpu"
    self._host_batch = HostBatch(config.block_size, token_floor=config.token_bucket_floor,
                                 seq_floor=config.seq_bucket_floor, blocks_floor=config.blocks_bucket_floor)
    self.idle_probe = idle_probe
    self._release_after_step: set[str] = set()   # release() of requests still in a step in flight
    self.stats = EngineStats()
    self._reqs: dict[str, _Req] = {}
    self._unfinished: set[str] = set()
    self._pending_out: dict[str, None] = {}   # requests with output not yet returned (insertion order)
    self._inflight: Optional[_InFlight] = None
    self._id_counter = itertools.count()
    self._empty_steps = 0
    # After the backend's thread pools exist (the cache and inputs are on the device), so they keep theirs.
    self.host_thread_nice = None   # the nice value applied to the building thread, None: left as it was
    if config.host_thread_nice:
      if set_thread_nice(config.host_thread_nice):
        self.host_thread_nice = config.host_thread_nice
      else:
        logging.getLogger(__name__).warning(
            "EngineConfig.host_thread_nice=%d: could not set it (needs CAP_SYS_NICE to lower); the host thread "
            "keeps its priority", config.host_thread_nice)
    self.host_thread_policy = None   # "fifo" once applied to the building thread, None: left as it was
    if config.host_thread_policy == "fifo":
      if set_thread_realtime():
        self.host_thread_policy = "fifo"
      else:
        logging.getLogger(__name__).warning(
            "EngineConfig.host_thread_policy='fifo': could not make the host thread real-time (needs "
            "CAP_SYS_NICE); it keeps its scheduling policy")

  # ------------------------------------------------------------------------------------------ sizing
  def _put(self, x: np.ndarray, commit: bool = False) -> jax.Array:
    """Host -> device for a step input: the default device (committed to it with ``commit``, as the step's
    outputs are), or replicated on the tensor-parallel mesh."""
    if self.tp is not None:
      return self.tp.put(x)
    return jax.device_put(x, jax.local_devices()[0]) if commit else jax.device_put(x)

  def _device_blocks(self) -> int:
    c = self.config
    if c.num_device_blocks:
      return c.num_device_blocks
    # Per device (tensor parallel: the least free device of the mesh, after its weight shards; its slice
    # of a block).
    if self.tp is None:
      free, block_bytes = free_device_bytes(jax.local_devices()[:1]), self.kv_spec.block_bytes
    else:
      free, block_bytes = self.tp.free_device_bytes(), self.tp.device_block_bytes(self.kv_spec)
    if free is None:
      raise ValueError("EngineConfig.num_device_blocks is unset and this backend reports no device memory "
                       "(e.g. CPU): give num_device_blocks")
    n = int(free * c.device_memory_fraction) // block_bytes - 1
    if n < 1:
      raise ValueError(f"device_memory_fraction={c.device_memory_fraction} of {free} free bytes holds no "
                       f"KV block of {block_bytes} bytes")
    return n

  def _host_blocks(self) -> int:
    c = self.config
    if c.num_host_blocks is not None:
      return c.num_host_blocks
    bb = self.kv_spec.block_bytes if self.tp is None else self.tp.host_block_bytes(self.kv_spec)
    return int(c.host_gib * 2**30) // bb

  def _make_duplex(self) -> Optional[DuplexKV]:
    """The DuplexKV over the host pool (None without one: nothing rotates). Pinned host memory where the
    backend has it, else unpinned (both hold the same bytes; only speed differs)."""
    if self.num_host_blocks == 0:
      return None
    rc = self.config.rotation
    device = jax.local_devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
    return DuplexKV(self.kv_spec, self.num_host_blocks, mode=rc.transfer_mode, device=device,
                    host_memory_kind=kind, min_bucket=rc.rotation_min_bucket, max_bucket=rc.rotation_max_bucket,
                    sharding=None if self.tp is None else self.tp.block_sharding)

  # ---------------------------------------------------------------------------------------- requests
  def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None, *,
                  request_id: Optional[str] = None, ttft_slo: Optional[float] = None,
                  tbt_slo: Optional[float] = None, arrival_time: Optional[float] = None) -> str:
    """Queues a request; returns its id. Raises ``RequestError`` (a ValueError) for a bad request,
    leaving the engine and every other request untouched."""
    params = dataclasses.replace(params) if params is not None else SamplingParams()
    try:
      params.validate(vocab_size=self.model_config.vocab_size)
    except ValueError as e:
      raise RequestError(str(e)) from None
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise RequestError("text prompt given but the engine has no tokenizer; pass token ids")
      prompt_ids = encode_text(self.tokenizer, prompt)
    else:
      try:
        prompt_ids = [int(t) for t in prompt]
      except (TypeError, ValueError):
        raise RequestError(f"prompt must be a string or a sequence of token ids, got {type(prompt)}") \
            from None
    if not prompt_ids:
      raise RequestError("empty prompt")
    bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
    if bad:
      raise RequestError(f"prompt token ids {bad[:5]} out of the vocabulary [0, {self.model_config.vocab_size})")
    if len(prompt_ids) >= self.max_model_len:
      raise RequestError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within the model's "
                         f"context of {self.max_model_len} tokens")
    if params.stop and self.tokenizer is None:
      raise RequestError("stop strings need a tokenizer")
    for slo in (ttft_slo, tbt_slo):
      if slo is not None and not slo > 0:
        raise RequestError(f"SLOs must be > 0 seconds, got {slo!r}")
    max_total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
    need = self.kv_spec.blocks_for_tokens(max_total - 1)   # the last sampled token is never fed back
    if need > self.num_device_blocks:
      raise RequestError(f"request needs up to {need} KV blocks ({max_total - 1} tokens) but the device pool has "
                         f"only {self.num_device_blocks}: it can never run")
    if request_id is None:
      request_id = f"req-{next(self._id_counter)}"
      while request_id in self._reqs:
        request_id = f"req-{next(self._id_counter)}"
    elif request_id in self._reqs:
      raise RequestError(f"duplicate request id {request_id!r}")
    seed = params.seed if params.seed is not None else sampling_lib.derive_seed(self.config.seed, request_id)
    now = self.clock.now() if arrival_time is None else arrival_time
    detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
             if self.tokenizer is not None else None)
    r = _Req(request_id=request_id, prompt_token_ids=prompt_ids, params=params, seed=seed,
             max_total_len=max_total, arrival_time=now, detok=detok)
    try:
      self.scheduler.add_request(Request(request_id, len(prompt_ids), max_total - len(prompt_ids), now,
                                         ttft_slo=ttft_slo, tbt_slo=tbt_slo))
    except ValueError as e:
      raise RequestError(str(e)) from None
    self._reqs[request_id] = r
    self._unfinished.add(request_id)
    return request_id

  def abort(self, request_id: str) -> bool:
    """Aborts a waiting, running or rotary request and frees its blocks. Its final output (finish reason
    "abort") comes with the next ``step()``. Returns False if the id is unknown or already finished."""
    r = self._reqs.get(request_id)
    if r is None or r.finished:
      return False
    self.scheduler.abort(request_id)
    self._finish(r, FINISH_ABORT)
    return True

  def has_unfinished(self) -> bool:
    """True while a request is queued, running, rotary, or has an output not yet returned, or a step is
    in flight (zero-bubble: the step dispatched after the last request's final step; the next ``step()``
    reads and discards it)."""
    return bool(self._unfinished) or bool(self._pending_out) or self._inflight is not None

  def get_request(self, request_id: str) -> CompletionOutput:
    """The accumulated result of a request (finished or not)."""
    r = self._reqs[request_id]
    return CompletionOutput(request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
                            token_ids=list(r.output_token_ids), text=r.text, finish_reason=r.finish_reason,
                            timestamps=list(r.timestamps), arrival_time=r.arrival_time)

  def release(self, request_id: str) -> None:
    """Forgets a finished request's accumulated state (long-running servers call this)."""
    r = self._reqs.get(request_id)
    if r is None or not r.reported_final:
      return
    if self._inflight is not None and request_id in self._inflight.scheduled:
      self._release_after_step.add(request_id)    # the step in flight still names it: release after it
    else:
      del self._reqs[request_id]

  # ----------------------------------------------------------------------------------------- the loop
  def step(self) -> list[RequestOutput]:
    """Runs one model step (pipelined: completes the step in flight, dispatches the next) and returns
    the new outputs: one ``RequestOutput`` per request that gained tokens or finished."""
    t0 = time.perf_counter()
    wait = 0.0
    if not self.config.pipeline:
      wait = self._step_sync()
    elif self.config.zero_bubble:
      wait = self._step_zero_bubble()
    else:
      wait = self._step_pipelined()
    outputs = self._collect_outputs()
    dt = time.perf_counter() - t0
    self.stats.steps += 1
    self.stats.step_time_s += dt
    self.stats.wait_time_s += wait
    self.stats.host_time_s += dt - wait
    return outputs

  def _step_sync(self) -> float:
    t0 = time.perf_counter()
    plan = self._schedule(lookahead=False)
    self._issue(plan)
    inflight = self._dispatch(plan)
    if inflight is None:
      self._on_step_done(plan, {}, {})
      self._break_probe_chain()
      self.stats.exposed_host_time_s += time.perf_counter() - t0
      return 0.0
    t1 = time.perf_counter()
    wait = self._complete(inflight)
    self.stats.exposed_host_time_s += (t1 - t0) + (time.perf_counter() - t1 - wait)
    return wait

  def _start_pipeline(self) -> bool:
    """With nothing in flight: plan and dispatch a step without lookahead. False when the plan ran nothing
    (it is then done: the caller's step returns)."""
    plan = self._schedule(lookahead=False)
    self._issue(plan)
    self._inflight = self._dispatch(plan)
    self._finish_if_empty(plan)
    return self._inflight is not None

  def _finish_if_empty(self, plan) -> None:
    """A plan that dispatched nothing (no sequences) completes at once."""
    if self._inflight is None:
      self._on_step_done(plan, {}, {})
      self._break_probe_chain()

  def _step_pipelined(self) -> float:
    if self._inflight is None and not self._start_pipeline():
      return 0.0
    # Step k is running on the device: plan step k+1 and start its transfers meanwhile.
    next_plan = self._schedule(lookahead=True)
    self._issue(next_plan)
    inflight, self._inflight = self._inflight, None
    wait = self._complete(inflight)
    t_read = inflight.read_time
    self._inflight = self._dispatch(next_plan)
    self._finish_if_empty(next_plan)
    self.stats.exposed_host_time_s += time.perf_counter() - t_read
    return wait

  def _step_zero_bubble(self) -> float:
    if self._inflight is None and not self._start_pipeline():
      return 0.0
    # Step k is running: plan, issue and dispatch step k+1 (its fed tokens come from k's device output),
    # then read step k's ids.
    next_plan = self._schedule(lookahead=True)
    self._issue(next_plan)
    inflight = self._inflight
    self._inflight = self._dispatch(next_plan, prev=inflight)
    wait = self._complete(inflight)
    self._finish_if_empty(next_plan)
    return wait

  def _break_probe_chain(self) -> None:
    if self.idle_probe is not None:
      self.idle_probe.break_chain()

  def _schedule(self, lookahead: bool):
    t = time.perf_counter()
    plan = self.scheduler.schedule(lookahead=lookahead) if lookahead else self.scheduler.schedule()
    st = self.stats
    st.schedule_time_s += time.perf_counter() - t
    st.rotations_out += len(plan.rotated_out)
    st.rotations_in += len(plan.rotated_in)
    st.round_trips += len(plan.round_trips)
    st.residency_steps += plan.residency_steps
    st.recompute_preemptions += len(plan.preempted)
    if plan.contention:
      st.contended_steps += 1
    self._record_state_changes(plan)
    return plan

  def _record_state_changes(self, plan) -> None:
    """Queues each request's state changes of ``plan`` for its next output (in the order they happened:
    proactive and reactive rotations out / recompute preemptions, then rotations in and admissions)."""
    t = plan.time
    for ids, state in ((plan.rotated_out, "rotary"), (plan.preempted, "preempted"),
                       (plan.rotated_in, "running"), (plan.admitted, "running")):
      for rid in ids:
        r = self._reqs.get(rid)
        if r is not None and not r.finished:
          r.pending_states.append((t, state))
          self._pending_out[rid] = None

  def _issue(self, plan) -> None:
    swap_out, writeback, swap_in = plan.swap_out, plan.writeback, plan.swap_in  # PairLists, column-wise
    if not (swap_out or writeback or swap_in):
      return
    st = self.stats
    bb = self.kv_spec.block_bytes
    st.blocks_out += len(swap_out)
    st.blocks_writeback += len(writeback)
    st.blocks_in += len(swap_in)
    st.bytes_out += (len(swap_out) + len(writeback)) * bb
    st.bytes_in += len(swap_in) * bb
    if self.duplex is None:
      raise RuntimeError("the scheduler planned KV copies but the engine has no host pool")
    t = time.perf_counter()
    if plan.round_trips:
      # A victim swapped straight back in (rotasched_code): its host blocks are this step's D2H destinations
      # and H2D sources, so the D2H copies go first and the H2D reads wait for them (data dependency).
      self.kv_cache = self.duplex.issue(self.kv_cache, swap_out, writeback)
      self.kv_cache = self.duplex.issue(self.kv_cache, swap_in=swap_in)
    else:
      self.kv_cache = self.duplex.issue(self.kv_cache, swap_out, writeback, swap_in)
    st.issue_time_s += time.perf_counter() - t

  def _dispatch(self, plan, prev: Optional[_InFlight] = None) -> Optional[_InFlight]:
    """Builds the inputs of ``plan`` (skipping finished requests) and dispatches the jitted step.

    ``prev``: the step in flight whose ids the host has not read (zero-bubble loop). A request it samples
    has one more token than the host knows; that token is fed from ``prev.tokens`` on device.
    """
    t0, c0 = time.perf_counter(), time.thread_time()
    pending = prev.rows if prev is not None else {}
    fresh = set(plan.rotated_in) | set(plan.admitted) if (plan.rotated_in or plan.admitted) else ()
    seqs: list[SeqInput] = []
    rows: dict[str, int] = {}  # request id -> logits row, for each sequence that samples (row i = sequence i)
    num_tokens = 0
    reqs = self._reqs
    for s in plan.scheduled:
      rid = s.req_id
      r = reqs.get(rid)
      if r is None or r.finish_reason is not None:
        self.stats.rescheduled_drops += 1
        continue
      num_out = len(r.output_token_ids)
      known = len(r.prompt_token_ids) + num_out
      feed_row = pending.get(rid, -1)
      start = s.num_computed_tokens
      stop = start + s.num_new_tokens
      if feed_row >= 0:
        if stop <= known:
          feed_row = -1        # the chunk ends before the token in flight (not fed)
        known += 1
      if stop > known:
        raise RuntimeError(f"scheduler planned tokens [{start}, {stop}) of {rid!r} which has only "
                           f"{known} tokens")
      sample = stop == known   # the chunk reaches the end of the known tokens: sample
      if s.sample != sample:
        raise RuntimeError(f"plan says sample={s.sample} for {rid!r} tokens [{start}, {stop}) but the "
                           f"request has {known} tokens")
      if feed_row >= 0:        # host tokens before the fed one (none for a decode step)
        tokens = () if stop - start == 1 else r.tokens(start, stop - 1)
      else:
        tokens = r.tokens(start, stop)
      if sample:
        rows[rid] = len(seqs)
      num_tokens += stop - start
      seqs.append(SeqInput(rid, tokens, start, s.block_table, feed_row, rid in fresh,
                           r.sampling if sample else None, num_out + (feed_row >= 0)))
    if not seqs:
      return None
    rebuilds = self._host_batch.rebuilds
    packed, dims = self._host_batch.build(seqs)
    R = dims[3]
    if R > self.out_rows:
      raise RuntimeError(f"plan has {len(seqs)} sequences: more than max_num_seqs "
                         f"({self.config.scheduler.max_num_seqs}) allows ({self.out_rows} output rows)")
    prev_tokens = prev.tokens if prev is not None else self._no_tokens
    tokens, self.kv_cache = self._call_step(packed, prev_tokens, dims)
    probe_step = self.idle_probe.dispatched(tokens) if self.idle_probe is not None else -1
    # Start the sampled ids' device->host copy now, ahead of the next plan's swap-out copies (which depend
    # on this step too): reading them back must not wait behind a large rotation on a shared D2H stream.
    # (The CPU backend has no such stream, and the call costs ~60 us of host time there.)
    if self._early_readback:
      tokens.copy_to_host_async()
    st = self.stats
    st.model_steps += 1
    st.batch_rebuilds += self._host_batch.rebuilds - rebuilds
    st.tokens_scheduled += num_tokens
    st.dispatch_time_s += time.perf_counter() - t0
    st.dispatch_cpu_time_s += time.thread_time() - c0
    return _InFlight(plan=plan, tokens=tokens, rows=rows, scheduled=[q.key for q in seqs],
                     probe_step=probe_step)

  def _call_step(self, packed: np.ndarray, prev_tokens: jax.Array, dims) -> tuple[jax.Array, jax.Array]:
    """Dispatches the jitted step on the donated cache; ``packed`` is the step's one host->device transfer.

    Single device: the numpy buffer goes into the jitted call itself, whose C++ dispatch path copies it
    (about 5 us on CPU, against 60-300 us for a separate ``jax.device_put``). That transfer is explicit:
    under a transfer guard it is allowed for this call only (``transfer_guard_host_to_device``), every
    other argument is already on the device, so any other transfer stays caught by
    ``jax.transfer_guard("disallow")``; without a guard (jax's default) the context is skipped. The
    weights go in as their flat leaf tuple (``params``). Tensor parallel: ``packed`` is replicated on the
    mesh first."""
    if self.tp is not None:
      packed, guard = self._put(packed), _NO_GUARD
    else:  # entering the guard's context costs ~50 us per call: only when a guard is set
      guard = _NO_GUARD if _host_to_device_allowed() else jax.transfer_guard_host_to_device("allow")
    with guard:
      return _jit_step(self._param_leaves, self.kv_cache, packed, prev_tokens, dims=dims,
                       params_def=self._params_def, **self._step_kwargs)

  def _complete(self, inflight: _InFlight) -> float:
    """Reads back step k's sampled ids, runs stop checks, tells the scheduler. Returns seconds waited."""
    t = time.perf_counter()
    tokens = jax.device_get(inflight.tokens).tolist()
    inflight.read_time = t_read = time.perf_counter()
    if self.idle_probe is not None and inflight.probe_step >= 0:
      self.idle_probe.read(inflight.probe_step)
    wait = t_read - t
    now = self.clock.now()
    new_tokens: dict[str, int] = {}
    finished: dict[str, str] = {}
    for rid, row in inflight.rows.items():
      r = self._reqs[rid]
      if r.finished:        # aborted while in flight, or (zero-bubble) stopped at the step before
        self.stats.discarded_tokens += r.finish_reason != FINISH_ABORT
        continue
      tok = tokens[row]
      new_tokens[rid] = tok
      reason = self._append_token(r, tok, now)
      if reason is not None:
        finished[rid] = reason
    self._on_step_done(inflight.plan, new_tokens, finished, now)
    for rid, reason in finished.items():
      self._finish(self._reqs[rid], reason)
    if self._release_after_step:
      for rid in inflight.scheduled:
        if rid in self._release_after_step:
          self._release_after_step.discard(rid)
          self.release(rid)
    self.stats.tokens_generated += len(new_tokens)
    self.stats.process_time_s += time.perf_counter() - t_read
    return wait

  def _on_step_done(self, plan, new_tokens, finished, now=None) -> None:
    self.scheduler.on_step_done(plan, new_tokens, finished, self.clock.now() if now is None else now)
    self.scheduler.pop_finished()  # the engine keeps its own results: the scheduler must not hoard them
    if self._unfinished and not new_tokens and not plan.has_work:
      self._empty_steps += 1
      if self._empty_steps > 1000:
        raise RuntimeError("the scheduler made no progress for 1000 steps with requests pending "
                           f"({len(self._unfinished)} unfinished); stuck")
    else:
      self._empty_steps = 0

  def _append_token(self, r: _Req, tok: int, now: float) -> Optional[str]:
    """Appends a sampled token; returns a finish reason if the request stops."""
    r.output_token_ids.append(tok)
    r.timestamps.append(now)
    r.pending_tokens.append(tok)
    r.pending_times.append(now)
    self._pending_out[r.request_id] = None
    if r.detok is not None:
      delta = r.detok.add_token(tok)
      r.pending_text += delta
      r.text = r.detok.text
      if r.detok.stopped:
        return FINISH_STOP
    p = r.params
    if not p.ignore_eos and tok in self.eos_token_ids:
      return FINISH_STOP
    if tok in p.stop_token_ids:
      return FINISH_STOP
    if r.all_tokens_len() >= r.max_total_len:
      return FINISH_LENGTH
    return None

  def _finish(self, r: _Req, reason: str) -> None:
    if r.finished:
      return
    r.finish_reason = reason
    self._pending_out[r.request_id] = None
    if r.detok is not None:
      r.pending_text += r.detok.flush()
      r.text = r.detok.text
    self._unfinished.discard(r.request_id)

  def _collect_outputs(self) -> list[RequestOutput]:
    outs = []
    pending, self._pending_out = self._pending_out, {}
    for rid in pending:
      r = self._reqs[rid]
      if r.reported_final:
        continue
      outs.append(RequestOutput(request_id=r.request_id, token_ids=r.pending_tokens, text=r.pending_text,
                                timestamps=r.pending_times, finished=r.finished,
                                finish_reason=r.finish_reason, prompt_token_ids=r.prompt_token_ids,
                                error=r.error, state_changes=r.pending_states))
      r.pending_tokens, r.pending_times, r.pending_text, r.pending_states = [], [], "", []
      if r.finished:
        r.reported_final = True
    return outs

  # ------------------------------------------------------------------------------------ conveniences
  def stream(self) -> Iterator[RequestOutput]:
    """Steps until every request finishes, yielding outputs as they are produced."""
    while self.has_unfinished():
      yield from self.step()

  def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
               params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> list[CompletionOutput]:
    """Submits all prompts together (one continuous batch) and blocks until all finish; results in
    input order."""
    if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
      prompts = [prompts]
    if params is None or isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
    ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in self.stream():
      pass
    return [self.get_request(i) for i in ids]

  def precompile_steps(self) -> int:
    """Compiles the model step for every token bucket up to ``max_num_batched_tokens`` at the configured
    sequence and block-table floors, by running dummy one-sequence batches. Only an idle engine may do
    this (its K/V land in free device blocks, which any later owner overwrites before reading). With the
    floors at their maxima (``seq_bucket_floor = max_num_seqs``, ``blocks_bucket_floor`` >= blocks of the
    longest request) that is every shape a run can hit. Returns the compiled step variants afterwards."""
    if self._inflight is not None or self._unfinished:
      raise RuntimeError("precompile_steps() needs an idle engine (no request queued or running)")
    c = self.config
    num_tokens = c.token_bucket_floor
    top = bucket(c.scheduler.max_num_batched_tokens)
    while True:
      n = min(num_tokens, self.max_model_len, self.num_device_blocks * c.block_size)
      table = list(range(1, self.kv_spec.blocks_for_tokens(n) + 1))
      packed, dims = self._host_batch.pack_from_scratch([SeqInput("", [0] * n, 0, table, -1, True, None, 0)])
      tokens, self.kv_cache = self._call_step(packed, self._no_tokens, dims)
      jax.block_until_ready(tokens)
      if num_tokens >= top:
        return self.num_compiled_shapes()
      num_tokens *= 2

  def precompile_rotation(self) -> None:
    """Compiles every rotation gather/scatter bucket now, so none compiles inside a timed run (the jit
    caches are process-wide). No-op without a host pool or while a step is in flight."""
    if self.duplex is not None and self._inflight is None:
      self.kv_cache = self.duplex.precompile(self.kv_cache)

  def num_compiled_shapes(self) -> int:
    """Compiled variants of the (process-wide) jitted step: bounded by the bucket scheme."""
    size = getattr(_jit_step, "_cache_size", None)   # private jax API (0.10 / 0.11); -1 if absent
    return size() if callable(size) else -1

  def check_invariants(self) -> None:
    """Block-manager invariants (tests)."""
    self.block_manager.check_invariants()
