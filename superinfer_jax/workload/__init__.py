"""Workloads: datasets (ShareGPT, LMSYS-style JSONL, SuperInfer/LTR traces, synthetic), multi-turn ShareGPT
conversations as a closed loop (``multiturn.py``, ``closed_loop.py``), recorded traces (Azure LLM inference
and Splitwise CSV, Mooncake JSONL with prefix-reuse block ids: ``traces.py``; the ids at the engine's block
size and a trace's reuse bound: ``reuse.py``), arrivals, and the prefix reuse prompts allow
(``prompt_reuse.py``).

Numpy and the standard library only (no JAX). Typical use::

  from superinfer_jax import workload as wl
  w = wl.load_dataset("sharegpt", tokenizer, num_requests=200, seed=0, max_total_len=2048)
  w = w.with_arrivals(wl.poisson_arrivals(len(w), rps=4.0, seed=42))
  # or, in one call (dataset "sharegpt" | "synthetic" | a path):
  w = wl.make_workload("sharegpt", tokenizer, num_requests=200, rps=4.0, seed=0, max_total_len=2048)
"""
from superinfer_jax.workload.arrivals import (ARRIVAL_PROCESSES, CONVENTIONS, SUPERINFER, VLLM, arrival_times,
                                              gamma_arrivals, gamma_shape_scale, poisson_arrivals)
from superinfer_jax.workload.builder import make_workload
from superinfer_jax.workload.closed_loop import ArrivalQueue
from superinfer_jax.workload.datasets import (PromptPair, TruncatedFileInfo, build_workload,
                                              dataset_pairs, detect_format, iter_json_array,
                                              load_dataset, lmsys_pairs, sharegpt_pairs, trace_pairs)
from superinfer_jax.workload.multiturn import (MULTITURN_DATASET, Conversation, MultiturnInfo,
                                               build_multiturn_workload, sharegpt_conversations,
                                               with_conversation_starts)
from superinfer_jax.workload.prompt_reuse import prefix_reuse_bound
from superinfer_jax.workload.synthetic import LengthDist, synthetic_workload
from superinfer_jax.workload.reuse import expand_block_ids, reuse_bound
from superinfer_jax.workload.traces import (TRACE_COLUMNS, TraceError, TraceInfo, detect_trace_format,
                                            load_trace, read_trace, rescale_to_rps)
from superinfer_jax.workload.types import RequestSpec, Workload, filter_requests

__all__ = [
    "ARRIVAL_PROCESSES",
    "CONVENTIONS", "SUPERINFER", "VLLM", "arrival_times", "gamma_arrivals", "gamma_shape_scale",
    "poisson_arrivals", "PromptPair", "TruncatedFileInfo", "build_workload", "dataset_pairs",
    "detect_format", "iter_json_array", "load_dataset", "lmsys_pairs", "sharegpt_pairs", "trace_pairs",
    "LengthDist", "synthetic_workload", "make_workload", "RequestSpec", "Workload", "filter_requests",
    "TRACE_COLUMNS", "TraceError", "TraceInfo", "detect_trace_format", "load_trace", "read_trace",
    "rescale_to_rps", "ArrivalQueue", "MULTITURN_DATASET", "Conversation", "MultiturnInfo",
    "build_multiturn_workload", "sharegpt_conversations", "with_conversation_starts", "prefix_reuse_bound",
    "expand_block_ids", "reuse_bound",
]
