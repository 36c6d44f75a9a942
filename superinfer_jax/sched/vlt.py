"""Virtual Lag Time (docs/paper.md §1.2, Algorithm 1's scheduling currency).

    VLT(r) = alpha * ReLU(now - t_last - beta_b * S_B)   r rotary   (t_last: its last token's time)
             ReLU(now - t_arr - beta_f * S_F)            r waiting / preempted (t_arr: arrival time)
             -(now - t_run)                              r running  (t_run: when it (re)entered running)

S_F is the request's TTFT SLO and S_B its TBT SLO (docs/paper.md §1.2 [G]). Seconds. Invariants: VLT >= 0 for
waiting/rotary requests, VLT <= 0 for running ones. Within one state the order by VLT does not change over
time (it is the order of t_arr, t_last, t_run), which the scheduler exploits to keep its queues sorted
instead of re-sorting every step.
"""
from __future__ import annotations

from superinfer_jax.sched.request import Request, RequestState


def rotary_ref_time(r: Request) -> float:
  """t_last of a rotary request (its last token; the rotation time if it never emitted one)."""
  return r.last_token_time if r.last_token_time is not None else r.state_time


def vlt(r: Request, now: float, *, alpha: float, beta_b: float, beta_f: float,
        ttft_slo: float, tbt_slo: float) -> float:
  """VLT of ``r`` at ``now``; per-request SLOs override the given defaults."""
  s = r.state
  if s is RequestState.RUNNING:
    return -(now - r.state_time)
  if s is RequestState.ROTARY:
    sb = r.tbt_slo if r.tbt_slo is not None else tbt_slo
    x = now - rotary_ref_time(r) - beta_b * sb
    return alpha * x if x > 0 else 0.0
  if s in (RequestState.WAITING, RequestState.PREEMPTED):
    sf = r.ttft_slo if r.ttft_slo is not None else ttft_slo
    x = now - r.arrival_time - beta_f * sf
    return x if x > 0 else 0.0
  raise ValueError(f"VLT undefined for a {s.value} request")
