"""The engine core driven through the ``ModelRunner`` seam by a host-only double (``engine/fake_runner.py``).

The fake's "model" samples a hash of the token ids its pretend KV cache holds for the sequence, so outputs equal
the hand-computed reference ``next_token(prompt + outputs so far)`` only if every block table, slot, transfer
and token feed the engine core produced is right, under rotation, write-back and recompute preemption.
"""
import numpy as np
import pytest

from superinfer_jax.engine import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from superinfer_jax.engine.fake_runner import FakeModelConfig, FakeRunner, next_token
from superinfer_jax.model.batch import bucket
from superinfer_jax.sched import VirtualClock

V = 1000


def _reference(prompt, n):
  ctx = list(prompt)
  for _ in range(n):
    ctx.append(next_token(ctx, V))
  return ctx[len(prompt):]


def _workload(seed, n=10):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, V, rng.integers(3, 22)).tolist() for _ in range(n)]
  lens = rng.integers(4, 18, n).tolist()
  return prompts, lens


def _engine(runner_cls=FakeRunner, **settings):
  cfg = EngineConfig.create(**dict(dict(num_device_blocks=14, num_host_blocks=64, block_size=4, max_num_seqs=6,
                                        max_num_batched_tokens=24, policy="rotasched", ttft_slo=0.5,
                                        tbt_slo=0.2), **settings))
  clock = VirtualClock()
  runner = runner_cls(num_device_blocks=cfg.num_device_blocks, num_host_blocks=cfg.num_host_blocks,
                      block_size=cfg.block_size, out_rows=bucket(cfg.scheduler.max_num_seqs, cfg.seq_bucket_floor),
                      model_config=FakeModelConfig(vocab_size=V), clock=clock)
  return LLMEngine.with_runner(runner, cfg, clock=clock), runner


@pytest.mark.parametrize("policy", ["rotasched", "fcfs", "fcfs_swap"])
@pytest.mark.parametrize("loop", [dict(), dict(zero_bubble=False), dict(pipeline=False)])
@pytest.mark.parametrize("seed", [0, 1])
def test_engine_core_through_the_runner_seam_gives_the_reference_tokens(policy, loop, seed):
  prompts, lens = _workload(seed)
  eng, runner = _engine(policy=policy, **loop)
  eng.loop.host_batch.verify = True
  outs = eng.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
  assert [o.token_ids for o in outs] == [_reference(p, n) for p, n in zip(prompts, lens)]
  assert all(o.finish_reason == "length" for o in outs)
  st = eng.stats
  moved = np.asarray(runner.transfers).sum(axis=0) if runner.transfers else np.zeros(3)
  assert (st.blocks_out, st.blocks_writeback, st.blocks_in) == tuple(int(x) for x in moved)
  if policy == "fcfs":
    assert st.recompute_preemptions > 0 and st.rotations_out == 0
  else:
    assert st.rotations_out > 0 and st.blocks_in > 0     # the pool is contended: KV went to host and back
  # Virtual time: timestamps are the fake's cost model, not the wall clock.
  assert 0 < max(o.timestamps[-1] for o in outs) < 0.02 * runner.steps + 1
  eng.check_invariants()
  assert eng.block_manager.num_free_device_blocks == eng.num_device_blocks


class _DropsSwapIn(FakeRunner):
  """Loses every host->device copy: a request rotated back in reads blocks that hold someone else's tokens."""

  def issue_transfers(self, swap_out, writeback, swap_in, round_trip):
    super().issue_transfers(swap_out, writeback, [], round_trip)


def test_a_runner_that_loses_copies_is_caught():
  prompts, lens = _workload(0)
  eng, _ = _engine(_DropsSwapIn)
  try:
    outs = eng.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
  except AssertionError:   # the fake saw a read of a slot never written
    return
  assert [o.token_ids for o in outs] != [_reference(p, n) for p, n in zip(prompts, lens)]


def _engine_with(model_config, **settings):
  cfg = EngineConfig.create(**dict(dict(num_device_blocks=32, num_host_blocks=0, block_size=4, max_num_seqs=4,
                                        max_num_batched_tokens=32, policy="fcfs"), **settings))
  clock = VirtualClock()
  runner = FakeRunner(num_device_blocks=cfg.num_device_blocks, num_host_blocks=cfg.num_host_blocks,
                      block_size=cfg.block_size, out_rows=bucket(cfg.scheduler.max_num_seqs, cfg.seq_bucket_floor),
                      model_config=model_config, clock=clock)
  return LLMEngine.with_runner(runner, cfg, clock=clock)


@pytest.mark.parametrize("loop", [dict(), dict(zero_bubble=False), dict(pipeline=False)])
def test_finish_reasons_and_their_precedence(loop):
  """The length stop is the scheduler's (``on_step_done`` returns "length" at ``max_tokens``, the context cap
  folded in at admission); the engine's stops (eos, stop ids) are the book's. A token that is both a stop and
  the last allowed one finishes with "stop" (vLLM's order), as before the length stop moved to the scheduler."""
  prompt = [5, 6, 7]
  ref = _reference(prompt, 6)
  last = ref[3]
  assert last not in ref[:3]
  other = [5, 9, 11]
  other_ref = _reference(other, 8)
  cases = [  # (model config, prompt, params, expected tokens, expected reason)
      (FakeModelConfig(vocab_size=V), prompt, SamplingParams(max_tokens=4, ignore_eos=True), ref[:4], "length"),
      (FakeModelConfig(vocab_size=V), prompt, SamplingParams(max_tokens=4, stop_token_ids=[last]), ref[:4],
       "stop"),
      (FakeModelConfig(vocab_size=V, eos_token_ids=(last,)), prompt, SamplingParams(max_tokens=4), ref[:4],
       "stop"),
      (FakeModelConfig(vocab_size=V, eos_token_ids=(last,)), prompt, SamplingParams(max_tokens=4,
                                                                                   ignore_eos=True),
       ref[:4], "length"),
      (FakeModelConfig(vocab_size=V, eos_token_ids=(last,)), prompt, SamplingParams(max_tokens=6), ref[:4],
       "stop"),
      # The context caps the request: 3 + 5 = 8 tokens of context, so 5 outputs, a length stop.
      (FakeModelConfig(vocab_size=V, max_position_embeddings=8), prompt,
       SamplingParams(max_tokens=6, ignore_eos=True), ref[:5], "length"),
  ]
  for mcfg, p, sp, want, reason in cases:
    eng = _engine_with(mcfg, **loop)
    # A second request keeps the pipeline busy past the first one's finish (zero-bubble discards its token).
    rid = eng.add_request(p, sp)
    oid = eng.add_request(other, SamplingParams(max_tokens=8, ignore_eos=True))
    finals = {}
    for out in eng.stream():
      if out.finished:
        assert out.request_id not in finals
        finals[out.request_id] = out.finish_reason
    res = eng.get_request(rid)
    assert (res.token_ids, res.finish_reason, finals[rid]) == (want, reason, reason), (mcfg, sp)
    assert eng.get_request(oid).token_ids == other_ref[:min(8, mcfg.max_position_embeddings - len(other))]
    eng.check_invariants()
    assert eng.scheduler_stats().free_device_blocks == eng.num_device_blocks
