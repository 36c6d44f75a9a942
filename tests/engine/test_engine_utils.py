"""Test doubles and helpers for the engine tests: a tiny random model and a minimal FCFS scheduler.

``FakeScheduler`` implements ``sched.protocol.SchedulerProtocol`` (``add_request``, ``abort``,
``schedule(lookahead)``, ``on_step_done`` (the length stop decided there), ``pop_finished``,
``has_unfinished``; plans are ``StepPlan``s)
with FCFS admission, chunked prefill and recompute preemption only — no rotation. It lets the engine loop
be tested independently of ``superinfer_jax.sched.Scheduler``.
"""
import collections

import jax
import numpy as np

from superinfer_jax.model.config import ModelConfig
from superinfer_jax.sched.plan import ScheduledSeq, StepPlan


def tiny_config(vocab=128, layers=2, hidden=64, heads=4, kv_heads=2, max_pos=256, eos=()):
  return ModelConfig(family="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                     max_position_embeddings=max_pos, rope_theta=10000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, eos_token_ids=tuple(eos), name="tiny-test")


def random_params(cfg, seed=0, scale=0.5):
  """Random params with the model package's layout (``superinfer_jax.model.params.param_shapes``)."""
  from superinfer_jax.model.params import param_shapes
  shapes = param_shapes(cfg)
  rng = np.random.default_rng(seed)

  def make(shape):
    if len(shape) >= 2 and shape[-1] != shape[-2] or len(shape) >= 2:
      fan_in = shape[-2]
      return (rng.standard_normal(shape) * scale / np.sqrt(fan_in)).astype(np.float32)
    return np.ones(shape, np.float32)

  def build(tree):
    if isinstance(tree, dict):
      return {k: build(v) for k, v in tree.items()}
    shape = tuple(tree)
    if len(shape) == 1 or (len(shape) == 2 and shape[0] == cfg.num_layers and shape[1] == cfg.hidden_size):
      return np.ones(shape, np.float32)   # norms
    if shape == (cfg.vocab_size, cfg.hidden_size):
      return (rng.standard_normal(shape) * 1.0).astype(np.float32)
    return make(shape)

  return jax.device_put(build(shapes))


class _R:
  def __init__(self, request_id, prompt_len, max_tokens):
    self.id = request_id
    self.num_tokens = prompt_len   # known tokens (prompt + generated)
    self.max_total = prompt_len + max_tokens
    self.num_computed = 0
    self.pending = False           # a sampled token is in flight


class FakeScheduler:
  """FCFS + chunked prefill + recompute preemption (no rotation), with lookahead."""

  def __init__(self, config, block_manager, clock):
    self.bm = block_manager
    self.clock = clock
    self.step_id = 0
    self.budget = config.max_num_batched_tokens
    self.max_seqs = config.max_num_seqs
    self.waiting = collections.deque()
    self.running = []
    self.reqs = {}
    self.num_preempted = 0

  def add_request(self, req):
    r = _R(req.req_id, req.prompt_len, req.max_tokens)
    self.reqs[r.id] = r
    self.waiting.append(r)

  def abort(self, req_id):
    r = self.reqs.pop(req_id, None)
    if r is None:
      return
    if r in self.running:
      self.running.remove(r)
    if r in self.waiting:
      self.waiting.remove(r)
    self.bm.free(req_id)

  def _target(self, r, lookahead):
    return r.num_tokens + (1 if (lookahead and r.pending) else 0)

  def schedule(self, lookahead=False):
    budget = self.budget
    plan = StepPlan(step_id=self.step_id, time=self.clock.now(), lookahead=lookahead)
    self.step_id += 1
    scheduled = []
    i = 0
    while i < len(self.running) and budget > 0:
      r = self.running[i]
      n = min(self._target(r, lookahead) - r.num_computed, budget)
      if n <= 0:
        i += 1
        continue
      ok = True
      while not self.bm.append_slots(r.id, n):
        victim = self.running.pop()
        self.bm.free(victim.id)
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        plan.preempted.append(victim.id)
        self.num_preempted += 1
        if victim is r:
          ok = False
          break
      if not ok:
        break
      scheduled.append((r, n))
      budget -= n
      i += 1
    while self.waiting and budget > 0 and len(self.running) < self.max_seqs and not plan.preempted:
      r = self.waiting[0]
      n = min(self._target(r, lookahead) - r.num_computed, budget)
      if not self.bm.append_slots(r.id, n):
        break
      self.waiting.popleft()
      self.running.append(r)
      scheduled.append((r, n))
      budget -= n
    for r, n in scheduled:
      target = self._target(r, lookahead)
      plan.scheduled.append(ScheduledSeq(r.id, n, r.num_computed, self.bm.block_table(r.id),
                                         r.num_computed + n >= target))
      r.num_computed += n
      self.bm.mark_computed(r.id, r.num_computed)
      if r.num_computed >= self._target(r, lookahead):
        r.pending = True
    return plan

  def pop_finished(self):
    return []

  def has_unfinished(self):
    return bool(self.reqs)

  def on_step_done(self, plan, new_tokens, finished, now):
    """Returns ``{req_id: reason}``: "length" at ``max_tokens`` (decided here), else the engine's reason."""
    done = {}
    for rid, _ in new_tokens.items():
      r = self.reqs.get(rid)
      if r is not None:
        r.num_tokens += 1
        if r.num_tokens >= r.max_total:
          done[rid] = "length"
    for rid, reason in finished.items():
      if rid in self.reqs:
        done.setdefault(rid, reason)
    for rid in done:
      self.abort(rid)
    # A request whose token arrived is no longer pending unless the plan it is in (lookahead) expects more.
    for rid in new_tokens:
      r = self.reqs.get(rid)
      if r is not None:
        r.pending = r.num_computed >= r.num_tokens
    return done


class TickClock:
  """A clock that advances ``dt`` seconds per read: deterministic time for VLT-driven policies."""

  def __init__(self, dt=0.01):
    self.t, self.dt = 0.0, dt

  def now(self):
    self.t += self.dt
    return self.t


def pressure_config(block_size=4, max_pos=128, **kw):
  """An ``EngineConfig`` for the tiny model under KV pressure: small pools and budgets, bucket floors at their
  maxima, SLOs in tens of milliseconds (a ``TickClock`` makes the VLT policies rotate deterministically);
  ``kw`` overrides any setting."""
  from superinfer_jax.engine.config import EngineConfig  # pylint: disable=import-outside-toplevel
  base = dict(num_device_blocks=64, num_host_blocks=256, block_size=block_size, policy="fcfs",
              max_num_batched_tokens=32, max_num_seqs=8, token_bucket_floor=32, seq_bucket_floor=8,
              blocks_bucket_floor=max_pos // block_size, ttft_slo=0.05, tbt_slo=0.02, proactive_swap_budget=8,
              rotation_min_bucket=8)
  base.update(kw)
  return EngineConfig.create(**base)
