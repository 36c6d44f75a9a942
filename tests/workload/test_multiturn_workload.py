"""The multi-turn ShareGPT workload (issue 49 item 8): prompts through the chat template, the closed-loop
arrival of later turns (ArrivalQueue, the real-engine replay with a fake engine, the simulator), the
``--dataset`` choice, and the workload's own prefix reuse bound, hand-worked."""
import dataclasses
import types

import pytest

from superinfer_jax.model.chat_template import encode_rendered, render_chat
from superinfer_jax.sweep import SweepSpec
from superinfer_jax.workload import (ArrivalQueue, MULTITURN_DATASET, Conversation, MultiturnInfo,
                                     build_multiturn_workload, dataset_pairs, load_dataset, make_workload,
                                     prefix_reuse_bound, sharegpt_conversations, with_conversation_starts)
from superinfer_jax.workload import multiturn
from superinfer_jax.workload.types import RequestSpec, Workload


@pytest.fixture(scope="module")
def tok():
  from superinfer_jax.model import load_tokenizer
  return load_tokenizer("smollm2-135m")


CONVS = [
    Conversation("a", (("Hi there", "Hello! How can I help?"), ("Tell me a joke", "Why did the chicken cross?"),
                       ("Another", "No."))),
    Conversation("b", (("What is 2+2?", "4"), ("And 3+3?", "6"))),
    Conversation("c", (("Only one turn", "ok"),)),
]


# ---- RequestSpec / Workload -------------------------------------------------------------------------------

def test_request_spec_closed_loop_fields_are_validated():
  assert RequestSpec("a", "", 3, 2).after_request_id is None   # every existing workload: unchanged
  RequestSpec("b", "", 3, 2, after_request_id="a", think_time_s=0.5)
  with pytest.raises(ValueError, match="needs an after_request_id"):
    RequestSpec("b", "", 3, 2, think_time_s=0.5)
  with pytest.raises(ValueError, match="think_time_s"):
    RequestSpec("b", "", 3, 2, after_request_id="a", think_time_s=-1.0)
  with pytest.raises(ValueError, match="after itself"):
    RequestSpec("b", "", 3, 2, after_request_id="b")
  with pytest.raises(ValueError, match="listed before"):
    Workload([RequestSpec("b", "", 3, 2, after_request_id="a"), RequestSpec("a", "", 3, 2)])
  w = Workload([RequestSpec("a", "", 3, 2), RequestSpec("b", "", 3, 2, after_request_id="a", think_time_s=1.5)])
  assert w.closed_loop and not Workload([RequestSpec("a", "", 3, 2)]).closed_loop
  back = RequestSpec.from_json_dict(w[1].to_json_dict())
  assert back == w[1]


# ---- conversations and prompts ----------------------------------------------------------------------------

def test_exchanges_are_strict_human_gpt_pairs():
  t = lambda who, text: {"from": who, "value": text}  # noqa: E731
  assert multiturn.exchanges_of([t("gpt", "lead"), t("human", "u1"), t("gpt", "a1"), t("human", "u2"),
                                 t("gpt", "a2"), t("human", "dangling")]) == [("u1", "a1"), ("u2", "a2")]
  assert multiturn.exchanges_of([t("human", "u1"), t("gpt", "a1"), t("human", "u2"), t("human", "u3"),
                                 t("gpt", "a3")]) == [("u1", "a1")]          # alternation broken: stop
  assert multiturn.exchanges_of([t("human", "u1"), t("gpt", " "), t("human", "u2")]) == []   # empty answer


def test_turn_prompts_are_the_chat_template_of_the_recorded_conversation(tok):
  info = MultiturnInfo()
  w = build_multiturn_workload(CONVS, tok, shuffle=False, think_time_s=0.75, info=info)
  assert [r.request_id for r in w] == ["c0-t1", "c0-t2", "c0-t3", "c1-t1", "c1-t2"]
  assert [r.after_request_id for r in w] == [None, "c0-t1", "c0-t2", None, "c1-t1"]
  assert [r.think_time_s for r in w] == [0.0, 0.75, 0.75, 0.0, 0.75]
  assert info.conversations_kept == 2 and info.conversations_too_short == 1 and info.turns_kept == 5
  conv = CONVS[0]
  msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
          {"role": "user", "content": "Tell me a joke"}]
  r = w[1]
  assert r.prompt == render_chat(tok, msgs)                     # the server's renderer, recorded answer 1
  assert list(r.prompt_token_ids) == encode_rendered(tok, r.prompt) and r.prompt_len == len(r.prompt_token_ids)
  assert r.prompt.endswith("<|im_start|>assistant\n")          # with the generation prompt
  assert r.output_len == len(tok.encode(conv.exchanges[1][1]))  # the recorded answer's token count
  assert r.source == "a#t2"
  # Under SmolLM2's template turn k's prompt is an exact token prefix of turn k+1's.
  for prev, nxt in ((w[0], w[1]), (w[1], w[2]), (w[3], w[4])):
    assert nxt.prompt_token_ids[:prev.prompt_len] == prev.prompt_token_ids


