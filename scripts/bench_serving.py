"""Load client for any OpenAI-compatible endpoint: replays a workload, streams, timestamps at the client.

The workload is the one ``run_experiment.py`` builds from the same flags (``SweepSpec``: --dataset,
--num_requests, --rps, --arrival_process, --burstiness, --seed, --synthetic_*_len, trace files as
--dataset=path ...; its ``make_workload``). Request i is sent at t0 + arrival_s[i] (its scheduled time is
its arrival, so client-side queueing counts against TTFT) as a streamed /v1/completions request (or
/v1/chat/completions with --endpoint=chat) with greedy sampling, ``ignore_eos`` and ``max_tokens`` = the
workload's output length, as the engine replay does. Every streamed chunk that carries output is one
token timestamp (``len(token_ids)`` timestamps where the server returns them: this server does with
``return_token_ids``). Output: ``results.jsonl`` (one ``metrics.results_row`` per run, ``engine`` =
"http") and ``requests-<label>-<rps>[-rep<k>].jsonl`` timelines under --output_dir, the schema
``plot.py`` reads. Against this repo's server the rotation / preemption counters come from the deltas of
its ``/metrics`` over the run. With --warmup (default) every prompt is first sent once, all at once with
short outputs and not recorded, so the server has compiled its step shapes before the timed runs.

While a run goes, a progress line (a bar, requests done, errors) is printed every --progress_interval s, and
each request's timeline is appended to the run's requests file as soon as it ends (the file is rewritten
in request order when the run ends). At the end a summary table: TTFT / TBT / E2E p50 / p90 / p99, SLO
attainment and goodput (requests per second meeting both SLOs) per run.

Example (a server started with scripts/serve.py --port=8000):
  python scripts/bench_serving.py --base_url=http://127.0.0.1:8000/v1 --model=smollm2-135m \
      --dataset=sharegpt --num_requests=24 --rps=1 --ttft_slo=3 --tbt_slo=0.5 --label=rotasched \
      --output_dir=runs/http
"""
import asyncio
import json
import logging
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from superinfer_jax import configtree  # noqa: E402
from superinfer_jax.experiment.real_sweep import SweepSpec  # noqa: E402
from superinfer_jax.sched.config import SchedulerConfig  # noqa: E402

flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "the endpoint's OpenAI base URL")
flags.DEFINE_string("served_model_name", None, "model name sent in requests (default: the first of /v1/models)")
flags.DEFINE_enum("endpoint", "completions", ["completions", "chat"], "which API to drive")
flags.DEFINE_string("api_key", "x", "bearer token sent to the endpoint")
configtree.define_flags(SchedulerConfig, only={"ttft_slo", "tbt_slo"})   # attainment; sent per request too
flags.DEFINE_bool("send_slos", True, "send ttft_slo / tbt_slo fields with each request (ignored elsewhere)")
flags.DEFINE_string("label", "http", "the run's label in results (the 'policy' column)")
flags.DEFINE_integer("max_total_len", 0, "context cap for the workload (0: the model config's)")
flags.DEFINE_integer("vocab_size", 0, "vocabulary of synthetic prompts (0: the model config's)")
flags.DEFINE_float("request_timeout", 600.0, "seconds before one request is given up")
flags.DEFINE_bool("token_id_prompts", True, "send token-id prompts when the workload has them (completions)")
flags.DEFINE_float("progress_interval", 2.0, "seconds between progress lines during a run")
configtree.define_flags(SweepSpec)
FLAGS = flags.FLAGS


def _model_info(model: str):
  """(tokenizer or None, context length, vocab size) of --model, without loading weights."""
  tok, ctx, vocab = None, None, None
  try:
    from superinfer_jax.model.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
    tok = load_tokenizer(model)
  except (FileNotFoundError, ValueError, OSError):
    tok = None
  try:
    from superinfer_jax.model.config import load_config  # pylint: disable=import-outside-toplevel
    cfg = load_config(model)
    ctx, vocab = cfg.max_position_embeddings, cfg.vocab_size
  except Exception:  # pylint: disable=broad-except
    pass
  return tok, ctx, vocab


