"""Multi-host serving: process 0 serves HTTP and broadcasts each engine iteration's events (new requests,
aborts, stop) to the other processes, which apply them in the same order before the same step.

End to end: two CPU processes joined by ``jax.distributed`` on loopback run ``scripts/serve.py`` (a 2-device
"tp" mesh across them); concurrent completions (plain, streamed, and one stream cut by its client) sent to
process 0 give the greedy tokens of a single-process engine, both processes exit 0 on SIGTERM, and their
plan digests agree. In process: the wire format, the channel over a fake collective, and two workers kept
in lockstep over fake engines (same engine calls in the same order, bounded idle broadcasts)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from superinfer_jax.engine.config import SamplingParams
from support.fake_engine import FakeEngine
from superinfer_jax.parallel.events import (AbortEvent, AddEvent, EventBatch, EventChannel, bucket_size,
                                            decode_batch, encode_batch)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------ wire format

def test_batch_round_trips_and_buckets():
  p = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop_token_ids=[4, 5],
                     stop=["x y"], ignore_eos=True, presence_penalty=0.5, frequency_penalty=-1.0,
                     repetition_penalty=1.2, logit_bias={"9": -3.5, 2: 100}, logprobs=4).validate()
  b = EventBatch(time=1234.5678901234, events=[AddEvent("r1", [1, 2, 3], p, 2.0, None), AbortEvent("r0"),
                                               AddEvent("r2", "w1 w2", SamplingParams()),
                                               AbortEvent("r1", shutdown=True)], stop=True)
  got = decode_batch(encode_batch(b))
  assert got == b and got.events[0].params == p and got.events[0].params.stop_token_ids == (4, 5)
  assert got.events[0].params.logit_bias == ((2, 100.0), (9, -3.5)) and got.events[0].params.logprobs == 4
  assert got.time == b.time   # floats round-trip exactly
  assert [bucket_size(n) for n in (0, 1, 256, 257, 1000, 5000)] == [256, 256, 256, 512, 1024, 8192]
  assert bucket_size(3, min_bucket=1) == 4
  with pytest.raises(ValueError, match="integers"):
    encode_batch(EventBatch(events=[AddEvent("r", [1, 2.5], p)]))
  with pytest.raises(ValueError, match="wire version"):
    decode_batch(b'{"v": 99, "time": null, "stop": false, "events": []}')
  assert EventBatch().empty and not EventBatch(stop=True).empty


class FakeCollective:
  """In-process stand-in for the broadcast collective among ``n`` threads: every caller blocks until all
  have called, then gets the source's array (shapes and dtypes must agree, as for the real one)."""

  def __init__(self, n: int):
    self._barrier = threading.Barrier(n, timeout=30)
    self._slot = {}
    self.calls = 0

  def member(self, is_source: bool):
    def broadcast(x):
      x = np.asarray(x)
      if is_source:
        self._slot["x"] = x.copy()
        self.calls += 1
      self._barrier.wait()
      src = self._slot["x"]
      assert src.shape == x.shape and src.dtype == x.dtype, (src.shape, x.shape)
      self._barrier.wait()     # nobody overwrites the slot before everyone read it
      return src
    return broadcast


def _channels(n=2, **kw):
  coll = FakeCollective(n)
  return coll, [EventChannel(is_source=i == 0, broadcast=coll.member(i == 0), **kw) for i in range(n)]


def test_channel_sends_process_zeros_batch_with_bounded_shapes():
  coll, (src, dst) = _channels(min_bucket=64)
  batches = [EventBatch(), EventBatch(time=3.0, events=[AddEvent("a", list(range(50)), SamplingParams())]),
             EventBatch(time=4.0, events=[AbortEvent("a")]), EventBatch(stop=True)]
  got = []
  t = threading.Thread(target=lambda: got.extend(dst.exchange(None) for _ in batches))
  t.start()
  mine = [src.exchange(b) for b in batches]
  t.join(30)
  assert got == mine and mine[1:] == batches[1:] and mine[0].empty
  assert coll.calls == 1 + 2 * 3             # an empty batch costs the header only
  assert src.exchanges == dst.exchanges == 4 and src.payloads == dst.payloads == 3
  with pytest.raises(ValueError, match="must pass"):
    src.exchange(None)


