"""Experiment harness on the real engine: replay a workload in real time, sweep policy × RPS, write results.

``workload_replay.replay_workload`` drives one ``LLMEngine`` through one workload; ``real_sweep.run_sweep``
builds an engine per policy, replays each RPS point and writes ``results.jsonl``, ``requests-<policy>-<rps>.jsonl``,
a config snapshot and plots (the schema lives in ``superinfer_jax.metrics``).
``sim_validation`` runs the real sweep next to the simulator's (``scripts/simulate.py --validate``).
"""
from superinfer_jax.experiment.workload_replay import ReplayResult, replay_workload
from superinfer_jax.experiment.real_sweep import SweepSpec, run_sweep

__all__ = ["ReplayResult", "SweepSpec", "replay_workload", "run_sweep"]