def _metrics_url(base_url: str) -> str:
  base = base_url.rstrip("/")
  return (base[:-3] if base.endswith("/v1") else base) + "/metrics"


async def _scrape(client, url):
  from superinfer_jax.serving.metrics import parse_metrics  # pylint: disable=import-outside-toplevel
  try:
    r = await client.get(url, timeout=10)
    if r.status_code != 200:
      return None
    m = parse_metrics(r.text)
    return m if any(k.startswith("superinfer_") for k in m) else None
  except Exception:  # pylint: disable=broad-except
    return None


class _Progress:
  """A run's progress: a line with a bar every --progress_interval s (and one at the end), and each
  request's timeline appended to ``path`` (if given) as soon as it ends, so a run cut short leaves its
  finished requests on disk."""

  def __init__(self, label: str, total: int, recorder, path=None):
    self.label, self.total, self.recorder = label, total, recorder
    self.done = self.failed = 0
    self.t0 = time.perf_counter()
    self._file = open(path, "w", encoding="utf-8") if path else None   # pylint: disable=consider-using-with

  def ended(self, rid: str, ok: bool) -> None:
    self.done += 1
    self.failed += not ok
    if self._file is not None:
      self._file.write(json.dumps(self.recorder.get(rid).to_json_dict(), allow_nan=False) + "\n")
      self._file.flush()

  def line(self) -> str:
    width = 30
    filled = width * self.done // max(self.total, 1)
    return (f"[bench] {self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
            f"{self.failed} errors, {time.perf_counter() - self.t0:.1f} s")

  async def report(self) -> None:
    while True:
      await asyncio.sleep(FLAGS.progress_interval)
      print(self.line(), flush=True)

  def close(self) -> None:
    print(self.line(), flush=True)
    if self._file is not None:
      self._file.close()


async def _one(client, url, model, spec, t0, recorder, errors, endpoint, progress):
  n_errors = len(errors)
  try:
    await _request(client, url, model, spec, t0, recorder, errors, endpoint)
  finally:
    progress.ended(str(spec.request_id), len(errors) == n_errors)