def test_context_rule_stops_a_conversation_at_its_first_turn_that_does_not_fit(tok):
  full = build_multiturn_workload(CONVS[:1], tok, shuffle=False)
  lens = [r.prompt_len + r.output_len for r in full]
  info = MultiturnInfo()
  w = build_multiturn_workload(CONVS[:1], tok, shuffle=False, max_total_len=lens[2] - 1, info=info)
  assert len(w) == 2 and info.stopped_by_context == 1
  info = MultiturnInfo()
  w = build_multiturn_workload(CONVS[:1], tok, shuffle=False, max_total_len=lens[1] - 1, info=info)
  assert len(w) == 0 and info.conversations_too_short == 1           # one turn left < min_turns = 2
  w = build_multiturn_workload(CONVS[:1], tok, shuffle=False, max_turns=2, max_output_len=3)
  assert len(w) == 2 and all(r.output_len <= 3 for r in w)
  with pytest.raises(ValueError):
    build_multiturn_workload(CONVS, tok, min_turns=3, max_turns=2)


def test_exponential_think_times_are_seeded(tok):
  a = build_multiturn_workload(CONVS, tok, think_time_dist="exponential", think_time_s=2.0, seed=5)
  b = build_multiturn_workload(CONVS, tok, think_time_dist="exponential", think_time_s=2.0, seed=5)
  assert [r.think_time_s for r in a] == [r.think_time_s for r in b]
  assert len({r.think_time_s for r in a if r.after_request_id}) == 3


def test_conversation_starts_go_to_first_turns_and_later_turns_inherit_them(tok):
  w = with_conversation_starts(build_multiturn_workload(CONVS, tok, shuffle=False), [1.0, 4.0])
  assert [r.arrival_s for r in w] == [1.0, 1.0, 1.0, 4.0, 4.0]
  with pytest.raises(ValueError):
    with_conversation_starts(w, [1.0])


# ---- the dataset choice -----------------------------------------------------------------------------------

def test_sharegpt_multiturn_is_a_dataset_choice(tok):
  spec = SweepSpec(dataset=MULTITURN_DATASET, num_requests=3, max_turns=2, think_time_s=0.5)
  w = spec.make_workload(tok, 2.0, max_total_len=2048, vocab_size=tok.vocab_size)
  roots = [r for r in w if r.after_request_id is None]
  assert w.closed_loop and len(roots) == 3 and len(w) == 6
  assert all(r.think_time_s == 0.5 for r in w if r.after_request_id)
  assert roots[0].arrival_s == 0.0 and roots[1].arrival_s > 0     # conversations start at --rps
  again = make_workload(MULTITURN_DATASET, tok, num_requests=3, rps=2.0, max_total_len=2048, max_turns=2,
                        think_time_s=0.5)
  assert [r.to_json_dict() for r in again] == [r.to_json_dict() for r in w]   # deterministic
  with pytest.raises(ValueError, match="closed-loop"):
    dataset_pairs(MULTITURN_DATASET)
  with pytest.raises(ValueError, match="min_prompt_len"):
    load_dataset(MULTITURN_DATASET, tok, num_requests=1, min_output_len=5)
  with pytest.raises(ValueError):
    SweepSpec(dataset=MULTITURN_DATASET, max_turns=0)
  assert multiturn.THINK_TIME_DISTS == ("fixed", "exponential")


def test_the_packaged_conversations_are_multi_turn():
  convs = []
  for c in sharegpt_conversations():
    convs.append(c)
    if len(convs) == 50:
      break
  assert len(convs) == 50 and all(len(c.exchanges) >= 2 for c in convs)


