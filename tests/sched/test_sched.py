"""Hand-worked scheduler tests: VLT values, the paper's conceptual example, baseline orders, B_xfer, lookahead."""
import pytest

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.sched import (POLICIES, Request, RequestState, Scheduler, SchedulerConfig, StepPlan,
                                  VirtualClock, WallClock, vlt)
from superinfer_jax.sched.step import StepBuilder

KW = dict(alpha=3.0, beta_b=0.0, beta_f=0.5, ttft_slo=5.0, tbt_slo=0.1)


def make(policy, dev=8, host=32, bs=4, **cfg):
  clk = VirtualClock()
  bm = BlockManager(dev, host, bs)
  cfg.setdefault("max_num_seqs", 16)
  cfg.setdefault("max_num_batched_tokens", 64)
  cfg.setdefault("proactive_swap_budget", 100)
  s = Scheduler(SchedulerConfig(**cfg), bm, clk, policy)
  return s, bm, clk


def step(s, clk, dt=0.1, finished=None):
  plan = s.schedule()
  s.check_invariants()
  clk.advance(dt)
  s.on_step_done(plan, finished=finished)
  s.check_invariants()
  return plan


def queue(s, r):
  """Places a hand-built WAITING or ROTARY request in its queue, as the scheduler's PendingQueues would."""
  if r.state is RequestState.ROTARY:
    s.pending.enqueue_rotary_many((r,))
  else:
    s.pending.enqueue_waiting(r, preempted=False)


def step_at(s, now):
  """A step of ``s`` planned at ``now`` (what a policy is handed), for reading its candidate orders."""
  return StepBuilder(s, StepPlan(step_id=s.step_id, time=now), count_needs=False)


def add(s, rid, t, prompt=2, max_tokens=3, **kw):
  r = Request(rid, prompt, max_tokens, t, **kw)
  s.add_request(r)
  return r


# ---------------------------------------------------------------------------- VLT
def test_vlt_values_per_state():
  r = Request("w", 4, 4, arrival_time=1.0)
  assert vlt(r, 2.0, **KW) == 0.0  # waited 1 s < beta_f * TTFT = 2.5 s
  assert vlt(r, 4.5, **KW) == pytest.approx(1.0)  # 3.5 - 2.5
  r.state = RequestState.PREEMPTED
  assert vlt(r, 4.5, **KW) == pytest.approx(1.0)  # preempted requests count as waiting from arrival
  r.state, r.state_time = RequestState.RUNNING, 3.0
  assert vlt(r, 3.0, **KW) == 0.0
  assert vlt(r, 3.75, **KW) == pytest.approx(-0.75)
  r.state, r.last_token_time = RequestState.ROTARY, 10.0
  assert vlt(r, 10.5, **KW) == pytest.approx(1.5)  # alpha * 0.5
  assert vlt(r, 10.5, **dict(KW, beta_b=10.0)) == 0.0  # ReLU(0.5 - 10 * 0.1)
  assert vlt(r, 10.5, **dict(KW, beta_b=-10.0)) == pytest.approx(3 * 1.5)  # negative beta_b: lags earlier
  r.tbt_slo = 0.01  # per-request SLO overrides the default
  assert vlt(r, 10.5, **dict(KW, beta_b=-10.0)) == pytest.approx(3 * 0.6)
  r.state = RequestState.FINISHED
  with pytest.raises(ValueError):
    vlt(r, 11.0, **KW)


def test_scheduler_vlt_uses_its_clock_and_config():
  s, _, clk = make("rotasched", beta_f=0.0)
  add(s, "a", 0.0)
  clk.advance(2.0)
  assert s.vlt("a") == pytest.approx(2.0)


# ---------------------------------------------------------------------------- conceptual example
def test_conceptual_example_longest_running_rotates_out():
  """docs/paper.md §2.1 example: 4 requests, device room for 2 (one 1-block request each).

  A (t=0) and B (t=0.05) are admitted in turn. C arrives at 0.15; at t=0.2 the device is full, C's VLT
  (>= 0) ranks above every running request, so the running request with the most negative VLT (A, the
  longest-running, VLT -0.2 vs B's -0.1) rotates out and C runs. At t=0.3, with B_xfer = 1 block, the
  rotary A (VLT = alpha * 0.1 = 0.3) beats the fresh D (VLT 0): A rotates back in, displacing the now
  longest-running B; D keeps waiting. A request that entered running this instant (VLT = 0) is never a victim.
  """
  s, bm, clk = make("rotasched", dev=2, proactive_swap_budget=1, max_num_batched_tokens=16)
  add(s, "A", 0.0, max_tokens=3)
  p0 = step(s, clk)  # t=0 -> 0.1
  assert p0.admitted == ["A"] and not p0.contention
  add(s, "B", 0.05)
  p1 = step(s, clk)  # t=0.1
  assert p1.admitted == ["B"] and p1.rotated_out == []
  add(s, "C", 0.15)
  now = clk.now()
  assert now == pytest.approx(0.2)
  assert s.vlt("A") == pytest.approx(-0.2) and s.vlt("B") == pytest.approx(-0.1) and s.vlt("C") == 0.0
  p2 = step(s, clk)  # t=0.2
  assert p2.contention
  assert p2.rotated_out == ["A"] and p2.admitted == ["C"] and p2.rotated_in == []
  assert s.get("A").state is RequestState.ROTARY and s.get("B").state is RequestState.RUNNING
  add(s, "D", 0.3)
  assert s.vlt("A") == pytest.approx(3 * 0.1) and s.vlt("D") == 0.0
  p3 = step(s, clk)  # t=0.3
  assert p3.rotated_in == ["A"] and p3.rotated_out == ["B"] and p3.admitted == []
  assert s.get("D").state is RequestState.WAITING
  assert p3.blocks_in <= 1


