"""Where alpha, beta_F and beta_B change a decision: hand-worked cases (issue 35, item 2).

Scenario (2 device blocks, block size 8: every request needs one block; B_xfer = 1 block, so Algorithm 1's
B_left = B_HBM + B_xfer = 1 lets one candidate per step displace a running request; steps of 0.1 s;
TTFT SLO 0.5 s, TBT SLO 0.1 s):
  t=0    A, B, C arrive; A and B fill the pool.
  t=0.1  C (VLT > 0) displaces A, the longest-running (A's last token came at 0.1).
  t=0.2  rotary A (lag 0.1 s: VLT = alpha * ReLU(0.1 - beta_B * 0.1)) and waiting D (arrived 0.15: VLT =
         ReLU(0.05 - beta_F * 0.5)) compete for the one slot B's rotation frees.
The literal Algorithm 1 (``rotasched``) orders the candidates by VLT, so the weights decide *who* is
admitted; the ReLU makes every candidate urgent, so they never decide *whether* a running request rotates
out. ``rotasched_strict`` (urgent only past the VLT zero point) lets beta_F / beta_B decide that too; alpha
only scales a lag and never changes its sign, so it acts through the order alone under both readings.
"""
import pytest

from superinfer_jax.sched import RequestState
from test_sched import add, make, step

BASE = dict(dev=2, bs=8, proactive_swap_budget=1, max_num_batched_tokens=32, ttft_slo=0.5, tbt_slo=0.1,
            alpha=3.0, beta_f=0.0, beta_b=0.0)


def _to_t02(policy, with_d=True, **knobs):
  """Runs the scenario to t=0.2; returns (plan at t=0.1, plan at t=0.2, scheduler)."""
  s, bm, clk = make(policy, **{**BASE, **knobs})
  for rid in "ABC":
    add(s, rid, 0.0, max_tokens=6)
  p0 = step(s, clk)
  assert p0.admitted == ["A", "B"]
  p1 = step(s, clk)                    # t=0.1
  if with_d:
    add(s, "D", 0.15, max_tokens=6)
  p2 = step(s, clk)                    # t=0.2
  return p1, p2, s


@pytest.mark.parametrize("policy", ["rotasched", "rotasched_strict"])
@pytest.mark.parametrize("knobs,winner", [
    # alpha: A's VLT 3 x 0.1 = 0.3 beats D's 0.05; at alpha 0.25 it is 0.025 and D wins.
    (dict(alpha=3.0), "A"), (dict(alpha=0.25), "D"),
    # beta_F (alpha 0.25): D's grace 0.15 x 0.5 = 0.075 s leaves it at lag -0.025 < A's 0.025.
    (dict(alpha=0.25, beta_f=0.0), "D"), (dict(alpha=0.25, beta_f=0.15), "A"),
    # beta_B (alpha 3): A's grace 2.5 x 0.1 = 0.25 s leaves it at lag -0.15 (x 3 = -0.45) < D's 0.05.
    (dict(beta_b=0.0), "A"), (dict(beta_b=2.5), "D"),
])
def test_each_weight_flips_who_is_admitted(policy, knobs, winner):
  p1, p2, s = _to_t02(policy, **knobs)
  assert p1.rotated_out == ["A"] and p1.admitted == ["C"]
  assert p2.rotated_out == ["B"]       # the longest-running makes room, whoever wins
  if winner == "A":
    assert p2.rotated_in == ["A"] and p2.admitted == []
    assert s.get("D").state is RequestState.WAITING
  else:
    assert p2.admitted == ["D"] and p2.rotated_in == []
    assert s.get("A").state is RequestState.ROTARY


@pytest.mark.parametrize("beta_f,rotates", [(0.0, True), (0.3, False)])
def test_beta_f_decides_whether_a_waiting_request_displaces_a_running_one(beta_f, rotates):
  """At t=0.1 C has waited 0.1 s; with beta_F 0.3 its zero point is 0.15 s: strict keeps A and B running,
  the literal algorithm rotates A out either way."""
  s, bm, clk = make("rotasched_strict", **{**BASE, "beta_f": beta_f})
  for rid in "ABC":
    add(s, rid, 0.0, max_tokens=6)
  step(s, clk)
  p1 = step(s, clk)
  assert (p1.rotated_out, p1.admitted) == ((["A"], ["C"]) if rotates else ([], []))
  lit, _, _ = _to_t02("rotasched", with_d=False, beta_f=beta_f)
  assert lit.rotated_out == ["A"] and lit.admitted == ["C"]


@pytest.mark.parametrize("beta_b,resumes", [(0.0, True), (2.0, False)])
def test_beta_b_decides_whether_a_rotary_request_displaces_a_running_one(beta_b, resumes):
  """At t=0.2 A has been parked since its last token at 0.1; beta_B 2 gives it 0.2 s of grace: strict
  keeps it rotary (and B running); with beta_B 0 it displaces B. The literal algorithm resumes it either
  way."""
  _, p2, s = _to_t02("rotasched_strict", with_d=False, beta_b=beta_b)
  if resumes:
    assert p2.rotated_in == ["A"] and p2.rotated_out == ["B"]
  else:
    assert p2.rotated_in == [] and p2.rotated_out == [] and s.get("A").state is RequestState.ROTARY
  _, lit, _ = _to_t02("rotasched", with_d=False, beta_b=beta_b)
  assert lit.rotated_in == ["A"] and lit.rotated_out == ["B"]
