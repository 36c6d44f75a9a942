"""Per-request logit processing and logprobs inside the jitted step: bias, penalties, log-probabilities.

What a step needs beyond the packed batch (``engine/packing.py``) when some row asks for more than plain
sampling (``SamplingParams`` documents the semantics and the order):

* **Processing buffer** (``build_processing``, host side): int32 ``[R, 4L + 3]``, one row per logits row.
  Columns ``[0, L)`` token ids, ``[L, 2L)`` their counts in the output the host knows, ``[2L, 3L)`` 1 where the
  token is in the prompt (only when the row's repetition penalty is on), ``[3L, 4L)`` the logit bias
  (float32 bits), then presence, frequency and repetition penalties (float32 bits). ``L`` is the largest
  row's number of distinct tokens (prompt, if repetition is on, plus output plus bias keys), bucketed to a
  power of two >= ``MIN_ENTRIES``. Padding entries (id 0, count 0, not in prompt, bias 0) and plain rows
  (penalties 0 / 0 / 1) change nothing: ``x / 1 == x`` and ``x * 1 == x`` exactly.
* **The newest token** of a row whose last token is fed on the device (zero-bubble: sampled by the step in
  flight, not read by the host yet) is counted on the device (``apply_processing``'s ``newest`` /
  ``newest_fed``), so the counts are exact without a device->host sync.
* **Logprobs** (``logprobs``, static ``k``): log-softmax of the raw logits (before processing), the sampled
  token's entry and the top ``k`` with their ids.

A step with no processing and no logprobs compiles without any of this (``None`` / ``0``): plain requests
pay nothing. Host-side building imports no JAX; the device functions import it lazily.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import numpy as np

from superinfer_jax.model.batch import bucket
from superinfer_jax.model.sampling_params import MAX_LOGPROBS, SamplingParams

MIN_ENTRIES = 16
LOGPROBS_K = MAX_LOGPROBS   # the one top-k a step computes when any row asks for logprobs (rows slice it)


def row_entries(params: SamplingParams, prompt_ids: Sequence[int], output_counts: Counter) -> dict[int, tuple]:
  """token id -> (output count, in prompt, bias) of one row: every token that any of its processors touches."""
  entries: dict[int, list] = {}
  if params.repetition_penalty != 1:
    for t in set(prompt_ids):
      entries[t] = [0, 1, 0.0]
  for t, c in output_counts.items():
    entries.setdefault(t, [0, 0, 0.0])[0] = c
  for t, b in params.logit_bias:
    entries.setdefault(t, [0, 0, 0.0])[2] = b
  return {t: tuple(v) for t, v in entries.items()}


def build_processing(rows: Sequence[tuple[int, SamplingParams, Sequence[int], Counter]],
                     num_rows: int) -> np.ndarray:
  """The processing buffer (module docstring) of a step with ``num_rows`` logits rows. ``rows``: for each
  processed row, ``(row index, params, prompt ids, counts of the output tokens the host knows)``; every other
  row is plain. Returns int32 ``[num_rows, 4L + 3]``."""
  per_row = [(i, p, row_entries(p, prompt, counts)) for i, p, prompt, counts in rows]
  L = bucket(max([len(e) for _, _, e in per_row] + [1]), MIN_ENTRIES)
  ids = np.zeros((num_rows, L), np.int32)
  counts = np.zeros((num_rows, L), np.int32)
  in_prompt = np.zeros((num_rows, L), np.int32)
  bias = np.zeros((num_rows, L), np.float32)
  scalars = np.zeros((num_rows, 3), np.float32)
  scalars[:, 2] = 1.0
  for i, p, e in per_row:
    n = len(e)
    if n:
      toks = np.fromiter(e.keys(), np.int32, n)
      vals = np.array(list(e.values()), np.float64).reshape(n, 3)
      ids[i, :n], counts[i, :n], in_prompt[i, :n], bias[i, :n] = toks, vals[:, 0], vals[:, 1], vals[:, 2]
    scalars[i] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
  return np.concatenate([ids, counts, in_prompt, bias.view(np.int32), scalars.view(np.int32)], axis=1)


def apply_processing(logits, buf, newest, newest_fed):
  """Applies the processing buffer ``buf`` [R, 4L+3] to ``logits`` [R, V] float32 (inside jit). ``newest`` [R]
  int32: each row's newest token; ``newest_fed`` [R] bool: whether the host has not counted it (fed on the
  device). Returns [R, V] float32: bias added, then repetition, frequency and presence penalties."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  R, V = logits.shape
  L = (buf.shape[1] - 3) // 4
  f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)   # noqa: E731
  ids = jnp.concatenate([buf[:, :L], newest[:, None]], axis=1)
  counts = jnp.concatenate([buf[:, L:2 * L], newest_fed[:, None].astype(jnp.int32)], axis=1)
  in_prompt = buf[:, 2 * L:3 * L]
  bias = f32(buf[:, 3 * L:4 * L])
  presence, frequency, repetition = (f32(buf[:, 4 * L + j]) for j in range(3))
  rows = jnp.arange(R, dtype=jnp.int32)[:, None]
  count_d = jnp.zeros((R, V), jnp.int32).at[rows, ids].add(counts)
  prompt_d = jnp.zeros((R, V), jnp.int32).at[rows, ids[:, :L]].max(in_prompt) > 0
  logits = logits + jnp.zeros((R, V), jnp.float32).at[rows, ids[:, :L]].add(bias)
  seen = prompt_d | (count_d > 0)
  rep = repetition[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  return logits - frequency[:, None] * count_d.astype(jnp.float32) - presence[:, None] * (count_d > 0)


def logprobs(raw_logits, tokens, k: int):
  """Inside jit: ``(values [R, 1 + k] float32, ids [R, k] int32)``; ``values[:, 0]`` is the log-probability of
  ``tokens`` [R] under ``log_softmax(raw_logits)``, ``values[:, 1:]`` the top ``k`` (descending) with ``ids``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  lsm = jax.nn.log_softmax(raw_logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(lsm, tokens[:, None].astype(jnp.int32), axis=1)
  top_vals, top_ids = jax.lax.top_k(lsm, k)
  return jnp.concatenate([chosen, top_vals], axis=1), top_ids.astype(jnp.int32)


def reference_processing(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                         output_ids: Sequence[int]) -> np.ndarray:
  """One row [V] processed in numpy, token by token as ``SamplingParams`` words it: the test reference."""
  out = np.asarray(logits, np.float64).copy()
  for t, b in params.logit_bias:
    out[t] += b
  counts = Counter(output_ids)
  if params.repetition_penalty != 1:
    for t in set(prompt_ids) | set(counts):
      out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
  for t, c in counts.items():
    out[t] -= params.frequency_penalty * c + params.presence_penalty
  return out


def step_extras(rows: Sequence[tuple[int, SamplingParams, Sequence[int], Counter]], wants_logprobs: bool,
                num_rows: int) -> tuple[Optional[np.ndarray], int]:
  """``(processing buffer or None, logprobs k or 0)`` of a step: None / 0 where no row needs them."""
  return (build_processing(rows, num_rows) if rows else None), (LOGPROBS_K if wants_logprobs else 0)
