"""Prefix caching in the simulator: it reads the same block manager as the engine (no cache model of its own),
so with a cache large enough to hold everything its hit rate equals each workload's own bound, computed
independently from the prompts (multi-turn ShareGPT) or the trace's hash ids (Mooncake); the cost rule's
sides come from the roofline; caching off and synthetic workloads see no hits."""
import dataclasses
import functools

import pytest

from superinfer_jax.engine.config import EngineConfig
from superinfer_jax.metrics.prefix_cache import prefix_cache_columns
from superinfer_jax.model.config import load_config
from superinfer_jax.sim import cost as cost_lib
from superinfer_jax.sim.event_loop import RooflineCost, prefix_hashes_of, simulate
from superinfer_jax.sim.profiles import load_hardware_profile
from superinfer_jax.workload import RequestSpec, make_workload, read_trace
from superinfer_jax.workload.prompt_reuse import prefix_reuse_bound
from superinfer_jax.workload.reuse import reuse_bound
from test_sim_loop import ConstCost

BS = 16


def _config(**kw):
  base = dict(policy="fcfs", num_device_blocks=200_000, num_host_blocks=1024, block_size=BS, max_num_seqs=64,
              max_num_batched_tokens=16384, ttft_slo=5.0, tbt_slo=0.1)
  base.update(kw)
  return EngineConfig.create(**base)


def _spaced(specs, gap_s):
  """The specs in arrival order, ``gap_s`` apart (each finishes before the next arrives)."""
  specs = sorted(specs, key=lambda r: r.arrival_s)
  return [dataclasses.replace(r, arrival_s=i * gap_s) for i, r in enumerate(specs)]


def test_mooncake_hit_rate_equals_the_trace_bound():
  w, _ = read_trace("mooncake", num_requests=120, token_ids=False)
  specs = _spaced([dataclasses.replace(r, output_len=2) for r in w if r.prompt_len + 2 <= 130_000], 100.0)
  bound = reuse_bound(specs, BS)
  assert bound["hit_blocks"] > 100
  res = simulate(specs, _config(), ConstCost(step=0.01))
  cols = prefix_cache_columns(res.counters["prefix_cache"], BS)
  assert cols["prefix_queried_blocks"] == bound["blocks"]
  assert cols["prefix_device_hit_blocks"] == bound["hit_blocks"]
  assert cols["prefix_hit_rate"] == pytest.approx(bound["hit_rate"])
  assert cols["prefill_tokens_saved"] == bound["hit_tokens"]


@functools.lru_cache(maxsize=None)
def _multiturn(n=30):
  from superinfer_jax.model import load_tokenizer
  return list(make_workload("sharegpt_multiturn", load_tokenizer("smollm2-135m"), num_requests=n, rps=1.0,
                            seed=0, max_total_len=2048))


def test_multiturn_hit_rate_equals_the_prompt_bound():
  specs = _multiturn()
  assert any(r.after_request_id for r in specs)
  bound = prefix_reuse_bound(specs, BS)
  assert bound["hit_blocks"] > 10
  res = simulate(specs, _config(), ConstCost(step=0.01))
  cols = prefix_cache_columns(res.counters["prefix_cache"], BS)
  assert (cols["prefix_queried_blocks"], cols["prefix_device_hit_blocks"]) == (bound["full_blocks"],
                                                                              bound["hit_blocks"])
  off = simulate(specs, _config(enable_prefix_caching=False), ConstCost(step=0.01))
  assert prefix_cache_columns(off.counters["prefix_cache"], BS)["prefix_queried_blocks"] == 0


def test_host_tier_catches_what_a_small_device_pool_evicts():
  specs = _multiturn()
  kw = dict(num_device_blocks=400, num_host_blocks=20_000, max_num_seqs=4)
  dev = prefix_cache_columns(simulate(specs, _config(host_prefix_cache=False, **kw), ConstCost(step=0.01))
                             .counters["prefix_cache"], BS)
  both = prefix_cache_columns(simulate(specs, _config(**kw), ConstCost(step=0.01)).counters["prefix_cache"], BS)
  assert dev["prefix_host_hit_blocks"] == 0 and dev["prefix_device_evictions"] > 0
  assert both["prefix_host_hit_blocks"] > 0
  assert both["prefill_tokens_saved"] > dev["prefill_tokens_saved"]


def test_what_is_hashed():
  mt = _multiturn(6)
  syn = list(make_workload("synthetic", None, num_requests=4, rps=1.0, seed=0, synthetic_prompt_len="uniform:40,60",
                           synthetic_output_len="uniform:4,8", vocab_size=256))
  assert all(prefix_hashes_of(syn, BS, "recorded")(r) is None for r in syn)
  assert all(len(prefix_hashes_of(syn, BS, "tokens")(r)) == r.prompt_len // BS for r in syn)
  assert all(len(prefix_hashes_of(mt, BS, "recorded")(r)) == r.prompt_len // BS for r in mt)
  trace = RequestSpec("t", "", prompt_len=1100, output_len=1, block_ids=(7, 8, 9), block_ids_tokens=512)
  h = prefix_hashes_of([trace], BS, "recorded")(trace)
  assert h == trace.derived_block_ids(BS)[:1100 // BS]


def test_cost_rule_sides_come_from_the_roofline():
  """The load side follows the link (NVLink-C2C loads a block faster than PCIe), the recompute side the GPU's
  prefill; for Llama-3.1-8B the rule loads on both links (docs/simulator.md "The bandwidth-aware choice")."""
  mcfg = load_config("llama-3.1-8b")
  sides = {}
  for hw_name in ("gh200", "h200"):
    cost = RooflineCost(cost_lib.ModelProfile.from_model_config(mcfg, "bfloat16"), load_hardware_profile(hw_name),
                        mcfg.kv_spec(BS, "bfloat16"), "duplex")
    sides[hw_name] = load_s, prefill_s = cost.prefix_rule_costs()
    assert 0 < load_s < BS * prefill_s < 1e-2, (hw_name, load_s, prefill_s)
    config = _config(prefix_load_s_per_block=load_s, prefill_s_per_token=prefill_s).scheduler
    assert config.loads_host_prefix(BS)
  assert sides["gh200"][0] < sides["h200"][0]
