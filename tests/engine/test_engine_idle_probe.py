"""DeviceIdleProbe (superinfer_jax/engine/idle_probe.py) on real device arrays, and the order of dispatch and
read-back in the engine's loops: zero-bubble dispatches step k+1 before it reads step k's ids."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.engine.config import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from superinfer_jax.engine.idle_probe import DeviceIdleProbe
from test_engine_utils import random_params, tiny_config


@jax.jit
def _slow(x):
  return jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ y), x)


def test_probe_measures_a_gap_and_no_gap():
  x = jnp.ones((256, 256)) * 1e-3
  _slow(x).block_until_ready()
  t = time.perf_counter()
  _slow(x).block_until_ready()
  run_s = time.perf_counter() - t
  probe = DeviceIdleProbe().start()
  a = _slow(x)
  probe.dispatched(a)
  b = _slow(a)                # enqueued while a runs: no idle between them
  probe.dispatched(b)
  b.block_until_ready()
  time.sleep(0.2)             # the device waits 200 ms for the host
  probe.dispatched(_slow(b))
  probe.stop()
  idle = probe.idle_ms()
  assert len(idle) == 2
  assert idle[0] == 0.0, (idle, run_s)
  assert 150.0 < idle[1] < 2000.0, idle


def test_break_chain_skips_the_pair():
  probe = DeviceIdleProbe().start()
  x = jnp.zeros(3)
  probe.dispatched(x)
  probe.break_chain()
  probe.dispatched(x + 1)
  probe.stop()
  assert probe.idle_ms() == []


class _OrderProbe(DeviceIdleProbe):
  """Also records the order of dispatches ("d", k) and host read-backs ("r", k)."""

  def __init__(self):
    super().__init__()
    self.events = []

  def dispatched(self, out):
    k = super().dispatched(out)
    self.events.append(("d", k))
    return k

  def read(self, k):
    super().read(k)
    self.events.append(("r", k))


@pytest.mark.parametrize("zero_bubble", [True, False])
def test_zero_bubble_dispatches_before_reading(zero_bubble):
  cfg = tiny_config(max_pos=128)
  eng = LLMEngine((cfg, random_params(cfg, seed=4), None), EngineConfig.create(
      num_device_blocks=64, num_host_blocks=0, block_size=4, policy="fcfs", max_num_batched_tokens=32,
      max_num_seqs=8, token_bucket_floor=32, seq_bucket_floor=8, blocks_bucket_floor=32,
      zero_bubble=zero_bubble))
  probe = eng.idle_probe = _OrderProbe().start()
  rng = np.random.default_rng(0)
  eng.generate([rng.integers(3, 100, size=6).tolist() for _ in range(3)],
               SamplingParams(max_tokens=8, ignore_eos=True))
  probe.stop()
  pos = {e: i for i, e in enumerate(probe.events)}
  n = probe.num_dispatched
  assert n >= 8 and all(("r", k) in pos for k in range(n))
  for k in range(n - 1):
    if zero_bubble:
      assert pos[("d", k + 1)] < pos[("r", k)]      # k+1 was in the device queue before k's ids were read
    else:
      assert pos[("r", k)] < pos[("d", k + 1)]
  assert len(probe.idle_ms()) == n - 1
