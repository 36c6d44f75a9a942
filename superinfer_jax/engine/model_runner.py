"""The engine's device side behind one narrow interface: ``ModelRunner``.

A runner owns everything on the accelerator: the weights in their step layout, the paged KV cache, the
compiled step functions and the KV copies between the device pool and the host pool. The engine core
(requests, scheduler, block manager, stop checks, outputs; ``engine/request_book.py``, ``engine/step_loop.py``) talks to
the device only through these calls:

* ``issue_transfers(swap_out, writeback, swap_in, round_trip)``: starts a plan's KV copies (block-id
  ``PairList``s, ``kv/pairs.py``) in the order ``rotation/duplexkv.py`` specifies, ahead of the step that
  needs them; never waits for them.
* ``dispatch(packed, dims, mode, prev, processing=None, num_logprobs=0) -> StepHandle``: puts the step's
  one packed int32 buffer (``engine/packing.py``) on the device, enqueues the step on the donated cache and
  returns at once with a handle to the ``out_rows`` sampled ids (row i = logits row i, zero-padded). ``prev``
  is the handle of the step before it, whose ids the buffer's token feed may read on the device; ``mode`` is
  the static sampling mode (``engine/sampling.py``). ``processing``: the step's logit-processing buffer or
  None; ``num_logprobs``: 0, or the top-k of logprobs the step also returns (``engine/logit_processing.py``).
* ``read_step(handle) -> (list[int], logprobs or None)``: blocks until that step is done and returns its
  ``out_rows`` ids and, when it computed them, its logprobs (``values [out_rows, 1 + k]`` float32, ``ids
  [out_rows, k]`` int32 numpy): the only device->host read of the step loop.
* ``precompile_step(packed, dims, mode)``, ``precompile_rotation()``, ``num_compiled_shapes()``: warm-up.

and reads ``model_config``, ``kv_spec``, ``num_device_blocks``, ``num_host_blocks``, ``out_rows``. A test
double or a cost model implements the same protocol (``engine/fake_runner.py``).

``JaxModelRunner`` is the real one. Its step (``_step_fn``) is one jitted function per shape bucket: model
forward over the donated cache plus on-device sampling. Inputs are device-resident before the call (one
explicit ``device_put`` of the packed buffer; the previous step's ids are already on the device), so the
call only enqueues work. With the unrolled layer loop (the default) the compiled step holds no while loop,
no conditional and no host callback: nothing in it makes the host wait for the device
(``tests/engine/test_engine_lowering.py`` checks the lowering for CUDA).
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import jax
import numpy as np

from superinfer_jax.engine import logit_processing, packing
from superinfer_jax.engine.packing import StepHandle
from superinfer_jax.engine import sampling as sampling_lib
from superinfer_jax.kv.layout import KVCacheSpec
from superinfer_jax.model.batch import bucket
from superinfer_jax.model.forward import forward, init_kv_cache
from superinfer_jax.model.fused import fuse_projections, unroll_layers
from superinfer_jax.parallel.mesh import free_device_bytes
from superinfer_jax.rotation import DuplexKV


class ModelRunner(Protocol):
  """The device side of an engine (module docstring). ``handle``: whatever ``dispatch`` returns."""
  model_config: Any
  kv_spec: KVCacheSpec
  num_device_blocks: int
  num_host_blocks: int
  out_rows: int

  def issue_transfers(self, swap_out, writeback, swap_in, round_trip: bool) -> None: ...

  def dispatch(self, packed: np.ndarray, dims: tuple[int, int, int, int], mode: str,
               prev: Optional[StepHandle], processing: Optional[np.ndarray] = None,
               num_logprobs: int = 0) -> StepHandle: ...

  def read_step(self, handle: StepHandle) -> tuple[list[int], Optional[tuple[np.ndarray, np.ndarray]]]: ...

  def precompile_step(self, packed: np.ndarray, dims: tuple[int, int, int, int], mode: str = "greedy") -> None: ...

  def precompile_rotation(self) -> None: ...

  def num_compiled_shapes(self) -> int: ...


def _step_fn(params, kv_cache, packed, prev_tokens, processing, *, dims, mode, num_logprobs, cfg, attention,
             params_def, logits_sharding=None):
  """Model forward on the donated cache + logit processing + on-device sampling. Returns
  ``((tokens[N] int32, logprobs or None), kv_cache)``.

  ``params``: the flat tuple of the weights' leaves (``params_def``: their static treedef). ``packed``: the
  step's int32 buffer with static batch dims ``dims``; ``prev_tokens`` [N]: the previous step's sampled ids
  (on device), read where the buffer's feed says so. ``processing``: None, or the logit-processing buffer
  [R, 4L+3] (``engine/logit_processing.py``); ``num_logprobs`` (static): 0, or the top-k of the raw-logit
  logprobs returned as ``(values [N, 1+k], ids [N, k])``. The R sampled ids are zero-padded to N, so every
  step's output can be the next one's input. ``logits_sharding`` (tensor parallel): the vocab-sharded logits
  are gathered to it before sampling."""
  params = jax.tree.unflatten(params_def, params)
  batch, samp, feed = packing.unpack(packed, dims)
  batch = batch._replace(token_ids=packing.feed_tokens(batch.token_ids, feed, prev_tokens))
  logits, kv_cache = forward(params, kv_cache, batch, cfg, attention)
  if logits_sharding is not None:
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
  raw = logits
  if processing is not None:
    newest = batch.token_ids[batch.logits_indices]
    logits = logit_processing.apply_processing(logits.astype(jax.numpy.float32), processing, newest,
                                               feed[batch.logits_indices] >= 0)
  tokens = sampling_lib.sample(logits, *samp, mode=mode)
  pad = lambda x: jax.numpy.zeros((prev_tokens.shape[0],) + x.shape[1:], x.dtype).at[:x.shape[0]].set(x)  # noqa: E731
  lp = None
  if num_logprobs:
    lp = tuple(pad(x) for x in logit_processing.logprobs(raw, tokens, num_logprobs))
  return (pad(tokens), lp), kv_cache


# One jit for all runners in the process (cfg and attention static), so engines built on the same model and
# bucket floors share compilations.
_jit_step = jax.jit(_step_fn, static_argnames=("dims", "mode", "num_logprobs", "cfg", "attention", "params_def",
                                               "logits_sharding"),
                    donate_argnums=(1,))


def step_layout(params, cfg, layer_loop: str, tensor_parallel: bool):
  """The weights as the step runs them: ``unrolled`` -> fused projections in a per-layer list
  (``model/fused.py``; tensor-parallel weights stay unfused, their specs shard each); ``scan`` -> as given."""
  if layer_loop == "scan":
    return params
  return unroll_layers(params if tensor_parallel else fuse_projections(params, cfg))


class JaxModelRunner:
  """The ``ModelRunner`` over JAX devices: one device, or a tensor-parallel mesh (``tp``).

  Args:
    cfg: the model config the step runs with (tensor parallel: ``tp.prepare``'s).
    params: the weights (on the device / mesh already).
    config: the ``EngineConfig`` (pool sizes, block size, layer loop, attention, bucket floors).
    tp: ``parallel.tensor_parallel`` helper, or None for one device.
  """

  def __init__(self, cfg, params, config, tp=None):
    self.config = config
    self.tp = tp
    self.model_config = cfg
    self.layer_loop = config.layer_loop
    self.params = step_layout(params, cfg, self.layer_loop, tp is not None)
    self.kv_spec = cfg.kv_spec(config.block_size, dtype=config.model.dtype)
    self.num_device_blocks = self._device_blocks()
    self.num_host_blocks = self._host_blocks()
    self.kv_cache = (init_kv_cache if tp is None else tp.init_kv_cache)(
        cfg, self.num_device_blocks + 1, config.block_size, config.model.dtype)
    self.duplex = self._make_duplex()
    self._step_kwargs = dict(cfg=cfg, attention=config.model.attention)
    if tp is not None:
      self._step_kwargs.update(attention=tp.attention(config.model.attention), logits_sharding=tp.replicated)
    # Rows of every step's sampled-ids output: the largest logits bucket a plan can have.
    self.out_rows = bucket(config.scheduler.max_num_seqs, config.seq_bucket_floor)
    self._no_tokens = self._put(np.zeros(self.out_rows, np.int32))
    # Start each step's sampled-ids read-back at dispatch where the device has its own copy streams.
    self.early_readback = self._no_tokens.devices().pop().platform != "cpu"

  @property
  def params(self):
    """The weights pytree in the step layout (the step is passed its flat leaves)."""
    return self._params

  @params.setter
  def params(self, params) -> None:
    self._params = params
    leaves, self._params_def = jax.tree.flatten(params)
    self._param_leaves = tuple(leaves)

  # ------------------------------------------------------------------------------------------ sizing
  def _put(self, x: np.ndarray) -> jax.Array:
    """Host -> device, explicitly: committed to the first local device, or replicated on the mesh."""
    if self.tp is not None:
      return self.tp.put(x)
    return jax.device_put(x, jax.local_devices()[0])

  def _device_blocks(self) -> int:
    c = self.config
    if c.num_device_blocks:
      return c.num_device_blocks
    if self.tp is None:
      free, block_bytes = free_device_bytes(jax.local_devices()[:1]), self.kv_spec.block_bytes
    else:   # the least free device of the mesh, after its weight shards; its slice of a block
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

  # ------------------------------------------------------------------------------------- the protocol
  def issue_transfers(self, swap_out, writeback, swap_in, round_trip: bool) -> None:
    """Starts the plan's KV copies. ``round_trip``: a victim swapped straight back in (its host blocks are
    this step's D2H destinations and H2D sources), so the D2H copies are issued first and the H2D reads
    follow them by data dependency."""
    if self.duplex is None:
      raise RuntimeError("the scheduler planned KV copies but the engine has no host pool")
    if round_trip:
      self.kv_cache = self.duplex.issue(self.kv_cache, swap_out, writeback)
      self.kv_cache = self.duplex.issue(self.kv_cache, swap_in=swap_in)
    else:
      self.kv_cache = self.duplex.issue(self.kv_cache, swap_out, writeback, swap_in)

  def dispatch(self, packed: np.ndarray, dims, mode: str, prev: Optional[StepHandle],
               processing: Optional[np.ndarray] = None, num_logprobs: int = 0) -> StepHandle:
    """Enqueues one step (module docstring); returns its handle (sampled ids ``[out_rows]`` int32 on the
    device, and its logprobs when ``num_logprobs``)."""
    packed_dev = self._put(packed)
    proc_dev = self._put(processing) if processing is not None else None
    prev_tokens = prev.tokens if prev is not None else self._no_tokens
    (tokens, lp), self.kv_cache = _jit_step(self._param_leaves, self.kv_cache, packed_dev, prev_tokens, proc_dev,
                                            dims=dims, mode=mode, num_logprobs=num_logprobs,
                                            params_def=self._params_def, **self._step_kwargs)
    if self.early_readback:
      # The ids' device->host copy starts now, ahead of the next plan's swap-out copies, which depend on
      # this step too: reading them must not queue behind a large rotation. Explicit, like device_get.
      with jax.transfer_guard_device_to_host("allow"):
        for x in (tokens,) + (lp or ()):
          x.copy_to_host_async()
    return StepHandle(tokens, lp)

  def read_step(self, handle: StepHandle):
    """The step's ids as a list and its logprobs (numpy ``(values, ids)``) or None; waits for the step."""
    tokens, lp = jax.device_get((handle.tokens, handle.logprobs))
    return tokens.tolist(), lp

  def precompile_step(self, packed: np.ndarray, dims, mode: str = sampling_lib.GREEDY) -> None:
    """Runs (and so compiles) the step of ``dims`` in sampling ``mode`` on a dummy batch and waits for it."""
    jax.block_until_ready(self.dispatch(packed, dims, mode, None).tokens)

  def precompile_rotation(self) -> None:
    """Compiles every rotation gather/scatter bucket (no-op without a host pool)."""
    if self.duplex is not None:
      self.kv_cache = self.duplex.precompile(self.kv_cache)

  def num_compiled_shapes(self) -> int:
    """Compiled variants of the (process-wide) jitted step: bounded by the bucket scheme."""
    size = getattr(_jit_step, "_cache_size", None)   # private jax API (0.10 / 0.11); -1 if absent
    return size() if callable(size) else -1
