"""Experiment harness on the real engine: replay a workload in real time, sweep policy × RPS, write results.

``replay.replay_workload`` drives one ``LLMEngine`` through one workload; ``runner.run_sweep`` builds an
engine per policy, replays each RPS point and writes ``results.jsonl``, ``requests-<policy>-<rps>.jsonl``,
a config snapshot and plots (the schema lives in ``superinfer_jax.metrics``).
"""
from superinfer_jax.experiment.replay import ReplayResult, replay_workload
from superinfer_jax.experiment.runner import SweepSpec, run_sweep

__all__ = ["ReplayResult", "SweepSpec", "replay_workload", "run_sweep"]
