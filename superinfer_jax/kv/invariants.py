"""``check_invariants`` for ``BlockManager``: a full O(total blocks) consistency check, for tests and debug.

Reads the manager only through its public fields and accessors (``device`` / ``host`` pools and their
``free_ids()`` / ``check()``, ``seqs``, ``writebacks``, ``reclaimable_host_blocks()``). Raises ``AssertionError``
describing the first violation; never changes the manager.
"""
from __future__ import annotations

import collections

from superinfer_jax.kv.block_seq import NO_BLOCK, computed_in_block
from superinfer_jax.kv.layout import PADDING_BLOCK, blocks_for


def check_invariants(bm) -> None:
  """Checks ``bm`` (a ``BlockManager``): ownership, free lists, per-request tables, write-back queue."""
  dev_owners = [0] * (bm.num_device_blocks + 1)
  host_owners = [0] * bm.num_host_blocks
  for rid, s in bm.seqs.items():
    _check_seq(bm, rid, s, dev_owners, host_owners)
  _check_counts(bm)
  assert dev_owners[PADDING_BLOCK] == 0, "padding block in use"
  _check_free_lists(bm, dev_owners, host_owners)


def _check_seq(bm, rid, s, dev_owners: list[int], host_owners: list[int]) -> None:
  """One request's columns; counts the blocks it owns into ``dev_owners`` / ``host_owners``."""
  bs = bm.block_size
  n = len(s.host)
  assert len(s.host_tokens) == n, f"{rid!r}: parallel lists differ in length"
  if s.on_host:
    assert not s.dev, f"{rid!r}: swapped request holds device blocks {s.dev}"
  else:
    assert len(s.dev) == n, f"{rid!r}: {len(s.dev)} device ids for {n} logical blocks"
  assert 0 <= s.num_computed <= s.num_tokens, f"{rid!r}: computed {s.num_computed} > {s.num_tokens}"
  assert n == blocks_for(s.num_tokens, bs), f"{rid!r}: {n} blocks do not cover exactly {s.num_tokens} tokens"
  for i in range(n):
    d, h, ht = NO_BLOCK if s.on_host else s.dev[i], s.host[i], s.host_tokens[i]
    assert 0 <= ht <= bs, f"{rid!r}[{i}]: host_tokens {ht}"
    if h == NO_BLOCK:
      assert ht == 0, f"{rid!r}[{i}]: host_tokens {ht} without a host block"
    else:
      assert 0 <= h < bm.num_host_blocks, f"{rid!r}[{i}]: bad host id {h}"
      host_owners[h] += 1
    if s.on_host:
      assert h != NO_BLOCK, f"{rid!r}[{i}]: swapped request lacks a host block"
      assert ht >= computed_in_block(s, i, bs), f"{rid!r}[{i}]: swapped block is dirty"
    else:
      assert d != PADDING_BLOCK, f"{rid!r}[{i}]: padding block allocated"
      assert 1 <= d <= bm.num_device_blocks, f"{rid!r}[{i}]: bad device id {d}"
      dev_owners[d] += 1
      full_dirty = (i + 1) * bs <= s.num_computed and ht < bs
      assert full_dirty == ((rid, i) in bm.writebacks), (
          f"{rid!r}[{i}]: full&dirty={full_dirty} but write-back queued={(rid, i) in bm.writebacks}")
  nhost = n - s.host.count(NO_BLOCK)
  assert s.nhost == nhost, f"{rid!r}: host block count {s.nhost} != {nhost}"
  if s.on_host:
    assert s.num_tokens == s.num_computed, f"{rid!r}: swapped with uncomputed slots"


def _check_counts(bm) -> None:
  """The mirror count and the per-request write-back counts match the columns and the queue."""
  seqs = bm.seqs
  mirrors = sum(len(s.host) - s.host.count(NO_BLOCK) for s in seqs.values() if not s.on_host)
  counted = bm.reclaimable_host_blocks()
  assert mirrors == counted, f"mirror count {counted} != {mirrors}"
  nwb = collections.Counter()
  for key in bm.writebacks:
    assert key[0] in seqs and not seqs[key[0]].on_host, f"stale write-back entry {key!r}"
    nwb[key[0]] += 1
  for rid, s in seqs.items():
    assert s.nwb == nwb[rid], f"{rid!r}: write-back count {s.nwb} != queued {nwb[rid]}"


def _check_free_lists(bm, dev_owners: list[int], host_owners: list[int]) -> None:
  """Each pool's free queue is well formed and holds exactly the blocks nobody owns."""
  bm.device.check()
  bm.host.check()
  dev_free = set(bm.device.free_ids())
  assert PADDING_BLOCK not in dev_free, "padding block on the free list"
  for b in range(1, bm.num_device_blocks + 1):
    assert dev_owners[b] <= 1, f"device block {b} owned {dev_owners[b]} times"
    assert (b in dev_free) == (dev_owners[b] == 0), f"device block {b}: free={b in dev_free}, owners={dev_owners[b]}"
  host_free = set(bm.host.free_ids())
  for b in range(bm.num_host_blocks):
    assert host_owners[b] <= 1, f"host block {b} owned {host_owners[b]} times"
    assert (b in host_free) == (host_owners[b] == 0), (
        f"host block {b}: free={b in host_free}, owners={host_owners[b]}")
