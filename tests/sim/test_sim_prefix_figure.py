"""``--figure=prefix_reuse`` on a small Mooncake window (the small-seed version ``make test`` runs): every
(policy, caching) arm on both hardware profiles, each window's load set by contention, the prefix columns and
the claims; the contention search reaches its target on both profiles."""
import os

from superinfer_jax.engine.config import EngineConfig
from superinfer_jax.metrics.results import read_results
from superinfer_jax.sim.config import SimConfig
from superinfer_jax.sim.figures import CACHE_POLICIES, CACHING, get_figure, run_figure
from superinfer_jax.sweep import SweepSpec

# 60 requests (~0.7M prompt tokens) on a 16384-block (262k-token) pool: the window contends at a rate the search
# finds (a pool much smaller than the largest prompts could not get below the target at any rate).
SMALL = dict(num_requests=60, progress=False)
SMALL_ENGINE = dict(num_device_blocks=16384, num_host_blocks=65536)


def test_prefix_reuse_figure_small(tmp_path):
  spec = SweepSpec(**SMALL)
  engine = EngineConfig().replace(dtype="bfloat16", **SMALL_ENGINE)
  out = str(tmp_path / "pr")
  res = run_figure("prefix_reuse", spec, engine, SimConfig(), explicit=set(SMALL) | set(SMALL_ENGINE),
                   output_dir=out, log=lambda *_: None, seeds=[0], workload="mooncake")
  fig = get_figure("prefix_reuse")
  assert os.path.isfile(res.plot) and len(res.claims) == len(fig.claims)
  for part in fig.parts:
    rows = read_results(os.path.join(out, part.name, "seed-0", "results.jsonl"))
    assert len(rows) == len(CACHE_POLICIES) * len(CACHING)
    assert {r["hardware"] for r in rows} == {part.name} and {r["model"] for r in rows} == {"llama-3.1-8b"}
    assert len({r["load_rps"] for r in rows}) == 1 and rows[0]["load_target"] == 1.5
    assert 0.8 * 1.5 <= rows[0]["load_kv_demand_p99"] <= 1.25 * 1.5
    for r in rows:
      if r["enable_prefix_caching"]:
        assert r["prefix_queried_blocks"] > 0 and r["prefix_hit_rate"] > 0 and r["prefill_tokens_saved"] > 0
        if not r["host_prefix_cache"]:
          assert r["prefix_host_hit_blocks"] == 0
      else:
        assert r["prefix_queried_blocks"] == 0 and r["prefill_tokens_saved"] == 0
    # the host tier adds hits where the device alone evicted (fcfs: the same schedule up to the hits)
    by = {(r["base_policy"], r["enable_prefix_caching"], r["host_prefix_cache"]): r for r in rows}
    assert by[("fcfs", True, True)]["prefix_hit_rate"] >= by[("fcfs", True, False)]["prefix_hit_rate"]
