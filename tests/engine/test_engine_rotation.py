"""Rotation wired through the engine: under heavy memory pressure every policy gives exactly the tokens of
running the same requests one by one with ample memory, while requests rotate out and in (DuplexKV) many
times; aborting a rotary request frees all its blocks; the rotating step loop makes no implicit transfers.

Time is a ``TickClock`` (advances a fixed amount per read) with small SLOs, so the VLT-driven policies
rotate deterministically, independent of machine speed.
"""
import jax
import numpy as np
import pytest

from superinfer_jax.engine.config import SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from superinfer_jax.sched.policies import POLICIES
from test_engine_utils import TickClock, pressure_config, random_params, tiny_config

pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator

BS = 4
MAX_POS = 128
ROTATING = ("fcfs_swap", "wf", "sf", "rotasched", "rotasched_strict", "rotasched_code", "edf")


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config(max_pos=MAX_POS)
  return cfg, random_params(cfg, seed=2)


def _config(**kw):
  return pressure_config(BS, MAX_POS, **kw)


def _engine(model, **kw):
  cfg, params = model
  return LLMEngine((cfg, params, None), _config(**kw), clock=TickClock())


def _prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 128, size=int(rng.integers(3, 22))).tolist() for _ in range(n)]


SP = SamplingParams(max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model):
  prompts = _prompts(10, seed=5)
  ref = []
  for p in prompts:
    ref.append(_engine(model).generate([p], SP)[0].token_ids)
  return prompts, ref


LOOPS = {"sync": dict(pipeline=False), "pipelined": dict(pipeline=True, zero_bubble=False),
         "zero_bubble": dict(pipeline=True, zero_bubble=True)}


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_memory_pressure_token_identical(model, reference, policy, loop):
  """Every policy, in each of the three step loops: the tokens of running each request alone (so the
  zero-bubble loop's tokens equal the non-pipelined loop's), with the persistent host batch checked
  against a full rebuild at every step."""
  prompts, ref = reference
  eng = _engine(model, policy=policy, num_device_blocks=18, **LOOPS[loop])
  eng.loop.host_batch.verify = True   # pylint: disable=protected-access
  ids = [eng.add_request(p, SP) for p in prompts]
  while eng.has_unfinished():
    eng.step()
    eng.scheduler.check_invariants()
  assert [eng.get_request(i).token_ids for i in ids] == ref
  st = eng.stats
  if policy in ROTATING:
    assert st.rotations_out > 3 and st.rotations_in > 3 and st.blocks_in > 0, st
  else:
    assert st.recompute_preemptions > 0, st
  assert eng.block_manager.num_requests == 0
  assert eng.block_manager.num_free_device_blocks == 18
  assert eng.block_manager.num_free_host_blocks == 256


def test_abort_rotary_request_frees_blocks(model):
  eng = _engine(model, policy="rotasched", num_device_blocks=18)
  ids = [eng.add_request(p, SP) for p in _prompts(8, seed=6)]
  rotary = None
  for _ in range(200):
    eng.step()
    if eng.scheduler.rotary_ids():
      rotary = eng.scheduler.rotary_ids()[0]
      break
  assert rotary is not None
  assert eng.block_manager.is_swapped(rotary)
  assert eng.abort(rotary)
  assert not eng.block_manager.has_request(rotary)
  eng.check_invariants()
  while eng.has_unfinished():
    eng.step()
  assert eng.get_request(rotary).finish_reason == "abort"
  assert all(eng.get_request(i).finish_reason == "length" for i in ids if i != rotary)
  assert eng.block_manager.num_free_host_blocks == 256 and eng.block_manager.num_free_device_blocks == 18


def test_rotating_loop_makes_no_implicit_transfers(model, reference):
  prompts, ref = reference
  _engine(model, policy="rotasched", num_device_blocks=18).generate(prompts, SP)   # compile everything
  eng = _engine(model, policy="rotasched", num_device_blocks=18)
  with jax.transfer_guard("disallow"):
    outs = eng.generate(prompts, SP)
  assert [o.token_ids for o in outs] == ref
  assert eng.stats.rotations_out > 0


def test_sampled_outputs_survive_rotation(model):
  """Seeded sampling is a function of (seed, output index): rotation and batching do not change it."""
  prompts = _prompts(6, seed=7)
  sps = [SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=100 + i, ignore_eos=True)
         for i in range(6)]
  alone = [_engine(model).generate([p], sp)[0].token_ids for p, sp in zip(prompts, sps)]
  eng = _engine(model, policy="rotasched", num_device_blocks=14)
  assert [o.token_ids for o in eng.generate(prompts, sps)] == alone
  assert eng.stats.rotations_out > 0


