"""DuplexKV engine tests (no block manager): bit-exact round trips in every mode/layout/dtype, the ordering
rules (each with a deliberately broken variant showing the check would catch the race), prefetch, bucketing
and compile bounds, validation, and no hidden transfers."""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.kv.layout import KVCacheSpec
from superinfer_jax.rotation import DUPLEX, MERGED, MODES, NAIVE, DuplexKV, bucket_size, read_device_block
from superinfer_jax.rotation import kernels

pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator


def _spec(dtype="float32", layout="block_first", head_dim=4):
  return KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=head_dim, block_size=4, dtype=dtype,
                     layout=layout)


def _bits(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[x.dtype.itemsize])


def _assert_bits_equal(a, b, msg=""):
  np.testing.assert_array_equal(_bits(np.asarray(a)), _bits(np.asarray(b)), err_msg=msg)


def _random_blocks(spec, n, rng):
  shape = (n, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
  return rng.standard_normal(shape).astype(jnp.dtype(spec.dtype))


def _to_cache(spec, blocks_np):
  """[NB, L, 2, BS, H, D] numpy blocks -> device cache in spec.layout."""
  arr = blocks_np if spec.block_axis == 0 else np.moveaxis(blocks_np, 0, 2)
  return jax.device_put(np.ascontiguousarray(arr))


@functools.partial(jax.jit, static_argnames=("block_axis",), donate_argnums=(0,))
def _overwrite_block(cache, block_id, value, *, block_axis):
  """A stand-in 'model step': writes a whole block (donated cache, like the real step)."""
  return jax.lax.dynamic_update_index_in_dim(cache, value, block_id, axis=block_axis)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["block_first", "layer_first"])
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_bit_identical(mode, layout, dtype):
  """Random KV rotated out and back many times, with model writes and unrelated traffic between."""
  spec = _spec(dtype, layout)
  rng = np.random.default_rng(zlib.crc32(f"{mode}{layout}{dtype}".encode()))
  nb, nh = 13, 16
  dev = _random_blocks(spec, nb, rng)          # numpy shadow of the device cache
  host: dict[int, np.ndarray] = {}             # numpy shadow of the host pool
  cache = _to_cache(spec, dev)
  eng = DuplexKV(spec, nh, mode=mode)
  for rnd in range(10):
    # D2H: some blocks out (swap-out) and some write-backs; H2D: some host blocks into any device blocks,
    # including the ones just swapped out (same-step reuse).
    srcs = rng.choice(np.arange(1, nb), size=rng.integers(0, 6), replace=False)
    in_hosts = [h for h in host if rng.random() < 0.4]
    free_hosts = [h for h in range(nh) if h not in in_hosts]
    dsts = rng.choice(free_hosts, size=len(srcs), replace=False)
    d2h = list(zip(srcs.tolist(), dsts.tolist()))
    split = rng.integers(0, len(d2h) + 1)
    h2d_dst = rng.choice(np.arange(1, nb), size=len(in_hosts), replace=False)
    h2d = list(zip(in_hosts, h2d_dst.tolist()))
    if mode == DUPLEX and rnd % 2:
      eng.prefetch(h2d)
    cache = eng.issue(cache, swap_out=d2h[:split], writeback=d2h[split:], swap_in=h2d)
    before = {h: host[h] for h, _ in h2d}
    for d, h in d2h:
      host[h] = dev[d].copy()
    for h, d in h2d:
      dev[d] = before[h]
    # A model step writes fresh values into two random blocks (after the issue, like the engine).
    for b in rng.choice(np.arange(1, nb), size=2, replace=False).tolist():
      val = _random_blocks(spec, 1, rng)[0]
      cache = _overwrite_block(cache, jnp.int32(b), val, block_axis=spec.block_axis)
      dev[b] = val
    for b in range(1, nb):
      _assert_bits_equal(read_device_block(cache, spec, b), dev[b], f"round {rnd} device block {b}")
    for h, val in host.items():
      _assert_bits_equal(eng.read_host_block(h), val, f"round {rnd} host block {h}")
  st = eng.stats
  assert st.bytes_out == st.blocks_out * spec.block_bytes and st.bytes_in == st.blocks_in * spec.block_bytes
  if mode == NAIVE:
    assert st.segments_out == st.blocks_out * 2 * spec.num_layers == st.batches_out
  else:
    assert st.segments_out == st.blocks_out


