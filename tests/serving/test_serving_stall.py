"""One bad client stalls nobody: the app in a real uvicorn server (in a thread, on a loopback port) over a
paced fake engine (one token per 50 ms, a decode step of a large model), a stream measured at the client while other clients send a 10 MB
body, send a body slowly, or never read their stream. Every wait is bounded."""
import json
import socket
import statistics
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from superinfer_jax.serving.app import build_app  # noqa: E402
from support.fake_engine import FakeEngine  # noqa: E402

STEP_S = 0.05


class PacedEngine(FakeEngine):
  def __init__(self):
    super().__init__()
    self.max_model_len = 10**6

  def step(self):
    time.sleep(STEP_S)
    return super().step()


@pytest.fixture
def paced_server():
  app = build_app(PacedEngine(), ["fake"], max_queue=16, max_body_bytes=1 << 20)
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
  t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  t.start()
  url = f"http://127.0.0.1:{sock.getsockname()[1]}"
  deadline = time.monotonic() + 30
  while not server.started:
    assert time.monotonic() < deadline and t.is_alive()
    time.sleep(0.05)
  yield url
  server.should_exit = True
  t.join(30)


def _raw_request(url, body: bytes, announced: int):
  host, port = url[len("http://"):].split(":")
  s = socket.create_connection((host, int(port)), timeout=10)
  s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {announced}\r\n\r\n".encode() + body)
  return s


def test_big_slow_and_unread_clients_do_not_stall_a_stream(paced_server):
  url = paced_server
  slow_sender = _raw_request(url, b'{"prompt": [1, 2', 1000)                 # and then nothing more
  unread = json.dumps({"prompt": [1], "max_tokens": 100000, "stream": True}).encode()
  slow_reader = _raw_request(url, unread, len(unread))                       # never reads its stream
  arrivals, big = [], {}
  body = json.dumps({"prompt": list(range(2_000_000)), "max_tokens": 1}).encode()   # ~15 MB of token ids
  assert len(body) > 10 * 2**20

  def send_big():
    t = time.monotonic()
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    big.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t, finished_at=time.monotonic())

  sender = threading.Thread(target=send_big)
  with httpx.Client(timeout=60) as c:
    with c.stream("POST", url + "/v1/completions", json={"prompt": [1], "max_tokens": 80, "stream": True}) as r:
      for line in r.iter_lines():
        if line.startswith("data: {"):
          arrivals.append(time.monotonic())
          if len(arrivals) == 20:
            sender.start()
  sender.join(30)
  assert big["status"] == 413 and str(1 << 20) in big["body"]["error"]["message"], big
  assert big["seconds"] < 2.0, big
  gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]     # from the second token: the first is prefill
  assert len(gaps) >= 70 and big["finished_at"] < arrivals[-1]   # the big request was answered mid-stream
  med = statistics.median(gaps)
  assert max(gaps) < 2 * med, (max(gaps), med)
  slow_sender.close()
  slow_reader.close()
  deadline = time.monotonic() + 20
  while httpx.get(url + "/health").json()["admitted"]:
    assert time.monotonic() < deadline
    time.sleep(0.1)
