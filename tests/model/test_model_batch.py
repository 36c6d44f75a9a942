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


def _reference_build(seqs, bs, logits, token_floor, seq_floor, blocks_floor, rows_floor):
  """A plain per-sequence, per-token packing (the definition ``build_batch`` vectorises)."""
  nbs = [-(-(c + len(t)) // bs) for t, c, _ in seqs]
  t_real = sum(len(t) for t, _, _ in seqs)
  r_real = len(seqs) if logits == "last" else t_real
  T, S = bucket(t_real, token_floor), bucket(len(seqs), seq_floor)
  MB, R = bucket(max(nbs), blocks_floor), bucket(r_real, rows_floor)
  tok, pos, slot = [0] * T, [0] * T, [i % bs for i in range(T)]
  tables = [[0] * MB for _ in range(S)]
  ctx, qsl, rows = [0] * S, [t_real] * (S + 1), [0] * R
  t = 0
  for i, ((tokens, c, table), nb) in enumerate(zip(seqs, nbs)):
    qsl[i] = t
    for j in range(nb):
      tables[i][j] = int(table[j])
    for k, x in enumerate(tokens):
      p = c + k
      tok[t], pos[t], slot[t] = int(x), p, int(table[p // bs]) * bs + p % bs
      if logits == "all":
        rows[t] = t
      t += 1
    ctx[i] = c + len(tokens)
    if logits == "last":
      rows[i] = t - 1
  return [tok, pos, slot, tables, ctx, qsl, rows], r_real


@pytest.mark.parametrize("seed", range(12))
def test_build_batch_matches_a_per_token_reference(seed):
  """Random ragged batches (prefill chunks and decode tokens, tables as lists, arrays and numpy with extra
  entries, both logits modes, random floors) against a per-token loop."""
  from array import array
  rng = np.random.default_rng(seed)
  bs = int(rng.choice([1, 4, 16]))
  seqs = []
  for _ in range(int(rng.integers(1, 70))):
    n = int(rng.choice([1, 1, 1, rng.integers(1, 40)]))
    c = int(rng.integers(0, 100))
    nb = -(-(c + n) // bs) + int(rng.integers(0, 3))
    table = rng.permutation(np.arange(1, 400))[:nb].astype(np.int32)
    kind = seed % 3
    table = table.tolist() if kind == 0 else array("i", table.tolist()) if kind == 1 else table
    tokens = rng.integers(0, 1000, n).tolist() if seed % 2 else tuple(rng.integers(0, 1000, n))
    seqs.append((tokens, c, table))
  logits = "last" if seed % 4 else "all"
  floors = dict(token_floor=int(rng.choice([1, 8, 64])), seq_floor=int(rng.choice([1, 8])),
                blocks_floor=int(rng.choice([1, 4])), rows_floor=int(rng.choice([1, 8])))
  batch, rows = build_batch(seqs, bs, logits=logits, **floors)
  want, want_rows = _reference_build(seqs, bs, logits, **floors)
  assert rows == want_rows
  for name, got, ref in zip(batch._fields, batch, want):
    assert got.dtype == np.int32, name
    np.testing.assert_array_equal(got, np.array(ref, np.int32), err_msg=name)


def test_padding_block_error_names_the_sequence():
  with pytest.raises(ValueError, match=r"sequence 2: block table uses the padding block"):
    build_batch([([1], 0, [3]), ([1, 2], 3, [4, 5]), ([7], 20, [6, 0, 8])], 16)