def test_no_contention_means_no_rotation():
  s, _, clk = make("rotasched", dev=8)
  for i in range(4):
    add(s, i, 0.0)
  for _ in range(3):
    p = step(s, clk)
    assert not p.contention and p.rotated_out == [] and p.preempted == []
  assert not s.has_unfinished()


# ---------------------------------------------------------------------------- baselines
def _fill_two(policy, **cfg):
  """r0, r1 (prompt 5: 2 blocks each) fill a 4-block pool; r2 waits. At token 9 r0 needs a 3rd block."""
  s, bm, clk = make(policy, dev=4, **cfg)
  add(s, "r0", 0.0, prompt=5, max_tokens=6)
  add(s, "r1", 0.01, prompt=5, max_tokens=6)
  add(s, "r2", 0.02, prompt=5, max_tokens=6)
  return s, bm, clk


def test_fcfs_recompute_preempts_last_admitted_and_requeues_at_head():
  s, bm, clk = _fill_two("fcfs")
  p = step(s, clk)
  assert p.admitted == ["r0", "r1"]  # arrival order; r2 blocked (no block left)
  plans = [step(s, clk) for _ in range(5)]
  pre = [p for p in plans if p.preempted]
  assert pre and pre[0].preempted == ["r1"] and pre[0].admitted == []  # no admission in a preempting step
  assert s.waiting_ids()[0] == "r1"  # head of the queue, ahead of r2 which arrived later
  assert s.get("r1").num_computed_tokens == 0 and s.get("r1").num_preemptions == 1
  assert all(p.rotated_out == [] for p in plans)


def test_fcfs_swap_swaps_victim_and_resumes_it_before_new():
  s, bm, clk = _fill_two("fcfs_swap")
  step(s, clk)
  plans = []
  while not any(p.rotated_out for p in plans):
    plans.append(step(s, clk))
  assert plans[-1].rotated_out == ["r1"] and plans[-1].preempted == []
  assert s.get("r1").state is RequestState.ROTARY
  while s.get("r1") is not None and s.get("r1").state is RequestState.ROTARY:
    p = step(s, clk)
    assert "r2" not in p.admitted  # swapped requests resume first
  assert p.rotated_in == ["r1"]


def _rotary_and_waiting(policy):
  """Returns a scheduler with one ROTARY request "x" and one WAITING request "w" (both 1 block)."""
  s, bm, clk = make(policy, dev=2, proactive_swap_budget=100, max_num_batched_tokens=16)
  add(s, "x", 0.0, max_tokens=3)
  add(s, "y", 0.0, max_tokens=3)
  step(s, clk)  # x, y running
  add(s, "z", 0.1, max_tokens=3)
  step(s, clk)  # x (longest-running) rotated out for z under rotation policies
  return s, bm, clk


def test_wf_rotates_running_out_for_waiting_and_ranks_waiting_above_rotary():
  s, bm, clk = make("wf", dev=1, proactive_swap_budget=100, max_num_batched_tokens=16)
  add(s, "x", 0.0, max_tokens=3)
  step(s, clk)  # x runs (t=0)
  add(s, "w", 0.1, max_tokens=3)
  p = step(s, clk)  # t=0.1: x rotates out for w (a waiting request outranks running ones)
  assert p.rotated_out == ["x"] and p.admitted == ["w"]
  add(s, "w2", 0.2, max_tokens=3)
  p = step(s, clk)  # t=0.2: w runs; candidates x (rotary) and w2 (waiting); one slot: waiting first
  assert p.admitted == ["w2"] and p.rotated_in == [] and p.rotated_out == ["w"]


def test_wf_preempts_latest_arrival_for_waiting_and_parks_rotary_while_any_waits():
  """The paper's WF on a hand-worked contended case (2 one-block slots; bs 4, prompt 2, 3 tokens: 1 block).

  t=0 A and t=0.1 B fill the pool. C arrives at 0.15: at t=0.2 WF rotates out B, the latest arrival (static
  priority, no lag rule), and admits C in the same step; rotasched rotates out A instead, the longest-running
  (most negative VLT). A finishes at t=0.2, freeing its block; D arrives at 0.25. At t=0.3 WF admits D and
  keeps B parked (a request waits, so rotary ones do not resume), although B's VLT (3 x 0.1 = 0.3) is above
  D's (ReLU(0.05 - 2.5) = 0): rotasched resumes B there.
  """
  out = {}
  for policy in ("wf", "rotasched"):
    s, bm, clk = make(policy, dev=2, proactive_swap_budget=100, max_num_batched_tokens=16)
    add(s, "A", 0.0)
    assert step(s, clk).admitted == ["A"]          # t=0
    add(s, "B", 0.05)
    assert step(s, clk).admitted == ["B"]          # t=0.1: the pool is full
    add(s, "C", 0.15)
    p2 = step(s, clk)                              # t=0.2
    add(s, "D", 0.25)
    p3 = step(s, clk)                              # t=0.3
    out[policy] = (p2, p3, s.get("B").state)
  p2, p3, b_state = out["wf"]
  assert p2.contention and p2.rotated_out == ["B"] and p2.admitted == ["C"]
  assert p3.admitted == ["D"] and p3.rotated_in == [] and b_state is RequestState.ROTARY
  p2, p3, b_state = out["rotasched"]
  assert p2.rotated_out == ["A"] and p2.admitted == ["C"]