def test_default_workload_prompts_are_exact_token_prefixes_and_the_bound_counts_them(tok):
  w = make_workload(MULTITURN_DATASET, tok, num_requests=24, rps=1.0, max_total_len=8192)
  by_id = {r.request_id: r for r in w}
  pairs = [(by_id[r.after_request_id], r) for r in w if r.after_request_id]
  assert pairs
  assert all(n.prompt_token_ids[:p.prompt_len] == p.prompt_token_ids for p, n in pairs)
  bound = prefix_reuse_bound(w, 16)
  # Every later turn hits at least the full blocks of its predecessor's prompt that end before its own
  # last token; the shared system prompt adds (at most) one block per conversation after the first.
  lower = sum(p.prompt_len // 16 for p, n in pairs)
  assert lower <= bound["hit_blocks"] <= lower + 24 * 4
  print("bound", bound)


# ---- the closed-loop arrival ------------------------------------------------------------------------------

def test_arrival_queue_releases_a_turn_think_time_after_its_predecessor_finishes():
  reqs = [RequestSpec("a1", "", 3, 2, arrival_s=0.0), RequestSpec("b1", "", 3, 2, arrival_s=0.5),
          RequestSpec("a2", "", 3, 2, arrival_s=0.0, after_request_id="a1", think_time_s=1.0),
          RequestSpec("a3", "", 3, 2, arrival_s=0.0, after_request_id="a2", think_time_s=1.0)]
  q = ArrivalQueue(reqs)
  assert len(q) == 4 and [(s.request_id, t) for s, t in q.due(0.2)] == [("a1", 0.0)]
  assert [s.request_id for s, _ in q.due(100.0)] == ["b1"]     # a2 waits for a1's finish, however late
  assert q.next_due_s() is None
  q.finished("a1", 3.0)
  assert q.next_due_s() == 4.0 and q.due(3.9) == []
  assert [(s.request_id, t) for s, t in q.due(4.0)] == [("a2", 4.0)]
  assert [s.request_id for s in q.dropped("a2")] == ["a3"] and len(q) == 0


class _FakeClock:
  """Virtual time that moves 1 ms per read (the replay's idle loop polls it)."""

  def __init__(self):
    self.t = 100.0

  def now(self):
    self.t += 0.001
    return self.t


class _FakeEngine:
  """Just enough ``LLMEngine`` for ``replay_workload``: one token per step per live request, 10 ms a step;
  records when each request was added (on its clock)."""

  def __init__(self):
    from superinfer_jax.engine.engine import EngineStats
    self.clock = _FakeClock()
    self.stats = EngineStats()
    self.live, self.added = {}, {}

  def num_compiled_shapes(self):
    return 0

  def add_request(self, prompt, params, request_id, arrival_time=None):
    self.added[request_id] = (self.clock.now(), arrival_time)
    self.live[request_id] = [params.max_tokens, 0]

  def has_unfinished(self):
    return bool(self.live)

  def abort(self, rid):
    self.live.pop(rid, None)

  def step(self):
    self.clock.t += 0.01
    outs = []
    for rid, st in list(self.live.items()):
      st[1] += 1
      done = st[1] >= st[0]
      outs.append(types.SimpleNamespace(request_id=rid, state_changes=[], timestamps=[self.clock.t],
                                        finished=done, finish_reason="length" if done else None))
      if done:
        del self.live[rid]
    return outs


def test_replay_submits_a_later_turn_only_think_time_after_the_previous_finished():
  from superinfer_jax.experiment.workload_replay import replay_workload
  reqs = [RequestSpec("c0-t1", "", 3, 5, prompt_token_ids=(1, 2, 3)),
          RequestSpec("c0-t2", "", 3, 4, prompt_token_ids=(1, 2, 3), after_request_id="c0-t1", think_time_s=0.3),
          RequestSpec("c1-t1", "", 3, 50, arrival_s=0.01, prompt_token_ids=(4, 5, 6)),
          RequestSpec("c0-t3", "", 3, 2, prompt_token_ids=(1, 2, 3), after_request_id="c0-t2", think_time_s=0.0)]
  eng = _FakeEngine()
  res = replay_workload(eng, reqs, progress=False, idle_sleep_max_s=0.0)
  tl = {t.request_id: t for t in res.timelines}
  assert all(t.finished for t in tl.values()) and not res.rejected
  for prev, nxt, think in (("c0-t1", "c0-t2", 0.3), ("c0-t2", "c0-t3", 0.0)):
    finish = tl[prev].token_times_s[-1]
    added_at, arrival = eng.added[nxt]
    assert arrival == pytest.approx(finish + think)        # its arrival is the release time
    assert tl[nxt].arrival_s == pytest.approx(finish + think)
    assert added_at >= finish + think - 1e-9               # never submitted before it
    assert tl[nxt].token_times_s[0] > finish + think
  # c0-t2 was released while c1-t1 was still running: the replay did not wait for idleness.
  assert tl["c0-t2"].arrival_s < tl["c1-t1"].token_times_s[-1]


def test_replay_never_submits_the_turns_after_a_refused_one():
  from superinfer_jax.experiment.workload_replay import replay_workload

  class Refusing(_FakeEngine):
    def add_request(self, prompt, params, request_id, arrival_time=None):
      if request_id == "c0-t1":
        raise ValueError("prompt too long")
      super().add_request(prompt, params, request_id, arrival_time)

  reqs = [RequestSpec("c0-t1", "", 3, 5, prompt_token_ids=(1, 2, 3)),
          RequestSpec("c0-t2", "", 3, 4, prompt_token_ids=(1, 2, 3), after_request_id="c0-t1", think_time_s=0.3),
          RequestSpec("c1-t1", "", 3, 5, prompt_token_ids=(4, 5, 6))]
  eng = Refusing()
  res = replay_workload(eng, reqs, progress=False, idle_sleep_max_s=0.0)
  assert [rid for rid, _ in res.rejected] == ["c0-t1", "c0-t2"] and "c0-t2" not in eng.added
  assert "refused" in res.rejected[1][1]


def test_simulator_honours_the_closed_loop():
  from superinfer_jax.engine.config import EngineConfig
  from superinfer_jax.sim.event_loop import simulate

  class Cost:
    empty_step_s = 0.01
    block_bytes = 0

    def step_time(self, seqs):
      return 0.01

    def transfer_time(self, blocks_out, blocks_in):
      return 0.0

  cfg = EngineConfig.create(policy="fcfs", num_device_blocks=20, num_host_blocks=64, block_size=8,
                            max_num_seqs=4, max_num_batched_tokens=64, ttft_slo=1.0, tbt_slo=1.0)
  reqs = [RequestSpec("c0-t1", "", 10, 5), RequestSpec("c1-t1", "", 10, 30, arrival_s=0.02),
          RequestSpec("c0-t2", "", 20, 4, after_request_id="c0-t1", think_time_s=0.5)]
  res = simulate(reqs, cfg, Cost())
  tl = {t.request_id: t for t in res.timelines}
  finish = tl["c0-t1"].token_times_s[-1]
  assert tl["c0-t2"].arrival_s == pytest.approx(finish + 0.5)
  assert tl["c0-t2"].token_times_s[0] > finish + 0.5 and tl["c0-t2"].finished


# ---- the prefix reuse bound -------------------------------------------------------------------------------

def _spec(rid, ids, t):
  return RequestSpec(rid, "", len(ids), 1, arrival_s=t, prompt_token_ids=tuple(ids))


def test_prefix_reuse_bound_hand_worked():
  # block size 4.
  # r0 (t=0): 1..10        -> full blocks [1-4] [5-8]; nothing earlier: 0 hits.
  # r1 (t=1): 1..8,20..24  -> full blocks [1-4] hit, [5-8] hit, [20-23] miss: 2 hits.
  # r2 (t=2): 1..8         -> full blocks [1-4] hit; [5-8] is cached but ends at the last prompt token,
  #                           which is always recomputed: no hit. 1 hit.
  # -> 3 of 7 full blocks; 12 of 31 prompt tokens.
  specs = [_spec("r2", range(1, 9), 2.0), _spec("r0", range(1, 11), 0.0),
           _spec("r1", list(range(1, 9)) + [20, 21, 22, 23, 24], 1.0)]   # listed out of order: arrival order rules
  b = prefix_reuse_bound(specs, 4)
  assert (b["full_blocks"], b["hit_blocks"], b["prompt_tokens"], b["hit_tokens"]) == (7, 3, 31, 12)
  assert b["block_hit_rate"] == pytest.approx(3 / 7) and b["token_hit_rate"] == pytest.approx(12 / 31)
  assert b["prefill_tokens"] == 19 and b["requests_with_hit"] == 2


def test_prefix_reuse_bound_needs_the_whole_prefix_not_just_the_block():
  # [1-4] appears again, but after another block: a different prefix, so no hit (a hash chain, as vLLM's).
  specs = [_spec("a", [1, 2, 3, 4, 5], 0.0), _spec("b", [9, 9, 9, 9, 1, 2, 3, 4, 5], 1.0)]
  assert prefix_reuse_bound(specs, 4)["hit_blocks"] == 0
  with pytest.raises(ValueError):
    prefix_reuse_bound([RequestSpec("x", "p", 3, 1)], 4)
  with pytest.raises(ValueError):
    prefix_reuse_bound(specs, 0)
