"""Serving engine: continuous batching, chunked prefill, rotation, on-device sampling, pipelined step loop.

Public API (``LLMEngine`` and friends import JAX lazily, so ``from superinfer_jax.engine import
EngineConfig`` stays JAX-free)::

  from superinfer_jax.engine import LLMEngine, EngineConfig, SamplingParams
  engine = LLMEngine("smollm2-135m", EngineConfig.create(num_device_blocks=512, policy="rotasched"))
  rid = engine.add_request("The capital of France is", SamplingParams(max_tokens=32))
  for out in engine.stream(): ...          # RequestOutput: token_ids, text delta, timestamps, finish_reason
  results = engine.generate(["a", "b"], SamplingParams(max_tokens=8))   # blocking, input order
"""
from superinfer_jax.engine.config import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_REASONS,
                                          FINISH_STOP, CompletionOutput, EngineConfig, RequestOutput,
                                          SamplingParams, TokenLogprobs, define_engine_flags,
                                          engine_config_from_flags)

_LAZY = {"LLMEngine": "engine", "EngineStats": "stats", "RequestError": "request_book", "ModelRunner": "model_runner",
         "JaxModelRunner": "model_runner",
         "IncrementalDetokenizer": "detokenizer", "sample": "sampling", "SamplingArrays": "sampling"}


def __getattr__(name):
  mod = _LAZY.get(name)
  if mod is None:
    raise AttributeError(f"module 'superinfer_jax.engine' has no attribute {name!r}")
  import importlib  # pylint: disable=import-outside-toplevel
  return getattr(importlib.import_module(f"superinfer_jax.engine.{mod}"), name)


__all__ = ["CompletionOutput", "EngineConfig", "EngineStats", "FINISH_ABORT", "FINISH_ERROR",
           "FINISH_LENGTH", "FINISH_REASONS", "FINISH_STOP", "IncrementalDetokenizer", "JaxModelRunner", "LLMEngine", "ModelRunner",
           "RequestError", "RequestOutput", "SamplingArrays", "SamplingParams", "TokenLogprobs", "define_engine_flags",
           "engine_config_from_flags", "sample"]
