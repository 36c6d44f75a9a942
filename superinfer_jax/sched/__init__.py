"""RotaSched and baseline policies: request lifecycle, VLT, step plans, lookahead. Pure Python (no JAX).

See ``scheduler.py`` for the API, ``policies/`` for the policies, ``plan.py`` for ``StepPlan``.
"""
from superinfer_jax.sched.clock import VirtualClock, WallClock
from superinfer_jax.sched.plan import ScheduledSeq, StepPlan
from superinfer_jax.sched.policies import POLICIES, Policy, make_policy
from superinfer_jax.sched.request import Request, RequestState
from superinfer_jax.sched.scheduler import Scheduler, SchedulerConfig
from superinfer_jax.sched.vlt import vlt

__all__ = ["POLICIES", "Policy", "Request", "RequestState", "ScheduledSeq", "Scheduler", "SchedulerConfig",
           "StepPlan", "VirtualClock", "WallClock", "make_policy", "vlt"]