def _run(s, clk, arrivals, dt=0.1, max_steps=500):
  """Drives ``s`` to completion; ``arrivals`` = [(time, rid, prompt, max_tokens)]. Returns (plans, first
  token time per request)."""
  pending = sorted(arrivals)
  plans, first = [], {}
  for _ in range(max_steps):
    while pending and pending[0][0] <= clk.now() + 1e-9:
      t, rid, prompt, mt = pending.pop(0)
      add(s, rid, t, prompt=prompt, max_tokens=mt)
    if not pending and not s.has_unfinished():
      return plans, first
    plan = s.schedule()
    s.check_invariants()
    clk.advance(dt)
    s.on_step_done(plan)
    s.check_invariants()
    for seq in plan.scheduled:
      if seq.sample and seq.req_id not in first:
        first[seq.req_id] = clk.now()
    plans.append(plan)
  raise AssertionError("did not finish")


# Two long requests fill a 4-block pool (bs 4: prompt 5 = 2 blocks, growing to 3); two short ones arrive
# while they run. Hand-worked: nobody fits until a long request finishes or is evicted.
_CONTENDED = [(0.0, "long0", 5, 6), (0.0, "long1", 5, 6), (0.15, "late0", 2, 2), (0.25, "late1", 2, 2)]


def test_sf_degenerates_to_fcfs_and_differs_from_wf():
  runs = {}
  for policy in ("fcfs", "fcfs_swap", "sf", "wf"):
    s, bm, clk = make(policy, dev=4, proactive_swap_budget=100, max_num_batched_tokens=32)
    plans, first = _run(s, clk, _CONTENDED)
    order = sorted(first, key=lambda r: (first[r], r))
    rot = sum(len(p.rotated_out) for p in plans)
    runs[policy] = (order, first, rot, sum(len(p.preempted) for p in plans),
                    sum(len(p.rotated_out) for p in plans if p.admitted))
  # fcfs: long1 is recompute-preempted when long0 grows; sf and fcfs_swap swap it out instead. All three
  # give the late requests their first tokens only after the long ones: the same first-token order.
  assert runs["fcfs"][0] == runs["sf"][0] == runs["fcfs_swap"][0] == ["long0", "long1", "late0", "late1"]
  assert runs["fcfs"][2] == 0 and runs["fcfs"][3] >= 1
  assert runs["sf"][3] == 0 and 1 <= runs["sf"][2] == runs["fcfs_swap"][2]  # reactive swaps only
  assert runs["sf"][1]["late0"] == runs["fcfs_swap"][1]["late0"] <= runs["fcfs"][1]["late0"]
  # wf rotates long requests out as soon as the late ones arrive: they get first tokens earlier.
  assert runs["wf"][1]["late0"] < runs["sf"][1]["late0"] and runs["wf"][1]["late1"] < runs["sf"][1]["late1"]
  # ... by proactive rotation: wf rotates out in steps that admit; sf never does (it evicts only reactively).
  assert runs["wf"][4] >= 1 and runs["sf"][4] == 0


def test_sf_resumes_oldest_swap_first_and_fcfs_swap_latest_first():
  # Three requests of 2 blocks (bs 4, prompt 5) fill a 6-block pool and grow to 4 blocks. When r0 needs its
  # 3rd block the last-admitted r2 is swapped out; when a request needs a block again r1 goes. sf then
  # resumes r2 (parked first), fcfs_swap r1 (parked last: the head of its queue).
  order = {}
  for policy in ("sf", "fcfs_swap"):
    s, bm, clk = make(policy, dev=6, proactive_swap_budget=100, max_num_batched_tokens=32)
    plans, _ = _run(s, clk, [(0.0, f"r{i}", 5, 12) for i in range(3)])
    outs = [rid for p in plans for rid in p.rotated_out]
    ins = [rid for p in plans for rid in p.rotated_in]
    assert outs[:2] == ["r2", "r1"], (policy, outs)
    order[policy] = ins[0]
  assert order == {"sf": "r2", "fcfs_swap": "r1"}


def test_sf_admits_no_new_request_while_one_is_rotary():
  s, bm, clk = make("sf", dev=4, proactive_swap_budget=100, max_num_batched_tokens=32)
  plans, first = _run(s, clk, _CONTENDED)
  for p in plans:
    if p.admitted:
      assert not p.rotated_out  # nothing evicted in an admitting step
  for i, p in enumerate(plans):
    if any(r in ("late0", "late1") for r in p.admitted):
      # no request was rotary when a new one was admitted
      parked = set()
      for q in plans[:i]:
        parked |= set(q.rotated_out)
        parked -= set(q.rotated_in)
      parked -= set(p.rotated_in)  # resumed earlier in the same step
      assert not parked, (i, parked)


def test_rotasched_orders_by_vlt_across_queues():
  # Two rotary requests (lags 0.5 s and 0.1 s: VLT 1.5 and 0.3) and two waiting ones (waited 3.5 s and 4.5 s:
  # VLT 1.0 and 2.0). Order: w_old (2.0), x_old (1.5), w_new (1.0), x_new (0.3).
  s, bm, clk = make("rotasched")
  pol = s.policy
  now = 10.0
  reqs = {}
  # (hand-placed in the queues below, as the scheduler's PendingQueues would place them)
  for rid, state, t in [("w_old", "W", 5.5), ("w_new", "W", 6.5), ("x_old", "R", 9.5), ("x_new", "R", 9.9)]:
    r = Request(rid, 2, 3, arrival_time=t if state == "W" else 0.0)
    if state == "R":
      r.state, r.last_token_time, r.num_generated, r.num_computed_tokens = RequestState.ROTARY, t, 1, 2
    queue(s, r)
    reqs[rid] = r
  order = [r.req_id for r in pol.candidates(step_at(s, now))]
  assert order == ["w_old", "x_old", "w_new", "x_new"]
  vl = [vlt(reqs[i], now, **KW) for i in order]
  assert vl == sorted(vl, reverse=True) and vl[0] == pytest.approx(2.0) and vl[-1] == pytest.approx(0.3)


