"""``SchedulerConfig``: every scheduling knob, declared once (name, default, help) for configs and flags.

Frozen; validated at construction (``ValueError`` naming the field). Defaults are the paper's where the
paper gives one (docs/paper.md §1.2 and the §2.2 table: alpha 3, beta_B 0, beta_F 0.5, B_xfer 2400, SLOs
5 s / 100 ms); the token budget and sequence cap are sized for the CPU engine (the paper's artifact runs
16384 / 16384 on a GH200). Pure Python, no JAX: the engine, the simulator and ``bench_scheduler.py`` share it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from superinfer_jax.configtree import check_choices, knob


def _policy_names() -> tuple[str, ...]:
  from superinfer_jax.sched.policies import POLICIES  # pylint: disable=import-outside-toplevel
  return tuple(POLICIES)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """Scheduler knobs (see ``policies/`` for what each policy does with them)."""
  policy: str = knob("rotasched", "scheduling policy", choices=_policy_names)
  max_num_seqs: int = knob(64, "most sequences in one step")
  max_num_batched_tokens: int = knob(512, "token budget of one step (chunked prefill)")
  proactive_swap_budget: int = knob(
      2400, "B_xfer: blocks rotated per step and direction at most (0: no proactive rotation)")
  alpha: float = knob(3.0, "VLT weight of rotary requests (alpha)")
  beta_b: float = knob(0.0, "VLT grace of rotary requests, in TBT SLOs (beta_B; in plain rotasched it only "
                            "reorders candidates, in rotasched_strict it delays rotation)")
  beta_f: float = knob(0.5, "VLT grace of waiting requests, in TTFT SLOs (beta_F)")
  ttft_slo: float = knob(5.0, "TTFT SLO in seconds (S_F)")
  tbt_slo: float = knob(0.1, "TBT SLO in seconds (S_B)")
  min_residency: int = knob(
      0, "steps a request stays running after it (re)enters RUNNING before it may be a proactive rotation "
         "victim (0: off, Algorithm 1 as written; reactive evictions ignore it)")
  max_rotations_per_request: Optional[int] = knob(
      None, "thrash guard: a request rotated out this many times is no longer a proactive victim (unset: no "
            "limit, Algorithm 1 as written; reactive evictions ignore it)", none_as=0)
  writeback: bool = knob(True, "eager write-back of full blocks to host (DuplexKV)")
  max_writeback_blocks: Optional[int] = knob(None, "write-back blocks per step at most", none_as=0)
  writeback_min_free_host: Optional[int] = knob(
      None, "host blocks eager write-back leaves free for rotations (unset: min(B_xfer, host pool / 4))",
      none_as=-1)
  proactive_recompute: bool = knob(
      False, "host pool full when a proactive victim should rotate out: recompute-preempt it (else it keeps "
             "running; the reactive path always falls back to recompute)")
  lvf_scan_limit: int = knob(1024, "candidates Algorithm 1 examines per step")
  lvf_max_skips: int = knob(64, "Algorithm 1 stops after this many consecutive candidates that do not fit")
  enable_prefix_caching: bool = knob(
      True, "prefix caching: full prompt blocks are published by content hash and shared by later requests "
            "with the same prefix; rotated requests re-adopt their blocks still on device (docs/prefix_caching.md)")
  host_prefix_cache: bool = knob(
      True, "host prefix tier: clean host copies of prompt blocks stay findable after their request ends, "
            "and a prompt loads the ones the device lacks when host_prefix_load says so")
  host_prefix_load: str = knob(
      "cost", "when a prefix found only on host is loaded instead of recomputed: cost (load iff "
              "prefix_load_s_per_block < block_size x prefill_s_per_token; either unset: load), always, never",
      choices=("cost", "always", "never"))
  prefix_load_s_per_block: Optional[float] = knob(
      None, "seconds to load one KV block host->device (the cost rule's load side; unset: loads count free)",
      none_as=-1.0)
  prefill_s_per_token: Optional[float] = knob(
      None, "seconds of prefill per prompt token (the cost rule's recompute side; unset: loads count free)",
      none_as=-1.0)
  code_swap_host_gate: float = knob(0.95, "rotasched_code: proactive swap-out only below this host usage")
  code_admit_host_gate: float = knob(0.9, "rotasched_code: WAITING requests admitted only below this host "
                                          "usage")

  def __post_init__(self):
    check_choices(self)
    for name in ("max_num_seqs", "max_num_batched_tokens", "lvf_scan_limit", "lvf_max_skips"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {v!r}")
    for name in ("proactive_swap_budget", "min_residency"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"SchedulerConfig.{name} must be an int >= 0, got {v!r}")
    for name in ("max_writeback_blocks", "writeback_min_free_host", "max_rotations_per_request"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ValueError(f"SchedulerConfig.{name} must be None or an int >= 0, got {v!r}")
    for name in ("alpha", "beta_b", "beta_f", "ttft_slo", "tbt_slo", "code_swap_host_gate",
                 "code_admit_host_gate"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"SchedulerConfig.{name} must be a finite number, got {v!r}")
    for name in ("prefix_load_s_per_block", "prefill_s_per_token"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                            or v < 0):
        raise ValueError(f"SchedulerConfig.{name} must be None or a finite number >= 0, got {v!r}")
    if self.ttft_slo <= 0 or self.tbt_slo <= 0:
      raise ValueError(f"SchedulerConfig SLOs must be > 0 s, got ttft_slo={self.ttft_slo}, "
                       f"tbt_slo={self.tbt_slo}")

  def loads_host_prefix(self, block_size: int) -> bool:
    """The load-or-recompute rule (``host_prefix_load``) for blocks of ``block_size`` tokens found only on
    host: True to load them through the plan's swap-in list, False to recompute them. Per block, so the
    answer does not depend on how many blocks: "cost" loads iff one block's load time is below its
    recompute time (``prefix_load_s_per_block < block_size * prefill_s_per_token``; with either unset,
    loads count as free)."""
    rule = self.host_prefix_load
    if rule != "cost":
      return rule == "always"
    load, per_token = self.prefix_load_s_per_block, self.prefill_s_per_token
    return load is None or per_token is None or load < block_size * per_token

  def vlt_kwargs(self) -> dict:
    return dict(alpha=self.alpha, beta_b=self.beta_b, beta_f=self.beta_f, ttft_slo=self.ttft_slo,
                tbt_slo=self.tbt_slo)
