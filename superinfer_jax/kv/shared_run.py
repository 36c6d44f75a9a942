"""``SharedRun``: leading device blocks that several requests took by content, owned once on behalf of them all.

Prefix caching shares full blocks. Requests that found the same leading blocks by content (a system prompt,
an earlier turn) hold them through one ``SharedRun``: the run is *one* owner of each of its blocks in the device
``BlockPool``'s count, and ``members`` counts the resident requests holding it. A request joining or leaving a
live run changes ``members`` only: no per-block reference count moves, and nothing is looked up. That is what
makes rotating a request with a shared prefix cost about what rotating one without does.

What goes in: the registry ``runs`` (a dict, content hash of a run's last block -> its run; the block manager
keeps one), the device pool, and a request's content hashes. A chained hash names its whole prefix
(``kv/prefix_hash.py``), so ``runs[hashes[n - 1]]`` is the live run of exactly the first ``n`` blocks of
``hashes``, if any.

Invariants (``kv/invariants.py`` checks them):

* A registered run has ``members >= 1``; every member is resident, its ``SeqBlocks.run`` is the run and its
  first ``len(run.blocks)`` device ids are ``run.blocks``. A request swapped out holds no run.
* A run's blocks are published under its keys (owned blocks are never evicted, and a published key is never
  taken by another block while its block is owned), so ``runs[key].blocks`` is what looking up its keys finds.
* Pool state is the same as if each member held the blocks itself: a block has other owners than a given
  request iff another request holds it (the pool's ``refs`` count a live run once), so every release, park and
  eviction decision is unchanged. When the last member leaves, it inherits the run's owner slot: the blocks
  become its own (no pool change), and it releases or parks them as its own blocks.

Pure Python, no JAX; never touches KV data.
"""
from __future__ import annotations

from array import array

from superinfer_jax.kv.block_pool import BlockPool
from superinfer_jax.kv.pairs import DEV_IDS


class SharedRun:
  """Leading device blocks held once for ``members`` resident requests (module docstring).

  Attributes:
    key: the content hash of its last block (its key in the registry).
    blocks: ``array`` of device ids (``DEV_IDS``), logical blocks ``0 .. len(blocks) - 1`` of every member.
    members: resident requests holding it (>= 1 while registered).
  """
  __slots__ = ("key", "blocks", "members")

  def __init__(self, key: int, blocks: array, members: int):
    self.key = key
    self.blocks = blocks
    self.members = members


def register(runs: dict, key: int, blocks, members: int) -> SharedRun:
  """Registers a run of ``blocks`` (published, found by content: the lookup of the hashes up to ``key``) under
  ``key``, which must name no live run, for ``members`` requests. The caller has given the run its owner slot of
  each block (``BlockPool.share_many``; an evictable block is re-adopted). Returns the run."""
  run = runs[key] = SharedRun(key, array(DEV_IDS, blocks), members)
  return run


def leave(runs: dict, run: SharedRun) -> int:
  """A member lets go of ``run`` (it swaps out or finishes). Returns how many of its leading blocks the run
  still holds for the others (``len(run.blocks)``), or 0 when it was the last member: the run is unregistered
  and its owner slot passes to the leaver, whose blocks they now are (the pool does not change)."""
  run.members -= 1
  if run.members:
    return len(run.blocks)
  del runs[run.key]
  return 0


def references(runs: dict, device: BlockPool, block: int) -> int:
  """Requests holding owned device ``block``: its owner slots (``device.owners``), each live run among them
  counted once per member. O(live runs); for tests and debug."""
  n = device.owners(block)
  for run in runs.values():
    if block in run.blocks:
      n += run.members - 1
  return n
