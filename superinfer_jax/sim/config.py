"""``SimConfig``: the simulator's own settings (model profile, link override, trace, length scale), as knobs.

Each field is declared once with ``configtree.knob`` and becomes a flag of ``scripts/simulate.py`` like every
other setting; the engine's settings (pools, pipeline, transfer mode, layout, scheduler knobs) come from the
one ``EngineConfig`` tree and the workload's from ``sweep.SweepSpec``; the hardware profile is
``SweepSpec.hardware`` (``profile_name``: unset is ``DEFAULT_HARDWARE``), whose name labels the results.
The tensor-parallel degree is the engine's (``EngineConfig.tensor_parallel_size``): the cost model divides
bytes and FLOPs by it and adds two all-reduces per layer.
Frozen, validated at construction (``ValueError`` naming the field). No JAX.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from superinfer_jax import configtree
from superinfer_jax.configtree import knob

DEFAULT_HARDWARE = "h200"   # the profile of a simulation whose SweepSpec.hardware is unset


def profile_name(hardware: Optional[str]) -> str:
  """The hardware profile (name in configs/hardware/ or JSON path) the simulator loads for
  ``SweepSpec.hardware``."""
  return hardware or DEFAULT_HARDWARE


PREFIX_CONTENT = ("recorded", "tokens", "none")
TRACE_ARRIVALS = ("recorded", "rescale", "contention")


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """What the simulator needs beyond the engine config and the workload."""
  model_profile: Optional[str] = knob(
      None, "model shape for the cost model: a name in configs/models/ or a config path (unset: --model)",
      none_as="")
  swap_bandwidth_gbps: float = knob(
      0.0, "override of the host link: scale its curves so the per-direction plateau is this many GB/s "
           "(the duplex cap scales alike; 0: the profile's)")
  trace: Optional[str] = knob(
      None, "replay a recorded trace instead of --dataset: an Azure LLM inference CSV "
            "(TIMESTAMP,ContextTokens,GeneratedTokens) or Splitwise CSV (arrived_at,num_prefill_tokens,"
            "num_decode_tokens), told apart by the header, a Mooncake JSON-lines trace (timestamp ms, "
            "input_length, output_length, hash_ids), or a packaged trace's name ('splitwise', 'mooncake': "
            "the conversation traces in workload/data/); the first --num_requests requests within the "
            "length filters", none_as="")
  trace_arrivals: str = knob(
      "recorded", "with --trace: 'recorded' replays the trace's own arrival times (--rps is ignored; the "
                  "rows' rps is the trace's mean rate); 'rescale' stretches them to each --rps value, "
                  "keeping the burstiness; 'contention' stretches each window to the rate at which fcfs "
                  "without prefix caching reaches --load_target (--rps is ignored; docs/simulator.md)",
      choices=TRACE_ARRIVALS)
  load_target: float = knob(
      1.5, "with --trace_arrivals=contention: the P99 over fcfs's plans of the live KV demand (resident + "
           "queued requests' blocks) per device pool that each window's rate is set to reach")
  trace_context_rule: str = knob(
      "drop", "with --trace: a request whose prompt + output exceeds the model's context (or the device pool) "
              "is 'drop'ped (before the window is taken) or 'clip'ped (the prompt keeps its first tokens and "
              "their block ids); the count is printed and in the rows (trace_context_dropped / _clipped)",
      choices=("drop", "clip"))
  length_scale: float = knob(
      1.0, "multiply every request's prompt and output length by this (rounded, clipped to the context): a "
           "length-scaled variant of --dataset or --trace (1: as loaded); the rows' length_scale")
  fixed_step_s: float = knob(0.0, "every model step takes this many seconds instead of the roofline's time "
                                  "(0: the roofline; transfers are still modelled)")
  prefix_content: str = knob(
      "recorded", "what prefix caching (--enable_prefix_caching) hashes in the simulator: 'recorded' only "
                  "workloads that record reuse (a trace's block ids; multi-turn conversations' token ids), "
                  "'tokens' every request with token ids, 'none' nothing (docs/prefix_caching.md)",
      choices=PREFIX_CONTENT)

  def __post_init__(self):
    if self.model_profile is not None and (not isinstance(self.model_profile, str) or not self.model_profile):
      raise ValueError(f"SimConfig.model_profile must be None or a name / path, got {self.model_profile!r}")
    if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
      raise ValueError(f"SimConfig.trace must be None or a trace path / name, got {self.trace!r}")
    v = self.length_scale
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
      raise ValueError(f"SimConfig.length_scale must be a finite number > 0, got {v!r}")
    if self.trace_arrivals not in TRACE_ARRIVALS:
      raise ValueError(f"SimConfig.trace_arrivals must be one of {TRACE_ARRIVALS}, got {self.trace_arrivals!r}")
    v = self.load_target
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
      raise ValueError(f"SimConfig.load_target must be a finite number > 0, got {v!r}")
    if self.prefix_content not in PREFIX_CONTENT:
      raise ValueError(f"SimConfig.prefix_content must be one of {PREFIX_CONTENT}, got {self.prefix_content!r}")
    if self.trace_context_rule not in ("drop", "clip"):
      raise ValueError(f"SimConfig.trace_context_rule must be 'drop' or 'clip', got {self.trace_context_rule!r}")
    for name in ("swap_bandwidth_gbps", "fixed_step_s"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"SimConfig.{name} must be a finite number >= 0, got {v!r}")

  @classmethod
  def create(cls, **settings) -> "SimConfig":
    return configtree.build(cls, settings)

  def replace(self, **settings) -> "SimConfig":
    """A copy with the given settings changed (also what ``sweep.apply_variant`` calls)."""
    return configtree.build(type(self), settings, base=self)

  def as_flat_dict(self) -> dict:
    return configtree.as_flat_dict(self)
