"""LLMEngine on a tiny random model: correctness vs. the model's greedy decode, pipelining, continuous
batching, abort, sampling, stop conditions, bad input, transfer guard.

Every engine here uses the same static shape buckets (``_config``), so the jitted step compiles once per
process for the tiny model; tests stay fast on a 2-core CPU.
"""
import dataclasses

import jax
import numpy as np
import pytest

from superinfer_jax.engine.config import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine, RequestError
from test_engine_utils import FakeScheduler, random_params, tiny_config

pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator

BS = 4
MAX_POS = 128


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config(max_pos=MAX_POS, eos=(2,))
  return cfg, random_params(cfg, seed=1)


def _config(**kw):
  base = dict(num_device_blocks=64, num_host_blocks=0, block_size=BS, policy="fcfs",
              max_num_batched_tokens=32, max_num_seqs=8, token_bucket_floor=32, seq_bucket_floor=8,
              blocks_bucket_floor=MAX_POS // BS)
  base.update(kw)
  return EngineConfig.create(**base)


def _engine(model, sched=None, tokenizer=None, clock=None, **kw):
  cfg, params = model
  return LLMEngine((cfg, params, tokenizer), _config(**kw), clock=clock, scheduler_factory=sched)


def _prompts(n, seed=0, lo=3, hi=20):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 128, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


class StepClock:
  """A clock that advances one unit per read: timestamps order events without wall-clock noise."""

  def __init__(self):
    self.t = 0.0

  def now(self):
    self.t += 1.0
    return self.t


def test_matches_model_greedy_generate(model):
  from superinfer_jax.model.api import greedy_generate
  cfg, params = model
  prompts = _prompts(3, seed=1)
  outs = _engine(model).generate(prompts, GREEDY)
  for p, o in zip(prompts, outs):
    assert o.token_ids == greedy_generate(params, cfg, p, 10, block_size=BS, stop_token_ids=())
    assert o.finish_reason == "length" and len(o.timestamps) == 10


@pytest.mark.parametrize("pipeline", [False, True])
def test_memory_pressure_recompute_matches_one_by_one(model, pipeline):
  prompts = _prompts(8, seed=2)
  ref = [_engine(model).generate([p], GREEDY)[0].token_ids for p in prompts]
  eng = _engine(model, num_device_blocks=14, pipeline=pipeline)   # room for ~2 requests
  outs = eng.generate(prompts, GREEDY)
  assert [o.token_ids for o in outs] == ref
  assert eng.stats.recompute_preemptions > 0
  eng.check_invariants()
  assert eng.block_manager.num_free_device_blocks == 14


@pytest.mark.parametrize("zero_bubble", [False, True])
def test_pipelined_equals_sync_and_drops_finished(model, zero_bubble):
  prompts = _prompts(6, seed=3)
  free = _engine(model).generate(prompts, SamplingParams(max_tokens=11, ignore_eos=True))
  # Mixed lengths, and stop tokens the scheduler cannot foresee (the engine stops those requests, so the
  # lookahead plan already scheduled them: the pipelined loop drops them before dispatch; the zero-bubble
  # loop has dispatched them already and discards the token).
  params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 3, 5, 7, 9, 11)]
  for i in (2, 4, 5):
    params[i] = dataclasses.replace(params[i], stop_token_ids=[free[i].token_ids[i - 1]])
  sync = _engine(model, pipeline=False, clock=StepClock())
  a = sync.generate(prompts, params)
  eng = _engine(model, pipeline=True, zero_bubble=zero_bubble, clock=StepClock())
  eng.loop.host_batch.verify = True   # pylint: disable=protected-access
  b = eng.generate(prompts, params)
  assert [o.token_ids for o in a] == [o.token_ids for o in b]
  assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
  for i, o in enumerate(b):
    assert o.token_ids == free[i].token_ids[:len(o.token_ids)]
    if i in (2, 4, 5):
      assert o.finish_reason == "stop" and len(o.token_ids) <= i
  if zero_bubble:
    assert eng.stats.discarded_tokens > 0 and eng.stats.rescheduled_drops == 0
    assert eng.stats.exposed_host_time_s == 0.0
  else:
    assert eng.stats.rescheduled_drops > 0 and eng.stats.discarded_tokens == 0
  assert sync.stats.discarded_tokens == sync.stats.rescheduled_drops == 0
  assert 0 < eng.stats.batch_rebuilds < eng.stats.model_steps    # most decode steps updated in place
  eng.check_invariants()
  assert eng.block_manager.num_requests == 0 and not eng.has_unfinished()


