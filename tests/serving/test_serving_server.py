"""scripts/serve.py end to end: a real server in a subprocess on a loopback port, a tiny random model with a
word-level tokenizer, driven by the ``openai`` package and ``httpx``. Every wait is bounded."""
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

from support.tiny_models import word_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from superinfer_jax.serving.metrics import parse_metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 96
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
ENGINE_ARGS = ["--block_size=16", "--num_device_blocks=40", "--num_host_blocks=64", "--max_num_seqs=4",
               "--max_num_batched_tokens=32", "--token_bucket_floor=32", "--seq_bucket_floor=4",
               "--blocks_bucket_floor=32"]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
MAX_QUEUE = 4
MODEL_POSITIONS = 1024
POOL_TOKENS = 40 * 16   # --num_device_blocks x --block_size: the context the server offers (< MODEL_POSITIONS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  from support.tiny_models import save_tiny_hf_model
  from superinfer_jax.model.tokenizer import Tokenizer, save_tokenizer
  d = str(tmp_path_factory.mktemp("tiny_llama_serve"))
  save_tiny_hf_model(d, "llama", max_position_embeddings=MODEL_POSITIONS, vocab_size=VOCAB, bos_token_id=VOCAB - 2,
                     eos_token_id=VOCAB - 1)
  save_tokenizer(Tokenizer(backend=word_tokenizer(VOCAB), bos_id=VOCAB - 2, eos_ids=(VOCAB - 1,),
                           chat_template=CHAT_TEMPLATE), d)
  return d


class Server:
  def __init__(self, model_dir, tmp, extra=()):
    self.port_file = os.path.join(tmp, f"port-{time.monotonic_ns()}")
    self.log = open(os.path.join(tmp, f"server-{time.monotonic_ns()}.log"), "w+")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), f"--model={model_dir}",
           "--served_model_name=tiny", "--port=0", f"--port_file={self.port_file}", "--log_level=warning",
           f"--max_queue={MAX_QUEUE}"] + ENGINE_ARGS + list(extra)
    self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not os.path.exists(self.port_file):
      if self.proc.poll() is not None or time.monotonic() > deadline:
        out = self.output()
        self.stop()
        raise RuntimeError(f"server did not start:\n{out}")
      time.sleep(0.2)
    with open(self.port_file) as f:
      self.port = int(f.read())
    self.url = f"http://127.0.0.1:{self.port}"
    self.health_seen = []   # the /health statuses answered while starting
    while True:
      try:
        status = httpx.get(self.url + "/health", timeout=5).status_code
        self.health_seen.append(status)
        if status == 200:
          break
      except httpx.HTTPError:
        pass
      if self.proc.poll() is not None or time.monotonic() > deadline:
        out = self.output()
        self.stop()
        raise RuntimeError(f"server not healthy:\n{out}")
      time.sleep(0.2)

  def output(self):
    self.log.flush()
    self.log.seek(0)
    return self.log.read()[-5000:]

  def stop(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait(30)
    self.log.close()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
  s = Server(model_dir, str(tmp_path_factory.mktemp("serve")))
  yield s
  s.stop()


@pytest.fixture
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def _generate_py(model_dir, prompt, max_tokens):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"), f"--model={model_dir}",
                      f"--prompt={prompt}", f"--max_tokens={max_tokens}", "--json"] + ENGINE_ARGS,
                     capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _metrics(server):
  return parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)


def _health_check(server):
  r = httpx.get(server.url + "/health", params={"check": 1}, timeout=30)
  assert r.status_code == 200, r.text
  h = r.json()
  assert h["invariants"] == "ok"
  return h


# ------------------------------------------------------------------------------------------ happy path

def test_models_and_health(server, client):
  assert [m.id for m in client.models.list().data] == ["tiny"]
  assert client.models.list().data[0].model_extra["max_model_len"] == POOL_TOKENS
  h = _health_check(server)
  assert h["device_blocks"] == 40 and h["device_blocks_free"] == 40


