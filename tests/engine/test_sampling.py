"""On-device sampling (superinfer_jax/engine/sampling.py) and SamplingParams validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.engine.config import SamplingParams
from superinfer_jax.engine.sampling import sample_jit

V = 64


def _logits(rows, seed=0):
  return np.random.default_rng(seed).normal(size=(rows, V)).astype(np.float32) * 2.0


def _sample(logits, temperature, top_k=0, top_p=1.0, seed=0, step=0):
  R = logits.shape[0]
  arr = lambda v, dt: np.broadcast_to(np.asarray(v, dt), (R,)).copy()
  return np.asarray(sample_jit(jnp.asarray(logits), arr(temperature, np.float32), arr(top_k, np.int32),
                               arr(top_p, np.float32), arr(seed, np.uint32), arr(step, np.int32)))


def test_greedy_is_argmax():
  lg = _logits(8)
  np.testing.assert_array_equal(_sample(lg, 0.0), lg.argmax(-1))


def test_seeded_reproducible_and_differs_across_seeds():
  lg = np.tile(_logits(1), (64, 1))
  a = _sample(lg, 1.0, seed=7, step=np.arange(64))
  b = _sample(lg, 1.0, seed=7, step=np.arange(64))
  c = _sample(lg, 1.0, seed=8, step=np.arange(64))
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()
  assert len(set(a.tolist())) > 1  # different steps draw different tokens


def test_independent_of_batch_composition():
  lg = _logits(6, seed=3)
  seeds = np.arange(6, dtype=np.uint32) + 100
  steps = np.arange(6, dtype=np.int32) * 3
  full = _sample(lg, 0.9, top_k=20, top_p=0.9, seed=seeds, step=steps)
  # Same rows, permuted and with extra greedy padding rows: each row draws the same token.
  perm = np.array([4, 1, 5, 0, 3, 2])
  lg2 = np.concatenate([lg[perm], _logits(2, seed=9)])
  t2 = np.array([0.9] * 6 + [0.0, 0.0], np.float32)
  got = np.asarray(sample_jit(jnp.asarray(lg2), t2, np.array([20] * 6 + [0, 0], np.int32),
                              np.array([0.9] * 6 + [1, 1], np.float32),
                              np.concatenate([seeds[perm], [0, 0]]).astype(np.uint32),
                              np.concatenate([steps[perm], [0, 0]]).astype(np.int32)))
  np.testing.assert_array_equal(got[:6], full[perm])


def test_top_k_1_and_tiny_top_p_are_greedy():
  lg = _logits(16, seed=5)
  np.testing.assert_array_equal(_sample(lg, 1.5, top_k=1, seed=np.arange(16)), lg.argmax(-1))
  np.testing.assert_array_equal(_sample(lg, 1.5, top_p=1e-6, seed=np.arange(16)), lg.argmax(-1))


def test_mixed_greedy_and_random_rows():
  lg = _logits(4, seed=2)
  t = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
  got = np.asarray(sample_jit(jnp.asarray(lg), t, np.array([0, 1, 0, 1], np.int32),
                              np.ones(4, np.float32), np.arange(4, dtype=np.uint32), np.zeros(4, np.int32)))
  np.testing.assert_array_equal(got, lg.argmax(-1))


def test_distribution_sanity():
  # Temperature 1 sampling of a known 4-token distribution: frequencies close to the probabilities.
  p = np.array([0.5, 0.3, 0.15, 0.05])
  lg = np.full((1, V), -1e9, np.float32)
  lg[0, :4] = np.log(p)
  n = 4000
  toks = _sample(np.tile(lg, (n, 1)), 1.0, seed=np.arange(n) % 97, step=np.arange(n))
  freq = np.bincount(toks, minlength=V)[:4] / n
  assert np.abs(freq - p).max() < 0.04, freq
  # top_k=2 keeps only the two most likely, renormalised (0.625 / 0.375).
  toks = _sample(np.tile(lg, (n, 1)), 1.0, top_k=2, seed=np.arange(n) % 97, step=np.arange(n))
  assert set(toks.tolist()) <= {0, 1}
  assert abs((toks == 0).mean() - 0.625) < 0.04
  # top_p=0.7: nucleus {0, 1} (0.5 < 0.7, 0.8 >= 0.7).
  toks = _sample(np.tile(lg, (n, 1)), 1.0, top_p=0.7, seed=np.arange(n) % 97, step=np.arange(n))
  assert set(toks.tolist()) <= {0, 1}
  # Low temperature sharpens.
  toks = _sample(np.tile(lg, (n, 1)), 0.2, seed=np.arange(n) % 97, step=np.arange(n))
  assert (toks == 0).mean() > 0.9


def test_sample_under_transfer_guard():
  lg = jax.device_put(_logits(4))
  args = [jax.device_put(x) for x in (np.ones(4, np.float32), np.zeros(4, np.int32), np.ones(4, np.float32),
                                      np.arange(4, dtype=np.uint32), np.zeros(4, np.int32))]
  sample_jit(lg, *args).block_until_ready()
  with jax.transfer_guard("disallow"):
    out = sample_jit(lg, *args)
    jax.device_get(out)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"),
])
def test_sampling_params_validation(kwargs, field):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kwargs).validate(vocab_size=1000)


def test_sampling_params_normalises():
  sp = SamplingParams(stop="abc", stop_token_ids=[1, 2]).validate()
  assert sp.stop == ("abc",) and sp.stop_token_ids == (1, 2)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9), (0.8, 0, 0.7)])
def test_every_mode_that_serves_the_rows_samples_the_same_tokens(temperature, top_k, top_p):
  """``sampling_mode`` picks the least general mode for the rows (a third of them greedy); that mode and every
  more general one give the same tokens row by row."""
  from superinfer_jax.engine.sampling import SAMPLING_MODES, sampling_mode
  lg = _logits(9, seed=5)
  R = lg.shape[0]
  temps = np.where(np.arange(R) % 3 == 0, 0.0, temperature).astype(np.float32)
  args = (temps, np.full(R, top_k, np.int32), np.full(R, top_p, np.float32), np.full(R, 11, np.uint32),
          np.arange(R, dtype=np.int32))
  mode = sampling_mode(zip(temps, args[1], args[2]))
  want_mode = "greedy" if temperature == 0 else "filtered" if (top_k or top_p < 1) else "random"
  assert mode == want_mode
  want = np.asarray(sample_jit(jnp.asarray(lg), *args))   # the default: filtered, serves any rows
  for m in SAMPLING_MODES[SAMPLING_MODES.index(mode):]:
    np.testing.assert_array_equal(np.asarray(sample_jit(jnp.asarray(lg), *args, mode=m)), want)
  if temperature == 0.0:
    np.testing.assert_array_equal(want, lg.argmax(-1))
  with pytest.raises(ValueError, match="sampling mode"):
    sample_jit(jnp.asarray(lg), *args, mode="beam")


def test_first_argmax_matches_jnp_argmax_with_ties_nan_and_inf():
  """The greedy argmax (two plain reductions) equals ``jnp.argmax`` on both axes: ties go to the first index,
  NaN counts as the maximum (first NaN wins), all -inf rows give 0, +inf wins."""
  from superinfer_jax.engine.sampling import first_argmax
  x = np.random.default_rng(0).normal(size=(7, 50)).astype(np.float32)
  x[1, [3, 9]] = 10.0                      # tie
  x[2, [4, 20]] = np.nan                   # NaNs
  x[3] = -np.inf                           # all -inf
  x[4, [5, 6]] = np.inf                    # +inf tie
  x[5, 0] = x[5].max() + 1                 # first element
  x[6, -1] = x[6].max() + 1                # last element
  for axis, data in ((-1, x), (0, x.T.copy()), (1, x)):
    got = np.asarray(jax.jit(first_argmax, static_argnums=1)(jnp.asarray(data), axis))
    want = np.asarray(jnp.argmax(jnp.asarray(data), axis=axis))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32
  np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x), -1))[:7], [x[0].argmax(), 3, 4, 0, 5, 0, 49])
