"""Prefix caching through the OpenAI server: ``cache_salt`` is parsed (a malformed one is a 400 naming it) and
reaches the engine, ``usage.prompt_tokens_details.cached_tokens`` reports the prompt tokens found cached
(bodies and the ``include_usage`` chunk), and ``/metrics`` counts prefix-cache queries and hits per tier in
tokens, consistent with the requests' ``cached_tokens``."""
import json
import types

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from superinfer_jax.engine.request_book import MAX_CACHE_SALT_CHARS  # noqa: E402
from superinfer_jax.serving import protocol as P  # noqa: E402
from superinfer_jax.serving.app import build_app  # noqa: E402
from superinfer_jax.serving.metrics import parse_metrics  # noqa: E402
from superinfer_jax.serving.request_parsing import parse_request  # noqa: E402
from superinfer_jax.serving.worker import EngineWorker  # noqa: E402
from support.fake_engine import FakeEngine  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "x"}]}
BAD_SALTS = [("", "invalid_value"), (5, "invalid_type"), ("s" * (MAX_CACHE_SALT_CHARS + 1), "invalid_value"),
             (["a"], "invalid_type")]


def _post(c, body, path="/v1/completions"):
  return c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def _stream(c, body):
  """The JSON chunks of a streamed completion (``[DONE]`` checked and dropped)."""
  with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as s:
    assert s.status_code == 200
    events = [l[6:] for l in s.iter_lines() if l.startswith("data: ")]
  assert events[-1] == "[DONE]"
  return [json.loads(e) for e in events[:-1]]


def test_cache_salt_is_parsed_and_a_malformed_one_is_a_400_naming_it():
  for kind, base in (("completion", {"prompt": "x"}), ("chat", CHAT)):
    req, _ = parse_request(dict(base, cache_salt="tenant-a"), kind, ["m"])
    assert req.cache_salt == "tenant-a"
    assert parse_request(dict(base, cache_salt="s" * MAX_CACHE_SALT_CHARS), kind, ["m"])[0].cache_salt
    assert parse_request(dict(base), kind, ["m"])[0].cache_salt is None
    assert parse_request(dict(base, cache_salt=None), kind, ["m"])[0].cache_salt is None
    for salt, code in BAD_SALTS:
      with pytest.raises(P.APIError) as e:
        parse_request(dict(base, cache_salt=salt), kind, ["m"])
      assert e.value.status == 400 and e.value.param == "cache_salt" and e.value.code == code, (salt, e.value.body())
      assert "'cache_salt'" in e.value.message


