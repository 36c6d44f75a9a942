"""The persistent host batch (superinfer_jax/engine/host_batch.py): a decode step of the same sequences is
applied in place and equals a full rebuild (``build_batch`` + ``pack``); anything else rebuilds."""
import numpy as np
import pytest

from superinfer_jax.engine import packing
from superinfer_jax.engine.host_batch import HostBatch, SeqInput

BS = 4


def _hb(**kw):
  floors = dict(token_floor=1, seq_floor=1, blocks_floor=2)
  floors.update(kw)
  hb = HostBatch(BS, **floors)
  hb.verify = True      # every build is compared with pack_from_scratch (raises on a difference)
  return hb


def _decode(key, start, table, feed_row=-1, token=7, fresh=False, seed=11):
  tokens = [] if feed_row >= 0 else [token]
  return SeqInput(key, tokens, start, table, feed_row, fresh, (0.5, 3, 0.9, seed), start - 5)


def test_decode_steps_update_in_place_and_grow_block_tables():
  hb = _hb(blocks_floor=4)
  tables = {"a": [3, 9, 4], "b": [5, 6, 8]}
  # Step 0: prefill chunks (rebuild); step 1: the first decode step (rebuild: the rows' token counts
  # changed); steps 2..6: one token each, crossing block boundaries (in place).
  buf, dims = hb.build([SeqInput("a", [1, 2, 3, 4, 5], 0, tables["a"], -1, True, (0.0, 0, 1.0, 1), 0),
                        SeqInput("b", [6, 7], 0, tables["b"], -1, True, (0.0, 0, 1.0, 2), 0)])
  assert hb.rebuilds == 1
  starts = {"a": 5, "b": 2}
  for step in range(6):
    seqs = [_decode("a", starts["a"], tables["a"][:starts["a"] // BS + 1], feed_row=0, seed=1),
            _decode("b", starts["b"], tables["b"][:starts["b"] // BS + 1], token=20 + step, seed=2)]
    buf, dims = hb.build(seqs)
    want, want_dims = hb.pack_from_scratch(seqs)
    assert dims == want_dims and np.array_equal(buf, want)
    starts = {k: v + 1 for k, v in starts.items()}
  assert hb.rebuilds == 2 and hb.builds == 7
  off = packing.offsets(dims)
  assert list(buf[slice(*off["feed"])][:2]) == [0, -1]          # a's token comes from the device
  assert list(buf[slice(*off["positions"])][:2]) == [10, 7]


def test_returned_buffer_is_a_copy():
  hb = _hb()
  seqs = [_decode("a", 5, [3, 9])]
  first, _ = hb.build(seqs)
  kept = first.copy()
  hb.build([_decode("a", 6, [3, 9])])
  assert np.array_equal(first, kept)       # a step in flight may still read (alias) the first buffer


@pytest.mark.parametrize("change", ["fresh", "order", "replaced"])
def test_rows_that_change_request_are_rewritten_in_place(change):
  hb = _hb()
  hb.build([_decode("a", 5, [3, 9]), _decode("b", 6, [4, 8], seed=5)])
  nxt = [_decode("a", 6, [3, 9]), _decode("b", 7, [4, 8], seed=5)]
  if change == "fresh":
    nxt[1] = _decode("b", 7, [10, 11], fresh=True, seed=5)    # rotated back in: new blocks, same length
  elif change == "order":
    nxt = nxt[::-1]
  elif change == "replaced":
    nxt[0] = _decode("c", 4, [12, 13], feed_row=1, seed=9)
  hb.build(nxt)                 # verify: equal to a full rebuild
  assert hb.rebuilds == 1 and hb.builds == 2


@pytest.mark.parametrize("change", ["new_row", "prefill", "bucket", "not_sampling"])
def test_plan_changes_rebuild(change):
  hb = _hb()
  base = [_decode("a", 5, [3, 9]), _decode("b", 6, [4, 8])]
  hb.build(base)
  nxt = [_decode("a", 6, [3, 9]), _decode("b", 7, [4, 8])]
  if change == "new_row":
    nxt.append(_decode("c", 5, [1, 2]))
  elif change == "prefill":
    nxt[0] = SeqInput("a", [1, 2], 6, [3, 9], -1, False, (0.5, 3, 0.9, 11), 1)
  elif change == "bucket":
    nxt[0] = _decode("a", 8, [3, 9, 12])              # 3 blocks: block-table bucket 2 -> 4
  elif change == "not_sampling":
    nxt[0] = nxt[0]._replace(sampling=None)
  hb.build(nxt)
  assert hb.rebuilds == 2


def test_pack_from_scratch_sampling_and_feed_columns():
  """Hand-worked rows: a prefill chunk that does not sample, a fed decode token, a host-token decode with a
  seed above 2**31, and a sampling prefill chunk; padding rows stay greedy."""
  hb = HostBatch(BS, token_floor=8, seq_floor=4, blocks_floor=2)
  seqs = [SeqInput("p", [1, 2, 3], 0, [5], -1, True, None, 0),
          SeqInput("f", [], 9, [6, 7, 8], 2, False, (0.7, 5, 0.8, 3), 4),
          SeqInput("h", [42], 4, [9, 10], -1, False, (0.0, 0, 1.0, 2**32 - 1), 1),
          SeqInput("q", [4, 5], 2, [11, 12], 0, True, (1.5, 0, 0.5, 7), 0)]
  buf, dims = hb.pack_from_scratch(seqs)
  assert dims == (8, 4, 4, 4)
  col = {k: buf[a:b] for k, (a, b) in packing.offsets(dims).items()}
  # tokens: p 0..2, f 3 (fed), h 4, q 5..7 (the last one fed)
  assert col["feed"].tolist() == [-1, -1, -1, 2, -1, -1, -1, 0]
  assert col["token_ids"].tolist() == [1, 2, 3, 0, 42, 4, 5, 0]
  np.testing.assert_array_equal(col["temperature"].view(np.float32), np.float32([0, 0.7, 0, 1.5]))
  assert col["top_k"].tolist() == [0, 5, 0, 0]
  np.testing.assert_array_equal(col["top_p"].view(np.float32), np.float32([1, 0.8, 1, 0.5]))
  assert col["seed"].view(np.uint32).tolist() == [0, 3, 2**32 - 1, 7]
  assert col["step"].tolist() == [0, 4, 1, 0]
