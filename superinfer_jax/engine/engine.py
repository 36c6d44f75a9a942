"""``LLMEngine``: the in-process serving engine, assembled from its parts.

* ``engine/model_runner.py`` — ``ModelRunner``, the device side: weights, KV cache, compiled steps, KV transfers.
* ``engine/request_book.py`` — ``RequestBook``: admission checks, per-request state, engine stop checks, outputs.
* ``engine/step_loop.py`` — ``StepLoop``: the zero-bubble / pipelined / sync step loop over scheduler and runner,
  and the only caller of the scheduler (admission, abort, steps, finishes, stats).
* ``engine/stats.py`` — ``EngineStats``, the counters.

``LLMEngine(model, config)`` loads a model and builds a ``JaxModelRunner`` for it;
``LLMEngine.with_runner(runner, config)`` assembles the same engine core over any ``ModelRunner`` (a test
double, a cost model). Either way the scheduler (``sched/``) and block manager (``kv/``) are the real ones.

Timestamps come from the injected clock (default ``WallClock``). Not thread-safe: one thread drives
``add_request`` / ``abort`` / ``step`` (a server funnels requests into that thread).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np

from superinfer_jax.engine.config import CompletionOutput, EngineConfig, RequestOutput, SamplingParams
from superinfer_jax.engine.request_book import ModelLimits, PromptType, RequestBook, RequestError
from superinfer_jax.engine.host_batch import SeqInput
from superinfer_jax.engine.sampling import GREEDY
from superinfer_jax.engine.step_loop import StepLoop
from superinfer_jax.engine.stats import EngineStats
from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.layout import BLOCK_FIRST
from superinfer_jax.model.batch import bucket
from superinfer_jax.sched import Scheduler, WallClock
from superinfer_jax.sched.protocol import SchedulerProtocol, SchedulerStats

__all__ = ["EngineStats", "LLMEngine", "RequestError"]


def _tokenizer_or_none(path_or_name: str):
  """The model's tokenizer, or None when the model ships none (token-id prompts only)."""
  from superinfer_jax.model import load_tokenizer  # pylint: disable=import-outside-toplevel
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


def _load(model, config: EngineConfig, tp):
  """``(cfg, params on the device / mesh, tokenizer or None)`` from a path / name or a ``(cfg, params[, tok])``
  tuple."""
  import jax  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model import load_model  # pylint: disable=import-outside-toplevel
  if isinstance(model, (tuple, list)):
    if len(model) not in (2, 3):
      raise ValueError("model tuple must be (cfg, params) or (cfg, params, tokenizer)")
    cfg, params, tok = (tuple(model) + (None,))[:3]
    return cfg, (jax.device_put(params) if tp is None else params), tok
  cfg, params = (load_model if tp is None else tp.load_model)(model, dtype=config.model.dtype)
  return cfg, params, _tokenizer_or_none(model)