def test_completion_stream_equals_nonstream_equals_generate(server, client, model_dir):
  prompt, n = "w1 w2 w3 w4 w5", 12
  full = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
  text = full.choices[0].text
  assert full.choices[0].finish_reason == "length"
  assert full.usage.prompt_tokens == 5 and full.usage.completion_tokens == n and full.usage.total_tokens == 5 + n
  pieces, finish, usage = [], None, None
  for ch in client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
    if ch.choices:
      pieces.append(ch.choices[0].text)
      finish = ch.choices[0].finish_reason or finish
    if ch.usage:
      usage = ch.usage
  assert "".join(pieces) == text and finish == "length" and usage.completion_tokens == n
  ref = _generate_py(model_dir, prompt, n)
  # generate.py stops at eos; the server run ignores it: compare up to generate.py's length.
  k = len(ref["token_ids"])
  assert full.choices[0].model_extra["token_ids"][:k] == ref["token_ids"]
  if ref["finish_reason"] == "length":
    assert text == ref["text"]
  # Token-id prompts work too, and give the same greedy tokens.
  ids = client.completions.create(model="tiny", prompt=[1, 2, 3, 4, 5], max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
  assert ids.choices[0].text == text


def test_chat_stream_equals_nonstream_equals_generate(server, client, model_dir):
  msgs = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6"}]
  n = 10
  full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
  assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
  text = full.choices[0].message.content
  assert full.usage.prompt_tokens == 3 and full.usage.completion_tokens == n
  pieces, roles = [], []
  for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=n, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
    for c in ch.choices:
      if c.delta.role:
        roles.append(c.delta.role)
      pieces.append(c.delta.content or "")
  assert roles == ["assistant"] and "".join(pieces) == text
  ref = _generate_py(model_dir, "w9 w5 w6 ", n)     # the model's template: contents joined by spaces
  assert full.choices[0].model_extra["token_ids"][:len(ref["token_ids"])] == ref["token_ids"]
  if ref["finish_reason"] == "length":
    assert ref["text"] == text


def test_chat_without_max_tokens_gets_the_rest_of_the_pool_capped_context(client):
  """The model has 1024 positions but the pool holds 640 tokens: the server offers 640, and a chat request
  without max_tokens runs to the end of it (it would be refused as needing more blocks than the pool has
  if the default asked for the model's 1024)."""
  r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w3 w4"}],
                                     temperature=0, extra_body={"ignore_eos": True})
  assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
  assert r.usage.prompt_tokens + r.usage.completion_tokens == POOL_TOKENS


# A first stream of two step shapes: the prompt's prefill runs in the 32-token bucket, its decode steps (one
# token each) in the 8-token one; without the warm-up both compile on the request path.
SECOND_SHAPE_ARGS = ["--token_bucket_floor=8"]
STALL_PROMPT = " ".join(f"w{i}" for i in range(20))
# The tiny model steps in about a millisecond and the client reads several events at once, so gaps below this are
# read granularity, not the engine: "within 2x the median" is taken of max(median, this). A compile is >> 2x it.
GAP_RESOLUTION_S = 0.025


def _stalls(gaps) -> bool:
  """True when the worst token gap exceeds 2x the median gap (at the read granularity above)."""
  return max(gaps) > 2 * max(statistics.median(gaps), GAP_RESOLUTION_S)