def test_edf_orders_by_deadline_and_rotasched_code_by_in_waiting_since():
  s, _, _ = make("edf")
  pol = s.policy
  w = Request("w", 2, 3, arrival_time=0.0)  # deadline 5.0
  x = Request("x", 2, 3, arrival_time=0.0)
  x.state, x.last_token_time = RequestState.ROTARY, 4.95  # deadline 5.05
  y = Request("y", 2, 3, arrival_time=0.0, ttft_slo=1.0)  # deadline 1.0 (tighter SLO)
  for r in (w, x, y):
    queue(s, r)
  assert [r.req_id for r in pol.candidates(step_at(s, 5.0))] == ["y", "w", "x"]
  assert pol.urgent(y, 2.0) and not pol.urgent(x, 5.0)

  s, _, _ = make("rotasched_code")
  pol = s.policy
  a = Request("a", 2, 3, arrival_time=3.0)
  b = Request("b", 2, 3, arrival_time=0.0)
  b.state, b.state_time = RequestState.ROTARY, 2.0  # rotated out at 2.0: in_waiting_since = 2.0
  a.state_time = 3.0
  queue(s, a)
  queue(s, b)
  assert [r.req_id for r in pol.candidates(step_at(s, 5.0))] == ["b", "a"]


def test_rotasched_code_keeps_budget_free():
  # B = 3 blocks: with fewer than 3 free blocks under contention, rotate out longest-running decode requests
  # while the accumulated blocks stay below B.
  s, bm, clk = make("rotasched_code", dev=4, proactive_swap_budget=3, max_num_batched_tokens=16)
  for i in range(4):
    add(s, f"r{i}", 0.0, max_tokens=3)
  step(s, clk)  # 4 running, 0 free
  add(s, "late", 0.1, max_tokens=3)
  p = step(s, clk)
  assert p.rotated_out == ["r0", "r1"]  # 1 + 1 < 3, a third would reach 3
  # The fork's admission loop then runs over waiting + rotary by in_waiting_since: "late" (0.1) first, then
  # the victims (stamped now = 0.1, appended to the tail): one block is left after "late", so r0 is swapped
  # straight back in within the step; r1 does not fit.
  assert p.admitted == ["late"] and p.rotated_in == ["r0"] and p.round_trips == ["r0"]
  assert s.get("r0").state is RequestState.RUNNING and s.get("r1").state is RequestState.ROTARY
  # r0's host copy is this step's D2H destination and H2D source: one pair each, same host block.
  assert set(p.swap_out.dsts) & set(p.swap_in.srcs)
  assert s.totals["round_trips"] == 1


def test_rotasched_code_round_trip_under_lookahead():
  # Pipelined engine: the plan is made while the previous step (which samples for every running request)
  # is in flight; victims with a sample in flight may still be swapped straight back in.
  s, bm, clk = make("rotasched_code", dev=4, proactive_swap_budget=3, max_num_batched_tokens=16)
  for i in range(4):
    add(s, f"r{i}", 0.0, max_tokens=4)
  p0 = s.schedule()
  clk.advance(0.1)
  s.on_step_done(p0)
  p1 = s.schedule()  # all 4 in decode, their samples in flight
  add(s, "late", clk.now(), max_tokens=3)
  p2 = s.schedule(lookahead=True)
  s.check_invariants()
  assert p2.rotated_out == ["r0", "r1"] and p2.admitted == ["late"] and p2.round_trips == ["r0"]
  seq = {q.req_id: q for q in p2.scheduled}
  assert seq["r0"].num_new_tokens == 1 and seq["r0"].sample  # its in-flight token comes next
  clk.advance(0.1)
  s.on_step_done(p1)
  s.check_invariants()
  s.on_step_done(p2)
  s.check_invariants()
  assert s.get("r0").num_generated == 3


def test_rotasched_code_host_gate_holds_back_waiting_not_preempted(monkeypatch):
  # a and b fill a 2-block pool; when a grows, b is recompute-preempted (the fork's reactive path). With the
  # host pool above 0.9 usage, the preempted b is still admitted when room frees up; the fresh w waits.
  s, bm, clk = make("rotasched_code", dev=2, host=8, proactive_swap_budget=0, max_num_batched_tokens=32)
  add(s, "a", 0.0, prompt=4, max_tokens=3)
  add(s, "b", 0.0, prompt=4, max_tokens=5)
  step(s, clk)
  p = step(s, clk)
  assert p.preempted == ["b"]
  add(s, "w", clk.now(), prompt=1, max_tokens=2)
  monkeypatch.setattr(bm, "host_usage", lambda: 0.92)
  admitted = []
  for _ in range(6):
    admitted += step(s, clk).admitted
  assert admitted == ["b"] and s.get("w").state is RequestState.WAITING
  monkeypatch.undo()
  for _ in range(3):
    admitted += step(s, clk).admitted
  assert "w" in admitted


