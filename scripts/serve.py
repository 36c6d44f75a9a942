"""OpenAI-compatible HTTP server over the serving engine (FastAPI + uvicorn).

Examples:
  python scripts/serve.py --model=smollm2-135m --num_device_blocks=256 --policy=rotasched --port=8000
  curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
      -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 16}'

Routes: POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models, GET /health,
GET /metrics (Prometheus). One engine thread owns the engine and steps continuously; every engine
setting is a flag (see superinfer_jax/engine/config.py; --helpfull lists them). --max_queue bounds the
requests accepted and not yet finished: beyond it the server answers 429. SIGINT / SIGTERM: the server
answers 503 (Retry-After) to new requests, lets the admitted ones finish for up to --shutdown_timeout
seconds, aborts the rest (each stream ends with finish_reason abort, an error event and [DONE]) and exits 0;
a second signal stops it at once. docs/serving.md has the details.

Multi-host: run it on every host with the same flags plus --coordinator_address/--num_processes/--process_id
(docs/parallel.md). Process 0 serves HTTP; the others run the engine loop on process 0's broadcast events
and exit when process 0 stops.
"""
import json
import logging
import os
import signal
import socket
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from superinfer_jax import configtree  # noqa: E402
from superinfer_jax.sweep import SweepSpec  # noqa: E402
from superinfer_jax.engine.config import define_engine_flags, engine_config_from_flags  # noqa: E402
from superinfer_jax.util import freeze_heap  # noqa: E402
from superinfer_jax.parallel.distributed import (define_distributed_flags, initialize_from_flags,  # noqa: E402
                                                 is_primary)

configtree.define_flags(SweepSpec, only={"model"})   # --model: the model the engine loads
flags.DEFINE_string("served_model_name", None, "model name clients use (default: --model's base name)")
flags.DEFINE_string("host", "127.0.0.1", "address to bind (default loopback only)")
flags.DEFINE_integer("port", 8000, "port to bind (0: any free port; see --port_file)")
flags.DEFINE_string("port_file", None, "write the bound port to this file once the server listens")
flags.DEFINE_integer("max_queue", 256, "max requests accepted and not finished; beyond it: HTTP 429")
flags.DEFINE_integer("max_request_bytes", 4 << 20, "largest request body accepted; beyond it: HTTP 413")
flags.DEFINE_float("shutdown_timeout", 10.0, "seconds admitted requests get to finish on SIGINT/SIGTERM (503 to "
                   "new ones meanwhile); then the rest are aborted")
flags.DEFINE_bool("precompile", True, "compile every step shape (each sampling mode) and the rotation buckets "
                  "before serving, so no request pays a compile (in the engine thread once the server listens; "
                  "/health answers 503 until done, with a progress bar in the log); --noprecompile for a quick "
                  "development start whose first requests compile on the request path")
flags.DEFINE_string("log_level", "info", "uvicorn / server log level")
flags.DEFINE_float("switch_interval", 0.0005, "Python's thread switch interval (s): the engine thread and the "
                   "event loop share the GIL; the default 5 ms would delay steps behind HTTP work")
flags.DEFINE_float("idle_broadcast_interval", 1.0, "multi-host: seconds process 0 waits for a request while idle "
                   "before it broadcasts an empty event batch (bounds the other processes' wait in one collective)")
define_engine_flags()
define_distributed_flags()
FLAGS = flags.FLAGS