def _first_stream_token_gaps(server, max_tokens=40) -> list:
  """Seconds between the streamed tokens of one completion (default sampling: temperature 1, the random mode)."""
  arrivals = []
  body = {"model": "tiny", "prompt": STALL_PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
  with httpx.Client(timeout=120) as c:
    with c.stream("POST", server.url + "/v1/completions", json=body) as r:
      for line in r.iter_lines():
        if line.startswith("data: {"):
          arrivals.append(time.monotonic())
  assert len(arrivals) >= max_tokens // 2
  return [b - a for a, b in zip(arrivals, arrivals[1:])]


def test_fresh_server_with_default_flags_streams_its_first_request_without_a_compile_stall(model_dir, tmp_path):
  s = Server(model_dir, str(tmp_path), extra=SECOND_SHAPE_ARGS)
  try:
    gaps = _first_stream_token_gaps(s)
    assert not _stalls(gaps), (max(gaps), statistics.median(gaps), s.output())
    assert "new shape(s) on the request path" not in s.output()   # the worker logs every request-path compile
  finally:
    s.stop()
  quick = Server(model_dir, str(tmp_path), extra=SECOND_SHAPE_ARGS + ["--noprecompile"])
  try:   # the opt-out: healthy at once, and the same first stream compiles its shapes on the request path
    assert quick.health_seen == [200], quick.health_seen
    _first_stream_token_gaps(quick)
    assert "new shape(s) on the request path" in quick.output()
  finally:
    quick.stop()


def test_precompile_is_the_default_with_a_progress_bar_and_health_is_503_until_ready(model_dir, tmp_path):
  s = Server(model_dir, str(tmp_path))
  try:
    out = s.output()
    assert 503 in s.health_seen and s.health_seen[-1] == 200, s.health_seen
    assert "[serve] precompiling the rotation buckets and 3 step shapes (1 token buckets x 3 sampling modes)" in out
    assert "[serve] precompiled [########################] 3/3 step shapes in" in out and "ready" in out
    r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
  finally:
    s.stop()


def test_max_model_len_beyond_the_pool_is_a_one_line_startup_error(model_dir, tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "serve.py"), f"--model={model_dir}",
                      "--port=0", "--max_model_len=1000"] + ENGINE_ARGS,
                     capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
  assert r.returncode == 2
  errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, r.stderr[-2000:]
  assert "--max_model_len=1000" in errors[0] and f"{POOL_TOKENS} tokens" in errors[0], errors


def test_stop_and_seed(server, client):
  base = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
  words = base.choices[0].text.split()
  assert len(words) >= 3
  stopped = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=8, temperature=0, stop=[words[2]],
                                      extra_body={"ignore_eos": True})
  assert stopped.choices[0].finish_reason == "stop" and words[2] not in stopped.choices[0].text.split()
  a, b = (client.completions.create(model="tiny", prompt="w1 w2", max_tokens=8, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True}).choices[0].text for _ in range(2))
  assert a == b


def test_stop_string_across_a_token_boundary(client):
  base = client.completions.create(model="tiny", prompt="w4 w8", max_tokens=10, temperature=0,
                                   extra_body={"ignore_eos": True})
  text = base.choices[0].text
  words = text.split()
  assert len(words) >= 4
  stop = f"{words[1][-1]} {words[2][:2]}"    # the end of one token's word and the start of the next one's
  cut = text.index(stop)
  r = client.completions.create(model="tiny", prompt="w4 w8", max_tokens=10, temperature=0, stop=stop,
                                extra_body={"ignore_eos": True})
  assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:cut]


def test_n_choices_seed_i_plus_one(client):
  kw = dict(model="tiny", prompt="w1 w2", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
  one = [client.completions.create(seed=s, **kw).choices[0].text for s in (11, 12, 13)]
  three = client.completions.create(seed=11, n=3, **kw)
  assert [c.index for c in three.choices] == [0, 1, 2]
  assert [c.text for c in three.choices] == one
  assert three.usage.completion_tokens == 18
  assert len(set(one)) > 1   # the seeds matter (else this test would prove nothing)


def test_logprobs_match_transformers(client, model_dir):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import numpy as np
  hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
  prompt_ids = [7, 8, 9, 10]
  r = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=6, temperature=0.9, seed=3, logprobs=3,
                                extra_body={"ignore_eos": True, "return_token_ids": True})
  out = r.choices[0].model_extra["token_ids"]
  with torch.no_grad():
    logits = hf(torch.tensor([prompt_ids + out])).logits[0].double()
  ref = torch.log_softmax(logits, -1).numpy()[len(prompt_ids) - 1:-1]
  lp = r.choices[0].logprobs
  np.testing.assert_allclose(lp.token_logprobs, [ref[j, t] for j, t in enumerate(out)], atol=2e-4)
  for j, top in enumerate(lp.top_logprobs):
    assert len(top) == 3
    np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(ref[j])[::-1][:3], atol=2e-4)
  # Chat format, greedy: each sampled token is its row's most likely one.
  c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w2 w3"}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
  content = c.choices[0].logprobs.content
  assert len(content) == 5
  for t in content:
    assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    assert t.logprob <= 0 and t.top_logprobs[1].logprob <= t.logprob


