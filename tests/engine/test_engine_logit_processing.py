"""Logit processing (logit_bias, presence / frequency / repetition penalties) and logprobs in the engine step.

References are independent of the step: ``logit_processing.reference_processing`` applies each rule token by
token in numpy, and the model's logits for a sequence come from ``model.api.score`` (a fresh prefill), so a
greedy engine run must pick, at every step, the argmax of the processed reference logits, and its logprobs must
equal the log-softmax of the raw ones. Both loops that feed tokens differently are covered: zero-bubble (the
newest token is counted on the device) and sync (every token counted by the host).
"""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.engine import logit_processing as lp
from superinfer_jax.engine.config import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine, RequestError
from superinfer_jax.model.api import score
from test_engine_utils import random_params, tiny_config

BS = 4
MAX_POS = 64


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config(max_pos=MAX_POS, vocab=96)
  return cfg, random_params(cfg, seed=3)


def _engine(model, **kw):
  base = dict(num_device_blocks=64, num_host_blocks=0, block_size=BS, policy="fcfs", max_num_batched_tokens=32,
              max_num_seqs=4, token_bucket_floor=32, seq_bucket_floor=4, blocks_bucket_floor=MAX_POS // BS)
  base.update(kw)
  return LLMEngine(model, EngineConfig.create(**base))


# ------------------------------------------------------------------------------------- the device kernel
def test_apply_processing_matches_the_token_by_token_reference():
  rng = np.random.default_rng(0)
  V, R = 50, 4
  logits = rng.normal(0, 3, (R, V)).astype(np.float32)
  params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3,
                           logit_bias={3: 5.0, 7: -2.5}).validate(V),
            SamplingParams(frequency_penalty=1.1).validate(V),
            None,                                                    # a plain row
            SamplingParams(repetition_penalty=0.6, logit_bias={49: 100.0}).validate(V)]
  prompts = [[1, 2, 2, 9], [4, 5], [6], [3, 3, 8]]
  outputs = [[9, 9, 11, 3], [12, 12, 12, 4], [], [8, 30]]
  newest = np.array([11, 40, 0, 30], np.int32)     # row 1 and 3: a fed token the host has not counted
  newest_fed = np.array([False, True, False, True])
  rows = []
  for i, p in enumerate(params):
    if p is not None:
      known = outputs[i][:-1] if newest_fed[i] else outputs[i]
      rows.append((i, p, prompts[i], Counter(known)))
  # Row 1's newest (40) is new to it and row 3's (30) repeats nothing known: the device must count them.
  outputs[1] = outputs[1][:-1] + [40]
  buf = lp.build_processing(rows, R)
  assert buf.shape[1] == 4 * lp.MIN_ENTRIES + 3
  got = np.asarray(jax.jit(lp.apply_processing)(jnp.asarray(logits), jnp.asarray(buf), jnp.asarray(newest),
                                                jnp.asarray(newest_fed)))
  for i, p in enumerate(params):
    want = logits[i] if p is None else lp.reference_processing(logits[i], p, prompts[i], outputs[i])
    np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5, err_msg=f"row {i}")
  assert np.array_equal(got[2], logits[2])          # a plain row is bit-identical


def test_entries_bucket_to_a_power_of_two():
  p = SamplingParams(repetition_penalty=1.2).validate()
  buf = lp.build_processing([(0, p, list(range(40)), Counter())], 2)
  assert buf.shape == (2, 4 * 64 + 3)


def test_logprobs_are_the_raw_log_softmax():
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 2, (3, 30)).astype(np.float32)
  tokens = np.array([4, 0, 29], np.int32)
  vals, ids = jax.jit(lp.logprobs, static_argnums=2)(jnp.asarray(logits), jnp.asarray(tokens), 5)
  lsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(vals)[:, 0], lsm[np.arange(3), tokens], atol=1e-5)
  order = np.argsort(-lsm, axis=-1)[:, :5]
  assert np.array_equal(np.asarray(ids), order)
  np.testing.assert_allclose(np.asarray(vals)[:, 1:], np.take_along_axis(lsm, order, -1), atol=1e-5)