def test_min_residency_delays_proactive_victims():
  # rotasched time-slices a 2-block pool among 4 one-block requests. With min_residency = 3 a request that
  # (re)entered running stays resident at least 3 steps before it can be a proactive victim again.
  for q in (0, 3):
    s, bm, clk = make("rotasched", dev=2, bs=16, proactive_swap_budget=100, max_num_batched_tokens=16,
                      min_residency=q)
    plans, _ = _run(s, clk, [(0.0, f"r{i}", 2, 8) for i in range(4)])
    entered = {}
    shortest = None
    for i, p in enumerate(plans):
      for rid in p.admitted + p.rotated_in:
        entered[rid] = i
      for rid in p.rotated_out:
        stay = i - entered[rid]
        shortest = stay if shortest is None else min(shortest, stay)
    assert shortest is not None
    if q == 0:
      assert shortest < 3  # every-step time slicing (a victim after one sampled token)
      rot0 = s.totals["rotations_out"]
    else:
      assert shortest >= 3 and s.totals["rotations_out"] < rot0
      assert s.totals["residency_steps"] / s.totals["rotations_out"] >= 3




# ---------------------------------------------------------------------------- budgets and rules
@pytest.mark.parametrize("bxfer", [4, 100])
def test_bxfer_caps_blocks_moved_per_step(bxfer):
  # 6 running requests of 2 blocks (prompt 8) fill 12 blocks; 6 more wait. No write-back, so a rotation
  # copies every block of the victim.
  s, bm, clk = make("rotasched", dev=12, host=64, proactive_swap_budget=bxfer, max_num_batched_tokens=128,
                    writeback=False)
  for i in range(6):
    add(s, f"a{i}", 0.0, prompt=8, max_tokens=8)
  step(s, clk)
  for i in range(6):
    add(s, f"b{i}", 0.1, prompt=8, max_tokens=8)
  plans = [step(s, clk) for _ in range(12)]
  most = max(max(p.blocks_out, p.blocks_in) for p in plans)
  if bxfer == 4:
    assert most == 4  # rotation happens, at the cap and never beyond it
  else:
    assert most > 4  # the same workload moves more when the budget allows it


def test_writeback_makes_rotation_copy_only_the_tail():
  s, bm, clk = make("rotasched", dev=4, host=64, proactive_swap_budget=100, max_num_batched_tokens=64,
                    writeback_min_free_host=0)
  add(s, "a", 0.0, prompt=9, max_tokens=4)  # 3 blocks: 2 full after prefill, tail has 1-2 tokens
  p = step(s, clk)
  assert p.writeback == []  # the prefill's KV is not written yet when the plan is made
  p = step(s, clk)
  assert len(p.writeback) == 2  # the two full blocks, computed by the previous step
  add(s, "b", clk.now(), prompt=8, max_tokens=4)
  p = step(s, clk)
  assert p.rotated_out == ["a"] and p.blocks_out == 1  # only the dirty tail block
  assert {d for d, _ in p.swap_out} <= set(range(1, 5))


def test_mid_prefill_never_rotated_and_never_out_and_in_same_step():
  s, bm, clk = make("rotasched", dev=6, proactive_swap_budget=100, max_num_batched_tokens=4)
  add(s, "long", 0.0, prompt=16, max_tokens=2)  # 4 prefill chunks of 4 tokens
  for i in range(3):
    add(s, f"s{i}", 0.0, prompt=2, max_tokens=6)
  for _ in range(30):
    plan = s.schedule()
    assert not set(plan.rotated_out) & set(plan.rotated_in)
    for rid in plan.rotated_out:
      r = s.get(rid)
      assert r.num_computed_tokens >= r.prompt_len  # prefill complete
    clk.advance(0.1)
    s.on_step_done(plan)
    s.check_invariants()
    if not s.has_unfinished():
      break
  assert not s.has_unfinished()


@pytest.mark.parametrize("proactive_recompute", [False, True])
def test_host_full_falls_back_to_recompute(proactive_recompute):
  s, bm, clk = make("rotasched", dev=2, host=0, proactive_swap_budget=100, max_num_batched_tokens=16,
                    proactive_recompute=proactive_recompute)
  add(s, "a", 0.0, max_tokens=3)
  add(s, "b", 0.0, max_tokens=3)
  step(s, clk)
  add(s, "c", 0.1, max_tokens=3)
  p = step(s, clk)
  assert p.rotated_out == []
  if proactive_recompute:
    assert p.preempted == ["a"] and p.admitted == ["c"]
    assert s.get("a").state is RequestState.PREEMPTED and s.get("a").num_computed_tokens == 0
  else:  # the optional rotation is skipped: a keeps its KV and runs
    assert p.preempted == [] and p.admitted == [] and s.get("a").state is RequestState.RUNNING


def test_reactive_eviction_recomputes_when_host_full():
  s, bm, clk = make("fcfs_swap", dev=4, host=0, max_num_batched_tokens=16)
  add(s, "r0", 0.0, prompt=5, max_tokens=6)
  add(s, "r1", 0.0, prompt=5, max_tokens=6)
  plans = [step(s, clk) for _ in range(5)]
  assert any(p.preempted == ["r1"] for p in plans) and all(not p.rotated_out for p in plans)


def test_token_budget_and_max_num_seqs():
  s, bm, clk = make("fcfs", dev=64, max_num_seqs=3, max_num_batched_tokens=10)
  for i in range(5):
    add(s, i, 0.0, prompt=4, max_tokens=2)
  p = s.schedule()
  assert p.num_batched_tokens <= 10 and len(p.scheduled) <= 3
  assert [q.num_new_tokens for q in p.scheduled] == [4, 4, 2]  # chunked prefill of the third
  assert [q.sample for q in p.scheduled] == [True, True, False]


