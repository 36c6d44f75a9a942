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
  _check_runs(bm, dev_owners)
  _check_counts(bm)
  assert dev_owners[PADDING_BLOCK] == 0, "padding block in use"
  _check_free_lists(bm, dev_owners, host_owners)
  _check_published(bm)


def _check_published(bm) -> None:
  """Prefix caching: a published block holds what its key says. A device block published under a content hash
  and owned is full and computed for an owner whose hash it is; a published host block owned by a request is a
  clean full copy of a block of that hash (parked blocks are not published: they sit on the free queue)."""
  bs = bm.block_size
  written = {}  # device block -> content hashes of owners that have it full and computed
  host_clean = {}
  for rid, s in bm.seqs.items():
    hashes = s.hashes or ()
    for i in range(min(len(hashes), s.num_computed // bs)):
      if not s.on_host:
        written.setdefault(s.dev[i], set()).add(hashes[i])
      if s.host[i] != NO_BLOCK and s.host_tokens[i] == bs:
        host_clean.setdefault(s.host[i], set()).add(hashes[i])
  dev = bm.device
  for key, b in dev.published_items().items():
    if not dev.is_evictable(b):
      assert key in written.get(b, ()), f"device block {b} published before an owner of that hash computed it"
  host = bm.host
  for key, h in host.published_items().items():
    if not host.is_evictable(h):
      assert key in host_clean.get(h, ()), f"host block {h} published without a clean copy of that hash"


def _check_runs(bm, dev_owners: list[int]) -> None:
  """Shared runs (``kv/shared_run.py``): each registered under its last block's hash with its members, the resident
  requests whose ``run`` it is, holding its blocks first; its blocks are what looking up their hashes finds; each
  run counts as one owner of its blocks (into ``dev_owners``; its members' first blocks were not counted)."""
  members = collections.Counter()
  for rid, s in bm.seqs.items():
    run = s.run
    if run is None:
      continue
    assert not s.on_host, f"{rid!r}: swapped out and a member of a shared run"
    assert bm.runs.get(run.key) is run, f"{rid!r}: its shared run is not registered"
    r = len(run.blocks)
    assert s.dev[:r] == run.blocks, f"{rid!r}: first blocks {s.dev[:r].tolist()} are not its run's"
    assert s.hashes is not None and len(s.hashes) >= r and s.hashes[r - 1] == run.key, (
        f"{rid!r}: its run's key is not the hash of its block {r - 1}")
    assert bm.device.lookup_many(s.hashes[:r]) == run.blocks.tolist(), f"{rid!r}: its run's blocks are not found"
    members[run.key] += 1
  for key, run in bm.runs.items():
    assert run.key == key and run.members >= 1, f"run under {key!r}: key {run.key!r}, {run.members} members"
    assert run.members == members[key], f"run under {key!r} counts {run.members} members, {members[key]} hold it"
    for b in run.blocks:
      dev_owners[b] += 1


def _check_seq(bm, rid, s, dev_owners: list[int], host_owners: list[int]) -> None:
  """One request's columns; counts the blocks it owns into ``dev_owners`` / ``host_owners`` (not those its shared
  run holds for it)."""
  bs = bm.block_size
  n = len(s.host)
  assert len(s.host_tokens) == n, f"{rid!r}: parallel lists differ in length"
  assert s.nhashes == (-1 if s.hashes is None else len(s.hashes)), f"{rid!r}: nhashes {s.nhashes} is not its hashes'"
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
      if s.run is None or i >= len(s.run.blocks):
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
  for name, pool, owners, lo in (("device", bm.device, dev_owners, 1), ("host", bm.host, host_owners, 0)):
    free = set(pool.free_ids()) | set(pool.evictable)
    assert PADDING_BLOCK not in free or name == "host", "padding block on the free list"
    if name == "device":
      parked = []
      for rid, s in bm.seqs.items():
        assert 0 <= s.pub_end <= len(s.host), f"{rid!r}: pub_end {s.pub_end} outside its {len(s.host)} blocks"
        if not s.on_host:
          assert not any(map(pool.published, s.dev[s.pub_end:])), f"{rid!r} owns published blocks past pub_end"
        if s.on_host and s.hashes is not None:
          group = pool.parked_blocks(s.park_end, s.park_count)
          assert set(group) <= free, f"blocks {group.tolist()} parked for {rid!r} are not free"
          assert not any(map(pool.published, group)), f"blocks {group.tolist()} parked for {rid!r} are published"
          parked += group
      assert len(set(parked)) == len(parked), "a block parked in two groups"
    for b in range(lo, len(owners)):
      n = owners[b]
      assert (b in free) == (n == 0), f"{name} block {b}: free={b in free}, owners={n}"
      if n:
        assert n == pool.owners(b), f"{name} block {b}: {n} owners but the count says {pool.owners(b)}"
