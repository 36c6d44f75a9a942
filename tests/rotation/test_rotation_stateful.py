"""BlockManager + DuplexKV driven together through thousands of random operations.

Each operation is one engine step in the order the engine uses: frees, swap-outs, swap-ins, slot appends,
write-backs taken last, ONE ``issue()``, then a model step that writes the new tokens' KV into the
donated cache, then ``mark_computed``. After each step: ``check_invariants()`` and every request's KV
(tracked in a numpy shadow) is intact — on device for resident requests, in the host pool for rotary ones.
"""
import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.layout import PADDING_BLOCK, KVCacheSpec
from superinfer_jax.rotation import DUPLEX, DuplexKV, bucket_size

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype="float32")
NUM_DEV, NUM_HOST = 12, 16


@functools.partial(jax.jit, static_argnames=("block_axis",), donate_argnums=(0,))
def _write_slots(cache, slots, values, *, block_axis):
  """Stand-in model step: token t's K/V (``values[t]``: [L, 2, H, D]) goes to slot ``slots[t]``."""
  bs = cache.shape[3]
  blocks, offs = slots // bs, slots % bs
  if block_axis == 0:
    return cache.at[blocks, :, :, offs].set(values)
  return cache.at[:, :, blocks, offs].set(jnp.moveaxis(values, 0, 2))