def test_streaming_outputs_concatenate_to_result(model):
  eng = _engine(model)
  prompts = _prompts(3, seed=4)
  ids = [eng.add_request(p, GREEDY) for p in prompts]
  got = {i: [] for i in ids}
  finals = {}
  for out in eng.stream():
    got[out.request_id] += out.token_ids
    assert len(out.timestamps) == len(out.token_ids)
    if out.finished:
      finals[out.request_id] = out.finish_reason
  assert finals == {i: "length" for i in ids}
  for i in ids:
    assert got[i] == eng.get_request(i).token_ids
  assert not eng.has_unfinished()


def test_continuous_batching_joins_without_waiting(model):
  eng = _engine(model, clock=StepClock())
  a = eng.add_request(_prompts(1, seed=5)[0], SamplingParams(max_tokens=40, ignore_eos=True))
  for _ in range(5):
    eng.step()
  b = eng.add_request(_prompts(1, seed=6)[0], SamplingParams(max_tokens=5, ignore_eos=True))
  while eng.has_unfinished():
    eng.step()
  ra, rb = eng.get_request(a), eng.get_request(b)
  # b was added while a decoded, produced all its tokens and finished before a finished.
  assert ra.timestamps[0] < rb.arrival_time < ra.timestamps[-1]
  assert rb.timestamps[-1] < ra.timestamps[-1]
  # ... and a kept decoding while b ran (interleaved timestamps).
  assert any(rb.timestamps[0] <= t <= rb.timestamps[-1] for t in ra.timestamps)
  # b's result does not depend on sharing the batch.
  assert rb.token_ids == _engine(model).generate([_prompts(1, seed=6)[0]],
                                                 SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("pipeline", [False, True])
def test_abort_running_and_waiting_frees_blocks(model, pipeline):
  eng = _engine(model, num_device_blocks=16, max_num_seqs=2, pipeline=pipeline)
  ids = [eng.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in _prompts(4, seed=7)]
  for _ in range(4):
    eng.step()
  running = [i for i in ids if eng.get_request(i).token_ids]
  waiting = [i for i in ids if not eng.get_request(i).token_ids]
  assert running and waiting
  assert eng.abort(running[0]) and eng.abort(waiting[0])
  assert not eng.abort(running[0])          # already finished
  assert not eng.block_manager.has_request(running[0])
  assert not eng.block_manager.has_request(waiting[0])
  eng.check_invariants()
  outs = []
  while eng.has_unfinished():
    outs += eng.step()
    eng.check_invariants()
  reasons = {o.request_id: o.finish_reason for o in outs if o.finished}
  assert reasons[running[0]] == "abort" and reasons[waiting[0]] == "abort"
  assert all(reasons[i] == "length" for i in ids if i not in (running[0], waiting[0]))
  assert eng.block_manager.num_free_device_blocks == 16 and eng.block_manager.num_requests == 0


def test_seeded_sampling_reproducible_and_batch_independent(model):
  prompts = _prompts(4, seed=8)
  sp = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True)
        for s in (11, 12, 13, 14)]
  together = _engine(model).generate(prompts, sp)
  alone = [_engine(model).generate([p], s)[0] for p, s in zip(prompts[:2], sp[:2])]
  assert [o.token_ids for o in together[:2]] == [o.token_ids for o in alone]
  other_seed = _engine(model).generate([prompts[0]], dataclasses.replace(sp[0], seed=99))[0]
  assert other_seed.token_ids != together[0].token_ids
  greedy = _engine(model).generate(prompts, GREEDY)
  top1 = _engine(model).generate(prompts, SamplingParams(max_tokens=10, temperature=1.3, top_k=1, seed=5,
                                                         ignore_eos=True))
  assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_stop_conditions(model):
  eng = _engine(model)
  p = _prompts(1, seed=9)[0]
  free = eng.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
  stop_tok = free[5]
  first = free.index(stop_tok)
  out = _engine(model).generate([p], SamplingParams(max_tokens=20, ignore_eos=True,
                                                    stop_token_ids=[stop_tok]))[0]
  assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
  # eos (cfg.eos_token_ids = (2,)) stops unless ignore_eos.
  cfg, params = model
  eos_cfg = dataclasses.replace(cfg, eos_token_ids=(stop_tok,))
  eng2 = LLMEngine((eos_cfg, params, None), _config())
  out = eng2.generate([p], SamplingParams(max_tokens=20))[0]
  assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
  # max_model_len caps generation ("length").
  eng3 = _engine(model, max_model_len=len(p) + 4)
  out = eng3.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
  assert out.token_ids == free[:4] and out.finish_reason == "length"


