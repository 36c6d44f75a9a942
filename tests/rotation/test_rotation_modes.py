"""The transfer-mode ablation (naive / merged / merged_kernel / duplex) and the transfer path's structure.

* Ablation: the four modes, fed the same plans, leave the same device cache and host pool and count the
  same blocks and bytes; they differ only in how the copies are cut and issued.
* Structure: what each mode issues per direction for N blocks, counted by wrapping ``jax.device_put`` and
  the rotation kernels (independent of the engine's own ``TransferStats``), against docs/duplexkv.md's
  table: ``merged_kernel`` and ``duplex`` make one transfer and one gather / scatter launch per direction
  whatever N (up to ``max_bucket``), ``merged`` N of each, ``naive`` one transfer per layer x K/V x block.
"""
import collections

import jax
import numpy as np
import pytest

from superinfer_jax.kv.layout import KVCacheSpec
from superinfer_jax.rotation import DUPLEX, MERGED, MERGED_KERNEL, MODES, NAIVE, DuplexKV, read_device_block
from superinfer_jax.rotation import kernels

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32",
                   layout="block_first")
NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS = 40, 64


def _blocks(n, seed):
  shape = (n, SPEC.num_layers, 2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _plans(seed=0, rounds=4):
  """Rounds of (swap_out, writeback, swap_in) pairs that a block manager could emit: fresh host ids out,
  previously written host ids in (into any device block, including ones just copied out)."""
  rng = np.random.default_rng(seed)
  written, plans = [], []
  for _ in range(rounds):
    free = [h for h in range(NUM_HOST_BLOCKS) if h not in written]
    n_out = int(rng.integers(1, 9))
    srcs = rng.choice(np.arange(1, NUM_DEVICE_BLOCKS + 1), size=n_out, replace=False).tolist()
    dsts = rng.choice(free, size=n_out, replace=False).tolist()
    ins = [h for h in written if rng.random() < 0.5]
    in_dsts = rng.choice(np.arange(1, NUM_DEVICE_BLOCKS + 1), size=len(ins), replace=False).tolist()
    split = int(rng.integers(0, n_out + 1))
    out = list(zip(srcs, dsts))
    plans.append((out[:split], out[split:], list(zip(ins, in_dsts))))
    written = [h for h in written if h not in ins] + dsts
  return plans


def _run(mode, plans):
  eng = DuplexKV(SPEC, NUM_HOST_BLOCKS, mode=mode)
  cache = jax.device_put(_blocks(NUM_DEVICE_BLOCKS + 1, seed=42))
  for swap_out, writeback, swap_in in plans:
    if mode == DUPLEX:
      eng.prefetch(swap_in)
    cache = eng.issue(cache, swap_out=swap_out, writeback=writeback, swap_in=swap_in)
  eng.wait()
  device = np.stack([read_device_block(cache, SPEC, b) for b in range(1, NUM_DEVICE_BLOCKS + 1)])
  host = {h: eng.read_host_block(h) for h in range(NUM_HOST_BLOCKS) if eng.has_host_block(h)}
  return device, host, eng.stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_mode_moves_the_same_kv(seed):
  plans = _plans(seed)
  results = {m: _run(m, plans) for m in MODES}
  ref_dev, ref_host, ref_stats = results[NAIVE]
  assert ref_stats.blocks_out > 0 and ref_stats.blocks_in > 0
  for mode, (dev, host, stats) in results.items():
    np.testing.assert_array_equal(dev, ref_dev, err_msg=mode)
    assert sorted(host) == sorted(ref_host), mode
    for h in host:
      np.testing.assert_array_equal(host[h], ref_host[h], err_msg=f"{mode} host block {h}")
    for key in ("blocks_out", "blocks_in", "writeback_blocks", "bytes_out", "bytes_in"):
      assert getattr(stats, key) == getattr(ref_stats, key), (mode, key)


class _Counter:
  """Counts, by wrapping them, the KV transfers (``jax.device_put`` to or from host memory) and the jitted
  gather / scatter launches the rotation code issues."""

  def __init__(self, monkeypatch):
    self.n = collections.Counter()
    real_put = jax.device_put

    def put(x, device=None, *args, **kwargs):
      kind = getattr(device, "memory_kind", None)
      leaves = jax.tree_util.tree_leaves(x)
      from_host = any(getattr(getattr(a, "sharding", None), "memory_kind", None) == SPEC_HOST for a in leaves)
      if kind == SPEC_HOST:
        self.n["d2h_transfers"] += 1
      elif from_host:
        self.n["h2d_transfers"] += 1
      return real_put(x, device, *args, **kwargs)

    def wrap(name, fn):
      def counted(*args, **kwargs):
        self.n[name] += 1
        return fn(*args, **kwargs)
      return counted

    monkeypatch.setattr(jax, "device_put", put)   # the one module object duplexkv / segment_copies call
    monkeypatch.setattr(kernels, "gather_blocks", wrap("gathers", kernels.gather_blocks))
    monkeypatch.setattr(kernels, "scatter_blocks", wrap("scatters", kernels.scatter_blocks))

  def reset(self):
    self.n.clear()


SPEC_HOST = "pinned_host"


def _one_rotation(eng, cache, n, counter):
  """Rotates n blocks out, then n others in (host blocks written beforehand); returns the counts per
  direction of the rotation itself."""
  out = [(b, b - 1) for b in range(1, n + 1)]
  cache = eng.issue(cache, swap_out=out)
  eng.wait()
  counter.reset()
  cache = eng.issue(cache, swap_out=[(b, n + b - 1) for b in range(n + 1, 2 * n + 1)],
                    swap_in=[(h, 2 * n + 1 + h) for h in range(n)])
  eng.wait()
  return dict(counter.n), cache


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("mode", MODES)
def test_launches_and_transfers_per_direction(mode, n, monkeypatch):
  counter = _Counter(monkeypatch)
  eng = DuplexKV(SPEC, NUM_HOST_BLOCKS, mode=mode, max_bucket=16)
  cache = jax.device_put(_blocks(3 * n + 2, seed=n))
  counts, _ = _one_rotation(eng, cache, n, counter)
  segments = 2 * SPEC.num_layers
  want = {
      NAIVE: dict(d2h_transfers=segments * n, h2d_transfers=segments * n),
      MERGED: dict(d2h_transfers=n, h2d_transfers=n, gathers=n, scatters=n),
      MERGED_KERNEL: dict(d2h_transfers=1, h2d_transfers=1, gathers=1, scatters=1),
      DUPLEX: dict(d2h_transfers=1, h2d_transfers=1, gathers=1, scatters=1),
  }[mode]
  for key, value in want.items():
    assert counts.get(key, 0) == value, (mode, n, key, counts)


@pytest.mark.parametrize("mode", [MERGED_KERNEL, DUPLEX])
def test_one_transfer_per_direction_beyond_the_bucket(mode, monkeypatch):
  """Past ``max_bucket`` blocks the gather / scatter is split into launches, the transfer stays one."""
  counter = _Counter(monkeypatch)
  eng = DuplexKV(SPEC, NUM_HOST_BLOCKS, mode=mode, max_bucket=4)
  cache = jax.device_put(_blocks(3 * 10 + 2, seed=3))
  counts, _ = _one_rotation(eng, cache, 10, counter)
  assert counts["d2h_transfers"] == 1 and counts["h2d_transfers"] == 1
  assert counts["gathers"] == 3 and counts["scatters"] == 3      # 10 blocks in launches of 4, 4, 2 (bucket 2)