class Harness:
  """A block manager, a DuplexKV engine, a device cache, and the numpy shadow of every request's KV."""

  def __init__(self, spec=SPEC, mode=DUPLEX, seed=0, num_dev=NUM_DEV, num_host=NUM_HOST):
    self.spec = spec
    self.bm = BlockManager(num_dev, num_host, spec.block_size)
    self.eng = DuplexKV(spec, num_host, mode=mode)
    self.cache = jax.device_put(np.zeros(spec.shape(num_dev + 1), jnp.dtype(spec.dtype)))
    self.rng = np.random.default_rng(seed)
    self.shadow: dict[int, np.ndarray] = {}    # req -> [num_computed, L, 2, H, D]
    self.next_id = 0
    self.steps = 0
    self.write_buckets: set[int] = set()
    self.recompute_preemptions = 0             # swap_out refused (host pool full)
    self.swap_in_refusals = 0                  # swap_in refused (device pool full)

  # -------------------------------------------------------------------- one engine step
  def step(self, frees=(), swap_outs=(), swap_ins=(), appends=None, new_prompts=()):
    """Runs one step; ``appends`` maps resident req -> new tokens; ``new_prompts`` are prompt lengths."""
    bm, spec = self.bm, self.spec
    for r in frees:                           # finish / abort (never a request rotated this step)
      bm.free(r)
      self.shadow.pop(r, None)
    so_pairs, si_pairs = [], []
    for r in swap_outs:
      pairs = bm.swap_out(r)
      if pairs is None:                        # host pool full: recompute preemption, nothing silent
        bm.free(r)
        del self.shadow[r]
        self.recompute_preemptions += 1
      else:
        so_pairs += pairs
    for r in swap_ins:
      pairs = bm.swap_in(r)
      if pairs is None:
        self.swap_in_refusals += 1
      else:
        si_pairs += pairs
    if si_pairs and self.rng.random() < 0.5:
      self.eng.prefetch(si_pairs)              # H2D starts as soon as the plan knows the swap-ins
    grow = dict(appends or {})
    for n in new_prompts:
      grow[self.next_id] = n
      self.shadow[self.next_id] = np.zeros((0,) + self._tok_shape(), np.float32)
      self.next_id += 1
    written = {}
    for r, k in grow.items():
      if bm.has_request(r) and bm.is_swapped(r):
        continue
      start = bm.num_tokens(r)
      if not bm.append_slots(r, k):
        if not bm.has_request(r):
          del self.shadow[r]                   # a new request that did not fit: never admitted
        continue
      written[r] = (start, k)
    wb_pairs = bm.take_writebacks()
    self.cache = self.eng.issue(self.cache, swap_out=so_pairs, writeback=wb_pairs, swap_in=si_pairs)
    # The model step: write the new tokens' KV (after the issue, into the donated cache).
    slots, values = [], []
    for r, (start, k) in written.items():
      table = bm.block_table(r)
      vals = self.rng.standard_normal((k,) + self._tok_shape()).astype(np.float32)
      for t in range(start, start + k):
        slots.append(table[t // spec.block_size] * spec.block_size + t % spec.block_size)
      values.append(vals)
      self.shadow[r] = np.concatenate([self.shadow[r], vals])
    if slots:
      n = bucket_size(len(slots), 4)
      self.write_buckets.add(n)
      pad = n - len(slots)
      slot_arr = np.array(slots + [PADDING_BLOCK * spec.block_size] * pad, np.int32)
      val_arr = np.concatenate(values + [np.zeros((pad,) + self._tok_shape(), np.float32)])
      self.cache = _write_slots(self.cache, jax.device_put(slot_arr), jax.device_put(val_arr),
                                block_axis=spec.block_axis)
    for r, (start, k) in written.items():
      bm.mark_computed(r, start + k)
    self.steps += 1

  def _tok_shape(self):
    s = self.spec
    return (s.num_layers, 2, s.num_kv_heads, s.head_dim)

  # -------------------------------------------------------------------- checks
  def check(self):
    bm, spec, bs = self.bm, self.spec, self.spec.block_size
    bm.check_invariants()
    cache = np.asarray(self.cache)
    if spec.block_axis == 2:
      cache = np.moveaxis(cache, 2, 0)
    host_cache: dict[int, np.ndarray] = {}
    assert set(self.shadow) == {r for r in self.shadow if bm.has_request(r)}
    for r, kv in self.shadow.items():
      n = kv.shape[0]
      assert bm.num_computed(r) == n
      if bm.is_swapped(r):
        table = bm.host_block_table(r)
        for t in range(n):
          h = table[t // bs]
          if h not in host_cache:
            host_cache[h] = self.eng.read_host_block(h)
          np.testing.assert_array_equal(host_cache[h][:, :, t % bs], kv[t],
                                        err_msg=f"step {self.steps}: swapped req {r} token {t} (host {h})")
      else:
        table = bm.block_table(r)
        for t in range(n):
          np.testing.assert_array_equal(cache[table[t // bs], :, :, t % bs], kv[t],
                                        err_msg=f"step {self.steps}: resident req {r} token {t}")

  # -------------------------------------------------------------------- random driver
  def random_step(self):
    rng, bm = self.rng, self.bm
    resident = [r for r in self.shadow if not bm.is_swapped(r)]
    swapped = [r for r in self.shadow if bm.is_swapped(r)]
    pick = lambda xs, p: [x for x in xs if rng.random() < p]  # noqa: E731
    frees = pick(resident + swapped, 0.05)
    rest_res = [r for r in resident if r not in frees]
    rest_sw = [r for r in swapped if r not in frees]
    swap_outs = pick(rest_res, 0.25)
    swap_ins = pick(rest_sw, 0.4)
    appends = {r: int(rng.integers(1, 4)) for r in rest_res if r not in swap_outs and rng.random() < 0.7}
    appends.update({r: 1 for r in swap_ins if rng.random() < 0.5})   # rotated in and decoding at once
    new = [int(rng.integers(1, 10))] if rng.random() < 0.3 else []
    self.step(frees, swap_outs, swap_ins, appends, new)


@pytest.mark.parametrize("layout", ["block_first", "layer_first"])
def test_random_rotation_traffic_keeps_kv_intact(layout):
  spec = KVCacheSpec(2, 1, 2, 4, "float32", layout)
  h = Harness(spec=spec, seed=11 if layout == "block_first" else 12)
  for _ in range(1000):
    h.random_step()
    h.check()
  st = h.eng.stats
  # The traffic really exercised rotation and eager write-back, in few compilations.
  assert st.blocks_out > 200 and st.blocks_in > 200 and st.writeback_blocks > 50, st
  assert st.prefetched_blocks > 50, st
  assert h.recompute_preemptions > 0 and h.swap_in_refusals > 0   # both pools ran full, nothing lost
  assert h.eng.num_kernel_variants <= 2 * 5, h.eng._variants   # buckets 1..16 for gather and scatter
  assert len(h.write_buckets) <= 4


def test_swap_out_after_eager_writeback_copies_only_the_dirty_tail():
  h = Harness()
  h.step(new_prompts=[10])                     # 10 tokens: blocks 0, 1 full after this step, 2 partial
  h.step(appends={0: 1})                       # write-back of the two full blocks happens here
  assert h.eng.stats.writeback_blocks == 2
  out_before = h.eng.stats.blocks_out
  h.step(swap_outs=[0])
  assert h.eng.stats.blocks_out - out_before == 1   # only the dirty tail block
  h.check()
  h.step(swap_ins=[0], appends={0: 1})
  h.check()
  h.step(swap_outs=[0])
  h.check()


class RotationMachine(RuleBasedStateMachine):
  """Hypothesis drives arrivals, decodes, rotations (alone and combined), finishes and aborts."""

  @initialize(seed=st.integers(0, 2**16))
  def setup(self, seed):
    self.h = Harness(seed=seed)

  def _resident(self):
    if not hasattr(self, "h"):
      return []
    return [r for r in self.h.shadow if not self.h.bm.is_swapped(r)]

  def _swapped(self):
    if not hasattr(self, "h"):
      return []
    return [r for r in self.h.shadow if self.h.bm.is_swapped(r)]

  @rule(prompt=st.integers(1, 14))
  def arrive(self, prompt):
    self.h.step(new_prompts=[prompt], appends={r: 1 for r in self._resident()})

  @precondition(lambda self: self._resident())
  @rule(data=st.data())
  def decode(self, data):
    res = self._resident()
    if res:
      chosen = data.draw(st.lists(st.sampled_from(res), unique=True, max_size=len(res)))
      self.h.step(appends={r: data.draw(st.integers(1, 5)) for r in chosen})

  @precondition(lambda self: self._resident())
  @rule(data=st.data())
  def rotate_out(self, data):
    res = self._resident()
    if res:
      r = data.draw(st.sampled_from(res))
      self.h.step(swap_outs=[r], appends={x: 1 for x in res if x != r})

  @precondition(lambda self: self._swapped())
  @rule(data=st.data())
  def rotate_in(self, data):
    sw = self._swapped()
    if sw:
      r = data.draw(st.sampled_from(sw))
      self.h.step(swap_ins=[r], appends={r: data.draw(st.integers(0, 2))})

  @precondition(lambda self: self._resident() and self._swapped())
  @rule(data=st.data())
  def rotate_both(self, data):
    """Swap one request out and another in within one step: freed blocks are reused at once."""
    res, sw = self._resident(), self._swapped()
    if res and sw:
      self.h.step(swap_outs=[data.draw(st.sampled_from(res))], swap_ins=[data.draw(st.sampled_from(sw))])

  @precondition(lambda self: self._resident())
  @rule(data=st.data())
  def finish(self, data):
    res = self._resident()
    if res:
      self.h.step(frees=[data.draw(st.sampled_from(res))])

  @precondition(lambda self: self.h.shadow)
  @rule(data=st.data())
  def abort(self, data):
    everyone = list(self.h.shadow)
    if everyone:
      self.h.step(frees=[data.draw(st.sampled_from(everyone))])

  @invariant()
  def kv_intact(self):
    if hasattr(self, "h"):
      self.h.check()


TestRotationMachine = RotationMachine.TestCase
TestRotationMachine.settings = settings(max_examples=60, stateful_step_count=100, deadline=None)