def test_streamed_logprobs_equal_the_non_streamed(client):
  kw = dict(model="tiny", prompt=[7, 8, 9], max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
  whole = client.completions.create(**kw).choices[0].logprobs
  streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
  for ch in client.completions.create(stream=True, **kw):
    lp = ch.choices[0].logprobs if ch.choices else None
    if lp is not None:
      for k in streamed:
        streamed[k] += getattr(lp, k)
  assert streamed["tokens"] == whole.tokens and len(whole.tokens) == 5
  assert streamed["token_logprobs"] == pytest.approx(whole.token_logprobs, abs=1e-6)
  assert [list(t) for t in streamed["top_logprobs"]] == [list(t) for t in whole.top_logprobs]


def _penalised_greedy(hf, prompt, n, *, bias=(), presence=0.0, frequency=0.0, repetition=1.0):
  """Greedy decoding of ``n`` tokens with vLLM's logit processing, by hand over transformers' logits: bias
  added, then repetition (prompt + output tokens), then frequency x count and presence (output tokens)."""
  import collections
  import torch
  out = []
  for _ in range(n):
    with torch.no_grad():
      x = hf(torch.tensor([prompt + out])).logits[0, -1].double().numpy().copy()
    for t, b in bias:
      x[t] += b
    for t in set(prompt + out):
      x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, c in collections.Counter(out).items():
      x[t] -= frequency * c + presence
    out.append(int(x.argmax()))
  return out


def test_penalties_and_logit_bias_change_the_output_as_specified(client, model_dir):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
  prompt, n = [7, 8, 9, 10, 7, 8], 8

  def run(**extra):
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True, **extra.pop("body", {})},
                                  **extra)
    return r.choices[0].model_extra["token_ids"]
  plain = run()
  assert plain == _penalised_greedy(hf, prompt, n)
  forced = run(logit_bias={"42": 100})
  assert forced == [42] * n
  banned = run(logit_bias={str(plain[0]): -100})
  assert plain[0] not in banned
  for kw, ref in ((dict(frequency_penalty=2.0), dict(frequency=2.0)), (dict(presence_penalty=2.0), dict(presence=2.0)),
                  (dict(body={"repetition_penalty": 3.0}), dict(repetition=3.0)),
                  (dict(logit_bias={"5": 3}, frequency_penalty=1.0), dict(bias=((5, 3.0),), frequency=1.0))):
    assert run(**kw) == _penalised_greedy(hf, prompt, n, **ref), kw
  assert len(set(plain)) < n and run(frequency_penalty=2.0) != plain   # plain greedy repeats; the penalty changes it


@pytest.mark.parametrize("field,value", [("best_of", 2), ("suffix", "x"), ("echo", True)])
def test_openai_client_sees_refused_fields(client, field, value):
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="tiny", prompt="w1", max_tokens=2, **{field: value})
  assert e.value.body["param"] == field and field in e.value.body["message"]
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=2,
                                   response_format={"type": "json_object"})
  assert e.value.body["param"] == "response_format"
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=2,
                                   tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
  assert e.value.body["param"] == "tools"


def test_models_retrieve_and_lone_surrogate(server, client):
  assert client.models.retrieve("tiny").id == "tiny"
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("nope")
  r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": "w1 \\ud800"}',
                 headers={"content-type": "application/json"}, timeout=30)
  assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text


# ------------------------------------------------------------------------------------------ bad input