# ------------------------------------------------------------------------------------------ the engine
def _reference_greedy(model, prompt, params, n):
  """Greedy decoding with the reference processing over fresh-prefill logits: (tokens, raw logits per step)."""
  cfg, weights = model
  out, raws = [], []
  for _ in range(n):
    raw = score(weights, cfg, prompt + out, block_size=BS)[-1]
    proc = lp.reference_processing(raw, params, prompt, out) if params.processes_logits else raw
    raws.append(raw)
    out.append(int(np.argmax(proc)))
  return out, raws


PENALISED = [
    SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=2.0),
    SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=-2.0),
]


@pytest.mark.parametrize("loop", ["zero_bubble", "sync"])
def test_penalised_greedy_matches_the_reference(model, loop):
  kw = dict(pipeline=False) if loop == "sync" else {}
  eng = _engine(model, **kw)
  prompts = [[5, 6, 7, 5, 6, 7, 5], [10, 11, 12], [20, 21, 20, 21]]
  plain = SamplingParams(max_tokens=12, ignore_eos=True)
  got = eng.generate(prompts + [prompts[0]], PENALISED + [plain])    # a plain row shares the batch
  for prompt, params, res in zip(prompts, PENALISED, got):
    want, _ = _reference_greedy(model, prompt, params, 12)
    assert res.token_ids == want, (params, res.token_ids, want)
  plain_want, _ = _reference_greedy(model, prompts[0], plain, 12)
  assert got[3].token_ids == plain_want
  # The penalties act: each penalised run differs from its plain greedy run.
  for prompt, params, res in zip(prompts, PENALISED, got):
    assert res.token_ids != _reference_greedy(model, prompt, plain, 12)[0], params


def test_logit_bias_forces_and_bans_tokens(model):
  eng = _engine(model)
  prompt = [5, 6, 7]
  plain = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
  forced = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={42: 100}))[0]
  assert forced.token_ids == [42] * 6
  banned = {t: -100 for t in set(plain)}
  res = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=banned))[0]
  assert not set(res.token_ids) & set(plain)
  sampled = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3,
                                                  logit_bias={17: 100}))[0]
  assert sampled.token_ids == [17] * 6


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_match_the_model(model, k):
  eng = _engine(model)
  prompt = [9, 8, 7, 6]
  params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=k, frequency_penalty=0.7)
  res = eng.generate([prompt], params)[0]
  want, raws = _reference_greedy(model, prompt, params, 5)
  assert res.token_ids == want and len(res.logprobs) == 5
  for tok, entry, raw in zip(want, res.logprobs, raws):
    lsm = raw - np.log(np.exp(raw.astype(np.float64)).sum())
    assert entry.logprob == pytest.approx(lsm[tok], abs=1e-4)
    assert [t for t, _ in entry.top] == np.argsort(-lsm)[:k].tolist()
    for t, v in entry.top:
      assert v == pytest.approx(lsm[t], abs=1e-4)


def test_streamed_outputs_carry_logprobs_per_token(model):
  eng = _engine(model)
  rid = eng.add_request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2))
  other = eng.add_request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
  seen = {rid: 0, other: 0}
  while eng.has_unfinished():
    for out in eng.step():
      if out.request_id == rid:
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        assert all(len(e.top) == 2 for e in out.logprobs)
      else:
        assert out.logprobs is None
      seen[out.request_id] += len(out.token_ids)
  assert seen == {rid: 4, other: 4}


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(logit_bias={96: 1.0}), dict(logit_bias={1: 101}), dict(logprobs=21)])
def test_bad_processing_params_are_refused_by_name(model, bad):
  eng = _engine(model)
  with pytest.raises(RequestError, match=next(iter(bad))):
    eng.add_request([1, 2, 3], SamplingParams(**bad))
