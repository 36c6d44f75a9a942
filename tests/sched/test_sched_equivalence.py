"""The scheduler's fast paths decide exactly as straightforward reference implementations do.

The rotation policies run Algorithm 1 through batched, incremental code: ``running_needs()`` kept by
``StepBuilder.finalize``, the LVF merge comparing un-ReLU'd lags, ``prioritize`` reading blocks from the queues' demand
and checking its stopping rules where their inputs change, victims rotated out and candidates rotated in
through batched block-manager calls. Each reference below subclasses the policy and replaces those parts by
the plain definitions: a full scan of the running requests, every candidate sorted by ``(-VLT, -x)``
(waiting first on ties, then queue order), the candidate scan written as the stopping rules read, and one
``rotate_out`` / ``swap_in`` / ``admit_waiting`` call per request. On random workloads (hypothesis) every
plan of the optimized policy must equal the reference's, field by field, block ids included.
"""
import dataclasses

import hypothesis.strategies as st
from hypothesis import given, settings

from superinfer_jax.sched import policies as P
from superinfer_jax.sched import replay
from superinfer_jax.sched.request import RequestState
from superinfer_jax.util import cdiv

ROTARY = RequestState.ROTARY


class ReferenceMixin:
  """Algorithm 1's steps written plainly (see the module docstring)."""
  uses_running_needs = False  # running_needs() scans every running request

  def prioritize(self, step, b_hbm, tokens):
    cfg = step.config
    now = step.now
    bx = cfg.proactive_swap_budget
    b_used = in_blocks = scanned = skips = 0
    R = []
    b_all = b_hbm + bx
    for r in self.candidates(step):
      scanned += 1
      if (scanned > cfg.lvf_scan_limit or skips >= cfg.lvf_max_skips or tokens <= 0
          or len(R) >= cfg.max_num_seqs or b_used >= b_all):
        break
      if r.touched_step == step.step_id or r.inflight_samples:
        continue
      blk = cdiv(r.planned_tokens, step.bm.block_size)
      if b_used + blk > (b_all if self.urgent(r, now) else b_hbm):
        skips += 1
        continue
      if r.state is ROTARY:
        nin = step.bm.blocks_to_swap_in(r.req_id)
        if not (in_blocks + nin <= bx or in_blocks == 0):
          skips += 1
          continue
        in_blocks += nin
        tokens -= 1
      else:
        tokens -= min(r.planned_tokens - r.num_computed_tokens, tokens)
      skips = 0
      R.append(r)
      b_used += blk
    return R, b_used

  def execute(self, step, victims, R):
    bx = step.config.proactive_swap_budget
    for v in victims:
      if not step.rotate_out(v) and step.config.proactive_recompute:
        step.preempt(v)
    step.schedule_running(self.reactive_mode, swap_cap=bx)
    for r in R:
      if step.budget_left() <= 0 or step.seats_left() <= 0:
        break
      if r.state is ROTARY:
        step.swap_in(r, bx)
      else:
        step.admit_waiting(r)


class ReferenceRotaSched(ReferenceMixin, P.RotaSched):
  def candidates(self, step):
    """Every waiting and rotary request by (-VLT, -x), x = the lag before the ReLU (queue key based)."""
    alpha = step.config.alpha
    now = step.now
    ranked = []
    for flag, queue, scale in ((0, step.waiting, 1.0), (1, step.rotary, alpha)):
      for i, (key, _, r) in enumerate(queue.entries()):
        x = now - key[0] if flag == 0 else scale * (now - key[0])
        ranked.append(((-max(x, 0.0), -x, flag, i), r))
    ranked.sort(key=lambda t: t[0])
    return iter([r for _, r in ranked])


class ReferenceStrict(ReferenceMixin, P.RotaSchedStrict):
  pass


class ReferenceEDF(ReferenceMixin, P.EDF):
  pass


class ReferenceCode(P.RotaSchedCode):
  uses_running_needs = False


REFERENCES = {"rotasched": ReferenceRotaSched, "rotasched_strict": ReferenceStrict,
              "edf": ReferenceEDF, "rotasched_code": ReferenceCode}


@st.composite
def scenarios(draw):
  bs = draw(st.sampled_from([2, 4, 16]))
  dev = draw(st.integers(8, 200))
  cap = dev * bs // draw(st.sampled_from([2, 8]))  # 8: many short requests contend for the pool
  config = dict(
      max_num_seqs=draw(st.sampled_from([1, 2, 4, 8, 32])),
      max_num_batched_tokens=draw(st.sampled_from([8, 64, 512, 4096])),
      proactive_swap_budget=draw(st.sampled_from([0, 4, 40, 2400, 2400])),
      proactive_recompute=draw(st.booleans()),
      min_residency=draw(st.sampled_from([0, 2])),
      beta_b=draw(st.sampled_from([0.0, 0.5])),
      alpha=draw(st.sampled_from([0.5, 3.0])),
      lvf_max_skips=draw(st.sampled_from([1, 4, 64])),
      lvf_scan_limit=draw(st.sampled_from([3, 1024])),
      max_writeback_blocks=draw(st.sampled_from([None, 2])),
  )
  return replay.Scenario(
      device_blocks=dev, host_blocks=draw(st.sampled_from([0, 8, 64, 4 * dev, 8 * dev, 8 * dev])), block_size=bs,
      num_requests=draw(st.sampled_from([1, 5, 20, 50, 100])), prompt_len=(1, max(1, min(300, cap))),
      max_tokens=(1, max(1, min(120, cap))), config=config, step_s=draw(st.sampled_from([0.01, 0.05])),
      lookahead=draw(st.booleans()), slo_jitter=draw(st.booleans()),
      stop_prob=draw(st.sampled_from([0.0, 0.05])), abort_every=draw(st.sampled_from([0, 5])))


def _same_plans(policy, scenario, seed, steps=80):
  fast = replay.Replay(policy, scenario, seed)
  ref = replay.Replay(policy, scenario, seed, policy_obj=REFERENCES[policy]())
  for step in range(steps):
    a, b = fast.schedule(), ref.schedule()
    assert replay.plan_fingerprint(a) == replay.plan_fingerprint(b), (policy, step)
    assert fast.complete(a) == ref.complete(b), (policy, step)
    if step % 10 == 0:
      fast.sched.check_invariants()
  assert fast.hexdigest() == ref.hexdigest()
  return fast


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 3), policy=st.sampled_from(sorted(REFERENCES)))
def test_fast_paths_decide_as_the_references(scenario, seed, policy):
  _same_plans(policy, scenario, seed)


def test_references_differ_from_each_other():
  """The comparison has teeth: the references are not all the same policy (rotasched vs edf differ)."""
  sc = replay.SCENARIOS["bench"]
  a = replay.run_scenario("rotasched", sc, 40)
  b = replay.run_scenario("edf", sc, 40)
  assert a != b


def test_bench_scale_rotation_matches_reference():
  """The benchmark's heavy-rotation regime (rotations every step) at a reduced scale."""
  sc = dataclasses.replace(replay.SCENARIOS["bench"], num_requests=120)
  rp = _same_plans("rotasched", sc, 0, steps=120)
  assert rp.sched.totals["rotations_out"] > 500
