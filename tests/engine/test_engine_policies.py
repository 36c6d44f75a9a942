"""The real engine tells the policies apart on crafted arrival patterns (tiny random model, TickClock).

Two long requests (18-token prompts: 5 blocks each) fill a 10-block device pool; a short request arrives
at step 2. Hand-worked: under fcfs, fcfs_swap and sf nothing displaces a running request to admit a new
one, so the late request waits until memory frees (the long ones grow, one is evicted reactively, and it
resumes or recomputes first); wf (static priority: a waiting request outranks a running one) and rotasched
(Algorithm 1 as written: any waiting request's VLT outranks a running one's) rotate a long request out at once, so the late request's first token comes in the step it is
admitted; rotasched_strict waits for its VLT to pass zero (beta_F * TTFT SLO) first. Tokens stay those of
running each request alone.
"""
import pytest

from superinfer_jax.engine.config import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from test_engine_utils import TickClock, random_params, tiny_config

POLICIES = ("fcfs", "fcfs_swap", "sf", "wf", "rotasched", "rotasched_strict", "rotasched_code", "edf")


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config(max_pos=128)
  return cfg, random_params(cfg, seed=2)


def _engine(model, **kw):
  base = dict(num_device_blocks=10, num_host_blocks=64, block_size=4, policy="fcfs", max_num_batched_tokens=48,
              max_num_seqs=4, token_bucket_floor=64, seq_bucket_floor=4, blocks_bucket_floor=32, ttft_slo=0.05,
              tbt_slo=0.02, proactive_swap_budget=8, rotation_min_bucket=8, pipeline=False,
              enable_prefix_caching=False)  # the hand-worked memory pressure: long0 and long1 share no blocks
  base.update(kw)
  cfg, params = model
  return LLMEngine((cfg, params, None), EngineConfig.create(**base), clock=TickClock())


LONG = list(range(5, 23))
LATE = [7, 8, 9]


def _crafted(model, policy):
  eng = _engine(model, policy=policy)
  for i in range(2):
    eng.add_request(LONG, SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"long{i}")
  first, step = {}, 0
  while eng.has_unfinished():
    if step == 2:
      eng.add_request(LATE, SamplingParams(max_tokens=2, ignore_eos=True), request_id="late")
    for o in eng.step():
      if o.token_ids and o.request_id not in first:
        first[o.request_id] = step
    step += 1
  tokens = {r: eng.get_request(r).token_ids for r in ("long0", "long1", "late")}
  return first, eng.stats, tokens


@pytest.fixture(scope="module")
def runs(model):
  return {p: _crafted(model, p) for p in POLICIES}


@pytest.fixture(scope="module")
def alone(model):
  out = {}
  for rid, prompt, n in (("long0", LONG, 8), ("late", LATE, 2)):
    out[rid] = _engine(model, num_device_blocks=64).generate([prompt], SamplingParams(max_tokens=n,
                                                                                      ignore_eos=True))[0].token_ids
  return out


def test_who_gets_the_first_token_first(runs):
  late = {p: runs[p][0]["late"] for p in POLICIES}
  # No proactive rotation: the late request waits for memory, the same step under all three.
  assert late["fcfs"] == late["fcfs_swap"] == late["sf"] >= 6
  # Algorithm 1 (every waiting request urgent) and Waiting-First admit it in its arrival step.
  assert late["wf"] == late["rotasched"] == late["rotasched_code"] == 2
  # Strict waits out beta_F * TTFT SLO of VLT grace; edf until its deadline passes: in between.
  assert 2 < late["rotasched_strict"] < late["fcfs"] and 2 < late["edf"] < late["fcfs"]
  for p in POLICIES:
    assert runs[p][0]["long0"] == runs[p][0]["long1"] == 0


def test_how_many_rotations_each_policy_makes(runs):
  rot = {p: runs[p][1].rotations_out for p in POLICIES}
  rec = {p: runs[p][1].recompute_preemptions for p in POLICIES}
  assert rot["fcfs"] == 0 and rec["fcfs"] >= 1            # recompute, never the host pool
  assert rot["sf"] == rot["fcfs_swap"] >= 1 and rec["sf"] == 0   # the same eviction, swapped instead
  for p in ("rotasched", "rotasched_code"):
    assert rot[p] >= 5 * rot["sf"], (p, rot)              # proactive time slicing
  assert 1 <= rot["wf"] < rot["rotasched"]                # for the late request only: no time slicing
  assert rot["rotasched_strict"] <= rot["rotasched"]


def test_every_policy_keeps_the_tokens(runs, alone):
  for p in POLICIES:
    tokens = runs[p][2]
    assert tokens["long0"] == tokens["long1"] == alone["long0"], p
    assert tokens["late"] == alone["late"], p


@pytest.mark.parametrize("pipeline", [False, True])
def test_rotasched_code_round_trip_keeps_tokens(model, pipeline):
  # Five 1-block requests fill a 5-block pool; B = 3; a sixth arrives. The fork's admission loop swaps a
  # victim straight back in within the step where one block is left (non-pipelined: a hand-worked case).
  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  prompts = [[5 + i, 9, 11] for i in range(6)]
  ref = [_engine(model, num_device_blocks=64).generate([p], sp)[0].token_ids for p in prompts]
  eng = _engine(model, policy="rotasched_code", num_device_blocks=5, proactive_swap_budget=3, pipeline=pipeline,
                max_num_seqs=8, seq_bucket_floor=8)
  ids = [eng.add_request(p, sp) for p in prompts[:5]]
  eng.step()
  ids.append(eng.add_request(prompts[5], sp))
  while eng.has_unfinished():
    eng.step()
  assert [eng.get_request(i).token_ids for i in ids] == ref
  if not pipeline:
    assert eng.stats.round_trips >= 1 and eng.stats.rotations_in >= eng.stats.round_trips
  assert eng.block_manager.num_free_device_blocks == 5