@pytest.mark.parametrize("host,written,free", [
    (40, 4, 36),   # reserve = B_xfer = 8: all 4 full blocks written back
    (10, 4, 6),    # reserve = 10 // 4 = 2 (B_xfer alone would switch write-back off)
    (4, 3, 1),     # reserve = 4 // 4 = 1: write-back stops there
])
def test_writeback_reserve_default_is_bxfer_capped_by_a_quarter_of_the_host_pool(host, written, free):
  s, bm, clk = make("rotasched", dev=8, host=host, proactive_swap_budget=8, max_num_batched_tokens=64)
  add(s, "a", 0.0, prompt=16, max_tokens=4)  # 4 full blocks after the prefill
  step(s, clk)
  p = step(s, clk)
  assert len(p.writeback) == written and bm.num_free_host_blocks == free


def test_rotation_reclaims_mirrors_of_running_requests_when_host_full():
  s, bm, clk = make("rotasched", dev=6, host=4, proactive_swap_budget=100, max_num_batched_tokens=64,
                    writeback_min_free_host=0)
  add(s, "a", 0.0, prompt=8, max_tokens=8)  # 2 full blocks after the prefill
  add(s, "b", 0.0, prompt=8, max_tokens=8)
  step(s, clk)
  p = step(s, clk)  # decode: a 3rd block each (6 used); write-back of the 4 full blocks fills the host
  assert len(p.writeback) == 4 and bm.num_free_host_blocks == 0 and bm.num_free_device_blocks == 0
  add(s, "c", clk.now(), prompt=4, max_tokens=2)
  p = step(s, clk)  # a rotates out for c; its dirty tail needs a host block: b's mirrors are reclaimed
  assert p.rotated_out == ["a"] and p.preempted == [] and p.admitted == ["c"]
  assert len(p.swap_out) == 1 and bm.is_swapped("a")
  assert bm.num_host_mirrors("b") == len(p.writeback) == 1  # reclaimed; write-back refilled the last free block


def test_reject_request_that_can_never_fit():
  s, _, _ = make("fcfs", dev=2, bs=4)
  with pytest.raises(ValueError, match="can never fit"):
    s.add_request(Request("big", 6, 4, 0.0))  # 9 tokens need 3 blocks > 2
  s.add_request(Request("ok", 5, 4, 0.0))  # 8 tokens, 2 blocks
  with pytest.raises(ValueError, match="already live"):
    s.add_request(Request("ok", 5, 4, 0.0))


def test_on_step_done_tokens_timestamps_and_finish():
  s, bm, clk = make("fcfs")
  r = Request("a", 2, 2, 0.0)
  s.add_request(r)
  p = s.schedule()
  assert p.scheduled[0].num_new_tokens == 2 and p.scheduled[0].block_table == bm.block_table("a")
  clk.advance(0.5)
  assert s.on_step_done(p, {"a": 7}) == {}
  assert r.first_token_time == 0.5 and r.num_generated == 1
  p = s.schedule()
  assert p.scheduled[0].num_new_tokens == 1 and p.scheduled[0].num_computed_tokens == 2
  clk.advance(0.25)
  assert s.on_step_done(p, {"a": 8}, finished={"a": "stop"}) == {"a": "length"}  # length is checked first
  assert r.state is RequestState.FINISHED and r.finish_reason == "length" and r.tbt_max == pytest.approx(0.25)
  assert bm.num_requests == 0 and s.pop_finished() == [r]


def test_engine_finish_and_abort_release_blocks():
  s, bm, clk = make("rotasched")
  add(s, "a", 0.0, max_tokens=10)
  add(s, "b", 0.0, max_tokens=10)
  p = s.schedule()
  clk.advance(0.1)
  assert s.on_step_done(p, finished={"a": "stop"}) == {"a": "stop"}
  assert s.abort("b") and not s.abort("b")
  assert bm.num_free_device_blocks == bm.num_device_blocks and not s.has_unfinished()
  assert [r.finish_reason for r in s.pop_finished()] == ["stop", "abort"]


def test_lookahead_plans_next_step_while_one_in_flight():
  s, bm, clk = make("fcfs")
  add(s, "a", 0.0, prompt=3, max_tokens=3)
  p0 = s.schedule()
  with pytest.raises(RuntimeError):
    s.schedule()  # without lookahead a plan must not be in flight
  p1 = s.schedule(lookahead=True)  # a is assumed to gain the token p0 samples
  assert p1.lookahead and p1.scheduled[0].num_computed_tokens == 3 and p1.scheduled[0].num_new_tokens == 1
  with pytest.raises(RuntimeError):
    s.schedule(lookahead=True)  # depth 1
  clk.advance(0.1)
  s.on_step_done(p0, {"a": 1})
  p2 = s.schedule(lookahead=True)  # 1 generated, p1 samples the 2nd, p2 the 3rd and last
  assert [(q.num_computed_tokens, q.num_new_tokens) for q in p2.scheduled] == [(4, 1)]
  s.on_step_done(p1, {"a": 2})
  p3 = s.schedule(lookahead=True)
  assert p3.scheduled == []  # max_tokens reached once p2 completes
  s.check_invariants()
  s.on_step_done(p2, {"a": 3})
  assert s.get("a") is None and s.pop_finished()[0].finish_reason == "length"
  s.on_step_done(p3)


def test_lookahead_does_not_schedule_past_max_tokens():
  s, bm, clk = make("fcfs")
  add(s, "a", 0.0, prompt=3, max_tokens=2)
  p0 = s.schedule()
  p1 = s.schedule(lookahead=True)
  assert len(p1.scheduled) == 1  # samples token 2 of 2
  clk.advance(0.1)
  s.on_step_done(p0)
  p2 = s.schedule(lookahead=True)
  assert p2.scheduled == []  # token 2 is in flight: the request will be done
  s.on_step_done(p1)
  assert not s.has_unfinished()
  s.on_step_done(p2)


