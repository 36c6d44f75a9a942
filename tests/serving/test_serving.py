"""serving/ in process (no model, no subprocess): request validation, chat templates, and the engine
thread's failure handling through the real app (starlette's TestClient) over a fake engine."""
import gc
import json
import os
import logging
import time
import types

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from superinfer_jax.serving import protocol as P  # noqa: E402
from superinfer_jax.serving.request_parsing import parse_json_body, parse_request  # noqa: E402
from superinfer_jax.serving.app import build_app  # noqa: E402
from superinfer_jax.serving.chat import FALLBACK_TEMPLATE, render_chat  # noqa: E402
from superinfer_jax.serving.metrics import parse_metrics  # noqa: E402
from support.fake_engine import FakeEngine  # noqa: E402


def test_parse_request_defaults_and_errors():
  req, _ = parse_request({"prompt": "hi"}, "completion", ["m"])
  assert req.model == "m" and req.max_tokens == 16 and req.temperature == 1.0 and not req.stream
  req, msgs = parse_request({"model": "m", "messages": [{"role": "user", "content": [
      {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 5,
      "ttft_slo": 2.0, "tbt_slo": 0.1, "ignore_eos": True}, "chat", ["m"])
  assert msgs == [{"role": "user", "content": "ab"}] and req.max_tokens == 5 and req.ttft_slo == 2.0
  assert req.ignore_eos and req.request_id.startswith("chatcmpl-")
  cases = [({"prompt": "x", "n": 17}, 400), ({"prompt": "x", "n": 0}, 400), ({"prompt": "x", "ttft_slo": 0}, 400), ({"prompt": "x", "top_k": -2}, 400),
           ({"prompt": ["a", "b"]}, 400), ({"prompt": "x", "stop": [1]}, 400), ({"prompt": "x", "seed": -1}, 400),
           ({"prompt": "x", "model": 3}, 400), ({"prompt": "x", "model": "other"}, 404),
           ({"prompt": "x", "temperature": float("nan")}, 400)]
  for body, status in cases:
    with pytest.raises(P.APIError) as e:
      parse_request(body, "completion", ["m"])
    assert e.value.status == status, body
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}
  with pytest.raises(P.APIError) as e:
    P.check_lengths(req, 10, 12)
  assert e.value.code == "context_length_exceeded"
  req.max_tokens = None
  assert P.check_lengths(req, 10, 12) == 2


def test_served_context_is_capped_at_the_pool():
  assert P.served_context(8192, 256, 16) == 4096          # SmolLM2's 8192 positions, a 4096-token pool
  assert P.served_context(2048, 256, 16) == 2048
  assert P.served_context(8192, 256, 16, explicit=4096) == 4096
  with pytest.raises(ValueError, match=r"--max_model_len=8192 exceeds the 4096 tokens") as e:
    P.served_context(8192, 256, 16, explicit=8192)
  assert "\n" not in str(e.value)


REFUSED_BODIES = [
    ("completion", "echo", True), ("completion", "suffix", "tail"), ("completion", "best_of", 3),
    ("chat", "response_format", {"type": "json_object"}),
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]), ("chat", "tool_choice", "auto"),
    ("chat", "parallel_tool_calls", True), ("chat", "functions", [{"name": "f"}]), ("chat", "function_call", "auto"),
    ("completion", "no_such_field", 1), ("completion", "messages", []), ("chat", "prompt", "x"),
    ("chat", "suffix", "x"), ("completion", "top_logprobs", 2),
]


@pytest.mark.parametrize("kind,name,value", REFUSED_BODIES, ids=[b[1] for b in REFUSED_BODIES])
def test_unimplemented_fields_are_refused_naming_them(kind, name, value):
  base = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "x"}]}
  with pytest.raises(P.APIError) as e:
    parse_request(dict(base, **{name: value}), kind, ["m"])
  assert e.value.status == 400 and e.value.param == name and e.value.code == "unsupported_parameter"
  assert f"'{name}'" in e.value.message