def _served_name(model: str) -> str:
  return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.max_queue < 1:
    raise app.UsageError("--max_queue must be >= 1")
  if FLAGS.max_request_bytes < 1:
    raise app.UsageError("--max_request_bytes must be >= 1")
  if not FLAGS.idle_broadcast_interval > 0:
    raise app.UsageError("--idle_broadcast_interval must be > 0")
  try:
    multi = initialize_from_flags()
    config = engine_config_from_flags()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  sys.setswitchinterval(FLAGS.switch_interval)
  logging.basicConfig(level=getattr(logging, FLAGS.log_level.upper(), logging.INFO),
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  import uvicorn  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  from superinfer_jax.serving.app import build_app, context_of  # pylint: disable=import-outside-toplevel

  def make_engine():
    return LLMEngine(FLAGS.model, config)

  t0 = time.monotonic()
  print(f"[serve] loading {FLAGS.model} and allocating the KV pools", flush=True)
  try:
    engine = make_engine()
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    context = context_of(engine)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"[serve] engine built in {time.monotonic() - t0:.1f} s", flush=True)
  # The engine serves for the process's life (a rebuild unfreezes first: serving/worker.py); with
  # --precompile (the default) the heap is frozen once the engine thread has compiled, before it serves.
  warmup = _precompile if FLAGS.precompile else None
  if warmup is None:
    freeze_heap()
  channel = None
  if multi:
    from superinfer_jax.parallel.events import EventChannel  # pylint: disable=import-outside-toplevel
    channel = EventChannel(idle_interval_s=FLAGS.idle_broadcast_interval)
    if not is_primary():
      return _follow(engine, channel, warmup)
  name = FLAGS.served_model_name or _served_name(FLAGS.model)
  capped = (f", capped from the model's {engine.max_model_len} to what the KV pool holds for one sequence"
            if context < engine.max_model_len else "")
  banner = (f"(context {context} tokens{capped}, {engine.num_device_blocks} device blocks, policy "
            f"{config.scheduler.policy})")
  application = build_app(engine, [name], max_queue=FLAGS.max_queue, channel=channel,
                          engine_factory=None if multi else make_engine,
                          max_body_bytes=FLAGS.max_request_bytes, warmup=warmup)
  del engine   # the engine thread owns it from here

  sock = socket.socket(socket.AF_INET6 if ":" in FLAGS.host else socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((FLAGS.host, FLAGS.port))
  except OSError as e:
    print(f"error: cannot bind {FLAGS.host}:{FLAGS.port}: {e}", file=sys.stderr)
    return 2
  port = sock.getsockname()[1]
  # The app drains itself before uvicorn shuts down (below): by then every request has ended.
  cfg = uvicorn.Config(application, log_level=FLAGS.log_level, timeout_graceful_shutdown=5, access_log=False)
  server = _draining_server_class()(cfg, application.state.drain, FLAGS.shutdown_timeout)
  print(f"[serve] {name} on http://{FLAGS.host}:{port}/v1 {banner}", flush=True)
  if FLAGS.port_file:
    tmp = FLAGS.port_file + ".tmp"
    with open(tmp, "w") as f:
      f.write(str(port))
    os.replace(tmp, FLAGS.port_file)
  # A second signal during the drain is uvicorn's: it shuts down at once and re-raises the signal under the
  # handlers it found, which only note it, so the process still exits 0.
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda s, _f: None)
  server.run(sockets=[sock])
  if server.drained is not None:
    print(f"[serve] drained: {json.dumps(server.drained, sort_keys=True)}", flush=True)
  sig = server.drain_signal
  print(f"[serve] stopped{' on ' + signal.Signals(sig).name if sig is not None else ''}", flush=True)
  if multi:
    worker = application.state.server_state["worker"]
    _report(worker.engine, channel)
    if worker.fatal is not None:
      return 1
  return 0


def _draining_server_class():
  import asyncio  # pylint: disable=import-outside-toplevel
  import uvicorn  # pylint: disable=import-outside-toplevel

  class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGINT / SIGTERM drains the app (``app.state.drain``: 503 to new requests,
    ``shutdown_timeout`` s for the admitted ones, then aborts with a final event) before uvicorn shuts down;
    a second signal is uvicorn's own (immediate) shutdown."""

    def __init__(self, config, drain, shutdown_timeout: float):
      super().__init__(config)
      self._drain, self._timeout = drain, shutdown_timeout
      self._loop = None
      self.drain_signal = None
      self.drained = None

    async def startup(self, sockets=None):
      self._loop = asyncio.get_running_loop()
      await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame):
      if self.drain_signal is not None or self._loop is None:
        super().handle_exit(sig, frame)
        return
      self.drain_signal = sig
      print(f"[serve] {signal.Signals(sig).name}: draining (503 to new requests, {self._timeout:g} s for the "
            "admitted ones)", flush=True)
      self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self):
      try:
        self.drained = await self._drain(self._timeout)
      finally:
        self.should_exit = True

  return DrainingServer