def test_clocks():
  c = VirtualClock(1.0)
  assert c.now() == 1.0 and c.advance(0.5) == 1.5
  with pytest.raises(ValueError):
    c.advance(-1)
  with pytest.raises(ValueError):
    c.set(1.0)
  w = WallClock()
  assert w.now() > 1e9 and WallClock(offset=w.now()).now() < 10


def test_all_policies_registered():
  assert set(POLICIES) >= {"fcfs", "fcfs_swap", "wf", "sf", "rotasched", "rotasched_strict", "rotasched_code",
                           "edf"}


@pytest.mark.parametrize("seed", range(3))
def test_sorted_queue_matches_a_sorted_list(seed):
  """push/remove (with the append-at-tail and remove-at-head fast paths) keep (key, push order) order."""
  import random
  from superinfer_jax.sched.queue import SortedQueue
  rng = random.Random(seed)
  q = SortedQueue()
  ref = []  # (key, push counter, request)
  n = 0
  for i in range(600):
    if ref and rng.random() < 0.4:
      j = 0 if rng.random() < 0.5 else rng.randrange(len(ref))  # often the head, as admission does
      q.remove(ref.pop(j)[2])
    else:
      r = Request(i, 1, 1, 0.0)
      # Mostly non-decreasing keys (the tail fast path), with ties and some out-of-order keys.
      key = (float(rng.choice([n // 3, n // 3, rng.randrange(n // 3 + 1)])),)
      n += 1
      q.push(r, key, i % 3)
      ref.append((key, n, r))
      ref.sort(key=lambda e: (e[0], e[1]))
    assert q.requests() == [e[2] for e in ref]
    assert q.demand == sum(e[2].req_id % 3 for e in ref)


@pytest.mark.parametrize("seed", range(3))
def test_lvf_merge_matches_heapq_merge(seed):
  """RotaSched's two-way merge yields the order of heapq.merge with the (-VLT, -lag) key, ties to waiting;
  its run-by-run form (bisection per run, alpha >= 0) and its element-wise form agree for any alpha."""
  import heapq
  import random
  from superinfer_jax.sched.policies import _lvf_merge, _lvf_merge_pairwise
  rng = random.Random(seed)
  for _ in range(200):
    now, alpha = rng.choice([0.0, 1.0, 2.5]), rng.choice([0.0, 0.5, 1.0, 3.0])
    pick = lambda: float(rng.randint(0, 8)) / 2  # coarse, so VLT ties (ReLU at 0, equal lags) are common
    size = rng.choice([6, 40])  # long queues give long runs
    w = sorted(((pick(),), i, f"w{i}") for i in range(rng.randint(0, size)))
    r = sorted(((pick(),), i, f"r{i}") for i in range(rng.randint(0, size)))

    def key(e, a):
      x = a * (now - e[0][0])
      return (-(x if x > 0 else 0.0), -x)

    expect = [e[2] for e in heapq.merge(w, r, key=lambda e: key(e, alpha if e[2][0] == "r" else 1.0))]
    assert list(_lvf_merge(w, r, now, alpha)) == expect
    assert list(_lvf_merge_pairwise(w, r, now, alpha)) == expect
    neg = -alpha - 0.5  # the rotary lag order reverses: the element-wise merge is used
    assert list(_lvf_merge(w, r, now, neg)) == list(_lvf_merge_pairwise(w, r, now, neg))


def test_request_sampling_its_last_token_in_flight_is_not_a_rotation_victim():
  """Under lookahead, plan k+1 must not rotate out a request whose in-flight step k samples its last token
  (its KV is freed a step later: the copy would waste bandwidth, host blocks and the B_xfer budget)."""
  s, bm, clk = make("rotasched", dev=4)
  add(s, "a", 0.0, prompt=7, max_tokens=3)          # 2 blocks
  step(s, clk)                                       # prefill + token 1
  step(s, clk)                                       # token 2
  p_k = s.schedule()                                 # in flight: samples a's 3rd and last token
  clk.advance(0.1)
  add(s, "b", clk.now(), prompt=12, max_tokens=2)   # 3 blocks: contention with a
  p_next = s.schedule(lookahead=True)
  assert p_next.rotated_out == [] and len(p_next.swap_out) == 0
  s.on_step_done(p_k)
  assert s.get("a") is None                          # a finished; its blocks are free for b
  s.on_step_done(p_next)
  s.check_invariants()


@pytest.mark.parametrize("policy,expect_writeback", [("fcfs", False), ("fcfs_swap", True),
                                                     ("rotasched", True)])
def test_writeback_only_for_policies_that_use_the_host_pool(policy, expect_writeback):
  s, bm, clk = make(policy, dev=8, host=40, proactive_swap_budget=8)
  add(s, "a", 0.0, prompt=16, max_tokens=4)  # 4 full blocks after the prefill
  step(s, clk)
  p = step(s, clk)
  assert (len(p.writeback) > 0) == expect_writeback


def test_rotasched_strict_rotates_only_for_lagging_requests():
  """Conceptual example under rotasched_strict: C (arrival 0.15, TTFT SLO 0.2, beta_F 0.5 -> VLT zero
  point 0.25) gets no rotation while its VLT is 0 (t = 0.2) and displaces the longest-running A once it
  lags (t = 0.3). Plain rotasched rotates at t = 0.2 already."""
  for policy, rotate_at in (("rotasched_strict", 3), ("rotasched", 2)):
    s, bm, clk = make(policy, dev=2, bs=8, proactive_swap_budget=1, max_num_batched_tokens=16,
                      ttft_slo=0.2)    # one 8-token block per request
    add(s, "A", 0.0, max_tokens=6)
    step(s, clk)                       # t=0   -> A
    add(s, "B", 0.05, max_tokens=6)
    step(s, clk)                       # t=0.1 -> B
    add(s, "C", 0.15, max_tokens=6)
    for k in (2, 3):
      p = step(s, clk)                 # t=0.2, then t=0.3
      if k < rotate_at:
        assert p.rotated_out == [] and p.admitted == [], (policy, k)
      elif k == rotate_at:
        assert p.rotated_out == ["A"] and p.admitted == ["C"], (policy, k, p)
    s.check_invariants()


@pytest.mark.parametrize("seed", range(10))
def test_sorted_queue_remove_many_in_any_order_or_refused_whole(seed):
  """remove_many takes any order of distinct queued requests (in queue order it scans only up to the last);
  one request that is not queued makes it raise KeyError and change nothing."""
  import random
  from superinfer_jax.sched.queue import SortedQueue
  rng = random.Random(seed)
  reqs = [Request(i, 1, 1, 0.0) for i in range(25)]
  q = SortedQueue()
  q.push_many(reqs, [(rng.choice([0.0, 1.0, rng.random()]),) for _ in reqs], [r.req_id for r in reqs])
  before = q.entries()
  pick = rng.sample(reqs, rng.randint(2, 12))
  pick.sort(key=lambda r: r._qentry)
  pick.append(pick.pop(0))  # the queue-first last: the others lie after pick[-1], so the whole-queue pass runs
  stranger = Request(99, 1, 1, 0.0)  # never queued
  bad = pick[:]
  bad.insert(rng.randrange(len(bad) + 1), stranger)
  with pytest.raises(KeyError):
    q.remove_many(bad)
  assert q.entries() == before and all(r._qentry is not None for r in pick)
  assert q.demand == sum(range(25)) and all(r.queued_demand == r.req_id for r in pick)
  q.remove_many(pick)
  assert q.entries() == [e for e in before if e[2] not in pick] and all(r._qentry is None for r in pick)
  assert q.demand == sum(range(25)) - sum(r.req_id for r in pick)


@pytest.mark.parametrize("seed", range(20))
def test_sorted_queue_batch_ops_equal_one_by_one(seed):
  """push_many orders by key, then push order; remove_many leaves the same entries as remove one at a time."""
  import random
  from superinfer_jax.sched.queue import SortedQueue
  rng = random.Random(seed)
  reqs_a = [Request(i, 1, 1, 0.0) for i in range(30)]
  reqs_b = [Request(i, 1, 1, 0.0) for i in range(30)]
  keys = [(rng.choice([0.0, 1.0, 2.0, rng.random()]),) for _ in range(30)]
  qa, qb = SortedQueue(), SortedQueue()
  qa.push_many(reqs_a, keys, [i % 4 for i in range(30)])
  for i, (r, k) in enumerate(zip(reqs_b, keys)):
    qb.push(r, k, i % 4)
  ids = lambda q: [(e[0], e[1], e[2].req_id) for e in q.entries()]
  assert ids(qa) == ids(qb)
  # independent reference: ascending key, equal keys in push order
  assert [e[2].req_id for e in qa.entries()] == sorted(range(30), key=lambda i: (keys[i], i))
  order = [e[2].req_id for e in qa.entries()]
  pick = sorted(rng.sample(range(30), rng.randint(1, 10)), key=order.index)
  if rng.random() < 0.5:
    pick = order[:len(pick)]  # the head: one slice deletion
  qa.remove_many([reqs_a[i] for i in pick])
  for i in pick:
    qb.remove(reqs_b[i])
  assert ids(qa) == ids(qb) and all(reqs_a[i]._qentry is None for i in pick)
  assert qa.demand == qb.demand == sum(e[2].req_id % 4 for e in qa.entries())
  with pytest.raises(KeyError):
    qa.remove_many([reqs_a[pick[0]]])  # no longer queued
  # A second batch with ascending keys: from the tail on (push_many's one-extend path) or starting below it.
  more_a = [Request(100 + i, 1, 1, 0.0) for i in range(10)]
  more_b = [Request(100 + i, 1, 1, 0.0) for i in range(10)]
  base = rng.choice([0.5, 2.0, 3.0])
  keys2 = sorted((base + rng.choice([0.0, 0.25]),) for _ in range(10))
  qa.push_many(more_a, keys2, [2] * 10)
  for r, k in zip(more_b, keys2):
    qb.push(r, k, 2)
  assert ids(qa) == ids(qb)
  assert all(r._qentry is e for r, e in zip(more_a, [e for e in qa.entries() if e[2].req_id >= 100]))


def test_stats_snapshot_counts_states_and_pools():
  s, bm, clk = make("rotasched")
  add(s, "a", 0.0, max_tokens=4)
  add(s, "b", 0.0, max_tokens=4)
  st = s.stats()
  assert (st.num_waiting, st.num_running, st.num_rotary) == (2, 0, 0)
  assert st.demand_blocks == s.demand_blocks > 0 and st.free_device_blocks == st.device_blocks
  p = s.schedule()
  st = s.stats()
  assert st.num_running == len(p.scheduled) and st.num_waiting == 2 - len(p.scheduled)
  assert st.free_device_blocks == bm.num_free_device_blocks < st.device_blocks
  assert st.totals["steps"] == 1 and st.totals is not s.totals