# --------------------------------------------------------------------------------- workers in lockstep

class RecordingEngine(FakeEngine):
  """``FakeEngine`` that logs every call that changes its state, with the arrival time it was given, and
  rejects a duplicate id or more than 10**6 tokens as the real engine rejects a bad request."""

  def __init__(self, clock=None):
    super().__init__(clock)
    self.log = []

  def add_request(self, prompt, params, request_id, ttft_slo=None, tbt_slo=None, arrival_time=None):
    if request_id in self.live or params.max_tokens > 10**6:
      self.log.append(("rejected", request_id))
      raise ValueError("too long")
    super().add_request(prompt, params, request_id, ttft_slo, tbt_slo, arrival_time)
    self.log.append(("add", request_id, tuple(prompt), params.max_tokens, ttft_slo, arrival_time))

  def abort(self, rid):
    self.log.append(("abort", rid, rid in self.live))
    super().abort(rid)

  def release(self, rid):
    self.log.append(("release", rid))

  def step(self):
    self.log.append(("step", tuple(sorted(self.live))))
    return super().step()


def test_workers_apply_the_same_events_before_the_same_steps():
  from superinfer_jax.serving.worker import EngineWorker
  _, (ch0, ch1) = _channels(idle_interval_s=0.05)
  t0 = [100.0]

  def clock():
    t0[0] += 1.0
    return t0[0]

  eng0, eng1 = RecordingEngine(clock), RecordingEngine(lambda: -1.0)   # only process 0's clock is read
  follower = EngineWorker(eng1, None, channel=ch1)
  done = threading.Event()
  ft = threading.Thread(target=lambda: (follower.follow(), done.set()))
  ft.start()
  with pytest.raises(ValueError, match="follow"):
    EngineWorker(RecordingEngine(), None, channel=ch0).follow()
  with pytest.raises(ValueError, match="engine_factory"):
    EngineWorker(RecordingEngine(), None, channel=ch0, engine_factory=RecordingEngine)

  async def drive():
    loop = asyncio.get_running_loop()
    w = EngineWorker(eng0, loop, channel=ch0, max_queue=16)
    w.start()
    qs = {f"r{i}": w.submit(f"r{i}", [i, i + 1], SamplingParams(max_tokens=3 + i)) for i in range(4)}
    long_q = w.submit("long", [9], SamplingParams(max_tokens=10**6), ttft_slo=5.0)
    bad_q = w.submit("bad", [1], SamplingParams(max_tokens=10**6 + 1))          # the engine rejects it: 400
    kind, ev = await asyncio.wait_for(bad_q.get(), 10)
    assert kind == "error" and ev.status == 400
    await asyncio.wait_for(long_q.get(), 10)                               # it runs ...
    w.abort("long")                                                        # ... until its client leaves
    outs = {}
    for rid, q in qs.items():
      toks = []
      while True:
        kind, ev = await asyncio.wait_for(q.get(), 10)
        assert kind == "output"
        toks += ev.token_ids
        if ev.finished:
          break
      outs[rid] = toks
      w.done(rid)
    assert outs == {f"r{i}": list(range(1, 4 + i)) for i in range(4)}
    probe = await asyncio.wait_for(w.call(lambda e: len(e.live)), 10)     # a call runs on process 0 only
    assert probe == 0
    n_idle = ch0.exchanges
    await asyncio.sleep(0.5)                                               # idle: a broadcast per interval
    n_idle = ch0.exchanges - n_idle
    assert 3 <= n_idle <= 0.5 / 0.05 + 3, n_idle
    late_q = w.submit("late", [5], SamplingParams(max_tokens=10**6))
    await asyncio.wait_for(late_q.get(), 10)
    await loop.run_in_executor(None, w.stop)                               # shutdown aborts "late": 503
    while True:
      kind, ev = await asyncio.wait_for(late_q.get(), 10)
      if kind != "output":
        break
      assert not ev.finished
    assert kind == "error" and ev.status == 503
    assert w.fatal is None

  asyncio.run(drive())
  assert done.wait(30), "the follower did not stop with process 0"
  ft.join(30)
  assert follower.fatal is None
  assert eng0.log == eng1.log                     # the same engine calls, in the same order, same arguments
  kinds = [e[0] for e in eng0.log]
  assert kinds.count("add") == 6 and ("rejected", "bad") in eng0.log
  assert ("abort", "long", True) in eng0.log and ("abort", "late", True) in eng0.log
  adds = [e for e in eng0.log if e[0] == "add"]
  assert all(a[5] is not None and a[5] > 100.0 for a in adds)           # process 0's clock everywhere
  assert [a[4] for a in adds if a[1] == "long"] == [5.0]
  assert ch0.exchanges == ch1.exchanges


