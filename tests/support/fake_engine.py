"""A deterministic stand-in for ``LLMEngine`` behind the serving layer (tests of the app, the worker and
multi-host serving run without a model).

``FakeEngine`` takes token-id prompts only; every ``step()`` emits one token per live request (ids 1, 2,
... up to its ``max_tokens``, text ``" t<n>"``, timestamp = the step count; with ``params.logprobs = k`` a
``TokenLogprobs`` of logprob ``-n / 10`` and top ids ``n, n + 1, ...`` at ``-(n + j) / 10``), then finishes it
with ``"length"``; ``abort`` finishes it with ``"abort"`` at the next step. It keeps the attributes the serving
layer reads (``tokenizer``, ``max_model_len``, ``model_config.vocab_size``, ``stats``, ``scheduler_stats()``,
``check_invariants()``, ``replica.local_now``). ``fail_next = n`` makes the next n steps raise.
"""
from __future__ import annotations

import time
import types


class FakeEngine:
  """See the module docstring. One device block is counted per live request."""

  def __init__(self, clock=None):
    from superinfer_jax.engine.engine import EngineStats  # pylint: disable=import-outside-toplevel
    self.tokenizer = None
    self.max_model_len = 64
    self.model_config = types.SimpleNamespace(vocab_size=100)
    self.stats = EngineStats()
    self.free_device_blocks = 8
    self.replica = types.SimpleNamespace(local_now=clock or time.monotonic)
    self.live: dict = {}          # request id -> [max_tokens, tokens emitted]
    self.final: list = []         # outputs of aborted requests, returned by the next step()
    self.arrivals: dict = {}
    self.fail_next = 0

  def add_request(self, prompt, params, request_id, ttft_slo=None, tbt_slo=None, arrival_time=None):
    del prompt, ttft_slo, tbt_slo
    self.live[request_id] = [params.max_tokens, 0, params.logprobs]
    self.arrivals[request_id] = arrival_time
    self.free_device_blocks -= 1

  def abort(self, rid):
    from superinfer_jax.engine.config import RequestOutput  # pylint: disable=import-outside-toplevel
    if rid in self.live:
      del self.live[rid]
      self.free_device_blocks += 1
      self.final.append(RequestOutput(rid, [], "", [], finished=True, finish_reason="abort"))

  def scheduler_stats(self):
    from superinfer_jax.sched.protocol import SchedulerStats  # pylint: disable=import-outside-toplevel
    return SchedulerStats(num_waiting=0, num_running=len(self.live), num_rotary=0, demand_blocks=0,
                          device_blocks=8, free_device_blocks=self.free_device_blocks, host_blocks=0,
                          free_host_blocks=0, pending_writebacks=0, totals={})

  def check_invariants(self):
    assert self.free_device_blocks == 8 - len(self.live), (self.free_device_blocks, self.live)

  def has_unfinished(self):
    return bool(self.live or self.final)

  def get_request(self, rid):
    arrival = self.arrivals.get(rid)
    return types.SimpleNamespace(arrival_time=0.0 if arrival is None else arrival)

  def release(self, rid):
    pass

  def step(self):
    from superinfer_jax.engine.config import RequestOutput, TokenLogprobs  # pylint: disable=import-outside-toplevel
    self.stats.steps += 1
    if self.fail_next:
      self.fail_next -= 1
      raise RuntimeError("boom")
    outs, self.final = self.final, []
    for rid, st in list(self.live.items()):
      st[1] += 1
      done = st[1] >= st[0]
      n, k = st[1], st[2]
      lps = None if k is None else [TokenLogprobs(-n / 10, [(n + j, -(n + j) / 10) for j in range(k)])]
      outs.append(RequestOutput(rid, [n], f" t{n}", [float(self.stats.steps)], finished=done,
                                finish_reason="length" if done else None, logprobs=lps))
      if done:
        del self.live[rid]
        self.free_device_blocks += 1
    return outs
