"""Prometheus metrics of the server (``GET /metrics``, prometheus-client text format).

The engine thread updates them (``after_step`` snapshots the scheduler, the block manager and
``EngineStats``; ``on_arrival`` / ``on_output`` / ``on_finish`` feed the token counters and the latency
histograms); the HTTP side only renders. Where vLLM has a metric, the name is vLLM's with ``superinfer_``
for its ``vllm:`` prefix and the same meaning; the rest are this engine's own.

==========================================================  ===========================================
metric                                                      meaning
==========================================================  ===========================================
superinfer_num_requests_running / _waiting                  requests per scheduler state (vLLM's)
superinfer_num_requests_rotary                              requests whose KV is rotated out to host
superinfer_num_requests_admitted                            accepted and not finished (vs --max_queue)
superinfer_kv_cache_usage_perc                              device KV pool in use, 0..1 (vLLM's)
superinfer_host_kv_cache_usage_perc                         host KV pool in use, 0..1
superinfer_device_blocks{kind=used|total}                   device KV pool blocks
superinfer_host_blocks{kind=used|total}                     host KV pool blocks
superinfer_prompt_tokens_total                              prompt tokens prefilled (vLLM's)
superinfer_generation_tokens_total                          output tokens (vLLM's)
superinfer_num_preemptions_total                            recompute preemptions (vLLM's)
superinfer_prefix_cache_queries_total                       prefix cache queries in tokens: full prompt blocks
                                                            of first admissions x block size (vLLM's)
superinfer_prefix_cache_hits_total{tier=device|host}        prefix cache hits in tokens per tier: the prompt
                                                            tokens of first admissions found cached on device
                                                            (shared) or on host (loaded); summed over the
                                                            tiers, vLLM's (and the engine requests'
                                                            num_cached_tokens summed)
superinfer_engine_steps_total                               engine steps
superinfer_rotations_total{direction=out|in}                rotations of a request's KV to / from host
superinfer_kv_bytes_moved_total{direction=d2h|h2d}          bytes moved by rotations and eager write-back
superinfer_requests_finished_total{reason}                  finished requests by reason (stop, length,
                                                            abort, error)
superinfer_requests_rejected_total{reason}                  refused at admission (queue_full)
superinfer_step_errors_total                                engine steps that raised
superinfer_time_to_first_token_seconds                      histogram: arrival -> first token (vLLM's)
superinfer_inter_token_latency_seconds                      histogram: gaps between output tokens (vLLM's)
superinfer_e2e_request_latency_seconds                      histogram: arrival -> last token (vLLM's)
superinfer_request_queue_time_seconds                       histogram: arrival -> first scheduled (vLLM's)
==========================================================  ===========================================

Latencies are on the engine clock (``RequestOutput.timestamps``, ``state_changes``).
"""
from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:

  def __init__(self, worker_admitted=lambda: 0):
    self.registry = CollectorRegistry()
    self._lock = threading.Lock()
    self._snap: dict[str, Any] = {}
    self._admitted = worker_admitted
    self._arrivals: dict[str, tuple[float, int]] = {}   # request id -> (arrival, prompt tokens)
    self._last_token: dict[str, float] = {}
    self._scheduled: set[str] = set()
    self.ttft = Histogram("superinfer_time_to_first_token_seconds", "time to first token (arrival -> first token)",
                          buckets=_LAT_BUCKETS, registry=self.registry)
    self.tbt = Histogram("superinfer_inter_token_latency_seconds", "time between consecutive output tokens",
                         buckets=_LAT_BUCKETS, registry=self.registry)
    self.e2e = Histogram("superinfer_e2e_request_latency_seconds", "end-to-end latency (arrival -> last token)",
                         buckets=_LAT_BUCKETS, registry=self.registry)
    self.queue = Histogram("superinfer_request_queue_time_seconds", "queue time (arrival -> first scheduled)",
                           buckets=_LAT_BUCKETS, registry=self.registry)
    self.prompt_tokens = Counter("superinfer_prompt_tokens", "prompt tokens prefilled", registry=self.registry)
    self.finished = Counter("superinfer_requests_finished", "finished requests by reason", ["reason"],
                            registry=self.registry)
    self.rejected = Counter("superinfer_requests_rejected", "requests refused at admission", ["reason"],
                            registry=self.registry)
    self.step_errors = Counter("superinfer_step_errors", "engine steps that raised", registry=self.registry)
    self.registry.register(_SnapshotCollector(self))

  # Engine thread.
  def on_arrival(self, rid: str, arrival: float, prompt_tokens: int = 0) -> None:
    self._arrivals[rid] = (arrival, prompt_tokens)

  def on_output(self, o) -> None:
    arrival, n_prompt = self._arrivals.get(o.request_id, (None, 0))
    if arrival is not None and o.request_id not in self._scheduled:
      first = next((t for t, state in o.state_changes if state == "running"), None)
      if first is not None:
        self._scheduled.add(o.request_id)
        self.queue.observe(max(0.0, first - arrival))
    for t in o.timestamps:
      last = self._last_token.get(o.request_id)
      if last is None:
        self.prompt_tokens.inc(n_prompt)
        if arrival is not None:
          self.ttft.observe(max(0.0, t - arrival))
      else:
        self.tbt.observe(max(0.0, t - last))
      self._last_token[o.request_id] = t
    if o.finished and arrival is not None and o.request_id in self._last_token:
      self.e2e.observe(max(0.0, self._last_token[o.request_id] - arrival))

  def on_finish(self, rid: str, reason: str) -> None:
    self.finished.labels(reason=reason or "unknown").inc()
    self._arrivals.pop(rid, None)
    self._last_token.pop(rid, None)
    self._scheduled.discard(rid)

  def after_step(self, engine) -> None:
    sch, st = engine.scheduler_stats(), engine.stats
    pc = sch.prefix_cache
    bs = engine.config.block_size if pc else 0   # caching counters in blocks; the metrics count tokens
    snap = dict(waiting=sch.num_waiting, running=sch.num_running, rotary=sch.num_rotary,
                dev_total=sch.device_blocks, dev_free=sch.free_device_blocks,
                host_total=sch.host_blocks, host_free=sch.free_host_blocks,
                steps=st.steps, rot_out=st.rotations_out, rot_in=st.rotations_in, bytes_out=st.bytes_out,
                bytes_in=st.bytes_in, recompute=st.recompute_preemptions, tokens=st.tokens_generated,
                prefix_queries=pc.get("queried", 0) * bs, prefix_device_hits=pc.get("device_hits", 0) * bs,
                prefix_host_hits=pc.get("host_hits", 0) * bs)
    with self._lock:
      self._snap = snap

  def snapshot(self) -> dict:
    with self._lock:
      return dict(self._snap)

  def render(self) -> bytes:
    return generate_latest(self.registry)