def test_follower_fails_loudly_when_its_step_raises():
  from superinfer_jax.serving.worker import EngineWorker
  _, (ch0, ch1) = _channels(idle_interval_s=0.05)
  eng1 = RecordingEngine()

  def boom():
    raise RuntimeError("device lost")

  eng1.step = boom
  follower = EngineWorker(eng1, None, channel=ch1)
  errors = []

  def run():
    try:
      follower.follow()
    except RuntimeError as e:
      errors.append(str(e))

  t = threading.Thread(target=run)
  t.start()
  ch0.exchange(EventBatch(time=1.0, events=[AddEvent("a", [1], SamplingParams(max_tokens=2))]))
  t.join(30)
  assert not t.is_alive() and errors and "device lost" in errors[0]


# ------------------------------------------------------------------------------------- two processes

VOCAB = 96
ENGINE_ARGS = ["--block_size=16", "--num_device_blocks=12", "--num_host_blocks=64", "--max_num_seqs=4",
               "--max_num_batched_tokens=32", "--token_bucket_floor=32", "--seq_bucket_floor=4",
               "--blocks_bucket_floor=16", "--policy=rotasched", "--attention=reference"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1")
  for k in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  from support.tiny_models import word_tokenizer
  from support.tiny_models import save_tiny_hf_model
  from superinfer_jax.model.tokenizer import Tokenizer, save_tokenizer
  d = str(tmp_path_factory.mktemp("tiny_llama_mh_serve"))
  save_tiny_hf_model(d, "llama", max_position_embeddings=256, vocab_size=VOCAB, bos_token_id=VOCAB - 2,
                     eos_token_id=VOCAB - 1)
  save_tokenizer(Tokenizer(backend=word_tokenizer(VOCAB), bos_id=VOCAB - 2, eos_ids=(VOCAB - 1,)), d)
  return d


def _reference_tokens(model_dir, prompts, max_tokens):
  """Greedy tokens of one process, one device (no mesh), same engine settings."""
  from absl import flags
  from superinfer_jax.engine.config import define_engine_flags, engine_config_from_flags
  from superinfer_jax.engine.engine import LLMEngine
  fv = flags.FlagValues()
  define_engine_flags(fv)
  fv(["ref"] + ENGINE_ARGS)
  engine = LLMEngine(model_dir, engine_config_from_flags(fv))
  outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
  return [o.token_ids for o in outs]


def test_two_process_server_serves_the_tokens_of_one(model_dir, tmp_path):
  httpx = pytest.importorskip("httpx")
  pytest.importorskip("fastapi")
  pytest.importorskip("uvicorn")
  from superinfer_jax.serving.metrics import parse_metrics
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, VOCAB - 3, n).tolist() for n in (21, 34, 9, 27, 40)]
  n_tok = 16
  port_file = str(tmp_path / "port")
  addr = f"127.0.0.1:{_free_port()}"
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), f"--model={model_dir}", "--served_model_name=tiny",
         "--port=0", f"--port_file={port_file}", "--log_level=warning", "--shutdown_timeout=1",
         "--tensor_parallel_size=2", f"--coordinator_address={addr}", "--num_processes=2",
         "--idle_broadcast_interval=0.2"] + ENGINE_ARGS
  logs = [open(tmp_path / f"p{i}.log", "w+") for i in range(2)]
  procs = [subprocess.Popen(cmd + [f"--process_id={i}"], stdout=logs[i], stderr=subprocess.STDOUT, env=_env(),
                            cwd=ROOT) for i in range(2)]

  def output(i):
    logs[i].flush()
    logs[i].seek(0)
    return logs[i].read()

  try:
    want = _reference_tokens(model_dir, prompts, n_tok)    # compiles while the servers start
    deadline = time.monotonic() + 120
    while not os.path.exists(port_file):
      assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, output(0) + output(1)
      time.sleep(0.2)
    url = f"http://127.0.0.1:{int(open(port_file).read())}"
    while True:  # as a client would: the servers precompile their step shapes before they take requests
      assert all(p.poll() is None for p in procs) and time.monotonic() < deadline + 300, output(0) + output(1)
      try:
        if httpx.get(url + "/health", timeout=5).status_code == 200:
          break
      except httpx.TransportError:
        pass
      time.sleep(0.5)
    results, errors = {}, []

    def plain(i):
      r = httpx.post(url + "/v1/completions", timeout=120, json={
          "model": "tiny", "prompt": prompts[i], "max_tokens": n_tok, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True})
      assert r.status_code == 200, r.text
      results[i] = r.json()["choices"][0]["token_ids"]

    def streamed(i):
      toks = []
      with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
          "model": "tiny", "prompt": prompts[i], "max_tokens": n_tok, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
          if line.startswith("data: ") and line != "data: [DONE]":
            toks += json.loads(line[6:])["choices"][0].get("token_ids") or []
      results[i] = toks

    def cut():   # a client that leaves after two chunks: its request is aborted on every process
      with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
          "model": "tiny", "prompt": prompts[0][:5], "max_tokens": 150, "temperature": 0, "ignore_eos": True,
          "stream": True}) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
          n += line.startswith("data: ")
          if n >= 2:
            break

    def guard(fn, *a):
      try:
        fn(*a)
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(repr(e))

    threads = [threading.Thread(target=guard, args=(plain, i)) for i in (0, 1, 2, 3)]
    threads += [threading.Thread(target=guard, args=(streamed, 4)), threading.Thread(target=guard, args=(cut,))]
    for t in threads:
      t.start()
    for t in threads:
      t.join(180)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert [results[i] for i in range(len(prompts))] == want

    deadline = time.monotonic() + 30
    while True:   # the cut request's blocks come back
      h = httpx.get(url + "/health", params={"check": 1}, timeout=30).json()
      if h["admitted"] == 0 and h["device_blocks_free"] == h["device_blocks"]:
        break
      assert time.monotonic() < deadline, h
      time.sleep(0.2)
    assert h["invariants"] == "ok" and h["running"] == h["waiting"] == h["rotary"] == 0
    m = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    print("rotations out/in:", m['superinfer_rotations_total{direction="out"}'],
          m['superinfer_rotations_total{direction="in"}'], "aborted:",
          m.get('superinfer_requests_finished_total{reason="abort"}'), "steps:", m["superinfer_engine_steps_total"])
    assert m.get('superinfer_requests_finished_total{reason="abort"}') == 1

    procs[0].send_signal(signal.SIGTERM)
    rcs = [p.wait(60) for p in procs]
    outs = [output(i) for i in range(2)]
    assert rcs == [0, 0], outs
    assert "[serve] stopped on SIGTERM" in outs[0] and "[serve] process 1: stopped" in outs[1]
    assert "http://" not in outs[1]                                        # only process 0 serves
    digests = [next(l for l in outs[i].splitlines() if l.startswith(f"[distributed] process {i}:")).split(":", 1)[1]
               for i in range(2)]
    assert digests[0] == digests[1] and " 0 plans" not in digests[0], digests
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(30)
    for f in logs:
      f.close()