def test_bad_requests_rejected_engine_keeps_serving(model):
  eng = _engine(model, num_device_blocks=8)
  good = eng.add_request(_prompts(1, seed=10)[0], GREEDY)
  eng.step()
  with pytest.raises(RequestError, match="empty prompt"):
    eng.add_request([], GREEDY)
  with pytest.raises(RequestError, match="context"):
    eng.add_request([5] * MAX_POS, GREEDY)
  with pytest.raises(RequestError, match="never"):
    eng.add_request(list(range(3, 30)), SamplingParams(max_tokens=40))   # 67 tokens > 8 blocks * 4
  with pytest.raises(RequestError, match="temperature"):
    eng.add_request([5, 6], SamplingParams(temperature=-1))
  with pytest.raises(RequestError, match="top_p"):
    eng.add_request([5, 6], SamplingParams(top_p=0))
  with pytest.raises(RequestError, match="vocab"):
    eng.add_request([5, 10**6], GREEDY)
  with pytest.raises(RequestError, match="tokenizer"):
    eng.add_request("text without a tokenizer", GREEDY)
  with pytest.raises(RequestError, match="duplicate"):
    eng.add_request([5, 6], GREEDY, request_id=good)
  while eng.has_unfinished():
    eng.step()
  assert eng.get_request(good).finish_reason == "length" and len(eng.get_request(good).token_ids) == 10
  eng.check_invariants()


def test_bad_config_is_a_startup_error(model):
  with pytest.raises(ValueError, match="policy: unknown value 'nope'.*rotasched"):
    _engine(model, policy="nope")
  with pytest.raises(ValueError, match="attention"):
    _engine(model, attention="flash")
  with pytest.raises(ValueError, match="block_size"):
    _engine(model, block_size=0)


def test_no_implicit_transfers_in_step_loop(model):
  prompts = _prompts(5, seed=11)
  sp = [GREEDY, SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=3, ignore_eos=True)] * 3
  # Warm up (compile) outside the guard, then run a fresh engine under it; each of the three loops.
  # The early read-back of the sampled ids (taken on accelerators) is forced on here too.
  for loop in (dict(zero_bubble=True), dict(zero_bubble=False), dict(pipeline=False)):
    _engine(model, num_device_blocks=16, **loop).generate(prompts, sp[:5])
    eng = _engine(model, num_device_blocks=16, **loop)
    eng.runner.early_readback = True
    with jax.transfer_guard("disallow"):
      outs = eng.generate(prompts, sp[:5])
    assert all(len(o.token_ids) == 10 for o in outs)


def test_bounded_compilations(model):
  eng = _engine(model, num_device_blocks=16)
  eng.generate(_prompts(6, seed=12), GREEDY)
  n = eng.num_compiled_shapes()
  eng2 = _engine(model, num_device_blocks=16)
  eng2.generate(_prompts(6, seed=13, lo=1, hi=30), GREEDY)
  assert eng2.num_compiled_shapes() == n   # same buckets: nothing new compiled


def test_custom_scheduler_factory(model):
  """The engine drives any scheduler with the contract's API (here a minimal FCFS test double)."""
  prompts = _prompts(4, seed=14)
  ref = _engine(model).generate(prompts, GREEDY)
  eng = _engine(model, sched=FakeScheduler, num_device_blocks=14)
  assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == [o.token_ids for o in ref]
  assert isinstance(eng.scheduler, FakeScheduler)


