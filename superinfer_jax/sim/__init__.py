"""Discrete-event simulator: the real ``Scheduler`` and ``BlockManager`` on a ``VirtualClock``, with a cost model
for the model step (``cost.py``: a roofline from the model and hardware profiles) and for KV copies
(``transfer.py``: bandwidth by segment size, DuplexKV's naive / merged / duplex modes). ``event_loop.py`` is the
event loop, ``sim_sweep.py`` the sweep behind ``scripts/simulate.py``; profiles live in ``configs/hardware/``
(``profiles.py``); ``calibration.py`` fits a profile from measured points (``scripts/calibrate.py``, which
measures with ``experiment/calibrate.py``); ``figures.py`` holds the paper's experiments (``simulate.py --figure``). The same-session
comparison with the real engine (``simulate.py --validate``) is ``experiment/sim_validation.py``, where both
harnesses are visible. See docs/simulator.md. No JAX and nothing of ``engine`` or ``experiment`` anywhere in
this package.
"""
from superinfer_jax.sim.config import SimConfig
from superinfer_jax.sim.cost import BatchShape, ModelProfile, StepCost, batch_shape, expected_experts, step_cost
from superinfer_jax.sim.event_loop import RooflineCost, SimResult, Simulator, simulate
from superinfer_jax.sim.profiles import HardwareProfile, LinkProfile, ProfileError, load_hardware_profile
from superinfer_jax.sim.transfer import TransferCost, curve_bandwidth, transfer_cost, transfer_time

__all__ = ["BatchShape", "HardwareProfile", "LinkProfile", "ModelProfile", "ProfileError", "RooflineCost",
           "SimConfig", "SimResult", "Simulator", "StepCost", "TransferCost", "batch_shape", "curve_bandwidth",
           "expected_experts", "load_hardware_profile", "simulate", "step_cost", "transfer_cost", "transfer_time"]
