"""One call from experiment flags to a timed workload (for run_experiment.py, the simulator, the client).

``make_workload`` = pick requests (``load_dataset`` or ``synthetic_workload``) + assign arrivals
(``arrival_times``). The request set depends only on (dataset, tokenizer, num_requests, seed, length
filters); the arrivals on (num_requests, rps, process, burstiness, convention, seed). Every policy at one
rps therefore replays the same requests at the same times.
"""
from __future__ import annotations

from typing import Any

from superinfer_jax.workload.arrivals import VLLM, arrival_times
from superinfer_jax.workload.datasets import MULTITURN_DATASET, load_dataset
from superinfer_jax.workload.synthetic import LengthDist, synthetic_workload
from superinfer_jax.workload.types import Workload


def make_workload(dataset: str, tokenizer: Any, *, num_requests: int, rps: float, seed: int = 0,
                  process: str = "poisson", burstiness: float = 1.0, convention: str = VLLM,
                  max_total_len: int | None = None, max_prompt_len: int | None = None,
                  max_output_len: int | None = None, min_prompt_len: int = 1,
                  min_output_len: int = 1,
                  synthetic_prompt_len: LengthDist | str | int = "uniform:16,256",
                  synthetic_output_len: LengthDist | str | int = "uniform:16,256",
                  vocab_size: int = 32000, max_turns: int = 4, think_time_s: float = 1.0,
                  think_time_dist: str = "fixed") -> Workload:
  """A workload of ``num_requests`` requests with arrivals at ``rps`` (requests/s).

  Args:
    dataset: "sharegpt" (the package file), "sharegpt_multiturn" (its conversations, one closed-loop request
      per turn: ``multiturn.py``), "synthetic", or a path (ShareGPT JSON, LMSYS-style JSONL or trace JSONL,
      auto-detected).
    tokenizer: the served model's tokenizer (``encode``); for "synthetic" only its optional ``decode`` is
      used.
    num_requests: requests wanted; fewer if the dataset has fewer that pass the filters
      (``sharegpt_multiturn``: conversations wanted).
    rps: mean arrival rate; ``inf`` = all at t = 0 (``sharegpt_multiturn``: the rate conversations start;
      later turns follow their predecessors' finishes).
    seed: seeds request selection and arrivals (arrivals use ``seed + 1`` so the two streams differ).
    process, burstiness, convention: see ``arrival_times`` / ``arrivals.py``.
    max_total_len ... min_output_len: token-length filters (real datasets); ``max_total_len`` also caps
      synthetic lengths. Pass the model's context length as ``max_total_len``.
    synthetic_prompt_len, synthetic_output_len, vocab_size: for dataset == "synthetic".
    max_turns, think_time_s, think_time_dist: for dataset == "sharegpt_multiturn" (``multiturn.py``).
  """
  if dataset == MULTITURN_DATASET:
    from superinfer_jax.workload.multiturn import with_conversation_starts  # pylint: disable=import-outside-toplevel
    w = load_dataset(dataset, tokenizer, num_requests=num_requests, seed=seed, max_total_len=max_total_len,
                     max_prompt_len=max_prompt_len, max_output_len=max_output_len, min_prompt_len=min_prompt_len,
                     min_output_len=min_output_len, max_turns=max_turns, think_time_s=think_time_s,
                     think_time_dist=think_time_dist)
    n = sum(r.after_request_id is None for r in w)
    return with_conversation_starts(w, arrival_times(n, rps, process=process, burstiness=burstiness,
                                                     convention=convention, seed=seed + 1))
  if dataset == "synthetic":
    w = synthetic_workload(num_requests, synthetic_prompt_len, synthetic_output_len, seed=seed,
                           vocab_size=vocab_size, tokenizer=tokenizer, max_total_len=max_total_len)
  else:
    w = load_dataset(dataset, tokenizer, num_requests=num_requests, seed=seed,
                     max_total_len=max_total_len, max_prompt_len=max_prompt_len,
                     max_output_len=max_output_len, min_prompt_len=min_prompt_len,
                     min_output_len=min_output_len)
  return w.with_arrivals(arrival_times(len(w), rps, process=process, burstiness=burstiness,
                                       convention=convention, seed=seed + 1))