BAD = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/completions", {"model": "tiny", "max_tokens": 4}, 400, "missing_required_parameter"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "missing_required_parameter"),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, 400, "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": "4"}, 400, "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "temperature": "hot"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400, "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "stream": "yes"}, 400, "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1 " * 700}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": -3}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": 700}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "temperature": -0.5}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "top_p": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "w1", "top_p": 1.5}, 400, "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 999]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "nope", "prompt": "w1"}, 404, "model_not_found"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "w1"}]}, 404,
     "model_not_found"),
    ("/v1/nothing", {}, 404, "not_found"),
]


@pytest.mark.parametrize("path,body,status,code", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_then_success(server, client, path, body, status, code):
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) >= {"message", "type", "code"} and err["message"] and err["code"] == code
  assert err["type"] == "invalid_request_error"
  ok = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=3, temperature=0)
  assert ok.choices[0].finish_reason in ("length", "stop")


def test_openai_client_sees_errors(client):
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="nope", prompt="w1", max_tokens=2)
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="tiny", prompt="w1", max_tokens=2, temperature=-1)
  assert "temperature" in str(e.value)


# ------------------------------------------------------------------------- disconnect and overload

def test_token_counters_and_latency_histograms(server, client):
  before = _metrics(server)
  r = client.completions.create(model="tiny", prompt="w1 w2 w3 w4", max_tokens=7, temperature=0,
                                extra_body={"ignore_eos": True})
  assert r.usage.completion_tokens == 7
  after = _metrics(server)
  d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
  assert d("superinfer_prompt_tokens_total") == 4 and d("superinfer_generation_tokens_total") == 7
  for h, n in (("time_to_first_token", 1), ("inter_token_latency", 6), ("e2e_request_latency", 1),
               ("request_queue_time", 1)):
    assert d(f"superinfer_{h}_seconds_count") == n, h
  assert 0 <= d("superinfer_request_queue_time_seconds_sum") <= d("superinfer_time_to_first_token_seconds_sum")
  assert d("superinfer_time_to_first_token_seconds_sum") <= d("superinfer_e2e_request_latency_seconds_sum")


def test_disconnect_mid_stream_frees_blocks(server):
  before = _metrics(server).get('superinfer_requests_finished_total{reason="abort"}', 0.0)
  body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 480, "temperature": 0, "stream": True,
          "ignore_eos": True}
  with httpx.Client(timeout=60) as c:
    with c.stream("POST", server.url + "/v1/completions", json=body) as r:
      assert r.status_code == 200
      n = 0
      for line in r.iter_lines():
        if line.startswith("data: "):
          n += 1
        if n >= 3:
          break
  deadline = time.monotonic() + 30
  while True:
    m = _metrics(server)
    if (m.get('superinfer_requests_finished_total{reason="abort"}', 0.0) > before
        and m['superinfer_device_blocks{kind="used"}'] == 0 and m["superinfer_num_requests_running"] == 0
        and m["superinfer_num_requests_admitted"] == 0):
      break
    assert time.monotonic() < deadline, m
    time.sleep(0.2)
  h = _health_check(server)
  assert h["device_blocks_free"] == h["device_blocks"] and h["running"] == h["waiting"] == h["rotary"] == 0


def _wait_idle_after_aborts(server, before, at_least=1):
  deadline = time.monotonic() + 30
  while True:
    m = _metrics(server)
    if (m.get('superinfer_requests_finished_total{reason="abort"}', 0.0) >= before + at_least
        and m['superinfer_device_blocks{kind="used"}'] == 0 and m["superinfer_num_requests_admitted"] == 0):
      return m
    assert time.monotonic() < deadline, m
    time.sleep(0.2)


def test_disconnect_non_streamed_request_aborts_it(server):
  before = _metrics(server).get('superinfer_requests_finished_total{reason="abort"}', 0.0)
  for _ in range(2):   # the second one runs on compiled shapes
    t = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "w4 w5", "max_tokens": 500, "temperature": 0, "ignore_eos": True})
    full_s = time.monotonic() - t
    assert r.status_code == 200
  with pytest.raises(httpx.TimeoutException):   # gone after a tenth of the time the request needs
    httpx.post(server.url + "/v1/completions", timeout=full_s / 10, json={
        "model": "tiny", "prompt": "w4 w5", "max_tokens": 500, "temperature": 0, "ignore_eos": True})
  _wait_idle_after_aborts(server, before)
  _health_check(server)


