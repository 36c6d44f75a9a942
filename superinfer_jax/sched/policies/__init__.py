"""Scheduling policies: one scheduler core (``scheduler.py``), pluggable step logic.

Modules: ``base.py`` (the ``Policy`` interface), ``static.py`` (fcfs, fcfs_swap, sf, wf), ``rotation.py``
(Algorithm 1: rotasched, rotasched_strict, edf), ``reference_code.py`` (rotasched_code), ``lvf.py`` (the
queue merges). This package holds the registry ``POLICIES`` and ``make_policy``.

* ``fcfs``: vLLM v1 default (docs/paper.md §3). Arrival order; when a running request cannot grow, the
  last-admitted running request is preempted by **recompute** and re-queued at the **head** of waiting; no
  admission in a step that preempted; head-of-line blocking. No rotation.
* ``fcfs_swap``: vLLM v1 with swap preemption. As fcfs, but the reactive victim is **swapped** to host
  (recompute if mid-prefill or the host is full) and re-queued at the head, as fcfs re-queues its recompute
  victims: the most recently evicted request resumes first (LIFO), before any new one. No proactive rotation.
* ``wf``: Waiting-First (docs/paper.md §3, the paper's "WF" of Fig. 1): a static priority, waiting > running >
  rotary, with no lag rule and no B_xfer. Waiting requests are admitted in arrival order, and running ones
  rotate out (latest arrival first) to make room; rotary requests resume only when no request waits.
* ``sf``: Swapped-First (docs/paper.md §3), vLLM v0's swap policy: no proactive rotation; the reactive victim is
  swapped to host; in a step without evictions, swapped requests resume oldest-swap first (FIFO), and new
  requests are admitted only while no request is swapped out. It protects TBT and degenerates to about FCFS.
* ``rotasched``: the paper's Algorithm 1 (docs/paper.md §2.1) with VLT (alpha, beta_B, beta_F, S_F = TTFT SLO,
  S_B = TBT SLO).
* ``rotasched_code``: the reference code's behaviour (docs/paper.md §2.2): oldest ``in_waiting_since`` first, keep
  B blocks free by rotating out longest-running decode requests (victims go to the tail of the one
  waiting order, and the admission loop may swap them straight back in within the step, as the fork's
  does), host-usage gates 0.95 (swap-out) / 0.9 (only WAITING requests, not PREEMPTED ones), recompute on
  the reactive path, swap-in not bounded by B.
* ``edf`` (beyond the paper): earliest SLO deadline first (waiting: t_arr + TTFT SLO; rotary: t_last + TBT
  SLO) inside Algorithm 1; only candidates already past their deadline may displace running requests, the
  others use free memory only. A deadline-driven baseline to set against VLT's weighted lag.

Algorithm 1 as implemented (``RotationPolicy.schedule_step`` = ``prioritize`` -> ``pick_victims`` ->
``execute``, or ``schedule_without_rotation``), per step at time ``now``:
  0. ``B_HBM`` = free device blocks minus the blocks running requests need for this step's tokens.
  1. Contention check: if ``B_HBM >= sum(blk(r) for r in waiting + rotary)`` (kept incrementally, O(1)): no
     rotation; schedule running, then admit candidates in policy order (no contention: all fit).
  2. Otherwise scan candidates (waiting + rotary, merged lazily in priority order; at most
     ``lvf_scan_limit``, stopping after ``lvf_max_skips`` consecutive misfits or when B_left is spent) and
     build R: ``r`` joins if it is *urgent* (VLT >= 0, which ReLU makes true for every
     waiting/rotary request; for edf: deadline passed) and ``blk(r) <= B_left`` (``B_left = B_HBM + B_xfer``
     for urgent candidates, ``B_HBM`` left for non-urgent ones), its swap-in fits the B_xfer in-budget, and
     tokens and seats remain. ``blk(r) = ceil(planned_tokens / block_size)``.
  3. ``B_swap = sum(blk(R)) - B_HBM`` and ``seats = |R| - free seats``; scan running requests from the tail of
     L (longest-running, i.e. smallest VLT, first): while ``B_swap > 0`` or ``seats > 0``, take ``r`` if its
     VLT < 0 (it has run for a positive time), it is in decode phase (never mid-prefill) and its D2H copies
     fit the B_xfer out-budget.
  4. Rotate out P, schedule running requests (reactive eviction = rotation if allowed, else recompute),
     then admit R in order, skipping those that do not fit. A victim the host pool cannot take stays running
     unless ``proactive_recompute`` is set (then it is preempted by recompute). Either way, when memory
     really runs out (a running request cannot grow) the reactive path falls back to recompute.
Queues stay sorted by time-invariant keys (VLT order within a state never changes), so a step costs
O(running + |R| + blocks rotated + log N), not a sort of all N requests.

Reading of the paper's conceptual example (docs/paper.md §2.1, [S]): "the longest-running request rotates out once
a waiting request's positive VLT exceeds its |VLT|". With the §1.2 formula a crossing test cannot be what
Algorithm 1 does: a waiting request's VLT and a running request's |VLT| both grow at rate 1, so a waiting
request could never displace one that started running before it arrived + beta_F * S_F. We implement
Algorithm 1 as written (a waiting/rotary request has VLT >= 0 thanks to ReLU and so outranks every running
request, whose VLT < 0 once it has run for any time); the victim is the tail of L, i.e. the longest-running
request, and a request that entered RUNNING this instant (VLT = 0) is never a victim. Under contention this
rotates up to B_xfer blocks per step (the paper's "(H)" ablation, TBT collapse without DuplexKV, is
consistent with that). ``tests/sched/test_sched.py::test_conceptual_example_longest_running_rotates_out`` works
the example through.
"""
from __future__ import annotations

from superinfer_jax.sched.policies.base import Policy
from superinfer_jax.sched.policies.lvf import _lvf_merge, _lvf_merge_pairwise  # noqa: F401 (tests read them)
from superinfer_jax.sched.policies.reference_code import RotaSchedCode
from superinfer_jax.sched.policies.rotation import EDF, RotaSched, RotaSchedStrict, RotationPolicy
from superinfer_jax.sched.policies.static import FCFS, FCFSSwap, SwappedFirst, WaitingFirst

__all__ = ["EDF", "FCFS", "FCFSSwap", "POLICIES", "Policy", "RotaSched", "RotaSchedCode", "RotaSchedStrict",
           "RotationPolicy", "SwappedFirst", "WaitingFirst", "make_policy"]

POLICIES = {p.name: p for p in (FCFS, FCFSSwap, WaitingFirst, SwappedFirst, RotaSched, RotaSchedStrict,
                                 RotaSchedCode, EDF)}


def make_policy(name: str) -> Policy:
  try:
    return POLICIES[name]()
  except KeyError:
    raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
