"""Hypothesis property test of every policy: a VirtualClock simulation loop over random arrivals, lengths and
memory sizes, with a fake KV store that checks the plans end to end.

Per step: the plan respects max_num_seqs, the token budget and both pools; no request is lost or duplicated;
copy lists obey the ordering contract (no host block written twice, none both read and written except by a
same-step round trip, which the fake store orders D2H first as the engine does); every
scheduled sequence finds the KV of all its earlier tokens in its device blocks (which proves that rotations,
write-back, recompute and block reuse never corrupt a request's context); scheduler and block-manager
invariants hold. After arrivals stop, every request finishes within a bounded number of steps.
"""
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.sched import POLICIES, Request, RequestState, Scheduler, SchedulerConfig, VirtualClock


class FakeKV:
  """Device/host pools of token tags; copies gather all D2H sources before scattering H2D."""

  def __init__(self, dev, host, bs):
    self.bs = bs
    self.dev = {b: [None] * bs for b in range(dev + 1)}
    self.host = {b: [None] * bs for b in range(host)}

  def issue(self, plan):
    d2h = list(plan.swap_out) + list(plan.writeback)
    targets = [h for _, h in d2h]
    assert len(set(targets)) == len(targets), "a host block is written twice in one step"
    # Only a same-step round trip (rotasched_code) reads a host block this step writes: D2H lands first.
    assert plan.round_trips or not set(targets) & {h for h, _ in plan.swap_in}, \
        "a host block is both read and written"
    assert len({d for _, d in plan.swap_in}) == len(plan.swap_in)
    staged = [(h, list(self.dev[d])) for d, h in d2h]
    for h, data in staged:
      self.host[h] = data
    for h, d in plan.swap_in:
      self.dev[d] = list(self.host[h])

  def dispatch(self, plan, live):
    bs = self.bs
    for q in plan.scheduled:
      if q.req_id not in live:
        continue  # finished while this plan was being made (lookahead): the engine drops it
      table = q.block_table
      assert len(table) * bs >= q.num_computed_tokens + q.num_new_tokens
      for t in range(q.num_computed_tokens):
        got = self.dev[table[t // bs]][t % bs]
        assert got == (q.req_id, t), f"{q.req_id} token {t}: found {got}"
      for t in range(q.num_computed_tokens, q.num_computed_tokens + q.num_new_tokens):
        self.dev[table[t // bs]][t % bs] = (q.req_id, t)


@st.composite
def scenarios(draw):
  bs = draw(st.sampled_from([1, 2, 4]))
  dev = draw(st.integers(4, 24))
  host = draw(st.sampled_from([0, 4, 16, 64]))
  max_seq_tokens = dev * bs
  n = draw(st.integers(1, 14))
  reqs = []
  t = 0.0
  for i in range(n):
    t += draw(st.sampled_from([0.0, 0.01, 0.05, 0.3, 1.0]))
    prompt = draw(st.integers(1, max(1, max_seq_tokens // 2)))
    max_tokens = draw(st.integers(1, max(1, max_seq_tokens - prompt + 1)))
    reqs.append((i, t, prompt, max_tokens))
  cfg = dict(
      max_num_seqs=draw(st.integers(1, 6)),
      max_num_batched_tokens=draw(st.integers(1, 3 * bs + 8)),
      proactive_swap_budget=draw(st.sampled_from([0, 1, 3, 100])),
      writeback=draw(st.booleans()),
      max_writeback_blocks=draw(st.sampled_from([None, 1])),
      writeback_min_free_host=draw(st.sampled_from([None, 0])),
      beta_f=draw(st.sampled_from([0.0, 0.5])),
      proactive_recompute=draw(st.booleans()),
  )
  lookahead = draw(st.booleans())
  stops = draw(st.sets(st.integers(0, n - 1), max_size=2))  # engine-side stop (EOS) after 1 token
  aborts = draw(st.sets(st.integers(0, n - 1), max_size=1))
  return bs, dev, host, reqs, cfg, lookahead, stops, aborts


def simulate(policy, scenario):
  bs, dev, host, reqs, cfg, lookahead, stops, aborts = scenario
  clk = VirtualClock()
  bm = BlockManager(dev, host, bs)
  s = Scheduler(SchedulerConfig(**cfg), bm, clk, policy)
  kv = FakeKV(dev, host, bs)
  pending = list(reqs)
  added, done = set(), set()
  inflight = None
  step = 0
  # Progress bound: every rotation/recompute cycle of a request yields >= 1 token and costs at most its
  # prefill chunks plus one step, and a step with work pending does >= 1 unit of it.
  budget = cfg["max_num_batched_tokens"]
  max_steps = 500 + 2 * sum(mt * (-(-(p + mt) // budget) + 2) for _, _, p, mt in reqs)
  while step < max_steps:
    step += 1
    while pending and pending[0][1] <= clk.now():
      i, t, prompt, mt = pending.pop(0)
      s.add_request(Request(i, prompt, mt, t))
      added.add(i)
    if i_abort := [i for i in aborts if i in added and i not in done and step % 7 == 0]:
      assert s.abort(i_abort[0])
      done.add(i_abort[0])
      aborts.discard(i_abort[0])
    plan = s.schedule(lookahead=lookahead and inflight is not None)
    # capacity and budget
    assert len(plan.scheduled) <= cfg["max_num_seqs"]
    assert plan.num_batched_tokens == sum(q.num_new_tokens for q in plan.scheduled)
    assert plan.num_batched_tokens <= cfg["max_num_batched_tokens"]
    ids = plan.scheduled_ids()
    assert len(ids) == len(set(ids))
    trips = set(plan.round_trips)
    assert not trips or policy == "rotasched_code"  # only the fork's admission loop swaps victims back in
    assert set(plan.rotated_out) & set(plan.rotated_in) == trips
    assert not set(plan.rotated_out) & set(ids) - trips and not set(plan.preempted) & set(ids)
    for q in plan.scheduled:
      assert all(1 <= b <= dev for b in q.block_table) and q.num_new_tokens >= 1
    s.check_invariants()
    kv.issue(plan)
    if inflight is not None:  # the previous step completes
      fin = s.on_step_done(inflight, finished={i: "stop" for i in stops if s.get(i) and s.get(i).num_generated})
      done.update(fin)
      s.check_invariants()
    kv.dispatch(plan, s.requests)
    if lookahead:
      inflight = plan
    else:
      done.update(s.on_step_done(plan))
      s.check_invariants()
      inflight = None
    clk.advance(0.002 + 0.0005 * plan.num_batched_tokens + 0.0001 * (plan.blocks_in + plan.blocks_out))
    if not pending and not s.has_unfinished():
      break
    if not s.has_unfinished() and pending:
      clk.set(max(clk.now(), pending[0][1]))
    # conservation: every added request is live or terminal, exactly once
    live = set(s.requests)
    assert not live & done and live | done == added, (live, done, added)
  if inflight is not None:
    done.update(s.on_step_done(inflight))
  assert not pending and not s.has_unfinished(), f"starvation after {step} steps: {s.requests}"
  assert done == {r[0] for r in reqs}
  assert bm.num_free_device_blocks == dev and bm.num_free_host_blocks == host
  for r in s.pop_finished():
    assert r.state in (RequestState.FINISHED, RequestState.ABORTED)
    if r.finish_reason == "length":
      assert r.num_generated == r.max_tokens
  return s


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=100, deadline=None)
@given(scenario=scenarios())
def test_policy_properties(policy, scenario):
  simulate(policy, scenario)
