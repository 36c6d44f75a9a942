"""WallClock never goes backwards, even when the system clock is set back."""
import time

from superinfer_jax.sched.clock import WallClock


def test_wall_clock_ignores_system_clock_jumps(monkeypatch):
  clk = WallClock()
  t0 = clk.now()
  assert abs(t0 - time.time()) < 1.0                 # on the time.time() scale
  monkeypatch.setattr(time, "time", lambda: 0.0)     # the system clock jumps back to 1970
  t1 = clk.now()
  assert t1 >= t0 and t1 - t0 < 1.0


def test_wall_clock_offset():
  clk = WallClock(offset=time.time())
  assert 0.0 <= clk.now() < 1.0