def test_default_values_of_refused_fields_are_accepted():
  for kind, body in (("completion", {"prompt": "x", "echo": False, "suffix": None, "best_of": 1,
                                     "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                                     "logit_bias": {}, "user": "u", "logprobs": None}),
                     ("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"},
                               "tools": [], "tool_choice": "none", "logprobs": False, "n": 2})):
    req, _ = parse_request(body, kind, ["m"])
    assert req.logprobs is None
  req, _ = parse_request({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3},
                           "chat", ["m"])
  assert req.logprobs == 3
  req, _ = parse_request({"prompt": "x", "logprobs": 0}, "completion", ["m"])
  assert req.logprobs == 0
  with pytest.raises(P.APIError) as e:
    parse_request({"prompt": "x", "logprobs": 21}, "completion", ["m"])
  assert e.value.param == "logprobs"
  req, _ = parse_request({"prompt": "x", "logprobs": 2, "stream": True}, "completion", ["m"])
  assert req.logprobs == 2 and req.stream          # streamed logprobs: each chunk carries its tokens'
  req, _ = parse_request({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                          "logit_bias": {"5": -100}}, "completion", ["m"])
  assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.5, -1.0, 1.2)
  assert req.logit_bias == ((5, -100.0),)


def test_every_field_is_documented():
  doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "serving.md")).read()
  where = {"both": "both", "completion": "completions", "chat": "chat"}
  for name, (endpoints, what) in P.FIELDS.items():
    assert f"| `{name}` | {where[endpoints]} | {what} |" in doc, name
  assert set(P.REFUSED) <= set(P.FIELDS)


def test_lone_surrogates_are_a_400():
  for raw in (b'{"prompt": "a\\ud800b"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
              b'{"prompt": "x", "stop": ["\\ud83d"]}'):
    with pytest.raises(P.APIError) as e:
      parse_json_body(raw)
    assert e.value.status == 400 and e.value.code == "invalid_unicode" and "Unicode" in e.value.message
  assert parse_json_body('{"prompt": "\\ud83d\\ude00"}'.encode())["prompt"] == "\U0001F600"   # a valid pair


def test_chat_templates():
  msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
  assert render_chat(None, msgs) == "system: be brief\nuser: hi\nassistant:"
  assert render_chat(None, msgs, FALLBACK_TEMPLATE) == render_chat(types.SimpleNamespace(chat_template=None), msgs)
  # A model template in the ChatML style (SmolLM2's), rendered as transformers does (trim/lstrip blocks).
  chatml = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
            "{% endif %}")
  out = render_chat(types.SimpleNamespace(chat_template=chatml), msgs)
  assert out == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                 "<|im_start|>assistant\n")
  from superinfer_jax.serving.chat import ChatTemplateError
  with pytest.raises(ChatTemplateError, match="no system"):
    render_chat(types.SimpleNamespace(chat_template="{{ raise_exception('no system') }}"), msgs)