class LLMEngine:
  """In-process serving engine (module docstring).

  Args:
    model: a model path / name accepted by ``load_model`` (HF dir, .gguf, orbax dir, ``smollm2-135m``), or a
      tuple ``(cfg, params)`` / ``(cfg, params, tokenizer)``.
    config: ``EngineConfig`` (validated at construction; a bad value -> ``ValueError``).
    clock: object with ``now() -> float`` seconds (default: ``sched.WallClock``).
    tokenizer: overrides the tokenizer loaded with the model (None: the model's; with ``(cfg, params)`` and no
      tokenizer, prompts must be token ids and outputs have no text).
    scheduler_factory: ``(scheduler_config, block_manager, clock) -> SchedulerProtocol`` (default:
      ``sched.Scheduler`` with ``config.scheduler.policy``).
    idle_probe: optional ``engine.idle_probe.DeviceIdleProbe`` told of every dispatch and read-back (also
      settable later as ``engine.idle_probe``).
  """

  def __init__(self, model: Any, config: Optional[EngineConfig] = None, clock: Any = None,
               tokenizer: Any = None, scheduler_factory: Any = None, idle_probe: Any = None):
    from superinfer_jax.engine.model_runner import JaxModelRunner  # pylint: disable=import-outside-toplevel
    from superinfer_jax.parallel.tensor_parallel import make_tensor_parallel  # pylint: disable=import-outside-toplevel
    config = config or EngineConfig()
    if config.rotation.kv_layout != BLOCK_FIRST:
      raise ValueError(f"kv_layout={config.rotation.kv_layout!r}: the engine's attention reads a block-first "
                       "cache; the layer-first layout is measured by scripts/bench_transfer.py and modelled "
                       "by the simulator")
    self.tp = make_tensor_parallel(config.tensor_parallel_size)   # None at tensor_parallel_size=1
    cfg, params, tok = _load(model, config, self.tp)
    run_cfg, params = (cfg, params) if self.tp is None else self.tp.prepare(cfg, params)
    runner = JaxModelRunner(run_cfg, params, config, self.tp)
    self._assemble(runner, config, cfg, clock, tokenizer if tokenizer is not None else tok, scheduler_factory,
                   idle_probe)

  @classmethod
  def with_runner(cls, runner, config: Optional[EngineConfig] = None, clock: Any = None, tokenizer: Any = None,
                  scheduler_factory: Any = None) -> "LLMEngine":
    """The engine core over any ``ModelRunner`` (``engine/model_runner.py``): its ``model_config`` gives the
    vocabulary, context and eos ids, its pool sizes the block manager's."""
    self = cls.__new__(cls)
    self.tp = None
    self._assemble(runner, config or EngineConfig(), runner.model_config, clock, tokenizer, scheduler_factory,
                   None)
    return self

  def _assemble(self, runner, config, cfg, clock, tokenizer, scheduler_factory, idle_probe) -> None:
    from superinfer_jax.parallel import distributed  # pylint: disable=import-outside-toplevel
    self.config, self.runner, self.model_config, self.tokenizer = config, runner, cfg, tokenizer
    self.eos_token_ids = frozenset(_eos_token_ids(cfg, tokenizer))
    self.max_model_len = min(config.model.max_model_len or cfg.max_position_embeddings,
                             cfg.max_position_embeddings)
    self.clock = clock if clock is not None else WallClock()
    self.replica = distributed.replicated_schedule(self.clock)   # multi-process: shared clock, plan digest
    if self.replica is not None:
      self.clock = self.replica
    self.block_manager = BlockManager(runner.num_device_blocks, runner.num_host_blocks, config.block_size,
                                      host_prefix_cache=config.scheduler.host_prefix_cache)  # tests inspect it
    scheduler: SchedulerProtocol = (scheduler_factory or Scheduler)(config.scheduler, self.block_manager,
                                                                    self.clock)
    if self.replica is not None:
      scheduler = self.replica.wrap(scheduler)
    limits = ModelLimits(cfg.vocab_size, self.max_model_len, self.eos_token_ids, runner.num_device_blocks,
                         config.block_size)
    self.book = RequestBook(limits, tokenizer, self.clock, config.seed)
    self.loop = StepLoop(config, scheduler, self.book, runner, EngineStats(), self.clock,
                         model_key=_model_key(cfg, config))
    self.loop.idle_probe = idle_probe
    self.loop.on_read = self._release_deferred
    self._release_after_step: set[str] = set()   # release() of requests still in a step in flight

  # ------------------------------------------------------------------------------------- device facts
  kv_spec = property(lambda self: self.runner.kv_spec, doc="The KV cache spec (block size, bytes per block).")
  num_device_blocks = property(lambda self: self.runner.num_device_blocks, doc="Usable device KV blocks.")
  num_host_blocks = property(lambda self: self.runner.num_host_blocks, doc="Host KV blocks (0: no rotation).")
  kv_cache = property(lambda self: self.runner.kv_cache, doc="The device KV cache (``JaxModelRunner``).")
  scheduler = property(lambda self: self.loop.scheduler,
                       doc="The scheduler (``SchedulerProtocol``), for inspection: only the step loop calls it.")
  stats = property(lambda self: self.loop.stats, lambda self, stats: setattr(self.loop, "stats", stats),
                   doc="The ``EngineStats`` counters (assign a fresh one to restart them).")
  step_observer = property(lambda self: self.loop.step_observer,
                           lambda self, fn: setattr(self.loop, "step_observer", fn),
                           doc="Called with ``(plan, now)`` as each plan's step completes (``StepLoop``), or None.")
  idle_probe = property(lambda self: self.loop.idle_probe,
                        lambda self, probe: setattr(self.loop, "idle_probe", probe),
                        doc="The ``DeviceIdleProbe`` told of every dispatch and read-back, or None.")

  def transfer_report(self) -> dict:
    """What rotation has moved and how much of its copy time the host saw, in total and per planned step.

    Keys: ``steps``; ``bytes_out`` / ``bytes_in`` (D2H incl. write-back / H2D) and ``bytes_per_step``;
    ``copy_time_s`` (issue -> landed, summed over copy groups), ``exposed_time_s`` (host blocked on copies)
    and ``hidden_time_s`` (the rest), each also ``*_per_step_ms``; ``hidden_share`` (hidden / copy, None
    before any copy landed). Read from the runner's ``DuplexKV.stats`` (``rotation/stats.py``); a runner
    without one (no host pool, a fake) reports zero times. Polls the copies first (never blocks).
    """
    duplex = getattr(self.runner, "duplex", None)
    copy_s = exposed_s = 0.0
    if duplex is not None:
      duplex.poll()
      copy_s, exposed_s = duplex.stats.copy_time_s, duplex.stats.blocked_time_s
    st = self.loop.stats
    steps = max(st.steps, 1)
    hidden_s = max(0.0, copy_s - exposed_s)
    return {"steps": st.steps, "bytes_out": st.bytes_out, "bytes_in": st.bytes_in,
            "bytes_per_step": (st.bytes_out + st.bytes_in) / steps,
            "copy_time_s": copy_s, "exposed_time_s": exposed_s, "hidden_time_s": hidden_s,
            "copy_time_per_step_ms": 1e3 * copy_s / steps, "exposed_time_per_step_ms": 1e3 * exposed_s / steps,
            "hidden_time_per_step_ms": 1e3 * hidden_s / steps,
            "hidden_share": hidden_s / copy_s if copy_s > 0 else None}

  # ---------------------------------------------------------------------------------------- requests
  def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None, *,
                  request_id: Optional[str] = None, ttft_slo: Optional[float] = None,
                  tbt_slo: Optional[float] = None, arrival_time: Optional[float] = None,
                  cache_salt: Optional[str] = None) -> str:
    """Queues a request; returns its id. Raises ``RequestError`` (a ValueError) for a bad request, leaving
    the engine and every other request untouched. ``cache_salt``: with prefix caching on, only requests of
    the same salt (or all without one) share cached KV blocks (a non-empty string, or None)."""
    r = self.book.new_request(prompt, params, request_id=request_id, ttft_slo=ttft_slo, tbt_slo=tbt_slo,
                              arrival_time=arrival_time, cache_salt=cache_salt)
    self.loop.add_request(r)
    return r.request_id

  def abort(self, request_id: str) -> bool:
    """Aborts a waiting, running or rotary request and frees its blocks. Its final output (finish reason
    "abort") comes with the next ``step()``. Returns False if the id is unknown or already finished."""
    return self.loop.abort(request_id)

  def has_unfinished(self) -> bool:
    """True while a request is queued, running, rotary, or has an output not yet returned, or a step is in
    flight (zero-bubble: the step dispatched after the last request's final step; the next ``step()`` reads
    and discards it)."""
    return bool(self.book.unfinished) or bool(self.book.pending_out) or self.loop.inflight is not None

  def get_request(self, request_id: str) -> CompletionOutput:
    """The accumulated result of a request (finished or not); ``KeyError`` once released."""
    return self.book.get(request_id)

  def release(self, request_id: str) -> None:
    """Forgets a finished request's accumulated state (long-running servers call this)."""
    r = self.book.reqs.get(request_id)
    if r is None or not r.reported_final:
      return
    inflight = self.loop.inflight
    if inflight is not None and request_id in inflight.scheduled:
      self._release_after_step.add(request_id)    # the step in flight still names it: release after it
    else:
      del self.book.reqs[request_id]

  def _release_deferred(self, inflight) -> None:
    for rid in inflight.scheduled:
      if rid in self._release_after_step:
        self._release_after_step.discard(rid)
        self.release(rid)

  # ----------------------------------------------------------------------------------------- stepping
  def step(self) -> list[RequestOutput]:
    """Runs one step of the loop (``engine/step_loop.py``) and returns the new outputs: one ``RequestOutput``
    per request that gained tokens, changed state or finished."""
    self.loop.step()
    return self.book.outputs()

  def stream(self) -> Iterator[RequestOutput]:
    """Steps until every request finishes, yielding outputs as they are produced."""
    while self.has_unfinished():
      yield from self.step()

  def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
               params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> list[CompletionOutput]:
    """Submits all prompts together (one continuous batch) and blocks until all finish; results in input
    order."""
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

  # ------------------------------------------------------------------------------------------ warm-up
  def precompile_steps(self, modes: Sequence[str] = (GREEDY,)) -> int:
    """Compiles the step in each sampling mode of ``modes`` (``sampling.SAMPLING_MODES``) for every token bucket
    up to ``max_num_batched_tokens`` at the configured sequence and block-table floors, by running dummy
    one-sequence batches. Only an idle engine may do this (the dummy K/V land in free device blocks, which any
    later owner overwrites before reading). With the floors at their maxima (``seq_bucket_floor =
    max_num_seqs``, ``blocks_bucket_floor`` >= blocks of the longest request) that is every shape a run in
    those modes can hit without logprobs or logit processing. Returns the compiled step variants."""
    if self.loop.inflight is not None or self.book.unfinished:
      raise RuntimeError("precompile_steps() needs an idle engine (no request queued or running)")
    c = self.config
    num_tokens, top = c.token_bucket_floor, bucket(c.scheduler.max_num_batched_tokens)
    while True:
      n = min(num_tokens, self.max_model_len, self.num_device_blocks * c.block_size)
      table = list(range(1, self.kv_spec.blocks_for_tokens(n) + 1))
      packed, dims = self.loop.host_batch.pack_from_scratch([SeqInput("", [0] * n, 0, table, -1, True, None, 0)])
      for mode in modes:
        self.runner.precompile_step(packed, dims, mode)
      if num_tokens >= top:
        return self.num_compiled_shapes()
      num_tokens *= 2

  def precompile_rotation(self) -> None:
    """Compiles every rotation gather/scatter bucket now, so none compiles inside a timed run (the jit
    caches are process-wide). No-op while a step is in flight."""
    if self.loop.inflight is None:
      self.runner.precompile_rotation()

  def num_compiled_shapes(self) -> int:
    """Compiled variants of the (process-wide) jitted step: bounded by the bucket scheme."""
    return self.runner.num_compiled_shapes()

  def scheduler_stats(self) -> SchedulerStats:
    """The scheduler's request counts, pool occupancy and cumulative counters now (``SchedulerStats``)."""
    return self.loop.scheduler_stats()

  def check_invariants(self) -> None:
    """The scheduler's and its block manager's invariants (``AssertionError`` on the first violation)."""
    self.loop.check_invariants()


def _model_key(cfg, config) -> str:
  """The model's identity in prefix-cache hashes: its architecture and the dtype its KV is computed in (one
  engine serves one model; the key keeps hashes of other models or dtypes apart wherever blocks meet)."""
  return f"{cfg!r}|{config.model!r}"