def test_many_streams_cut_at_random_points(server):
  import random
  rng = random.Random(0)
  before = _metrics(server).get('superinfer_requests_finished_total{reason="abort"}', 0.0)
  cut = [0, 1, 5, 20]

  def run(i):
    with httpx.Client(timeout=60) as c:
      with c.stream("POST", server.url + "/v1/completions", json={
          "model": "tiny", "prompt": f"w{i + 3} w7", "max_tokens": 400, "temperature": 0.8, "seed": i,
          "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for n, _ in enumerate(r.iter_lines()):
          if n >= cut[i]:
            break

  for _ in range(2):
    rng.shuffle(cut)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cut))]
    for t in threads:
      t.start()
    for t in threads:
      t.join(60)
    assert not any(t.is_alive() for t in threads)
  _wait_idle_after_aborts(server, before, at_least=2 * len(cut))
  h = _health_check(server)
  assert h["host_blocks_free"] == h["host_blocks"]
  ok = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "w1", "max_tokens": 3})
  assert ok.status_code == 200


def test_overload_rejects_with_429_and_loses_nothing(server):
  import asyncio

  async def one(c, i):
    r = await c.post(server.url + "/v1/completions", json={
        "model": "tiny", "prompt": f"w{i + 1} w2", "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    return r.status_code, r.json(), r.headers

  async def burst():
    async with httpx.AsyncClient(timeout=120) as c:
      return await asyncio.gather(*(one(c, i) for i in range(3 * MAX_QUEUE)))

  results = asyncio.run(asyncio.wait_for(burst(), 180))
  ok = [b for s, b, _ in results if s == 200]
  rejected = [b for s, b, _ in results if s == 429]
  assert all(h.get("retry-after") == "1" for s, _, h in results if s == 429)
  assert len(ok) + len(rejected) == len(results), [s for s, _, _ in results]
  assert len(ok) >= 1 and len(rejected) >= 1
  for b in ok:
    assert b["usage"]["completion_tokens"] == 24 and b["choices"][0]["finish_reason"] == "length"
  for b in rejected:
    assert b["error"]["code"] == "queue_full" and "max_queue" in b["error"]["message"]
  h = _health_check(server)
  assert h["admitted"] == 0 and h["device_blocks_free"] == h["device_blocks"]
  m = _metrics(server)
  assert m['superinfer_requests_rejected_total{reason="queue_full"}'] >= len(rejected)
  for name in ("superinfer_num_requests_waiting", "superinfer_num_requests_rotary", 'superinfer_host_blocks{kind="total"}',
               'superinfer_rotations_total{direction="out"}', 'superinfer_kv_bytes_moved_total{direction="d2h"}',
               "superinfer_num_preemptions_total", "superinfer_host_kv_cache_usage_perc"):
    assert name in m, name
  assert m["superinfer_kv_cache_usage_perc"] == 0.0   # idle: nothing in the device pool


# ----------------------------------------------------------------------------------------- shutdown

def _stream_lines(url, body, got, started):
  try:
    with httpx.Client(timeout=60) as c:
      with c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
          if line:
            got.append(line)
            started.set()
  finally:
    started.set()


def test_sigterm_drains_finishes_short_requests_and_ends_long_ones_with_a_final_event(model_dir, tmp_path):
  s = Server(model_dir, str(tmp_path), extra=["--shutdown_timeout=1"])
  try:
    runs = {}
    for name, n in (("long", 620), ("short", 20)):
      got, started = [], threading.Event()
      t = threading.Thread(target=_stream_lines, args=(s.url, {
          "model": "tiny", "prompt": "w1", "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True},
          got, started))
      t.start()
      assert started.wait(60)
      runs[name] = (t, got)
    s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:   # draining: new requests and /health get 503 with Retry-After
      r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2}, timeout=10)
      if r.status_code == 503:
        break
      assert time.monotonic() < deadline, r.text
      time.sleep(0.05)
    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "unavailable"
    h = httpx.get(s.url + "/health", timeout=10)
    assert h.status_code == 503 and h.json()["status"] == "draining"
    rc = s.proc.wait(60)
    for t, _ in runs.values():
      t.join(60)
      assert not t.is_alive()
    out = s.output()
    assert rc == 0, out
    assert "[serve] stopped on SIGTERM" in out
    short = [json.loads(l[6:]) for l in runs["short"][1] if l.startswith("data: {")]
    assert runs["short"][1][-1] == "data: [DONE]" and short[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"].split()) for c in short) == 20
    long_lines = runs["long"][1]
    assert long_lines[-1] == "data: [DONE]", long_lines[-3:]
    assert json.loads(long_lines[-2][6:])["error"]["code"] == "unavailable", long_lines[-3:]
    assert json.loads(long_lines[-3][6:])["choices"][0]["finish_reason"] == "abort"
    drained = json.loads(out.split("[serve] drained: ")[1].splitlines()[0])
    assert drained["aborted"] == 1 and drained["admitted"] == 0 and drained["invariants"] == "ok"
    assert drained["device_blocks_free"] == drained["device_blocks"] == 40
    assert drained["host_blocks_free"] == drained["host_blocks"]
  finally:
    s.stop()


# ------------------------------------------------------------------------------------ bench_serving

def test_bench_serving_against_server(model_dir, tmp_path):
  from superinfer_jax.metrics import read_results, read_timelines, requests_filename, validate_results_row
  s = Server(model_dir, str(tmp_path), extra=["--max_queue=64", "--policy=rotasched"])
  try:
    out = tmp_path / "bench"
    timelines = out / requests_filename("rotasched", 4.0)
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "bench_serving.py"),
                          f"--base_url={s.url}/v1", f"--model={model_dir}", "--dataset=synthetic", "--num_requests=8",
                          "--rps=4", "--synthetic_prompt_len=uniform:8,24", "--synthetic_output_len=uniform:6,12",
                          "--ttft_slo=5", "--tbt_slo=1", "--label=rotasched", f"--output_dir={out}",
                          "--progress_interval=0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    partial = set()   # line counts of the requests file seen while the run went on
    deadline = time.monotonic() + 300
    while p.poll() is None:
      assert time.monotonic() < deadline
      if timelines.exists() and not (out / "results.jsonl").exists():
        partial.add(len(timelines.read_text().splitlines()))
      time.sleep(0.05)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr[-3000:]
    assert partial & set(range(1, 8)), partial   # some of the 8 requests were on disk before the run ended
    assert "[bench] warm-up: 8/8" in stdout
    assert "[bench] rps=4 rep=0 [" in stdout and "8/8 done, 0 errors" in stdout
    table = stdout[stdout.index("[bench] summary"):].splitlines()
    assert table[1].startswith("| label | rps |") and "goodput req/s" in table[1]
    assert table[3].startswith("| rotasched | 4 | 0 | 8/8 | 0 |")
    rows = read_results(str(out / "results.jsonl"))
    assert len(rows) == 1
    row = rows[0]
    validate_results_row(row)
    assert row["engine"] == "http" and row["policy"] == "rotasched" and row["model"] == "tiny"
    assert row["num_requests"] == 8 and row["num_finished"] == 8 and row["num_errors"] == 0
    assert row["slo_attainment"] > 0 and row["num_rotations"] >= 0
    assert row["goodput_req_s"] == pytest.approx(row["slo_attainment"] * 8 / row["duration_s"])
    assert table[3].endswith(f"| {100 * row['slo_attainment']:.1f} | {row['goodput_req_s']:.2f} |")
    tls = read_timelines(str(timelines))
    assert len(tls) == 8 and [t.request_id for t in tls] == sorted((t.request_id for t in tls), key=int)
    for tl in tls:
      assert tl.finish_reason == "length" and tl.output_len == tl.target_output_len
      assert tl.token_times_s == sorted(tl.token_times_s) and tl.token_times_s[0] >= tl.arrival_s
  finally:
    s.stop()