class _SnapshotCollector:
  def __init__(self, m: ServerMetrics):
    self.m = m

  def collect(self):
    s = self.m.snapshot()
    for state, what in (("running", "running"), ("waiting", "waiting"), ("rotary", "rotated out to host")):
      yield GaugeMetricFamily(f"superinfer_num_requests_{state}", f"requests {what}", value=s.get(state, 0))
    yield GaugeMetricFamily("superinfer_num_requests_admitted", "requests accepted and not finished",
                            value=self.m._admitted())  # pylint: disable=protected-access
    for name, total, free, usage in (("device", "dev_total", "dev_free", "kv_cache_usage_perc"),
                                     ("host", "host_total", "host_free", "host_kv_cache_usage_perc")):
      n, used = s.get(total, 0), s.get(total, 0) - s.get(free, 0)
      yield GaugeMetricFamily(f"superinfer_{usage}", f"{name} KV pool in use (0..1)", value=used / n if n else 0.0)
      g = GaugeMetricFamily(f"superinfer_{name}_blocks", f"{name} KV pool blocks", labels=["kind"])
      g.add_metric(["used"], used)
      g.add_metric(["total"], n)
      yield g
    yield CounterMetricFamily("superinfer_engine_steps", "engine steps", value=s.get("steps", 0))
    c = CounterMetricFamily("superinfer_rotations", "rotations of KV to / from host", labels=["direction"])
    c.add_metric(["out"], s.get("rot_out", 0))
    c.add_metric(["in"], s.get("rot_in", 0))
    yield c
    c = CounterMetricFamily("superinfer_kv_bytes_moved", "KV bytes moved (rotation + write-back)",
                            labels=["direction"])
    c.add_metric(["d2h"], s.get("bytes_out", 0))
    c.add_metric(["h2d"], s.get("bytes_in", 0))
    yield c
    yield CounterMetricFamily("superinfer_num_preemptions", "recompute preemptions", value=s.get("recompute", 0))
    yield CounterMetricFamily("superinfer_generation_tokens", "output tokens", value=s.get("tokens", 0))
    yield CounterMetricFamily("superinfer_prefix_cache_queries",
                              "prefix cache queries, in tokens: full prompt blocks of first admissions x block "
                              "size", value=s.get("prefix_queries", 0))
    c = CounterMetricFamily("superinfer_prefix_cache_hits",
                            "prefix cache hits, in tokens: prompt tokens of first admissions whose KV came from "
                            "the device cache (shared) or the host cache (loaded)", labels=["tier"])
    c.add_metric(["device"], s.get("prefix_device_hits", 0))
    c.add_metric(["host"], s.get("prefix_host_hits", 0))
    yield c


def parse_metrics(text: str) -> dict[str, float]:
  """``{'name{labels}': value}`` of a Prometheus text page (tests, bench)."""
  out = {}
  for line in text.splitlines():
    if not line or line.startswith("#"):
      continue
    name, _, value = line.rpartition(" ")
    try:
      out[name] = float(value)
    except ValueError:
      pass
  return out