def test_pipeline_plans_next_step_while_one_is_in_flight(model):
  """Pipelined: every plan after the first is made with lookahead while the previous step is dispatched
  and unread; non-pipelined: never."""
  for pipeline in (True, False):
    eng = _engine(model, pipeline=pipeline)
    seen = []
    orig = eng.scheduler.schedule

    def spy(lookahead=False, _orig=orig, _eng=eng, _seen=seen):
      _seen.append((lookahead, _eng.loop.inflight is not None))
      return _orig(lookahead=lookahead)

    eng.scheduler.schedule = spy
    eng.generate(_prompts(3, seed=15), GREEDY)
    if pipeline:
      assert seen[0] == (False, False)
      assert sum(1 for s in seen if s == (True, True)) >= len(seen) - 2
      assert all(s[0] == s[1] for s in seen)
    else:
      assert all(s == (False, False) for s in seen)


def test_pallas_attention_backend_same_tokens(model):
  """The engine runs the Pallas attention backend (interpret mode on CPU) with the reference's tokens."""
  prompts = _prompts(2, seed=16, lo=3, hi=9)
  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  small = dict(max_num_batched_tokens=16, token_bucket_floor=16, seq_bucket_floor=2, blocks_bucket_floor=4,
               max_num_seqs=2)
  ref = _engine(model, **small).generate(prompts, sp)
  got = _engine(model, attention="pallas", **small).generate(prompts, sp)
  assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def _word_tokenizer(vocab):
  """Word-level tokenizer over the tiny model's vocab: token i <-> "w{i}", decoded joined by spaces."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
  from superinfer_jax.model.tokenizer import Tokenizer
  tok = tokenizers.Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece(prefix="##")
  return Tokenizer(backend=tok, eos_ids=(2,))


def test_text_prompts_stop_strings_and_text_deltas(model):
  tok = _word_tokenizer(128)
  eng = _engine(model, tokenizer=tok)
  prompt = "w5 w17 w99 w3 w42"
  free = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
  assert free.prompt_token_ids == [5, 17, 99, 3, 42]
  assert free.text.split() == [f"w{t}" for t in free.token_ids]
  # Stop string = the text of generated tokens 4..5: the text is cut before it, finish reason "stop".
  words = free.text.split()
  stop = " ".join(words[4:6])
  eng = _engine(model, tokenizer=tok)
  rid = eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))
  deltas, final = [], None
  for out in eng.stream():
    deltas.append(out.text)
    final = out
  res = eng.get_request(rid)
  assert final.finish_reason == "stop" and res.finish_reason == "stop"
  cut = free.text[:free.text.index(stop)]
  assert res.text == cut and "".join(deltas) == cut
  assert res.token_ids == free.token_ids[:6]     # stopped at the token that completed the stop string


def test_device_memory_fraction_needs_memory_stats(model):
  cfg, params = model
  if jax.local_devices()[0].memory_stats():
    pytest.skip("backend reports memory: the fraction path is exercised on GPU")
  with pytest.raises(ValueError, match="num_device_blocks"):
    LLMEngine((cfg, params, None), _config(num_device_blocks=None))


def test_scheduler_does_not_hoard_finished_requests(model):
  """A long-running server: finished requests are not kept by the scheduler (the engine drains them)."""
  eng = _engine(model, num_device_blocks=16)
  eng.generate(_prompts(5, seed=21), GREEDY)
  assert eng.scheduler.pop_finished() == []


def test_release_waits_for_the_step_in_flight(model):
  """Zero-bubble: a request's final output comes while the next step (which still names it) is in flight;
  releasing it then is deferred until that step is read, and then forgets it."""
  eng = _engine(model)
  rid = eng.add_request(_prompts(1, seed=22)[0], SamplingParams(max_tokens=3, ignore_eos=True,
                                                                stop_token_ids=list(range(128))))
  other = eng.add_request(_prompts(1, seed=23)[0], SamplingParams(max_tokens=6, ignore_eos=True))
  final = None
  while final is None:
    final = next((o for o in eng.step() if o.request_id == rid and o.finished), None)
  assert final.finish_reason == "stop" and len(final.token_ids) == 1
  assert rid in eng.loop.inflight.scheduled
  eng.release(rid)
  assert eng.get_request(rid).finish_reason == "stop"   # still known: the step in flight names it
  eng.step()
  with pytest.raises(KeyError):
    eng.get_request(rid)
  while eng.has_unfinished():
    eng.step()
  assert len(eng.get_request(other).token_ids) == 6
  assert eng.stats.discarded_tokens == 1
