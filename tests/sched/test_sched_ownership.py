"""One writer per piece of scheduler state, enforced while the real code runs.

* A ``Request``'s fields are written only by ``sched/request.py`` (its constructor and transitions), and its
  queue handle also by ``sched/queue.py`` (``request.FIELD_WRITERS``).
* A ``Scheduler``'s attributes are written only by ``sched/scheduler.py``; a ``StepBuilder``'s only by
  ``sched/step.py``; a ``StepPlan``'s only by ``sched/step.py`` (the step being built) and ``sched/plan.py``
  (its constructor): no policy writes a plan field.
* Nothing per-step survives on the scheduler: its attributes are the same before and after a step, and none
  holds the step.

The guards replace ``__setattr__`` for the duration of a test and refuse a write whose calling frame belongs
to another module; every policy runs every replay scenario, and the engine runs on its fake runner, under them.
"""
import sys

import pytest

from superinfer_jax.engine import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from superinfer_jax.engine.fake_runner import FakeModelConfig, FakeRunner
from superinfer_jax.model.batch import bucket
from superinfer_jax.sched import POLICIES, Request, RequestState, Scheduler, StepPlan, VirtualClock, replay
from superinfer_jax.sched import request as request_mod
from superinfer_jax.sched.policies.static import FCFS
from superinfer_jax.sched.step import StepBuilder


def _guard(cls, owner_of, monkeypatch):
  """Makes ``cls``'s attributes writable only from the module ``owner_of(name)`` names (a set of modules)."""
  def guarded_setattr(self, name, value):
    caller = sys._getframe(1).f_globals.get("__name__")
    if caller not in owner_of(name):
      raise AttributeError(f"{cls.__name__}.{name} written from {caller}, owned by {sorted(owner_of(name))}")
    object.__setattr__(self, name, value)
  monkeypatch.setattr(cls, "__setattr__", guarded_setattr)


@pytest.fixture
def owned(monkeypatch):
  request_owner = {request_mod.__name__}
  _guard(Request, lambda name: request_owner | ({request_mod.FIELD_WRITERS[name]}
                                                if name in request_mod.FIELD_WRITERS else set()), monkeypatch)
  _guard(Scheduler, lambda name: {"superinfer_jax.sched.scheduler"}, monkeypatch)
  _guard(StepBuilder, lambda name: {"superinfer_jax.sched.step"}, monkeypatch)
  _guard(StepPlan, lambda name: {"superinfer_jax.sched.step", "superinfer_jax.sched.plan"}, monkeypatch)


def test_the_guards_refuse_a_write_from_elsewhere(owned):
  r = Request("a", 4, 4, 0.0)
  with pytest.raises(AttributeError, match="Request.state written from"):
    r.state = RequestState.RUNNING
  with pytest.raises(AttributeError, match="Request._qentry written from"):
    r._qentry = None
  with pytest.raises(AttributeError, match="StepPlan.contention written from"):
    StepPlan(step_id=0, time=0.0).contention = True


def test_a_policy_that_writes_a_plan_field_is_refused(owned):
  class Sneaky(FCFS):
    def schedule_step(self, step):
      step._plan.contention = True  # pylint: disable=protected-access

  rp = replay.Replay("fcfs", replay.SCENARIOS["small_host"], policy_obj=Sneaky())
  with pytest.raises(AttributeError, match="StepPlan.contention written from " + __name__):
    rp.schedule()


@pytest.mark.parametrize("scenario", sorted(replay.SCENARIOS))
def test_every_policy_keeps_to_the_writers(owned, scenario):
  sc = replay.SCENARIOS[scenario]
  for policy in sorted(POLICIES):
    rp = replay.Replay(policy, sc)
    attrs = set(vars(rp.sched))
    for _ in range(40 if scenario == "bench_1k" else 120):
      plan = rp.schedule()
      assert set(vars(rp.sched)) == attrs, policy  # nothing per-step was left on the scheduler
      assert not any(isinstance(v, StepBuilder) or v is plan for v in vars(rp.sched).values()), policy
      rp.complete(plan)
    rp.sched.check_invariants()
    assert rp.sched.totals["steps"] > 0


@pytest.mark.parametrize("policy", ["rotasched", "fcfs", "fcfs_swap", "rotasched_code"])
def test_the_engine_keeps_to_the_writers(owned, policy):
  cfg = EngineConfig.create(num_device_blocks=14, num_host_blocks=64, block_size=4, max_num_seqs=6,
                            max_num_batched_tokens=24, policy=policy, ttft_slo=0.5, tbt_slo=0.2)
  clock = VirtualClock()
  runner = FakeRunner(num_device_blocks=cfg.num_device_blocks, num_host_blocks=cfg.num_host_blocks,
                      block_size=cfg.block_size, out_rows=bucket(cfg.scheduler.max_num_seqs, cfg.seq_bucket_floor),
                      model_config=FakeModelConfig(vocab_size=1000), clock=clock)
  eng = LLMEngine.with_runner(runner, cfg, clock=clock)
  prompts = [[(7 * i + j) % 997 + 1 for j in range(3 + 2 * i)] for i in range(8)]
  outs = eng.generate(prompts, [SamplingParams(max_tokens=6 + i, ignore_eos=True) for i in range(8)])
  assert [len(o.token_ids) for o in outs] == [6 + i for i in range(8)]
  eng.check_invariants()
