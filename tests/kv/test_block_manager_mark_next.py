"""BlockManager.mark_computed_next (the scheduler's swap-in batch marking) == mark_computed(rid, computed + 1)."""
import random

import pytest

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.pairs import PairList


def _state(bm):
  return ({rid: (list(s.dev), s.host.tolist(), list(s.host_tokens), s.num_tokens, s.num_computed, s.nwb)
           for rid, s in bm.seqs.items()}, list(bm.writebacks))


@pytest.mark.parametrize("seed", range(20))
def test_mark_computed_next_matches_mark_computed(seed):
  rng = random.Random(seed)
  a, b = BlockManager(256, 512, 4), BlockManager(256, 512, 4)
  rids = list(range(8))
  for bm in (a, b):
    for rid in rids:
      n = random.Random(seed * 100 + rid).randint(1, 30)
      assert bm.append_slots(rid, n)
      bm.mark_computed(rid, n)
      bm.take_writebacks()  # some full blocks clean, later ones dirty
      assert bm.swap_out_to(rid, PairList()) is not None
  batch = rng.sample(rids, 5)
  for bm in (a, b):
    assert len(bm.swap_in_many(batch, 1, PairList())) == len(batch)  # each gains its pending token's slot
  for rid in batch:
    a.mark_computed(rid, a.num_computed(rid) + 1)
  b.mark_computed_next(batch)
  assert _state(a) == _state(b)
  a.check_invariants()
  b.check_invariants()


def test_mark_computed_next_rejects_bad_ids():
  bm = BlockManager(16, 16, 4)
  assert bm.append_slots("r", 3)
  bm.mark_computed("r", 3)
  with pytest.raises(ValueError, match="no uncomputed slot"):
    bm.mark_computed_next(["r"])
  bm.swap_out_to("r", PairList())
  with pytest.raises(ValueError, match="swapped out"):
    bm.mark_computed_next(["r"])