def _post(c, body, path="/v1/completions"):
  return c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_step_exception_fails_requests_with_500_and_server_keeps_serving():
  eng = FakeEngine()
  with TestClient(build_app(eng, ["fake"], max_queue=8)) as c:
    r = _post(c, {"prompt": [1, 2], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t1 t2 t3"
    eng.fail_next = 1
    r = _post(c, {"prompt": [1, 2], "max_tokens": 3})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_error" and "boom" in err["message"]
    eng.fail_next = 1
    with c.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 3, "stream": True}) as s:
      lines = [l for l in s.iter_lines() if l]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "engine_error"
    r = _post(c, {"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    h = c.get("/health", params={"check": 1}).json()
    assert h["status"] == "ok" and h["step_errors"] == 2 and h["admitted"] == 0
    assert h["device_blocks_free"] == 8
    m = parse_metrics(c.get("/metrics").text)
    assert m["superinfer_step_errors_total"] == 2 and m['superinfer_requests_finished_total{reason="error"}'] == 2


def test_streaming_over_fake_engine_and_no_tokenizer_errors():
  eng = FakeEngine()
  with TestClient(build_app(eng, ["fake"], max_queue=8)) as c:
    with c.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 3, "stream": True,
                                                     "stream_options": {"include_usage": True}}) as s:
      events = [l[6:] for l in s.iter_lines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == " t1 t2 t3"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    r = _post(c, {"prompt": "text", "max_tokens": 3})   # no tokenizer: text prompts are refused
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    r = _post(c, {"messages": [{"role": "user", "content": "x"}]}, "/v1/chat/completions")
    assert r.status_code == 400
    assert c.get("/v1/models").json()["data"][0]["id"] == "fake"


def test_real_engine_recovers_from_a_failed_step(tmp_path):
  """A real LLMEngine whose step raises once: the live requests get a 500, later ones are served, and the
  block manager's invariants hold (the worker drains the aborted requests, or rebuilds the engine)."""
  pytest.importorskip("transformers")
  from superinfer_jax.engine.config import EngineConfig
  from superinfer_jax.engine.engine import LLMEngine
  from support.tiny_models import save_tiny_hf_model
  save_tiny_hf_model(str(tmp_path), "llama", max_position_embeddings=128)
  cfg = EngineConfig.create(num_device_blocks=16, num_host_blocks=16, block_size=8, max_num_batched_tokens=32,
                            token_bucket_floor=32, seq_bucket_floor=4, blocks_bucket_floor=8)
  made = []

  def factory():
    made.append(1)
    return LLMEngine(str(tmp_path), cfg)

  eng = LLMEngine(str(tmp_path), cfg)
  real = eng.runner.read_step
  calls = {"n": 0}

  def flaky(handle):
    calls["n"] += 1
    if calls["n"] == 3:
      raise RuntimeError("injected device failure")
    return real(handle)

  eng.runner.read_step = flaky
  gc.freeze()   # as scripts/serve.py does once its engine is built: the rebuild unfreezes, then freezes again
  try:
    _serve_through_a_failure(eng, factory, made)
  finally:
    gc.unfreeze()


def _serve_through_a_failure(eng, factory, made):
  with TestClient(build_app(eng, ["tiny"], max_queue=8, engine_factory=factory)) as c:
    r = _post(c, {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    for _ in range(2):
      r = _post(c, {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
      assert r.status_code == 200, r.text
      assert r.json()["usage"]["completion_tokens"] == 8
    h = c.get("/health", params={"check": 1}).json()
    assert h["invariants"] == "ok" and h["device_blocks_free"] == 16 and h["step_errors"] == 1
    assert gc.get_freeze_count() > 0   # still frozen, or frozen again after a rebuild
    print("engine rebuilt:", bool(made))


class _StuckEngine:
  """An engine the worker cannot drain (so it rebuilds it), held in a reference cycle as real engines are."""
  def __init__(self):
    self.me = self

  def has_unfinished(self):
    return True

  def step(self):
    raise RuntimeError("still broken")


def test_worker_rebuild_frees_a_frozen_engine_and_freezes_again():
  """scripts/serve.py freezes the heap once its engine is built; a rebuild must unfreeze first, or the old
  engine (a cycle, frozen) would keep its KV pool, then freeze again with the new engine."""
  import weakref
  from superinfer_jax.serving.worker import EngineWorker
  from superinfer_jax.util import freeze_heap
  old = _StuckEngine()
  ref = weakref.ref(old)
  worker = EngineWorker(old, None, engine_factory=FakeEngine)
  del old
  quiet = logging.getLogger("superinfer_jax.serving")
  level = quiet.level
  quiet.setLevel(logging.CRITICAL)   # a captured log record would keep the failure's traceback (and the engine)
  try:
    freeze_heap()
    worker._recover()   # drains nothing (the engine stays stuck): rebuilds
    assert isinstance(worker.engine, FakeEngine) and ref() is None
    assert gc.get_freeze_count() > 0 and not any(o is worker.engine for o in gc.get_objects())
  finally:
    gc.unfreeze()
    quiet.setLevel(level)


def test_n_choices_logprobs_and_model_retrieve_over_fake_engine():
  """The engine's logprobs reach both formats, streamed and not; n choices each get theirs."""
  eng = FakeEngine()
  with TestClient(build_app(eng, ["fake"], max_queue=8)) as c:
    assert c.get("/v1/models/fake").json()["id"] == "fake"
    r = c.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(c, {"prompt": [5, 6, 7], "max_tokens": 3, "n": 3, "logprobs": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 9
    for ch in body["choices"]:
      assert ch["token_ids"] == [1, 2, 3] and ch["text"] == " t1 t2 t3"
      lp = ch["logprobs"]
      assert lp["tokens"] == ["token_id:1", "token_id:2", "token_id:3"]
      assert lp["token_logprobs"] == [-0.1, -0.2, -0.3]
      assert lp["top_logprobs"] == [{f"token_id:{n}": -n / 10, f"token_id:{n + 1}": -(n + 1) / 10}
                                    for n in (1, 2, 3)]
      assert lp["text_offset"] == [0, 10, 20]
    r = _post(c, {"prompt": [5], "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None          # not asked: none
    r = _post(c, {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "/v1/chat/completions")
    assert r.status_code == 400   # no tokenizer: chat is refused before logprobs matter
    with c.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 2, "n": 2, "stream": True,
                                                   "logprobs": 1}) as s:
      events = [json.loads(l[6:]) for l in s.iter_lines() if l.startswith("data: {")]
    by_index = {0: "", 1: ""}
    streamed_lps = {0: [], 1: []}
    for e in events:
      ch = e["choices"][0]
      by_index[ch["index"]] += ch["text"]
      if ch["logprobs"] is not None:
        streamed_lps[ch["index"]] += ch["logprobs"]["token_logprobs"]
    assert by_index == {0: " t1 t2", 1: " t1 t2"}
    assert streamed_lps == {0: [-0.1, -0.2], 1: [-0.1, -0.2]}
    assert sorted(e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]) == ["length"] * 2
    h = c.get("/health", params={"check": 1}).json()
    assert h["admitted"] == 0 and h["device_blocks_free"] == 8


def test_penalties_and_logit_bias_reach_the_engine_or_get_a_400():
  """presence / frequency / repetition penalties and logit_bias go into the request's SamplingParams; an
  out-of-range value is a 400 naming the field."""
  seen = {}
  eng = FakeEngine()
  add = eng.add_request

  def spy(prompt, params, request_id, **kw):
    seen[request_id] = params
    return add(prompt, params, request_id, **kw)
  eng.add_request = spy
  with TestClient(build_app(eng, ["fake"], max_queue=8)) as c:
    r = _post(c, {"prompt": [5], "max_tokens": 1, "presence_penalty": 0.5, "frequency_penalty": -1,
                  "repetition_penalty": 1.3, "logit_bias": {"7": 100, "3": -2.5}})
    assert r.status_code == 200, r.text
    (p,) = seen.values()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.3)
    assert p.logit_bias == ((3, -2.5), (7, 100.0)) and p.processes_logits
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"-1": 1}),
                         ("logit_bias", {"100": 1}), ("logit_bias", [1])):
      r = _post(c, {"prompt": [5], "max_tokens": 1, field: value})
      assert r.status_code == 400, (field, value, r.text)
      assert r.json()["error"]["param"] == field, (field, value, r.json())


def test_health_and_requests_answer_503_until_the_warmup_is_done():
  import threading
  go = threading.Event()
  warmed = []

  def warmup(eng):
    assert go.wait(30)
    warmed.append(eng)

  eng = FakeEngine()
  with TestClient(build_app(eng, ["fake"], max_queue=8, warmup=warmup)) as c:
    h = c.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "starting" and h.headers["retry-after"] == "1"
    r = _post(c, {"prompt": [1], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable" and r.headers["retry-after"] == "1"
    go.set()
    for _ in range(300):
      if c.get("/health").status_code == 200:
        break
      time.sleep(0.01)
    assert warmed == [eng] and c.get("/health").json()["status"] == "ok"
    assert _post(c, {"prompt": [1], "max_tokens": 2}).status_code == 200
