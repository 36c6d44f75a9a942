"""Metrics: per-request timelines -> TTFT/TBT/TPOT/E2E, SLO attainment, the results.jsonl schema.

Numpy and the standard library only (no JAX); matplotlib is imported lazily by ``plots``. Typical use::

  from superinfer_jax import metrics as M
  row = M.results_row(timelines, engine="real", model="smollm2-135m", hardware="cpu", policy="fcfs",
                      rps=4.0, ttft_slo_s=5.0, tbt_slo_s=0.1, num_rotations=..., swap_out_bytes=...)
  M.append_results_row(os.path.join(out_dir, "results.jsonl"), row)
  M.write_timelines(os.path.join(out_dir, M.requests_filename("fcfs", 4.0)), timelines)
"""
from superinfer_jax.metrics.latency import (compute_metrics, latency_samples, request_meets_slo,
                                            summarize)
from superinfer_jax.metrics.results import (ENGINES, RESULTS_KEYS, RESULTS_SCHEMA, append_results_row,
                                            format_comparison_table, print_comparison_table,
                                            read_jsonl, read_results, results_row,
                                            validate_results_row, write_jsonl)
from superinfer_jax.metrics.timeline import (FINISHED, PREEMPTED, RUNNING, STATES, ROTARY, WAITING,
                                             RequestTimeline, TimelineRecorder, format_rps,
                                             parse_requests_filename, parse_requests_filename_full,
                                             read_timelines, requests_filename, write_timelines)

__all__ = [
    "compute_metrics", "latency_samples", "request_meets_slo", "summarize", "ENGINES", "RESULTS_KEYS",
    "RESULTS_SCHEMA", "append_results_row", "format_comparison_table", "print_comparison_table",
    "read_jsonl", "read_results", "results_row", "validate_results_row", "write_jsonl", "FINISHED",
    "PREEMPTED", "RUNNING", "STATES", "ROTARY", "WAITING", "RequestTimeline", "TimelineRecorder",
    "format_rps", "parse_requests_filename", "parse_requests_filename_full", "read_timelines",
    "requests_filename", "write_timelines",
]
