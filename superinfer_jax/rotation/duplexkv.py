"""DuplexKV: the KV rotation engine (docs/paper.md §4) — device cache <-> pinned-host block pool.

One ``issue()`` per engine step executes the block manager's copy lists:

* D2H (swap-out + eager write-back, ``(device, host)`` pairs): ONE jitted, bucketed gather of the source
  blocks from ``cache`` into per-block staging arrays on device, then ONE batched ``device_put`` of them to
  ``pinned_host`` (asynchronous).
* H2D (swap-in, ``(host, device)`` pairs): ONE batched ``device_put`` of the host blocks to device (started
  as early as the plan is known: by ``prefetch()`` or first thing in ``issue()``), then ONE jitted, bucketed
  scatter into the donated ``cache``.

Ordering (the rules docs/paper.md §7.2 says the reference code breaks), all by JAX data dependencies, no waits:

1. The D2H gather reads ``cache``, the array returned by the last *dispatched* model step, so it runs after
   the step that wrote the copied tokens (never a stale block).
2. Within ``issue()`` the gather is dispatched before the scatter that donates ``cache``; the runtime orders
   a donation after all pending reads of the buffer. So a device block freed by a swap-out can be the
   target of a swap-in (or of the next model step's writes) in the same step: its old content is already
   in the staging array. The staging array, not the cache, is the source of the D2H ``device_put``.
3. Host blocks are immutable arrays: a D2H copy to host block ``h`` makes a *new* array and rebinds ``h``
   to it. A pending H2D read of the old content keeps the old array alive; an H2D read of ``h`` issued after
   the rebinding waits (in the runtime) for the D2H copy to land. So no cross-step write-after-read or
   read-after-write hazard exists on the host side, and the engine never blocks on a transfer whose data is
   not needed yet.

Host-pool representation (why not one big host array): scatter / dynamic-update-slice INTO a ``pinned_host``
array inside jit crashes XLA (openxla/xla #34565, #47362) and indexing a ``pinned_host`` array fails
(jax #34041); see docs/platform.md. So the host pool is a dict ``host_id -> jax.Array [L, 2, BS, H, D]`` in
``pinned_host`` memory: each host block is its own buffer (taken from the runtime's pinned-host allocator),
written whole by a ``device_put`` and read whole by a ``device_put``; nothing ever indexes or updates a host
array in place. In the block-first layout that buffer is exactly the block's contiguous device segment, so
each block moves as one DMA segment, and a step's blocks move in one batched ``device_put`` call.

Ablation modes (docs/paper.md §4.3 and Table 1), chosen by ``mode``:

* ``"duplex"`` (default): batched per direction; H2D and D2H issued together, no waits (overlap each other
  and the model step).
* ``"merged"``: batched per direction (merged segments) but serialized: the D2H batch is waited for before
  the H2D batch starts, and the H2D batch is waited for before the scatter.
* ``"naive"``: vLLM's per-layer, per-K/V, per-block copies (segments ``[BS, H, D]``), one ``device_put`` at
  a time, each waited for; all D2H first, then all H2D. Host blocks are then kept as ``2 * L`` segments.

``spec.layout == "layer_first"`` (cache ``[L, 2, NB, BS, H, D]``) works in every mode: the device-side
gather turns the block's ``2 * L`` strided segments into one staging block, so in the batched modes the
layout costs a strided gather on device, and in ``"naive"`` mode the transfers are the layer-first segments.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import numpy as np

from superinfer_jax.kv.layout import PADDING_BLOCK, KVCacheSpec
from superinfer_jax.kv.pairs import PairList, columns
from superinfer_jax.rotation import kernels
from superinfer_jax.rotation.config import DUPLEX, MERGED, MODES, NAIVE  # noqa: F401 (re-exported)
from superinfer_jax.util import next_power_of_2


Pair = tuple[int, int]


@dataclasses.dataclass
class TransferStats:
  """Counters of everything an engine has moved (cumulative)."""
  issues: int = 0               # issue() calls
  blocks_out: int = 0           # D2H blocks (swap-out + write-back)
  writeback_blocks: int = 0     # of which eager write-back
  blocks_in: int = 0            # H2D blocks
  bytes_out: int = 0
  bytes_in: int = 0
  batches_out: int = 0          # D2H device_put calls (naive: one per segment)
  batches_in: int = 0           # H2D device_put calls (naive: one per segment; prefetch() calls count)
  segments_out: int = 0         # contiguous D2H segments (batched modes: one per block)
  segments_in: int = 0
  prefetched_blocks: int = 0    # swap-in blocks whose H2D was started by prefetch()
  gathers: int = 0              # jitted gather launches
  scatters: int = 0             # jitted scatter launches

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def bucket_size(n: int, min_bucket: int = 1) -> int:
  """Smallest power of two >= max(n, min_bucket)."""
  return next_power_of_2(max(n, min_bucket))


def _pairs(pairs: Iterable[Sequence[int]] | None) -> PairList:
  """A fresh PairList of Python ints: a PairList is copied column-wise (no per-pair tuple), anything else is
  read as an iterable of ``(src, dst)`` pairs."""
  if pairs is None:
    return PairList()
  if isinstance(pairs, PairList):
    return PairList.from_columns(list(map(int, pairs.srcs)), list(map(int, pairs.dsts)))
  srcs, dsts = [], []
  for a, b in pairs:
    srcs.append(int(a))
    dsts.append(int(b))
  return PairList.from_columns(srcs, dsts)


class DuplexKV:
  """Rotation engine: a pinned-host block pool and the batched, ordered transfers to and from a device cache.

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
      mode: ``"duplex"``, ``"merged"`` or ``"naive"`` (see the module docstring).
      device: the device holding the cache (default: ``jax.devices()[0]``).
      host_memory_kind: ``"pinned_host"`` (GPU); ``"unpinned_host"`` also works on CPU.
      max_bucket: most blocks per jitted gather/scatter launch; more blocks are split into several launches
        (still one ``device_put`` per direction). Bounds compile time (it grows linearly with the bucket:
        SmolLM2 blocks on CPU, gather + scatter of 16 blocks ~4 s, of 64 blocks ~15 s) and staging memory.
      min_bucket: smallest bucket (power of two).
      sharding: device sharding of one block ``[L, 2, BS, H, D]`` when the cache is sharded (tensor
        parallelism: ``parallel.kv.kv_block_sharding``, heads split over the mesh); ``device`` is then
        ignored. A host block is then one array with the same sharding in ``host_memory_kind``: each
        device's slice is its own host buffer, copied by that device alone, and a block's copy is done
        when every shard's copy is (``wait`` / ``is_ready`` on the array cover all shards). Byte counters
        count every shard (``spec.block_bytes`` of the whole block).
    """
    if mode not in MODES:
      raise ValueError(f"mode {mode!r} not one of {MODES}")
    if num_host_blocks < 0:
      raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
    if max_bucket < 1 or max_bucket & (max_bucket - 1):
      raise ValueError(f"max_bucket must be a power of two, got {max_bucket}")
    self.spec = spec
    self.num_host_blocks = num_host_blocks
    self.mode = mode
    self.max_bucket = max_bucket
    self.min_bucket = min(bucket_size(min_bucket), max_bucket)
    if sharding is None:
      self.device = device if device is not None else jax.devices()[0]
      sharding = jax.sharding.SingleDeviceSharding(self.device)
    else:
      self.device = min(sharding.device_set, key=lambda d: d.id)
    for d in sharding.device_set:
      if d.process_index != jax.process_index():
        continue
      kinds = {m.kind for m in d.addressable_memories()}
      if host_memory_kind not in kinds:
        raise ValueError(f"{d} has no {host_memory_kind!r} memory (has {sorted(kinds)})")
    self.host_memory_kind = host_memory_kind
    self._dev_sharding = sharding.with_memory_kind(self.device.default_memory().kind)
    self._host_sharding = sharding.with_memory_kind(host_memory_kind)
    # Block ids go to every device of the cache's sharding (replicated).
    self._ids_sharding = (jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
                          if isinstance(sharding, jax.sharding.NamedSharding) else self._dev_sharding)
    self._dtype = np.dtype(jax.numpy.dtype(spec.dtype))
    self._block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    self._host: dict[int, jax.Array | tuple[jax.Array, ...]] = {}
    self._prefetched: dict[int, tuple[object, jax.Array]] = {}
    self._pending_out: list[jax.Array] = []
    self._pad_block_dev: jax.Array | None = None
    self._variants: set[tuple] = set()
    self.stats = TransferStats()

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
      self._variants.add(("gather", cache.shape, str(cache.dtype), bucket))
      self._variants.add(("scatter", cache.shape, str(cache.dtype), bucket))
      bucket *= 2
    return cache

  def prefetch(self, swap_in: Iterable[Sequence[int]]) -> None:
    """Starts the H2D copies of the next ``issue()``'s ``swap_in`` pairs now (duplex mode only).

    Call it as soon as the plan is known (e.g. before dispatching the current model step). The copies land
    in fresh device buffers, so nothing in the cache is touched before ``issue()``. Prefetches not consumed
    by the next ``issue()`` are dropped. In ``"merged"`` and ``"naive"`` modes this is a no-op (those modes
    serialize H2D after D2H by definition).
    """
    pairs = _pairs(swap_in)
    if self.mode != DUPLEX or not pairs:
      return
    todo = []
    for h in pairs.srcs:
      src = self._host_entry(h)
      pf = self._prefetched.get(h)
      if pf is None or pf[0] is not src:
        todo.append((h, src))
    if not todo:
      return
    arrays = jax.device_put([src for _, src in todo], self._dev_sharding)
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
    d2h_so, d2h_wb, h2d = _pairs(swap_out), _pairs(writeback), _pairs(swap_in)
    d2h = d2h_so + d2h_wb
    num_blocks = self._check_cache(cache)
    self._validate(num_blocks, d2h, h2d)
    prefetched, self._prefetched = self._prefetched, {}
    self._pending_out = [a for a in self._pending_out if not a.is_ready()]
    if self.mode == DUPLEX:
      incoming = self._start_h2d(h2d, prefetched)      # H2D first: it does not depend on the cache
      self._start_d2h(cache, d2h)                      # gather from cache, then D2H of the staging blocks
      cache = self._scatter(cache, h2d.dsts, incoming)   # donates cache: after the gather
    elif self.mode == MERGED:
      self._start_d2h(cache, d2h)
      self.wait()
      incoming = self._start_h2d(h2d, {})
      jax.block_until_ready(incoming)
      cache = self._scatter(cache, h2d.dsts, incoming)
    else:
      self._naive_d2h(cache, d2h)
      incoming = self._naive_h2d(h2d)
      cache = self._scatter(cache, h2d.dsts, incoming)
    st, bb = self.stats, self.spec.block_bytes
    st.issues += 1
    st.blocks_out += len(d2h)
    st.writeback_blocks += len(d2h_wb)
    st.blocks_in += len(h2d)
    st.bytes_out += len(d2h) * bb
    st.bytes_in += len(h2d) * bb
    return cache

  def wait(self) -> None:
    """Blocks until every D2H copy issued so far has landed in host memory (tests, benchmarks, shutdown).

    The engine itself never needs this: readers of a host block wait for it through the runtime.
    """
    jax.block_until_ready(self._pending_out)
    self._pending_out = []

  def read_host_block(self, host_id: int) -> np.ndarray:
    """Returns a copy of host block ``host_id`` as numpy ``[L, 2, BS, H, D]`` (``spec.dtype``); waits for it.

    For tests and debugging only (``np.asarray`` after a D2H copy can stall for a while on GPU, jax #36651;
    the engine never reads host blocks into numpy).
    """
    entry = self._host_entry(host_id)
    if isinstance(entry, tuple):
      segs = [np.asarray(s) for s in entry]
      return np.stack([np.stack(segs[2 * l:2 * l + 2]) for l in range(self.spec.num_layers)])
    return np.array(entry)

  def write_host_block(self, host_id: int, data: np.ndarray) -> None:
    """Sets host block ``host_id`` to ``data`` (``[L, 2, BS, H, D]``); for tests and for seeding a pool."""
    self._check_host_id(host_id)
    data = np.asarray(data)
    if data.shape != self._block_shape or data.dtype != self._dtype:
      raise ValueError(f"host block must be {self._block_shape} {self._dtype}, got {data.shape} {data.dtype}")
    if self.mode == NAIVE:
      segs = [data[l, kv] for l in range(self.spec.num_layers) for kv in range(2)]
      self._host[host_id] = tuple(jax.device_put(segs, self._segment_host_sharding()))
    else:
      self._host[host_id] = jax.device_put(data, self._host_sharding)

  def free_host_blocks(self, host_ids: Iterable[int]) -> None:
    """Releases the host memory of these blocks (optional: a later D2H to the id replaces it anyway)."""
    for h in host_ids:
      self._host.pop(int(h), None)
      self._prefetched.pop(int(h), None)

  # ------------------------------------------------------------------------------------------- internals
  def _check_host_id(self, h: int) -> None:
    if not 0 <= h < self.num_host_blocks:
      raise ValueError(f"host block id {h} out of range [0, {self.num_host_blocks})")

  def _host_entry(self, h: int):
    self._check_host_id(h)
    try:
      return self._host[h]
    except KeyError:
      raise KeyError(f"host block {h} holds no data (never written, or freed)") from None

  def _check_cache(self, cache: jax.Array) -> int:
    axis = self.spec.block_axis
    if cache.ndim != 6:
      raise ValueError(f"cache must be 6-D {self.spec.layout}, got shape {cache.shape}")
    nb = cache.shape[axis]
    if tuple(cache.shape) != self.spec.shape(nb) or np.dtype(cache.dtype) != self._dtype:
      raise ValueError(f"cache {cache.shape} {cache.dtype} does not match spec {self.spec.shape(nb)} "
                       f"{self._dtype}")
    return nb

  def _validate(self, num_blocks: int, d2h: Iterable[Sequence[int]], h2d: Iterable[Sequence[int]]) -> None:
    out_devs, out_hosts = columns(d2h)
    in_hosts, in_devs = columns(h2d)
    if not self._ids_ok(out_devs, out_hosts, num_blocks):
      for d, h in zip(out_devs, out_hosts):  # report the first bad pair, as a per-pair check would
        if not PADDING_BLOCK < d < num_blocks:
          raise ValueError(f"D2H source device block {d} out of range [1, {num_blocks})")
        self._check_host_id(h)
    if not self._ids_ok(in_devs, in_hosts, num_blocks):
      for h, d in zip(in_hosts, in_devs):
        if not PADDING_BLOCK < d < num_blocks:
          raise ValueError(f"H2D destination device block {d} out of range [1, {num_blocks})")
        self._check_host_id(h)
    out_set = set(out_hosts)
    if len(out_set) != len(out_hosts):
      raise ValueError(f"a host block is the D2H destination twice: {sorted(out_hosts)}")
    if len(set(in_devs)) != len(in_devs):
      raise ValueError(f"a device block is the H2D destination twice: {sorted(in_devs)}")
    both = out_set.intersection(in_hosts)
    if both:
      raise ValueError(f"host blocks {sorted(both)} are both H2D sources and D2H destinations in one step")

  def _ids_ok(self, devs: Sequence[int], hosts: Sequence[int], num_blocks: int) -> bool:
    """True when every device id is in ``[1, num_blocks)`` and every host id in the pool (min/max, in C)."""
    if not devs:
      return True
    return (PADDING_BLOCK < min(devs) and max(devs) < num_blocks and 0 <= min(hosts)
            and max(hosts) < self.num_host_blocks)

  def _ids(self, ids: Sequence[int], bucket: int) -> jax.Array:
    padded = np.full((bucket,), PADDING_BLOCK, np.int32)
    padded[:len(ids)] = ids
    return jax.device_put(padded, self._ids_sharding)   # explicit: fine under transfer_guard("disallow")

  def _chunks(self, n: int):
    for start in range(0, n, self.max_bucket):
      stop = min(n, start + self.max_bucket)
      yield start, stop, bucket_size(stop - start, self.min_bucket)

  def _gather(self, cache: jax.Array, src: Sequence[int]) -> list[jax.Array]:
    """Device staging copies ``[L, 2, BS, H, D]`` of blocks ``src`` (bucketed jitted gathers)."""
    out: list[jax.Array] = []
    for start, stop, bucket in self._chunks(len(src)):
      ids = self._ids(src[start:stop], bucket)
      blocks = kernels.gather_blocks(cache, ids, block_axis=self.spec.block_axis)
      self._variants.add(("gather", cache.shape, str(cache.dtype), bucket))
      self.stats.gathers += 1
      out.extend(blocks[:stop - start])
    return out

  def _segment_host_sharding(self) -> jax.sharding.Sharding:
    """Host sharding of one naive-mode segment ``[BS, H, D]`` (the block's, without the L and K/V axes)."""
    sh = self._host_sharding
    if isinstance(sh, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*tuple(sh.spec)[2:]),
                                        memory_kind=sh.memory_kind)
    return sh

  def _pad_block(self) -> jax.Array:
    if self._pad_block_dev is None:
      self._pad_block_dev = jax.device_put(np.zeros(self._block_shape, self._dtype), self._dev_sharding)
    return self._pad_block_dev

  def _scatter(self, cache: jax.Array, dst: Sequence[int], blocks: Sequence[jax.Array]) -> jax.Array:
    """Writes ``blocks`` (device ``[L, 2, BS, H, D]``) into device blocks ``dst`` of the donated cache."""
    for start, stop, bucket in self._chunks(len(dst)):
      ids = self._ids(dst[start:stop], bucket)
      chunk = list(blocks[start:stop]) + [self._pad_block()] * (bucket - (stop - start))
      cache = kernels.scatter_blocks(cache, ids, tuple(chunk), block_axis=self.spec.block_axis)
      self._variants.add(("scatter", cache.shape, str(cache.dtype), bucket))
      self.stats.scatters += 1
    return cache

  def _start_d2h(self, cache: jax.Array, d2h: Iterable[Sequence[int]]) -> None:
    """Batched modes: gather, then one batched device_put of the staging blocks to host memory."""
    devs, hosts = columns(d2h)
    if not devs:
      return
    staged = self._gather(cache, devs)
    on_host = jax.device_put(staged, self._host_sharding)
    self.stats.batches_out += 1
    self.stats.segments_out += len(devs)
    for h, arr in zip(hosts, on_host):
      self._host[h] = arr
    self._pending_out.extend(on_host)

  def _start_h2d(self, h2d: Iterable[Sequence[int]],
                 prefetched: dict[int, tuple[object, jax.Array]]) -> list[jax.Array]:
    """Batched modes: device copies of the swap-in host blocks (prefetched ones reused), one device_put."""
    hosts, _ = columns(h2d)
    arrays: list[jax.Array | None] = [None] * len(hosts)
    todo_idx, todo_src = [], []
    for i, h in enumerate(hosts):
      src = self._host_entry(h)
      pf = prefetched.get(h)
      if pf is not None and pf[0] is src:
        arrays[i] = pf[1]
        self.stats.prefetched_blocks += 1
      else:
        todo_idx.append(i)
        todo_src.append(src)
    if todo_src:
      for i, arr in zip(todo_idx, jax.device_put(todo_src, self._dev_sharding)):
        arrays[i] = arr
      self.stats.batches_in += 1
    self.stats.segments_in += len(hosts)
    return arrays  # type: ignore[return-value]

  def _naive_d2h(self, cache: jax.Array, d2h: Iterable[Sequence[int]]) -> None:
    """Naive mode: per block, per layer, per K/V segment, one blocking device_put at a time."""
    devs, hosts = columns(d2h)
    if not devs:
      return
    staged = self._gather(cache, devs)
    self._variants.add(("split", self._block_shape))
    for h, blk in zip(hosts, staged):
      segs = []
      for seg in kernels.split_block(blk):
        seg = jax.device_put(seg, seg.sharding.with_memory_kind(self.host_memory_kind))
        seg.block_until_ready()
        segs.append(seg)
      self._host[h] = tuple(segs)
      self.stats.batches_out += len(segs)
      self.stats.segments_out += len(segs)

  def _naive_h2d(self, h2d: Iterable[Sequence[int]]) -> list[jax.Array]:
    blocks = []
    for h in columns(h2d)[0]:
      segs = []
      for seg in self._host_entry(h):
        seg = jax.device_put(seg, seg.sharding.with_memory_kind(self._dev_sharding.memory_kind))
        seg.block_until_ready()
        segs.append(seg)
      blocks.append(kernels.join_block(tuple(segs)))
      self._variants.add(("join", self._block_shape))
      self.stats.batches_in += len(segs)
      self.stats.segments_in += len(segs)
    return blocks


def read_device_block(cache: jax.Array, spec: KVCacheSpec, block_id: int) -> np.ndarray:
  """Block ``block_id`` of a device cache as numpy ``[L, 2, BS, H, D]`` (tests, debugging; copies the cache)."""
  arr = np.asarray(cache)
  if spec.block_axis == 0:
    return arr[block_id]
  return arr[:, :, block_id]
