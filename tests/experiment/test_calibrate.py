"""The main job's calibration: load and SLOs from the measured step time, drift flags, run order."""
import pytest

from superinfer_jax.experiment import calibrate as c
from superinfer_jax.sched.config import SchedulerConfig


def test_derive_hand_worked():
  cal = c.derive([0.1, 0.2, 0.1, 0.1, 0.3], [10, 20, 30, 40], [5, 5, 5, 5], num_steps_saturated=20,
                 pool_tokens=640, load_factor=1.5, ttft_slo_steps=30, tbt_slo_steps=5, cpu_count=2)
  assert cal.step_s == pytest.approx(0.1)                   # the median, robust to slow outliers
  assert cal.capacity_rps == pytest.approx(4 / (20 * 0.1))  # 4 requests in 20 steps of 0.1 s
  assert cal.rps == pytest.approx(3.0)
  assert (cal.ttft_slo_s, cal.tbt_slo_s) == (pytest.approx(3.0), pytest.approx(0.5))
  text = cal.explain()
  assert "100 ms median" in text and "30 steps = 3.00 s" in text and "1.5 x capacity = 3.000 req/s" in text


def test_a_slower_machine_gets_a_proportionally_lower_load_and_looser_slos():
  args = dict(num_steps_saturated=50, pool_tokens=640, load_factor=1.0, ttft_slo_steps=30, tbt_slo_steps=5)
  fast = c.derive([0.05] * 9, [10] * 8, [20] * 8, **args)
  slow = c.derive([0.15] * 9, [10] * 8, [20] * 8, **args)
  assert slow.rps == pytest.approx(fast.rps / 3, rel=1e-3) and slow.tbt_slo_s == pytest.approx(3 * fast.tbt_slo_s)
  # The same experiment in step units: arrivals per step and SLOs in steps are equal.
  assert slow.rps * slow.step_s == pytest.approx(fast.rps * fast.step_s, rel=1e-3)  # rps has 4 digits


def test_derive_rejects_bad_input():
  with pytest.raises(ValueError, match="step times"):
    c.derive([], [1], [1], num_steps_saturated=1, pool_tokens=1, load_factor=1, ttft_slo_steps=1,
             tbt_slo_steps=1)
  with pytest.raises(ValueError, match="load_factor"):
    c.derive([0.1], [1], [1], num_steps_saturated=1, pool_tokens=1, load_factor=0, ttft_slo_steps=1,
             tbt_slo_steps=1)


def test_saturated_steps_hand_worked():
  cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
  # Two requests (prompt 4, 3 output tokens) at once: one prefill step samples the first token of each,
  # two decode steps the rest.
  assert c.saturated_steps([4, 4], [3, 3], scheduler_config=cfg, num_device_blocks=16, num_host_blocks=0,
                           block_size=4) == 3
  # One seat: they run one after the other.
  cfg1 = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)
  assert c.saturated_steps([4, 4], [3, 3], scheduler_config=cfg1, num_device_blocks=16, num_host_blocks=0,
                           block_size=4) == 6
  # A token budget of 2 chunks each 4-token prompt over two steps.
  cfg2 = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2)
  assert c.saturated_steps([4], [3], scheduler_config=cfg2, num_device_blocks=16, num_host_blocks=0,
                           block_size=4) == 4


def test_drift_and_perturbed_flag():
  assert c.step_drift([0.1, 0.3, 0.3], 0.1) == pytest.approx(3.0)
  assert c.step_drift([], 0.1) is None
  assert c.is_perturbed(3.0, 1.5) and c.is_perturbed(0.5, 1.5)
  assert not c.is_perturbed(1.4, 1.5) and not c.is_perturbed(None, 1.5)


def test_interleaved_order_is_abba():
  assert c.interleaved_order(["fcfs", "rotasched"], 3) == [
      (0, "fcfs"), (0, "rotasched"), (1, "rotasched"), (1, "fcfs"), (2, "fcfs"), (2, "rotasched")]
  # Across two repeats every policy's mean position in the run order is the same.
  order = c.interleaved_order(["a", "b", "c"], 2)
  pos = {p: [i for i, (_, q) in enumerate(order) if q == p] for p in "abc"}
  assert len({sum(v) for v in pos.values()}) == 1
