"""build_batch: bucketing, slot mapping, padding conventions, errors (host-side numpy only)."""
import numpy as np
import pytest

from superinfer_jax.model.batch import bucket, build_batch


def test_bucket_is_power_of_two_with_floor():
  assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
  assert bucket(3, floor=8) == 8 and bucket(9, floor=8) == 16


def test_mixed_prefill_and_decode_batch():
  bs = 4
  seqs = [([11, 12, 13, 14, 15], 2, [7, 3]),       # prefill chunk: positions 2..6 -> blocks 7, 3
          ([21], 9, [5, 6, 9, 1])]                  # decode token at position 9 -> block 9, offset 1
  batch, rows = build_batch(seqs, bs, token_floor=8, seq_floor=1, blocks_floor=1)
  assert rows == 2
  assert batch.token_ids.shape == (8,) and batch.block_tables.shape == (2, 4)
  np.testing.assert_array_equal(batch.token_ids[:6], [11, 12, 13, 14, 15, 21])
  np.testing.assert_array_equal(batch.positions[:6], [2, 3, 4, 5, 6, 9])
  np.testing.assert_array_equal(batch.slot_mapping[:6], [7 * 4 + 2, 7 * 4 + 3, 3 * 4, 3 * 4 + 1, 3 * 4 + 2,
                                                         9 * 4 + 1])
  assert np.all(batch.slot_mapping[6:] // bs == 0)      # padding tokens write into block 0
  np.testing.assert_array_equal(batch.block_tables, [[7, 3, 0, 0], [5, 6, 9, 0]])
  np.testing.assert_array_equal(batch.context_lens, [7, 10])
  np.testing.assert_array_equal(batch.query_start_loc, [0, 5, 6])
  np.testing.assert_array_equal(batch.logits_indices, [4, 5])
  assert all(a.dtype == np.int32 for a in batch)


def test_padding_sequences_and_all_logits():
  seqs = [([1, 2, 3], 0, [1]), ([4], 0, [2]), ([5, 6], 0, [3])]
  batch, rows = build_batch(seqs, 16, logits="all", token_floor=4, seq_floor=4, blocks_floor=2)
  assert rows == 6
  assert batch.token_ids.shape == (8,) and batch.context_lens.shape == (4,)
  assert batch.logits_indices.shape == (8,) and batch.block_tables.shape == (4, 2)
  np.testing.assert_array_equal(batch.query_start_loc, [0, 3, 4, 6, 6])
  assert batch.context_lens[3] == 0
  np.testing.assert_array_equal(batch.logits_indices[:6], np.arange(6))


@pytest.mark.parametrize("seqs,match", [
    ([], "at least one"),
    ([([], 0, [1])], "no new tokens"),
    ([([1, 2, 3], 2, [1])], "needs 2"),
    ([([1], 0, [0])], "padding block"),
])
def test_build_batch_errors(seqs, match):
  with pytest.raises(ValueError, match=match):
    build_batch(seqs, 4)