# ------------------------------------------------------------------------------------------ ordering rules
@jax.jit
def _slow_value(x):
  """Deterministic, deliberately slow (so the step is still running when issue() is called)."""
  m = jnp.eye(64, dtype=jnp.float32) * 0.5 + 0.5 / 64
  def body(_, a):
    return a @ m
  a = jax.lax.fori_loop(0, 300, body, jnp.ones((64, 64), jnp.float32))
  return x + jnp.round(a[0, 0])   # a stays ~1.0: exact, but the data dependency is real


@functools.partial(jax.jit, donate_argnums=(0,))
def _slow_step(cache, block_id, value):
  return jax.lax.dynamic_update_index_in_dim(cache, _slow_value(value), block_id, axis=0)


def _write_then_copy_out(kind: str, gather_before_step: bool):
  """A step writes block 3; block 3 is then copied to host block 0 (``kind``: swap_out or writeback).

  Returns (old content, content written by the step, host copy)."""
  spec = _spec()
  rng = np.random.default_rng(1)
  blocks = _random_blocks(spec, 6, rng)
  cache = _to_cache(spec, blocks)
  eng = DuplexKV(spec, 4)
  new_value = _random_blocks(spec, 1, rng)[0]
  copy = {kind: [(3, 0)]}
  if gather_before_step:   # the race of docs/paper.md §7.2(a): copy taken from the cache before the step
    cache = eng.issue(cache, **copy)
    cache = _slow_step(cache, jnp.int32(3), new_value)
  else:                    # the rule: D2H gathers from the cache returned by the last dispatched step
    cache = _slow_step(cache, jnp.int32(3), new_value)
    cache = eng.issue(cache, **copy)
  written = read_device_block(cache, spec, 3)
  return blocks[3], written, eng.read_host_block(0)


@pytest.mark.parametrize("kind", ["swap_out", "writeback"])
def test_copy_out_sees_the_block_written_by_the_last_dispatched_step(kind):
  old, written, host = _write_then_copy_out(kind, gather_before_step=False)
  assert not np.array_equal(old, written)
  _assert_bits_equal(host, written, "D2H copy must include the step's writes")
  # The broken order would copy stale KV: the check above would fail for it.
  old, written, host = _write_then_copy_out(kind, gather_before_step=True)
  assert np.array_equal(host, old) and not np.array_equal(host, written)


class _ScatterFirst(DuplexKV):
  """Deliberately broken engine: scatters the swap-ins before gathering the swap-outs (docs/paper.md §7.2(b))."""

  def issue(self, cache, swap_out=(), writeback=(), swap_in=()):
    swap_in = [tuple(p) for p in swap_in]
    incoming = self._batched_h2d([h for h, _ in swap_in], {})
    cache = self._scatter(cache, [d for _, d in swap_in], incoming)
    out = [tuple(p) for p in list(swap_out) + list(writeback)]
    self._batched_d2h(cache, [d for d, _ in out], [h for _, h in out])
    return cache


@pytest.mark.parametrize("mode", MODES)
def test_freed_block_reused_by_swap_in_in_the_same_step(mode):
  """Request A's block 3 is swapped out to host 0 and request B (host 1) is swapped into block 3 at once."""
  def run(engine_cls, mode):
    spec = _spec("bfloat16")
    rng = np.random.default_rng(2)
    blocks = _random_blocks(spec, 6, rng)
    b_content = _random_blocks(spec, 1, rng)[0]
    eng = engine_cls(spec, 4, mode=mode)
    eng.write_host_block(1, b_content)
    cache = eng.issue(_to_cache(spec, blocks), swap_out=[(3, 0)], swap_in=[(1, 3)])
    return blocks[3], b_content, eng.read_host_block(0), read_device_block(cache, spec, 3)

  a_content, b_content, a_host, block3 = run(DuplexKV, mode)
  _assert_bits_equal(a_host, a_content, "A's host copy must be A's KV, not B's")
  _assert_bits_equal(block3, b_content, "block 3 must now hold B's KV")
  # With the scatter first, A's host copy would be B's KV: the check above would fail.
  a_content, b_content, a_host, _ = run(_ScatterFirst, DUPLEX)
  assert np.array_equal(_bits(a_host), _bits(b_content))