async def _request(client, url, model, spec, t0, recorder, errors, endpoint):
  rid = str(spec.request_id)
  await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
  body = {"model": model, "max_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
  if FLAGS.send_slos:
    body.update(ttft_slo=FLAGS.ttft_slo, tbt_slo=FLAGS.tbt_slo)
  if endpoint == "chat":
    body["messages"] = [{"role": "user", "content": spec.prompt}]
  elif FLAGS.token_id_prompts and spec.prompt_token_ids is not None:
    body["prompt"] = list(spec.prompt_token_ids)
  else:
    body["prompt"] = spec.prompt
  finish = None
  last = None
  try:
    async with client.stream("POST", url, json=body, timeout=FLAGS.request_timeout) as r:
      if r.status_code != 200:
        text = (await r.aread()).decode(errors="replace")
        errors.append((rid, r.status_code, text[:300]))
        return
      async for line in r.aiter_lines():
        t = time.perf_counter()
        if not line.startswith("data:"):
          continue
        data = line[5:].strip()
        if data == "[DONE]":
          break
        ev = json.loads(data)
        if "error" in ev:
          errors.append((rid, 200, json.dumps(ev["error"])[:300]))
          return
        for ch in ev.get("choices") or []:
          content = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
          n = len(ch["token_ids"]) if isinstance(ch.get("token_ids"), list) else (1 if content else 0)
          if n:
            recorder.token(rid, t, n)
            last = t
          if ch.get("finish_reason"):
            finish = ch["finish_reason"]
  except Exception as e:  # pylint: disable=broad-except
    errors.append((rid, None, f"{type(e).__name__}: {e}"))
    return
  if finish is not None:
    recorder.finish(rid, last if last is not None else time.perf_counter(), finish)


async def _warm_up(workload, model):
  """Every prompt at once with short outputs, not recorded: the server compiles its step shapes (as
  run_experiment.py's warm-up does) before the timed runs."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  short = [dataclasses.replace(s, arrival_s=0.0, output_len=min(s.output_len, 24)) for s in workload]
  tls, _, errors, _, _ = await _run(short, model, float("inf"), "warm-up")
  return sum(t.finished for t in tls), errors


async def _run(workload, model, rps, label, partial_path=None):
  """One timed run: (timelines, duration, errors, /metrics before, after); progress lines under ``label``,
  timelines appended to ``partial_path`` as requests end."""
  import httpx  # pylint: disable=import-outside-toplevel
  from superinfer_jax.metrics.timeline import TimelineRecorder  # pylint: disable=import-outside-toplevel
  url = FLAGS.base_url.rstrip("/") + ("/chat/completions" if FLAGS.endpoint == "chat" else "/completions")
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  headers = {"Authorization": f"Bearer {FLAGS.api_key}"}
  async with httpx.AsyncClient(limits=limits, headers=headers, timeout=FLAGS.request_timeout) as client:
    before = await _scrape(client, _metrics_url(FLAGS.base_url))
    recorder = TimelineRecorder()
    errors = []
    t0 = time.perf_counter() + 0.05
    for s in workload:
      recorder.add_request(str(s.request_id), t0 + s.arrival_s, s.prompt_len, target_output_len=s.output_len,
                           source=getattr(s, "source", "") or "")
    progress = _Progress(label, len(workload), recorder, partial_path)
    reporter = asyncio.ensure_future(progress.report())
    try:
      await asyncio.gather(*(_one(client, url, model, s, t0, recorder, errors, FLAGS.endpoint, progress)
                             for s in workload))
    finally:
      reporter.cancel()
      progress.close()
    after = await _scrape(client, _metrics_url(FLAGS.base_url))
  tls = recorder.timelines()
  last = max((t.token_times_s[-1] for t in tls if t.token_times_s), default=t0)
  return tls, max(last - t0, 1e-9), errors, before, after


def _delta(before, after, key):
  if before is None or after is None or key not in after:
    return None
  return int(after[key] - before.get(key, 0.0))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    spec = configtree.from_flags(SweepSpec)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import httpx  # pylint: disable=import-outside-toplevel
  from superinfer_jax import metrics as M  # pylint: disable=import-outside-toplevel
  model = FLAGS.served_model_name
  if model is None:
    r = httpx.get(FLAGS.base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {FLAGS.api_key}"},
                  timeout=30)
    r.raise_for_status()
    model = r.json()["data"][0]["id"]
  tok, ctx, vocab = _model_info(spec.model)
  max_total = FLAGS.max_total_len or ctx
  vocab = FLAGS.vocab_size or vocab or 32000
  if FLAGS.endpoint == "chat" and spec.dataset == "synthetic":
    raise app.UsageError("--endpoint=chat needs a text dataset (synthetic prompts are token ids)")
  if spec.dataset == "sharegpt_multiturn":
    # Its later turns are released by earlier turns' finishes (workload.closed_loop.ArrivalQueue), which this
    # open-loop client does not do yet: refuse rather than send every turn at its conversation's start.
    raise app.UsageError("--dataset=sharegpt_multiturn is a closed loop: run it with run_experiment.py or "
                         "simulate.py; bench_serving.py sends open-loop arrivals only")
  os.makedirs(spec.output_dir, exist_ok=True)
  results_path = os.path.join(spec.output_dir, "results.jsonl")
  hardware = spec.hardware or f"http:{FLAGS.base_url}"
  logging.getLogger("httpx").setLevel(logging.WARNING)
  warmed = not spec.warmup
  rows = []
  for rps in spec.rps_values:
    workload = spec.make_workload(tok, rps, max_total_len=max_total, vocab_size=vocab)
    if not warmed:
      t = time.perf_counter()
      done, errors = asyncio.run(_warm_up(workload, model))
      print(f"[bench] warm-up: {done}/{len(workload)} requests in {time.perf_counter() - t:.1f} s"
            f"{f', {len(errors)} errors' if errors else ''}", flush=True)
      warmed = True
    for rep in range(spec.repeats):
      timelines_path = os.path.join(spec.output_dir, M.requests_filename(FLAGS.label, rps,
                                                                         rep if spec.repeats > 1 else None))
      tls, duration, errors, before, after = asyncio.run(_run(workload, model, rps, f"rps={rps:g} rep={rep}",
                                                              timelines_path))
      row = M.results_row(
          tls, engine="http", model=model, hardware=hardware, policy=FLAGS.label, rps=rps,
          ttft_slo_s=FLAGS.ttft_slo, tbt_slo_s=FLAGS.tbt_slo, duration_s=duration,
          num_rotations=_delta(before, after, 'superinfer_rotations_total{direction="out"}'),
          swap_out_bytes=_delta(before, after, 'superinfer_kv_bytes_moved_total{direction="d2h"}') or 0,
          swap_in_bytes=_delta(before, after, 'superinfer_kv_bytes_moved_total{direction="h2d"}') or 0,
          num_recompute_preemptions=_delta(before, after, "superinfer_num_preemptions_total"),
          extra={"goodput_req_s": sum(M.request_meets_slo(t, FLAGS.ttft_slo, FLAGS.tbt_slo) for t in tls) / duration,
                 "base_url": FLAGS.base_url, "endpoint": FLAGS.endpoint, "repeat": rep, "dataset": spec.dataset,
                 "seed": spec.seed, "num_errors": len(errors), "errors": [list(e) for e in errors[:20]]})
      M.append_results_row(results_path, row)
      M.write_timelines(timelines_path, tls)   # the run's timelines in request order (replacing the partial file)
      rows.append(row)
      ms = lambda k: "-" if row.get(k) is None else f"{1e3 * row[k]:.0f}"  # noqa: E731
      print(f"[bench] {FLAGS.label} rps={rps:g} rep={rep}: {row['num_finished']}/{row['num_requests']} finished, "
            f"{len(errors)} errors, SLO {100 * row['slo_attainment']:.1f}%, TTFT p50/p99 "
            f"{ms('ttft_p50_s')}/{ms('ttft_p99_s')} ms, TBT p50/p99 {ms('tbt_p50_s')}/{ms('tbt_p99_s')} ms, "
            f"{row['output_throughput_tok_s']:.1f} tok/s", flush=True)
      for e in errors[:5]:
        print(f"[bench]   error {e}", file=sys.stderr)
  print(summary_table(rows, FLAGS.ttft_slo, FLAGS.tbt_slo), flush=True)
  return 0


def summary_table(rows, ttft_slo: float, tbt_slo: float) -> str:
  """A Markdown table of the runs: TTFT / TBT / E2E p50, p90, p99 (ms), SLO attainment and goodput
  (requests per second that met both SLOs)."""
  cols = ["label", "rps", "rep", "finished", "errors"] + [f"{m} p{q}" for m in ("TTFT", "TBT", "E2E")
                                                          for q in (50, 90, 99)] + ["SLO %", "goodput req/s"]
  lines = [f"[bench] summary (ms; SLOs TTFT {ttft_slo:g} s, TBT {tbt_slo:g} s)", "| " + " | ".join(cols) + " |",
           "|" + "---|" * len(cols)]
  for r in rows:
    ms = ["-" if r.get(f"{m}_p{q}_s") is None else f"{1e3 * r[f'{m}_p{q}_s']:.0f}"
          for m in ("ttft", "tbt", "e2e") for q in (50, 90, 99)]
    cells = [r["policy"], f"{r['rps']:g}", str(r.get("repeat", 0)), f"{r['num_finished']}/{r['num_requests']}",
             str(r.get("num_errors", 0))] + ms + [f"{100 * r['slo_attainment']:.1f}", f"{r['goodput_req_s']:.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