def test_cache_salt_over_http_reaches_the_engine_and_usage_has_cached_tokens():
  """Over the fake engine (no prefix cache: num_cached_tokens stays None): bad salts are 400s naming the field on
  both endpoints, a good one is handed to ``add_request`` (none when not given), and usage carries
  ``prompt_tokens_details.cached_tokens`` = 0, in the body and in the include_usage chunk."""
  eng = FakeEngine()
  seen = {}
  add = eng.add_request

  def spy(prompt, params, request_id, **kw):
    seen[request_id] = kw.pop("cache_salt", "<absent>")
    return add(prompt, params, request_id, **kw)
  eng.add_request = spy
  with TestClient(build_app(eng, ["fake"], max_queue=8)) as c:
    for path, base in (("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}), ("/v1/chat/completions", CHAT)):
      for salt, code in BAD_SALTS:
        r = _post(c, dict(base, cache_salt=salt), path)
        assert r.status_code == 400, (path, salt, r.text)
        err = r.json()["error"]
        assert err["param"] == "cache_salt" and err["code"] == code and "'cache_salt'" in err["message"], err
    assert not seen
    r = _post(c, {"prompt": [1, 2], "max_tokens": 2, "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    r = _post(c, {"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert sorted(seen.values()) == ["<absent>", "tenant-a"]
    chunks = _stream(c, {"prompt": [1], "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    m = parse_metrics(c.get("/metrics").text)
    assert m["superinfer_prefix_cache_queries_total"] == 0
    assert m['superinfer_prefix_cache_hits_total{tier="device"}'] == 0
    assert m['superinfer_prefix_cache_hits_total{tier="host"}'] == 0


def test_the_salt_rides_on_the_broadcast_add_event():
  """Multi-process: the engine events broadcast to every process carry the salt, so all apply it alike."""
  from superinfer_jax.parallel.events import AddEvent, EventBatch, decode_batch, encode_batch
  from superinfer_jax.engine.config import SamplingParams
  batch = EventBatch(time=1.0, events=[AddEvent("r", [1, 2], SamplingParams(), None, None, "tenant-a"),
                                       AddEvent("s", "hi", SamplingParams())])
  back = decode_batch(encode_batch(batch))
  assert [e.cache_salt for e in back.events] == ["tenant-a", None]


BS = 8


def test_cached_tokens_salts_and_prefix_cache_metrics_over_a_real_engine(tmp_path):
  """A real LLMEngine (prefix caching on, its default) behind the app: the second of two identical prompts of
  several blocks reports cached_tokens = its full blocks before the last token (a multiple of the block size,
  below prompt_tokens), the first 0; a salt isolates (another salt: 0, the same salt again: cached); streams
  with include_usage report the same; /metrics' queries and per-tier hits (tokens) match the requests."""
  pytest.importorskip("transformers")
  from superinfer_jax.engine.config import EngineConfig
  from superinfer_jax.engine.engine import LLMEngine
  from support.tiny_models import save_tiny_hf_model
  save_tiny_hf_model(str(tmp_path), "llama", max_position_embeddings=128)
  cfg = EngineConfig.create(num_device_blocks=48, num_host_blocks=16, block_size=BS, max_num_batched_tokens=64,
                            token_bucket_floor=64, seq_bucket_floor=4, blocks_bucket_floor=16)
  eng = LLMEngine(str(tmp_path), cfg)
  assert eng.config.scheduler.enable_prefix_caching
  prompt = [3 + (7 * i) % 120 for i in range(5 * BS + 3)]   # 43 tokens: 5 full blocks and 3 tokens
  other = [4 + (11 * i) % 120 for i in range(5 * BS + 3)]
  full = (len(prompt) - 1) // BS * BS                           # the last token is always computed: 40
  reported = []

  def usage(body, path="/v1/completions"):
    r = _post(c, dict(body, max_tokens=3, temperature=0, ignore_eos=True), path)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] == len(body["prompt"]) and u["completion_tokens"] == 3
    assert set(u["prompt_tokens_details"]) == {"cached_tokens"}
    reported.append(u["prompt_tokens_details"]["cached_tokens"])
    return u["prompt_tokens_details"]["cached_tokens"]

  def streamed(body):
    chunks = _stream(c, dict(body, max_tokens=3, temperature=0, ignore_eos=True,
                             stream_options={"include_usage": True}))
    assert all("usage" not in ch for ch in chunks[:-1])
    u = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and u["prompt_tokens"] == len(body["prompt"])
    reported.append(u["prompt_tokens_details"]["cached_tokens"])
    return u["prompt_tokens_details"]["cached_tokens"]

  with TestClient(build_app(eng, ["tiny"], max_queue=8)) as c:
    assert usage({"prompt": prompt}) == 0
    second = usage({"prompt": prompt})
    assert 0 < second < len(prompt) and second % BS == 0 and second == full
    assert usage({"prompt": prompt, "cache_salt": "alice"}) == 0     # salted: not the unsalted blocks
    assert usage({"prompt": prompt, "cache_salt": "bob"}) == 0       # nor another salt's
    assert usage({"prompt": prompt, "cache_salt": "alice"}) == full  # the same salt shares
    assert streamed({"prompt": other}) == 0
    assert streamed({"prompt": other}) == full
    chunks = _stream(c, {"prompt": other, "max_tokens": 2})            # no include_usage: no usage chunk
    assert all("usage" not in ch for ch in chunks)
    m = parse_metrics(c.get("/metrics").text)
    queries = m["superinfer_prefix_cache_queries_total"]
    hits = {t: m[f'superinfer_prefix_cache_hits_total{{tier="{t}"}}'] for t in ("device", "host")}
    # 8 requests, each a first admission of 5 full prompt blocks; the hits are exactly what the bodies reported
    # (the last stream reported none, being without usage, but found its prompt cached too).
    assert queries == 8 * 5 * BS
    assert hits["device"] + hits["host"] == sum(reported) + full
    assert queries >= hits["device"] + hits["host"] and hits["device"] > 0
    assert queries % BS == 0 and hits["device"] % BS == 0 and hits["host"] % BS == 0
    h = c.get("/health", params={"check": 1}).json()
    assert h["invariants"] == "ok" and h["admitted"] == 0