def test_bfloat16_rotation_token_identical(model):
  """bf16 KV cache and host pool: rotation under pressure == one by one (same dtype)."""
  prompts = _prompts(6, seed=8)
  alone = [_engine(model, dtype="bfloat16").generate([p], SP)[0].token_ids for p in prompts]
  eng = _engine(model, policy="rotasched", num_device_blocks=14, dtype="bfloat16")
  assert [o.token_ids for o in eng.generate(prompts, SP)] == alone
  assert eng.stats.rotations_out > 0 and eng.kv_cache.dtype == jax.numpy.bfloat16


@pytest.mark.parametrize("policy,pipeline", [("rotasched", True), ("fcfs_swap", True), ("rotasched_code", False),
                                             ("fcfs", True)])
def test_random_arrivals_aborts_and_stops(model, policy, pipeline):
  """Randomised serving: requests arrive while others run, some are aborted (in any state), some stop on a
  token; every surviving greedy request still gets exactly its solo tokens, invariants hold every step."""
  rng = np.random.default_rng(hash(policy) % 1000)
  prompts = _prompts(14, seed=9)
  max_toks = [int(rng.integers(2, 16)) for _ in prompts]
  solo = [_engine(model).generate([p], SamplingParams(max_tokens=m, ignore_eos=True))[0].token_ids
          for p, m in zip(prompts, max_toks)]
  eng = _engine(model, policy=policy, num_device_blocks=16, pipeline=pipeline)
  ids, stops, aborted = {}, {}, set()
  pending = list(range(len(prompts)))
  steps = 0
  while pending or eng.has_unfinished():
    if pending and rng.random() < 0.5:
      i = pending.pop(0)
      stop = [solo[i][max_toks[i] // 2]] if rng.random() < 0.3 else []
      stops[i] = stop
      ids[i] = eng.add_request(prompts[i], SamplingParams(max_tokens=max_toks[i], ignore_eos=True,
                                                          stop_token_ids=stop))
    if ids and rng.random() < 0.08:
      i = int(rng.choice(list(ids)))
      if eng.abort(ids[i]):
        aborted.add(i)
    eng.step()
    eng.scheduler.check_invariants()
    steps += 1
    assert steps < 2000
  for i, rid in ids.items():
    res = eng.get_request(rid)
    if i in aborted:
      assert res.finish_reason == "abort" and res.token_ids == solo[i][:len(res.token_ids)]
      continue
    expect = solo[i]
    if stops[i]:
      expect = expect[:expect.index(stops[i][0]) + 1]
    assert res.token_ids == expect, (i, policy)
    assert res.finish_reason == ("stop" if len(expect) < max_toks[i] or (stops[i] and expect[-1] == stops[i][0])
                                 else "length")
  assert eng.block_manager.num_requests == 0
  assert eng.block_manager.num_free_device_blocks == 16 and eng.block_manager.num_free_host_blocks == 256


@pytest.mark.parametrize("mode", ["duplex", "merged"])
def test_transfer_report_per_step(model, reference, mode):
  """The engine reports bytes moved and copy time hidden vs exposed per step: its bytes are the blocks the
  stats counted, hidden + exposed = copy time, and a serialized mode hides nothing (it waits in issue())."""
  prompts, ref = reference
  eng = _engine(model, policy="rotasched", num_device_blocks=18, transfer_mode=mode)
  assert [o.token_ids for o in eng.generate(prompts, SP)] == ref
  rep = eng.transfer_report()
  st, bb = eng.stats, eng.kv_spec.block_bytes
  assert rep["steps"] == st.steps > 0
  assert rep["bytes_out"] == (st.blocks_out + st.blocks_writeback) * bb > 0
  assert rep["bytes_in"] == st.blocks_in * bb > 0
  assert rep["bytes_per_step"] == pytest.approx((rep["bytes_out"] + rep["bytes_in"]) / st.steps)
  assert rep["copy_time_s"] > 0
  assert rep["exposed_time_per_step_ms"] == pytest.approx(1e3 * rep["exposed_time_s"] / st.steps)
  if mode == "merged":   # every issue() returns with its copies landed: all of it exposed
    assert rep["exposed_time_s"] == pytest.approx(rep["copy_time_s"]) and rep["hidden_share"] == pytest.approx(0.0)
  else:
    assert rep["hidden_time_s"] == pytest.approx(max(0.0, rep["copy_time_s"] - rep["exposed_time_s"]))
    assert 0.0 <= rep["hidden_share"] <= 1.0
