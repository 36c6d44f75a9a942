"""Prefix caching through the engine: greedy outputs are token-identical with caching off, on the device only,
and on device + host, under every policy with rotation forced, for prompts that share prefixes on and off
block boundaries; they equal transformers' greedy ``generate``; cached prefixes are really used (hits on
both tiers, fewer prefill tokens); salts isolate; ``num_cached_tokens`` is reported.
"""
import numpy as np
import pytest

from superinfer_jax.engine.config import SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from superinfer_jax.engine.request_book import RequestError
from superinfer_jax.sched.policies import POLICIES
from support.tiny_models import save_tiny_hf_model, torch_greedy
from test_engine_utils import TickClock, pressure_config, random_params, tiny_config

BS = 4
MAX_POS = 128
SP = SamplingParams(max_tokens=10, ignore_eos=True)
CACHING = {"off": dict(enable_prefix_caching=False), "device": dict(host_prefix_cache=False),
           "device+host": dict()}


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config(max_pos=MAX_POS)
  return cfg, random_params(cfg, seed=3)


def _config(**kw):
  return pressure_config(BS, MAX_POS, **kw)


def _prompts(seed):
  """Prompts sharing prefixes: a system prefix of 8 tokens (on a block boundary) or 10 (off it), plus
  suffixes; some prompts repeat whole, one is a prefix of another."""
  rng = np.random.default_rng(seed)
  sys_on = rng.integers(3, 128, size=8).tolist()
  sys_off = rng.integers(3, 128, size=10).tolist()
  out = []
  for i in range(10):
    head = sys_on if i % 2 else sys_off
    out.append(head + rng.integers(3, 128, size=int(rng.integers(1, 9))).tolist())
  out.append(list(out[0]))  # a repeat
  out.append(out[1][:9])  # a prefix of another prompt, ending one token into a block
  return out


@pytest.fixture(scope="module")
def reference(model):
  """Each prompt alone with caching off and ample memory."""
  cfg, params = model
  prompts = _prompts(7)
  ref = [LLMEngine((cfg, params, None), _config(enable_prefix_caching=False), clock=TickClock())
         .generate([p], SP)[0].token_ids for p in prompts]
  return prompts, ref


def _run(model, prompts, staggered=True, **kw):
  cfg, params = model
  eng = LLMEngine((cfg, params, None), _config(**kw), clock=TickClock())
  ids = []
  for i, p in enumerate(prompts):
    ids.append(eng.add_request(p, SP))
    if staggered and i % 3 == 2:  # later requests arrive after earlier ones computed their prefixes
      for _ in range(4):
        eng.step()
        eng.scheduler.check_invariants()
  while eng.has_unfinished():
    eng.step()
    eng.scheduler.check_invariants()
  return eng, [eng.get_request(i) for i in ids]


@pytest.mark.parametrize("caching", sorted(CACHING))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_identical_with_caching_under_rotation(model, reference, policy, caching):
  prompts, ref = reference
  eng, outs = _run(model, prompts, policy=policy, num_device_blocks=14, **CACHING[caching])
  assert [o.token_ids for o in outs] == ref
  st = eng.scheduler.stats()
  pc = st.prefix_cache
  if caching == "off":
    assert pc["queried"] == 0 and all(o.num_cached_tokens == 0 for o in outs)
  else:
    assert pc["queried"] > 0 and pc["device_hits"] + pc["host_hits"] > 0, pc
    assert sum(o.num_cached_tokens for o in outs) == BS * (pc["device_hits"] + pc["host_hits"])
    assert all(o.num_cached_tokens % BS == 0 and o.num_cached_tokens < len(p) for o, p in zip(outs, prompts))
  t = st.totals
  assert t["rotations_out"] + t["recompute_preemptions"] > 0, t  # memory pressure forced evictions
  assert eng.block_manager.num_requests == 0
  assert eng.block_manager.num_free_device_blocks == 14


def test_caching_saves_prefill_and_host_tier_outlives_requests(model, reference):
  """Sequential requests (each after the last finished) on a device pool too small to keep old prefixes:
  device-only caching loses them, the host tier loads them back; fewer tokens are prefilled."""
  prompts, ref = reference
  results = {}
  for name, kw in CACHING.items():
    eng, outs = _run(model, prompts, staggered=False, policy="fcfs", num_device_blocks=8, max_num_seqs=1, **kw)
    assert [o.token_ids for o in outs] == ref
    results[name] = (eng.scheduler.stats().totals["scheduled_tokens"], eng.scheduler.stats().prefix_cache)
  off, dev, both = (results[k][0] for k in ("off", "device", "device+host"))
  assert both < off and dev <= off, results
  assert results["device+host"][1]["host_hits"] > 0, results
  assert both <= dev, results


def test_salt_isolates_and_bad_salt_is_refused(model):
  cfg, params = model
  eng = LLMEngine((cfg, params, None), _config(), clock=TickClock())
  p = list(range(3, 3 + 4 * BS + 1))
  first = eng.generate([p], SP)[0]
  assert first.num_cached_tokens == 0
  rid = eng.add_request(p, SP)
  rid_salted = eng.add_request(p, SP, cache_salt="tenant-a")
  while eng.has_unfinished():
    eng.step()
  assert eng.get_request(rid).num_cached_tokens == 4 * BS
  assert eng.get_request(rid_salted).num_cached_tokens == 0
  assert eng.get_request(rid_salted).token_ids == first.token_ids
  for bad in ("", 5, "x" * 5000):
    with pytest.raises(RequestError, match="cache_salt"):
      eng.add_request(p, SP, cache_salt=bad)


def test_cached_prefixes_match_transformers(tmp_path):
  """A tiny random transformers Llama: with caching on and rotation forced, shared-prefix prompts give
  transformers' greedy tokens."""
  model = save_tiny_hf_model(str(tmp_path), "llama", max_position_embeddings=128, seed=5)
  prompts = _prompts(11)[:8]
  want = [torch_greedy(model, p, SP.max_tokens) for p in prompts]
  config = _config(num_device_blocks=16, policy="rotasched", attention="reference")
  eng = LLMEngine(str(tmp_path), config, clock=TickClock())
  ids = []
  for i, p in enumerate(prompts):
    ids.append(eng.add_request(p, SP))
    if i % 2:
      for _ in range(3):
        eng.step()
  while eng.has_unfinished():
    eng.step()
  assert [eng.get_request(i).token_ids for i in ids] == want
  assert eng.scheduler.stats().prefix_cache["device_hits"] + eng.scheduler.stats().prefix_cache["host_hits"] > 0