def test_reuse_across_steps_without_waiting():
  """Step 1 swaps block 2 out (host 0); step 2 swaps other KV into block 2 and host 0 back into block 4,
  without anyone waiting for step 1's D2H. Host copies are immutable arrays: nothing can be overwritten."""
  spec = _spec()
  rng = np.random.default_rng(3)
  blocks = _random_blocks(spec, 6, rng)
  other = _random_blocks(spec, 1, rng)[0]
  eng = DuplexKV(spec, 4)
  eng.write_host_block(3, other)
  cache = _to_cache(spec, blocks)
  cache = _overwrite_block(cache, jnp.int32(2), blocks[5], block_axis=0)   # a step writes block 2
  cache = eng.issue(cache, swap_out=[(2, 0)])
  cache = eng.issue(cache, swap_in=[(3, 2), (0, 4)])
  cache = eng.issue(cache, swap_out=[(4, 1)])   # and out again, from the just-scattered block
  _assert_bits_equal(read_device_block(cache, spec, 2), other)
  _assert_bits_equal(read_device_block(cache, spec, 4), blocks[5])
  _assert_bits_equal(eng.read_host_block(0), blocks[5])
  _assert_bits_equal(eng.read_host_block(1), blocks[5])


def test_duplex_issue_never_blocks(monkeypatch):
  """Duplex mode issues both directions and returns without waiting on any transfer."""
  spec = _spec()
  rng = np.random.default_rng(4)
  eng = DuplexKV(spec, 8)
  for h in range(3):
    eng.write_host_block(h, _random_blocks(spec, 1, rng)[0])
  cache = _to_cache(spec, _random_blocks(spec, 8, rng))
  def forbidden(*a, **k):
    raise AssertionError("duplex issue() waited on a transfer")
  monkeypatch.setattr(jax, "block_until_ready", forbidden)
  try:
    monkeypatch.setattr(type(cache), "block_until_ready", forbidden)
  except (TypeError, AttributeError):   # an immutable array type in some jax version
    pass
  cache = eng.issue(cache, swap_out=[(1, 5), (2, 6)], writeback=[(3, 7)], swap_in=[(0, 1), (1, 4)])
  monkeypatch.undo()
  eng.wait()
  cache.block_until_ready()


# ------------------------------------------------------------------------------------------ prefetch
def test_prefetch_starts_h2d_early_and_is_invalidated_by_a_rewrite():
  spec = _spec()
  rng = np.random.default_rng(5)
  vals = _random_blocks(spec, 4, rng)
  eng = DuplexKV(spec, 4)
  for h in range(3):
    eng.write_host_block(h, vals[h])
  cache = _to_cache(spec, _random_blocks(spec, 6, rng))
  pairs = [(0, 1), (1, 2), (2, 3)]
  eng.prefetch(pairs)
  assert eng.stats.batches_in == 1
  eng.write_host_block(2, vals[3])       # host block 2 changes after the prefetch
  cache = eng.issue(cache, swap_in=pairs)
  assert eng.stats.prefetched_blocks == 2 and eng.stats.batches_in == 2
  for (h, d), want in zip(pairs, [vals[0], vals[1], vals[3]]):
    _assert_bits_equal(read_device_block(cache, spec, d), want)
  eng.prefetch([(0, 4)])                  # not consumed by the next issue(): dropped
  cache = eng.issue(cache, swap_in=[(1, 4)])
  assert eng.stats.prefetched_blocks == 2
  _assert_bits_equal(read_device_block(cache, spec, 4), vals[1])
  merged = DuplexKV(spec, 4, mode=MERGED)
  merged.write_host_block(0, vals[0])
  merged.prefetch([(0, 1)])               # no-op outside duplex mode
  assert merged.stats.batches_in == 0


