"""Hypothesis stateful test of the block manager with a shadow model of token ownership and KV content.

A fake device pool and host pool hold one tag per token slot. Marking tokens computed writes their tags
(``(req, t)``) into the device slots of the request's block table; copy pairs returned by the manager are
applied at once (so all D2H gathers of an operation precede later H2D scatters, as the ordering contract
requires); freed blocks are poisoned. After every rule: ``check_invariants()``, the manager's token counts
equal the shadow model's, and every computed token of every request is readable where the manager says it is
(device table if resident, host table if swapped).
"""
import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from superinfer_jax.kv.block_manager import NO_BLOCK, BlockManager

BS = 4
NUM_DEV = 12
NUM_HOST = 16
POISON = ("poison",)


class BlockManagerMachine(RuleBasedStateMachine):

  def __init__(self):
    super().__init__()
    self.bm = BlockManager(NUM_DEV, NUM_HOST, BS)
    self.dev = {b: [POISON] * BS for b in range(NUM_DEV + 1)}
    self.host = {b: [POISON] * BS for b in range(NUM_HOST)}
    self.shadow = {}  # rid -> [num_tokens, num_computed, swapped]
    self.next_id = 0

  # ------------------------------------------------------------------ helpers
  def _resident(self):
    return sorted(r for r, v in self.shadow.items() if not v[2])

  def _swapped(self):
    return sorted(r for r, v in self.shadow.items() if v[2])

  def _d2h(self, pairs):
    snap = [(h, list(self.dev[d])) for d, h in pairs]  # gather first
    for h, data in snap:
      self.host[h] = data

  def _h2d(self, pairs):
    snap = [(d, list(self.host[h])) for h, d in pairs]
    for d, data in snap:
      self.dev[d] = data

  def _poison_freed(self, dev_blocks, host_blocks):
    dev_free = set(self.bm.device.free_ids())
    host_free = set(self.bm.host.free_ids())
    for b in dev_blocks:
      if b != NO_BLOCK and b in dev_free:
        self.dev[b] = [POISON] * BS
    for b in host_blocks:
      if b != NO_BLOCK and b in host_free:
        self.host[b] = [POISON] * BS

  # ------------------------------------------------------------------ rules
  def new_request(self, data):
    n = data.draw(st.integers(1, 4 * BS))
    rid = self.next_id
    self.next_id += 1
    need = -(-n // BS)
    free = self.bm.num_free_device_blocks
    ok = self.bm.append_slots(rid, n)
    assert ok == (need <= free)
    if ok:
      self.shadow[rid] = [n, 0, False]

  def append(self, data):
    if not self._resident():
      return
    n = data.draw(st.integers(0, 2 * BS))
    rid = data.draw(st.sampled_from(self._resident()))
    need = self.bm.blocks_to_grow(rid, self.shadow[rid][0] + n)
    free = self.bm.num_free_device_blocks
    ok = self.bm.append_slots(rid, n)
    assert ok == (need <= free)
    if ok:
      self.shadow[rid][0] += n

  def compute(self, data):
    if not self._resident():
      return
    k = data.draw(st.integers(0, 2 * BS))
    rid = data.draw(st.sampled_from(self._resident()))
    ntok, ncomp, _ = self.shadow[rid]
    new = min(ntok, ncomp + k)
    table = self.bm.block_table(rid)
    for t in range(ncomp, new):  # the model step writes the new tokens' KV
      self.dev[table[t // BS]][t % BS] = (rid, t)
    self.bm.mark_computed(rid, new)
    self.shadow[rid][1] = new

  def writeback(self, data):
    max_blocks = data.draw(st.one_of(st.none(), st.integers(0, 4)))
    min_free = data.draw(st.integers(0, 2))
    before = self.bm.num_free_host_blocks
    pairs = self.bm.take_writebacks(max_blocks=max_blocks, min_free_host=min_free)
    if max_blocks is not None:
      assert len(pairs) <= max_blocks
    assert len({h for _, h in pairs}) == len(pairs)
    assert self.bm.num_free_host_blocks >= min(before, min_free)
    self._d2h(pairs)

  def rotate_out(self, data):
    if not self._resident():
      return
    rid = data.draw(st.sampled_from(self._resident()))
    need_host = self.bm.blocks_to_swap_out(rid)
    free_host = self.bm.num_free_host_blocks
    copies = self.bm.swap_out_copies(rid)
    old_dev = self.bm.block_table(rid)
    old_host = self.bm.host_block_table(rid)
    pairs = self.bm.swap_out(rid)
    if need_host > free_host:
      assert pairs is None
      assert self.bm.block_table(rid) == old_dev
      return
    assert pairs is not None and len(pairs) == copies
    self._d2h(pairs)
    self._poison_freed(old_dev, old_host)
    self.shadow[rid][0] = self.shadow[rid][1]  # uncomputed slots are dropped
    self.shadow[rid][2] = True

  def rotate_in(self, data):
    if not self._swapped():
      return
    rid = data.draw(st.sampled_from(self._swapped()))
    need = self.bm.blocks_to_swap_in(rid)
    free = self.bm.num_free_device_blocks
    pairs = self.bm.swap_in(rid)
    if need > free:
      assert pairs is None and self.bm.is_swapped(rid)
      return
    assert len(pairs) == need
    self._h2d(pairs)
    self.shadow[rid][2] = False

  def free(self, data):  # finish / abort / recompute preemption
    if not self.shadow:
      return
    rid = data.draw(st.sampled_from(sorted(self.shadow)))
    s = self.bm.seqs[rid]
    dev, host = list(s.dev), list(s.host)
    self.bm.free(rid)
    self._poison_freed(dev, host)
    del self.shadow[rid]

  def drop_mirrors(self, data):
    if not self._resident():
      return
    rid = data.draw(st.sampled_from(self._resident()))
    host = self.bm.host_block_table(rid)
    self.bm.drop_host_mirrors(rid)
    self._poison_freed([], host)

  # One weighted rule (instead of one rule per operation) so that hypothesis' swarm testing and uniform rule
  # choice do not starve the multi-step sequences that matter (rotate out, in, grow the tail, out again).
  @rule(data=st.data(), op=st.sampled_from(
      ["new"] * 2 + ["append"] * 3 + ["compute"] * 4 + ["writeback"] * 2 + ["out"] * 3 + ["in"] * 3
      + ["free", "drop"]))
  def op(self, data, op):
    {"new": self.new_request, "append": self.append, "compute": self.compute, "writeback": self.writeback,
     "out": self.rotate_out, "in": self.rotate_in, "free": self.free, "drop": self.drop_mirrors}[op](data)

  # ------------------------------------------------------------------ checks
  @invariant()
  def consistent(self):
    self.bm.check_invariants()
    assert self.bm.num_requests == len(self.shadow)
    for rid, (ntok, ncomp, swapped) in self.shadow.items():
      assert self.bm.num_tokens(rid) == ntok and self.bm.num_computed(rid) == ncomp
      assert self.bm.is_swapped(rid) == swapped
      if swapped:
        table, pool = self.bm.host_block_table(rid), self.host
      else:
        table, pool = self.bm.block_table(rid), self.dev
      assert len(table) == -(-ntok // BS)
      for t in range(ncomp):
        assert pool[table[t // BS]][t % BS] == (rid, t), (rid, t, swapped)


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