def _progress_bar(done: int, total: int, width: int = 24) -> str:
  """``[#########---------------] 3/8``: ``done`` of ``total`` as a text bar (a log line, not a terminal one)."""
  filled = width * min(done, total) // max(total, 1)
  return f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total}"


def _precompile(engine) -> None:
  """The engine thread's warm-up with --precompile (the default; every process alike): the rotation buckets,
  then every step shape in every sampling mode, with a progress bar in the log every 2 s (step shapes compiled
  of the token buckets x sampling modes to do); then freezes the heap. The server answers 503 until it is
  done."""
  import threading  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.sampling import SAMPLING_MODES  # pylint: disable=import-outside-toplevel
  c = engine.config
  floor, top = c.token_bucket_floor, c.scheduler.max_num_batched_tokens
  buckets = 1
  while floor < top:
    floor, buckets = 2 * floor, buckets + 1
  shapes = buckets * len(SAMPLING_MODES)
  t0, done = time.monotonic(), threading.Event()
  before = engine.num_compiled_shapes()
  table = -(-engine.max_model_len // c.block_size)
  if c.seq_bucket_floor < c.scheduler.max_num_seqs or c.blocks_bucket_floor < table:
    print(f"[serve] note: batches of more than --seq_bucket_floor={c.seq_bucket_floor} sequences (of up to "
          f"--max_num_seqs={c.scheduler.max_num_seqs}) or block tables wider than --blocks_bucket_floor="
          f"{c.blocks_bucket_floor} (of up to {table}) compile on the request path, each logged", flush=True)

  def heartbeat():
    while not done.wait(2.0):
      print(f"[serve] precompiling {_progress_bar(engine.num_compiled_shapes() - before, shapes)} step shapes "
            f"({time.monotonic() - t0:.0f} s)", flush=True)

  print(f"[serve] precompiling the rotation buckets and {shapes} step shapes ({buckets} token buckets x "
        f"{len(SAMPLING_MODES)} sampling modes); /health answers 503 until done (--noprecompile skips this)",
        flush=True)
  threading.Thread(target=heartbeat, name="precompile-progress", daemon=True).start()
  try:
    engine.precompile_rotation()
    print(f"[serve] precompiled the rotation buckets ({time.monotonic() - t0:.1f} s)", flush=True)
    engine.precompile_steps(SAMPLING_MODES)
  finally:
    done.set()
  compiled = engine.num_compiled_shapes() - before
  print(f"[serve] precompiled {_progress_bar(compiled, shapes)} step shapes in {time.monotonic() - t0:.1f} s; "
        "ready", flush=True)
  freeze_heap()


def _follow(engine, channel, warmup) -> int:
  """Process i > 0: the engine loop on process 0's events until process 0 stops. A signal here is noted
  and waited out (process 0 decides when every process stops; if it died, the next collective fails)."""
  import jax  # pylint: disable=import-outside-toplevel
  from superinfer_jax.serving.worker import EngineWorker  # pylint: disable=import-outside-toplevel
  pid = jax.process_index()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda s, _f: print(f"[serve] process {pid}: {signal.Signals(s).name} noted; stopping "
                                           "when process 0 does", flush=True))
  print(f"[serve] process {pid}: running the engine on process 0's requests", flush=True)
  worker = EngineWorker(engine, None, channel=channel, warmup=warmup)
  try:
    worker.follow()
  except RuntimeError as e:
    print(f"error: process {pid}: {e}", file=sys.stderr, flush=True)
    return 1
  finally:
    _report(worker.engine, channel)
  print(f"[serve] process {pid}: stopped", flush=True)
  return 0


def _report(engine, channel) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  print(f"[distributed] process {jax.process_index()}: {engine.replica.describe()}; {engine.replica.exchanges} "
        f"clock exchanges, {channel.exchanges} event exchanges ({channel.payloads} with events, "
        f"{channel.payload_bytes} bytes)", file=sys.stderr, flush=True)


if __name__ == "__main__":
  app.run(main)