# ------------------------------------------------------------------------------------------ bucketing
def test_bucket_size():
  assert [bucket_size(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [1, 1, 2, 4, 4, 8, 8, 16]
  assert bucket_size(3, min_bucket=8) == 8


def test_compilations_are_bounded_by_buckets():
  spec = _spec(head_dim=3)   # a shape no other test uses: the jit caches start empty for it
  rng = np.random.default_rng(6)
  nb = 40
  eng = DuplexKV(spec, 64)
  cache = _to_cache(spec, _random_blocks(spec, nb, rng))
  before = kernels.compiled_variants()
  for n in range(1, 17):
    ids = rng.choice(np.arange(1, nb), size=n, replace=False).tolist()
    cache = eng.issue(cache, swap_out=list(zip(ids, range(n))))
    cache = eng.issue(cache, swap_in=list(zip(range(n), ids)))
  # Buckets 1, 2, 4, 8, 16 for gather and for scatter.
  assert eng.num_kernel_variants == 10
  after = kernels.compiled_variants()
  if before is not None:     # jit's cache size is private API: checked where this jax exposes it
    assert after - before <= 10


def test_max_bucket_splits_launches_but_not_transfers():
  spec = _spec()
  rng = np.random.default_rng(7)
  blocks = _random_blocks(spec, 16, rng)
  eng = DuplexKV(spec, 16, max_bucket=4)
  cache = eng.issue(_to_cache(spec, blocks), swap_out=[(b, b) for b in range(1, 12)])
  assert eng.stats.gathers == 3 and eng.stats.batches_out == 1
  cache = eng.issue(cache, swap_in=[(b, 16 - b) for b in range(1, 12)])
  assert eng.stats.scatters == 3 and eng.stats.batches_in == 1
  for b in range(1, 12):
    _assert_bits_equal(eng.read_host_block(b), blocks[b])
    _assert_bits_equal(read_device_block(cache, spec, 16 - b), blocks[b])


# ------------------------------------------------------------------------------------------ hygiene
def test_no_implicit_transfers():
  spec = _spec()
  rng = np.random.default_rng(8)
  eng = DuplexKV(spec, 8)
  eng.write_host_block(0, _random_blocks(spec, 1, rng)[0])
  cache = _to_cache(spec, _random_blocks(spec, 8, rng))
  with jax.transfer_guard("disallow"):
    eng.prefetch([(0, 5)])
    cache = eng.issue(cache, swap_out=[(1, 1), (2, 2)], writeback=[(3, 3)], swap_in=[(0, 5)])
    cache = eng.issue(cache, swap_in=[(1, 6)])
  eng.wait()
  _assert_bits_equal(eng.read_host_block(3), read_device_block(cache, spec, 3))


def test_host_blocks_live_in_the_requested_memory_kind():
  spec = _spec()
  eng = DuplexKV(spec, 4)
  cache = _to_cache(spec, _random_blocks(spec, 4, np.random.default_rng(9)))
  eng.issue(cache, swap_out=[(1, 0)])
  assert eng._host[0].sharding.memory_kind == "pinned_host"   # pylint: disable=protected-access
  with pytest.raises(ValueError):
    DuplexKV(spec, 4, host_memory_kind="no_such_memory")


def test_validation():
  spec = _spec()
  eng = DuplexKV(spec, 4)
  cache = _to_cache(spec, _random_blocks(spec, 6, np.random.default_rng(10)))
  with pytest.raises(ValueError, match="out of range"):
    eng.issue(cache, swap_out=[(0, 0)])          # the padding block is never a request's block
  with pytest.raises(ValueError, match="out of range"):
    eng.issue(cache, swap_out=[(1, 4)])          # host id beyond the pool
  with pytest.raises(ValueError, match="twice"):
    eng.issue(cache, swap_out=[(1, 0)], writeback=[(2, 0)])
  with pytest.raises(KeyError):
    eng.issue(cache, swap_in=[(2, 1)])           # nothing was ever written to host block 2
  cache = eng.issue(cache, swap_out=[(1, 0)])
  with pytest.raises(ValueError, match="both"):
    eng.issue(cache, swap_out=[(2, 0)], swap_in=[(0, 3)])
  with pytest.raises(ValueError, match="twice"):
    eng.issue(cache, swap_in=[(0, 3), (0, 3)])
  with pytest.raises(ValueError, match="spec"):
    eng.issue(cache.astype(jnp.bfloat16), swap_out=[(1, 1)])
  eng.free_host_blocks([0])
  assert not eng.has_host_block(0)
  with pytest.raises(ValueError):
    DuplexKV(spec, 4, mode="bogus")
