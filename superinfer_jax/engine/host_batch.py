"""The step's packed inputs kept on the host between steps: rebuilt only where the plan changed.

``HostBatch.build(seqs)`` returns the one int32 buffer of ``engine/packing.py`` (and its dims) for a list
of ``SeqInput``. Most decode steps schedule the same sequences in the same order as the step before, each
with one new token: then the buffer of the last step is updated in place (positions, context lengths,
slots, the token ids / feed and the sampling step index, written vectorised over the rows; a block-table
row only gains the blocks appended since) instead of being rebuilt sequence by sequence. Anything else (a
new or dropped sequence, a prefill chunk, a request whose blocks changed other than by appending, i.e.
``fresh``: admitted, rotated in, round trip; a new bucket) rebuilds the buffer with ``model.batch.build_batch``
and ``packing.pack``, the one definition of the layout.

Invariants of the fast path (checked against a full rebuild when ``verify`` is set; tests do):
  * a sequence that is not ``fresh`` keeps its block table except for blocks appended at the end;
  * its sampling parameters (temperature, top-k, top-p, seed) are fixed per request id;
  * a decode-only batch has token i = sequence i = logits row i (query starts and logits rows unchanged).

``build`` returns a copy of the buffer: on CPU ``jax.device_put`` aliases an aligned numpy array (zero
copy), so the persistent buffer must never be the one a step in flight reads.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from superinfer_jax.engine import packing
from superinfer_jax.engine.sampling import SamplingArrays
from superinfer_jax.model.batch import bucket, build_batch
from superinfer_jax.util import cdiv


class SeqInput(NamedTuple):
  """One sequence of a step, as the engine hands it to ``HostBatch.build``.

  key       request id (fast-path identity of a row).
  tokens    the new token ids the host knows, in order.
  start     tokens of the sequence already in the cache (position of the first new token).
  table     its device block ids (covering ``start + num_new``; extra entries ignored).
  feed_row  -1, or the row of the previous step's sampled tokens that holds one more new token, after
            ``tokens`` (on-device token feedback): ``num_new = len(tokens) + (feed_row >= 0)``.
  fresh     its block table may have changed other than by appending (admitted, rotated in, round trip).
  sampling  ``(temperature, top_k, top_p, seed)`` when the step samples a token for it, else None.
  step      output index of the token sampled (0 for the first generated token).
  """
  key: str
  tokens: Sequence[int]
  start: int
  table: Sequence[int]
  feed_row: int
  fresh: bool
  sampling: Optional[tuple[float, int, float, int]]
  step: int


class HostBatch:
  """Persistent host buffer of the step inputs (module docstring). Bucket floors as in ``build_batch``."""

  def __init__(self, block_size: int, *, token_floor: int, seq_floor: int, blocks_floor: int):
    self.block_size = block_size
    self.floors = dict(token_floor=token_floor, seq_floor=seq_floor, blocks_floor=blocks_floor,
                       rows_floor=seq_floor)
    self.verify = False          # tests: compare every in-place update with a full rebuild
    self.rebuilds = 0            # full builds (counters: the fast path's share is 1 - rebuilds / builds)
    self.builds = 0
    self._buf: Optional[np.ndarray] = None
    self._dims = None
    self._keys: list = []
    self._nblocks: list[int] = []   # block-table entries written per row
    self._decode_only = False       # the buffer's last build had one new token per sequence, all sampling
    self._views: dict = {}

  def build(self, seqs: Sequence[SeqInput]) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """The packed buffer (a fresh copy) and dims for ``seqs`` (non-empty)."""
    self.builds += 1
    if not self._update_in_place(seqs):
      self._rebuild(seqs)
    if self.verify:
      want, dims = self.pack_from_scratch(seqs)
      if dims != self._dims or not np.array_equal(want, self._buf):
        raise AssertionError(f"HostBatch in-place update differs from a rebuild (dims {self._dims} vs {dims})")
    return self._buf.copy(), self._dims

  def pack_from_scratch(self, seqs: Sequence[SeqInput]):
    """``build_batch`` + ``packing.pack`` for ``seqs`` (no state): the reference layout."""
    rows = [(list(s.tokens) + [0] * (s.feed_row >= 0), s.start, s.table) for s in seqs]
    batch, _ = build_batch(rows, self.block_size, logits="last", **self.floors)
    T, R = batch.token_ids.shape[0], batch.logits_indices.shape[0]
    samp = SamplingArrays.empty(R)
    feed = np.full(T, -1, np.int32)
    # Column-wise (one numpy write per field, not one per sequence and field): a rebuild of 64-256 rows.
    fed = [i for i, s in enumerate(seqs) if s.feed_row >= 0]
    if fed:   # the fed token is the sequence's last new one
      feed[batch.query_start_loc[np.array(fed) + 1] - 1] = [seqs[i].feed_row for i in fed]
    sampled = [i for i, s in enumerate(seqs) if s.sampling is not None]
    if sampled:
      rows_idx = np.array(sampled)
      temperature, top_k, top_p, seed = zip(*[seqs[i].sampling for i in sampled])
      samp.temperature[rows_idx] = np.array(temperature, np.float32)
      samp.top_k[rows_idx] = top_k
      samp.top_p[rows_idx] = np.array(top_p, np.float32)
      samp.seed[rows_idx] = np.array(seed, np.uint32)
      samp.step[rows_idx] = [seqs[i].step for i in sampled]
    return packing.pack(batch, samp, feed)

  # ------------------------------------------------------------------------------------------ internals
  def _rebuild(self, seqs) -> None:
    self.rebuilds += 1
    self._buf, self._dims = self.pack_from_scratch(seqs)
    self._views = {k: self._buf[a:b] for k, (a, b) in packing.offsets(self._dims).items()}
    S, MB = self._dims[1], self._dims[2]
    self._views["block_tables"] = self._views["block_tables"].reshape(S, MB)
    self._keys = [s.key for s in seqs]
    bs = self.block_size
    self._nblocks = [cdiv(s.start + len(s.tokens) + (s.feed_row >= 0), bs) for s in seqs]
    self._decode_only = all(len(s.tokens) + (s.feed_row >= 0) == 1 and s.sampling is not None for s in seqs)

  def _update_in_place(self, seqs) -> bool:
    """Applies a decode step of as many sequences as the last one in place; False (nothing written) when a
    rebuild is needed. A row whose request is the same as last step's only gains appended blocks; a row
    that now holds another request (the scheduler reordered or replaced it) has its block-table row and
    sampling parameters rewritten."""
    if not self._decode_only or len(seqs) != len(self._keys):
      return False
    bs = self.block_size
    # One new token per sequence, all sampling: either fed (no host token) or exactly one host token.
    for s in seqs:
      if s.sampling is None or len(s.tokens) != (s.feed_row < 0):
        return False
    starts = [s.start for s in seqs]
    nblocks = [p // bs + 1 for p in starts]
    if bucket(max(nblocks), self.floors["blocks_floor"]) != self._dims[2]:
      return False
    feeds = [s.feed_row for s in seqs]
    tokens = [s.tokens[0] if s.tokens else 0 for s in seqs]
    steps = [s.step for s in seqs]
    v = self._views
    tables = v["block_tables"]
    for i, (s, n, o, key) in enumerate(zip(seqs, nblocks, self._nblocks, self._keys)):
      if s.key == key and not s.fresh and n >= o:
        if n > o:
          tables[i, o:n] = s.table[o:n]
        continue
      tables[i, :n] = s.table[:n]          # another request in this row (or its blocks changed)
      tables[i, n:] = 0
      t, k, p, seed = s.sampling
      v["temperature"][i:i + 1] = np.float32(t).view(np.int32)
      v["top_k"][i] = k
      v["top_p"][i:i + 1] = np.float32(p).view(np.int32)
      v["seed"][i:i + 1] = np.uint32(seed).view(np.int32)
    self._nblocks = nblocks
    self._keys = [s.key for s in seqs]
    S = len(seqs)
    pos = np.array(starts, np.int32)
    v["positions"][:S] = pos
    v["context_lens"][:S] = pos + 1
    v["slot_mapping"][:S] = tables[np.arange(S), pos // bs] * bs + pos % bs
    v["token_ids"][:S] = tokens
    v["feed"][:S] = feeds
    v["step"][:S] = steps
    return True
