"""DuplexKV: the KV rotation engine (docs/paper.md §4, docs/duplexkv.md) — device cache <-> pinned-host pool.

One ``issue()`` per engine step executes the block manager's copy lists. In the batched modes
(``merged_kernel`` and ``duplex``):

* D2H (swap-out + eager write-back, ``(device, host)`` pairs): jitted, bucketed gathers of the source
  blocks from ``cache`` into per-block staging arrays on device (one launch per ``max_bucket`` blocks), then
  ONE batched ``device_put`` of them to ``pinned_host`` (asynchronous).
* H2D (swap-in, ``(host, device)`` pairs): ONE batched ``device_put`` of the host blocks to device (in
  ``duplex`` started as early as the plan is known: by ``prefetch()`` or first thing in ``issue()``), then
  jitted, bucketed scatters into the donated ``cache``.

``duplex`` issues both directions and returns without waiting; ``merged_kernel`` waits for the D2H batch
before starting the H2D batch, and for the H2D batch before the scatter. The per-segment modes ``naive`` and
``merged`` live in ``segment_copies.py``.

Ordering rules (docs/paper.md §7.2), all by JAX data dependencies, no waits:

1. The D2H gather reads ``cache``, the array returned by the last *dispatched* model step, so it runs after
   the step that wrote the copied tokens (never a stale block).
2. Within ``issue()`` the gather is dispatched before the scatter that donates ``cache``; the runtime orders
   a donation after all pending reads of the buffer. So a device block freed by a swap-out can be the
   target of a swap-in (or of the next model step's writes) in the same step: its old content is already
   in the staging array, which (not the cache) is the source of the D2H ``device_put``.
3. Host blocks are immutable arrays: a D2H copy to host block ``h`` makes a *new* array and rebinds ``h``
   to it. A pending H2D read of the old content keeps the old array alive; an H2D read of ``h`` issued after
   the rebinding waits (in the runtime) for the D2H copy to land. So no host-side write-after-read or
   read-after-write hazard exists across steps, and the engine never blocks on a copy it does not need.

Host pool: scatter / dynamic-update-slice INTO a ``pinned_host`` array inside jit crashes XLA (openxla/xla
#34565, #47362) and indexing a ``pinned_host`` array fails (jax #34041; docs/platform.md). So the pool is a
dict ``host_id -> jax.Array [L, 2, BS, H, D]`` in host memory (naive mode: a tuple of ``2 * L`` segments):
each host block is its own buffer, written whole and read whole by ``device_put``; nothing indexes or
updates a host array in place. In the block-first layout that buffer is the block's contiguous device
segment, so each block moves as one DMA segment.

``spec.layout == "layer_first"`` works in every mode: the device-side gather turns the block's ``2 * L``
strided segments into one staging block, so the batched modes pay a strided gather on device, and
``naive`` mode moves the layer-first segments.

Times of the copies (issue -> ready, and the part the caller blocked for) are booked in ``stats`` (see
``stats.py``); ``poll()`` closes landed copies without blocking.
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

import jax
import numpy as np

from superinfer_jax.kv.layout import PADDING_BLOCK, KVCacheSpec
from superinfer_jax.kv.pairs import columns
from superinfer_jax.rotation import kernels, segment_copies
from superinfer_jax.rotation.checks import as_pairs, check_host_id, validate_step
from superinfer_jax.rotation.config import (DUPLEX, MERGED, MERGED_KERNEL, MODES, NAIVE,  # noqa: F401
                                            SERIAL_MODES)
from superinfer_jax.rotation.memory import check_memory_kind
from superinfer_jax.rotation.stats import CopyGroups, TransferStats  # noqa: F401 (re-exported)
from superinfer_jax.util import next_power_of_2

Pair = tuple[int, int]


def bucket_size(n: int, min_bucket: int = 1) -> int:
  """Smallest power of two >= max(n, min_bucket)."""
  return next_power_of_2(max(n, min_bucket))


class DuplexKV:
  """Rotation engine: a pinned-host block pool and the ordered transfers to and from a device cache.

  The engine does not own the device cache: ``issue()`` takes the current cache and returns the updated
  one (donated), like the model step. It owns the host pool: host block ids ``0..num_host_blocks-1``, each
  either absent (never written / freed) or one array ``[L, 2, BS, H, D]`` (``spec.dtype``) in host memory
  (naive mode: ``2 * L`` arrays ``[BS, H, D]``).
  """

  def __init__(self, spec: KVCacheSpec, num_host_blocks: int, *, mode: str = DUPLEX,
               device: jax.Device | None = None, host_memory_kind: str = "pinned_host",
               max_bucket: int = 16, min_bucket: int = 1, sharding: jax.sharding.Sharding | None = None):
    """Creates an engine.

    Args:
      spec: cache shape; ``spec.layout`` selects block-first or layer-first kernels.
      num_host_blocks: host pool size (ids ``0..num_host_blocks-1``).
      mode: one of ``MODES`` (``rotation/config.py``).
      device: the device holding the cache (default: ``jax.devices()[0]``).
      host_memory_kind: ``"pinned_host"`` (GPU); ``"unpinned_host"`` also works on CPU.
      max_bucket: most blocks per jitted gather/scatter launch (a power of two); more blocks are split
        into several launches (still one ``device_put`` per direction). Compile time and staging memory
        grow with it.
      min_bucket: smallest bucket (rounded up to a power of two).
      sharding: device sharding of one block ``[L, 2, BS, H, D]`` when the cache is sharded (tensor
        parallelism: ``parallel.kv.kv_block_sharding``); ``device`` is then ignored. A host block is then one
        array with the same sharding in ``host_memory_kind``: each device's slice is its own host buffer,
        copied by that device alone, and a block's copy is done when every shard's is. Byte counters count
        every shard (``spec.block_bytes`` of the whole block).
    """
    if mode not in MODES:
      raise ValueError(f"mode {mode!r} not one of {MODES}")
    if num_host_blocks < 0:
      raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
    if max_bucket < 1 or max_bucket & (max_bucket - 1):
      raise ValueError(f"max_bucket must be a power of two, got {max_bucket}")
    self.spec, self.num_host_blocks, self.mode = spec, num_host_blocks, mode
    self.max_bucket = max_bucket
    self.min_bucket = min(bucket_size(min_bucket), max_bucket)
    if sharding is None:
      self.device = device if device is not None else jax.devices()[0]
      sharding = jax.sharding.SingleDeviceSharding(self.device)
    else:
      self.device = min(sharding.device_set, key=lambda d: d.id)
    check_memory_kind(sharding, host_memory_kind)
    self.host_memory_kind = host_memory_kind
    self.device_sharding = sharding.with_memory_kind(self.device.default_memory().kind)
    self.host_sharding = sharding.with_memory_kind(host_memory_kind)
    # Block ids go to every device of the cache's sharding (replicated).
    self._ids_sharding = (jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
                          if isinstance(sharding, jax.sharding.NamedSharding) else self.device_sharding)
    self._dtype = np.dtype(jax.numpy.dtype(spec.dtype))
    self._block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    self._host: dict[int, jax.Array | tuple[jax.Array, ...]] = {}
    self._prefetched: dict[int, tuple[object, jax.Array]] = {}
    self._pad_block_dev: jax.Array | None = None
    self._variants: set[tuple] = set()
    self.stats = TransferStats()
    self.copies = CopyGroups(self.stats)

  # ------------------------------------------------------------------------------------------- public API
  @property
  def block_shape(self) -> tuple[int, ...]:
    """Shape of one block as it lives on the host: ``[L, 2, BS, H, D]``."""
    return self._block_shape

  @property
  def num_kernel_variants(self) -> int:
    """Distinct (kernel, cache shape, bucket) combinations this engine has launched = its compilations."""
    return len(self._variants)

  @property
  def num_host_blocks_held(self) -> int:
    return len(self._host)

  def has_host_block(self, host_id: int) -> bool:
    return host_id in self._host

  def precompile(self, cache: jax.Array) -> jax.Array:
    """Compiles every gather/scatter bucket this engine can launch (``min_bucket..max_bucket``) by moving
    the padding block onto itself; returns the (donated, unchanged apart from block 0) cache.

    Call once before a timed run so no rotation compiles inside it (jit caches are process-wide)."""
    self._check_cache(cache)
    bucket = self.min_bucket
    while bucket <= self.max_bucket:
      ids = self._ids([PADDING_BLOCK] * bucket, bucket)
      blocks = kernels.gather_blocks(cache, ids, block_axis=self.spec.block_axis)
      cache = kernels.scatter_blocks(cache, ids, blocks, block_axis=self.spec.block_axis)
      self.note_variant(("gather", cache.shape, str(cache.dtype), bucket))
      self.note_variant(("scatter", cache.shape, str(cache.dtype), bucket))
      bucket *= 2
    return cache

  def prefetch(self, swap_in: Iterable[Sequence[int]]) -> None:
    """Starts the H2D copies of the next ``issue()``'s ``swap_in`` pairs now (duplex mode only).

    Not part of the engine's duplex path: the engine never calls it (its H2D copies start in ``issue()``,
    ordered by data dependency). It is an optional early start measured by ``rotation/link_bench.py`` and
    exercised by the rotation tests: call it as soon as the plan is known (e.g. before dispatching the
    current model step). The copies land
    in fresh device buffers, so nothing in the cache is touched before ``issue()``. Prefetches not consumed
    by the next ``issue()`` are dropped. In the serialized modes this is a no-op (they start H2D after D2H
    by definition).
    """
    # Close landed copy groups first: ``self.copies`` holds the previous step's H2D staging arrays until it sees
    # them ready, and they must be released before this prefetch allocates the next step's.
    self.copies.poll()
    pairs = as_pairs(swap_in)
    if self.mode != DUPLEX or not pairs:
      return
    todo = []
    for h in pairs.srcs:
      src = self.host_entry(h)
      pf = self._prefetched.get(h)
      if pf is None or pf[0] is not src:
        todo.append((h, src))
    if not todo:
      return
    arrays = jax.device_put([src for _, src in todo], self.device_sharding)
    self.stats.batches_in += 1
    for (h, src), arr in zip(todo, arrays):
      self._prefetched[h] = (src, arr)

  def issue(self, cache: jax.Array, swap_out: Iterable[Sequence[int]] = (),
            writeback: Iterable[Sequence[int]] = (),
            swap_in: Iterable[Sequence[int]] = ()) -> jax.Array:
    """Executes one step's copies; returns the updated (donated) cache.

    Args:
      cache: the device cache returned by the last dispatched model step (or the last ``issue()``), shape
        ``spec.shape(NB)``, dtype ``spec.dtype``. Donated if ``swap_in`` is non-empty. Should be committed
        to the device (any jit output is); an uncommitted one (``jnp.zeros``) compiles extra variants.
      swap_out: D2H ``(device, host)`` pairs of requests rotated out.
      writeback: D2H ``(device, host)`` pairs of the eager write-back.
      swap_in: H2D ``(host, device)`` pairs of requests rotated in.
      Each is a ``PairList`` (``kv/pairs.py``; read column-wise, no per-pair tuple) or any iterable of pairs.

    Returns:
      The cache with every ``swap_in`` block written. D2H sources are read before any ``swap_in`` block is
      written (a device block may be both a D2H source and an H2D destination).

    Raises:
      ValueError: bad ids, the padding block used, a duplicate destination, or a host block that is both an
        H2D source and a D2H destination in this call.
      KeyError: a ``swap_in`` source host block holds nothing (never written or freed).
    """
    t0 = time.perf_counter()
    d2h_so, d2h_wb, h2d = as_pairs(swap_out), as_pairs(writeback), as_pairs(swap_in)
    d2h = d2h_so + d2h_wb
    validate_step(self._check_cache(cache), self.num_host_blocks, d2h, h2d)
    prefetched, self._prefetched = self._prefetched, {}
    self.copies.poll()
    (devs, hosts), (srcs, dsts) = columns(d2h), columns(h2d)
    if self.mode == DUPLEX:
      incoming = self._batched_h2d(srcs, prefetched)    # H2D first: it does not depend on the cache
      on_host = self._batched_d2h(cache, devs, hosts)   # gather from cache, then D2H of the staging blocks
      cache = self._scatter(cache, dsts, incoming)      # donates cache: after the gather
      self.copies.add(t0, on_host + incoming)
    else:
      blocked0 = self.stats.blocked_time_s
      cache = self._serial_issue(cache, devs, hosts, srcs, dsts)
      self.copies.add_serial(t0, blocked0)
    st, bb = self.stats, self.spec.block_bytes
    st.issues += 1
    st.blocks_out += len(d2h)
    st.writeback_blocks += len(d2h_wb)
    st.blocks_in += len(h2d)
    st.bytes_out += len(d2h) * bb
    st.bytes_in += len(h2d) * bb
    return cache

  def poll(self) -> int:
    """Books the copies seen landed (``stats.copy_time_s``); never blocks. Returns issue() groups in flight."""
    return self.copies.poll()

  def wait(self) -> None:
    """Blocks until every copy issued so far has landed (tests, benchmarks, shutdown); the wait is booked
    as blocked time. The engine itself never needs this: readers of a host block wait through the runtime."""
    self.copies.wait()

  def read_host_block(self, host_id: int) -> np.ndarray:
    """Returns a copy of host block ``host_id`` as numpy ``[L, 2, BS, H, D]`` (``spec.dtype``); waits for it.

    For tests and debugging only (``np.asarray`` after a D2H copy can stall on GPU, jax #36651; the engine
    never reads host blocks into numpy).
    """
    entry = self.host_entry(host_id)
    if isinstance(entry, tuple):
      segs = [np.asarray(s) for s in entry]
      return np.stack([np.stack(segs[2 * l:2 * l + 2]) for l in range(self.spec.num_layers)])
    return np.array(entry)

  def write_host_block(self, host_id: int, data: np.ndarray) -> None:
    """Sets host block ``host_id`` to ``data`` (``[L, 2, BS, H, D]``); for tests and for seeding a pool."""
    check_host_id(host_id, self.num_host_blocks)
    data = np.asarray(data)
    if data.shape != self._block_shape or data.dtype != self._dtype:
      raise ValueError(f"host block must be {self._block_shape} {self._dtype}, got {data.shape} {data.dtype}")
    if self.mode == NAIVE:
      segs = [data[l, kv] for l in range(self.spec.num_layers) for kv in range(2)]
      self._host[host_id] = tuple(jax.device_put(segs, self._segment_host_sharding()))
    else:
      self._host[host_id] = jax.device_put(data, self.host_sharding)

  def free_host_blocks(self, host_ids: Iterable[int]) -> None:
    """Releases the host memory of these blocks (optional: a later D2H to the id replaces it anyway)."""
    for h in host_ids:
      self._host.pop(int(h), None)
      self._prefetched.pop(int(h), None)

  # ------------------------------------------- pieces shared with segment_copies.py (not for other callers)
  def host_entry(self, h: int):
    """Host block ``h``'s array (naive: tuple of segments); ``KeyError`` if it holds nothing."""
    check_host_id(h, self.num_host_blocks)
    try:
      return self._host[h]
    except KeyError:
      raise KeyError(f"host block {h} holds no data (never written, or freed)") from None

  def set_host_entry(self, h: int, value) -> None:
    self._host[h] = value

  def note_variant(self, key: tuple) -> None:
    self._variants.add(key)

  def gather(self, cache: jax.Array, src: Sequence[int], per_launch: int | None = None) -> list[jax.Array]:
    """Device staging copies ``[L, 2, BS, H, D]`` of blocks ``src``: bucketed jitted gathers of at most
    ``per_launch`` (default ``max_bucket``) blocks each."""
    out: list[jax.Array] = []
    for start, stop, bucket in self._chunks(len(src), per_launch):
      ids = self._ids(src[start:stop], bucket)
      blocks = kernels.gather_blocks(cache, ids, block_axis=self.spec.block_axis)
      self.note_variant(("gather", cache.shape, str(cache.dtype), bucket))
      self.stats.gathers += 1
      out.extend(blocks[:stop - start])
    return out

  # ------------------------------------------------------------------------------------------- internals
  def _serial_issue(self, cache: jax.Array, devs, hosts, srcs, dsts) -> jax.Array:
    """The serialized modes: D2H (waited for), then H2D (waited for), then the scatter."""
    if self.mode == NAIVE:
      segment_copies.naive_d2h(self, cache, devs, hosts)
      return self._scatter(cache, dsts, segment_copies.naive_h2d(self, srcs))
    if self.mode == MERGED:
      segment_copies.merged_d2h(self, cache, devs, hosts)
      return self._scatter(cache, dsts, segment_copies.merged_h2d(self, srcs), per_launch=1)
    self.copies.block(self._batched_d2h(cache, devs, hosts))
    incoming = self._batched_h2d(srcs, {})
    self.copies.block(incoming)
    return self._scatter(cache, dsts, incoming)

  def _check_cache(self, cache: jax.Array) -> int:
    axis = self.spec.block_axis
    if cache.ndim != 6:
      raise ValueError(f"cache must be 6-D {self.spec.layout}, got shape {cache.shape}")
    nb = cache.shape[axis]
    if tuple(cache.shape) != self.spec.shape(nb) or np.dtype(cache.dtype) != self._dtype:
      raise ValueError(f"cache {cache.shape} {cache.dtype} does not match spec {self.spec.shape(nb)} "
                       f"{self._dtype}")
    return nb

  def _ids(self, ids: Sequence[int], bucket: int) -> jax.Array:
    padded = np.full((bucket,), PADDING_BLOCK, np.int32)
    padded[:len(ids)] = ids
    return jax.device_put(padded, self._ids_sharding)   # explicit: fine under transfer_guard("disallow")

  def _chunks(self, n: int, per_launch: int | None = None):
    step = min(per_launch or self.max_bucket, self.max_bucket)
    for start in range(0, n, step):
      stop = min(n, start + step)
      yield start, stop, bucket_size(stop - start, self.min_bucket)

  def _segment_host_sharding(self) -> jax.sharding.Sharding:
    """Host sharding of one naive-mode segment ``[BS, H, D]`` (the block's, without the L and K/V axes)."""
    sh = self.host_sharding
    if isinstance(sh, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*tuple(sh.spec)[2:]),
                                        memory_kind=sh.memory_kind)
    return sh

  def _pad_block(self) -> jax.Array:
    if self._pad_block_dev is None:
      self._pad_block_dev = jax.device_put(np.zeros(self._block_shape, self._dtype), self.device_sharding)
    return self._pad_block_dev

  def _scatter(self, cache: jax.Array, dst: Sequence[int], blocks: Sequence[jax.Array],
               per_launch: int | None = None) -> jax.Array:
    """Writes ``blocks`` (device ``[L, 2, BS, H, D]``) into device blocks ``dst`` of the donated cache."""
    for start, stop, bucket in self._chunks(len(dst), per_launch):
      ids = self._ids(dst[start:stop], bucket)
      chunk = list(blocks[start:stop]) + [self._pad_block()] * (bucket - (stop - start))
      cache = kernels.scatter_blocks(cache, ids, tuple(chunk), block_axis=self.spec.block_axis)
      self.note_variant(("scatter", cache.shape, str(cache.dtype), bucket))
      self.stats.scatters += 1
    return cache

  def _batched_d2h(self, cache: jax.Array, devs: Sequence[int], hosts: Sequence[int]) -> list[jax.Array]:
    """Gathers, then ONE batched device_put of the staging blocks to host memory; returns the host arrays."""
    if not devs:
      return []
    on_host = jax.device_put(self.gather(cache, devs), self.host_sharding)
    self.stats.batches_out += 1
    self.stats.segments_out += len(devs)
    for h, arr in zip(hosts, on_host):
      self._host[h] = arr
    return list(on_host)

  def _batched_h2d(self, hosts: Sequence[int], prefetched: dict[int, tuple[object, jax.Array]]
                   ) -> list[jax.Array]:
    """Device copies of host blocks ``hosts`` (prefetched ones reused), the rest in ONE device_put."""
    arrays: list[jax.Array | None] = [None] * len(hosts)
    todo_idx, todo_src = [], []
    for i, h in enumerate(hosts):
      src = self.host_entry(h)
      pf = prefetched.get(h)
      if pf is not None and pf[0] is src:
        arrays[i] = pf[1]
        self.stats.prefetched_blocks += 1
      else:
        todo_idx.append(i)
        todo_src.append(src)
    if todo_src:
      for i, arr in zip(todo_idx, jax.device_put(todo_src, self.device_sharding)):
        arrays[i] = arr
      self.stats.batches_in += 1
    self.stats.segments_in += len(hosts)
    return arrays  # type: ignore[return-value]
