"""superinfer_jax.util: ceil division, power-of-two rounding and the machine description benchmarks print."""
import os

from hypothesis import given
from hypothesis import strategies as st

from superinfer_jax.util import _parse_cache_size, cdiv, machine_description, next_power_of_2


def test_cdiv_hand_worked():
  assert [cdiv(a, 16) for a in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
  assert cdiv(7, 1) == 7
  assert cdiv(3, 5) == 1


def test_next_power_of_2_hand_worked():
  assert [next_power_of_2(n) for n in (-3, 0, 1, 2, 3, 4, 5, 8, 9, 1000, 1024, 1025)] == \
      [1, 1, 1, 2, 4, 4, 8, 8, 16, 1024, 1024, 2048]


@given(st.integers(0, 10**12), st.integers(1, 10**6))
def test_cdiv_is_the_ceiling(a, b):
  q = cdiv(a, b)
  assert q * b >= a > (q - 1) * b or (a == 0 and q == 0)


@given(st.integers(-10, 10**12))
def test_next_power_of_2_is_the_smallest(n):
  p = next_power_of_2(n)
  assert p >= 1 and p & (p - 1) == 0      # a power of two
  assert p >= n and (p == 1 or p // 2 < n)  # the smallest one >= n


def test_machine_description_reads_cpuinfo_and_the_cache_sizes(tmp_path):
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                     "model name\t: AMD EPYC\n\nprocessor\t: 1\nmodel name\t: Other CPU\n")
  cache = tmp_path / "cache"
  for idx, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "64K"), (2, "Unified", "1024K"),
                                             (3, "Unified", "32M")]):
    d = cache / f"index{idx}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")
  m = machine_description(str(cpuinfo), str(cache))
  assert m["cpu"] == "AMD EPYC (AuthenticAMD family 25 model 17)"  # the first processor's block only
  assert (m["l2_kib"], m["l3_kib"]) == (1024, 32 * 1024)
  assert m["cpus"] == os.cpu_count()


def test_machine_description_missing_files_give_none(tmp_path):
  m = machine_description(str(tmp_path / "no_cpuinfo"), str(tmp_path / "no_cache"))
  assert m == {"cpu": None, "cpus": os.cpu_count(), "l2_kib": None, "l3_kib": None}


def test_parse_cache_size_units():
  assert [_parse_cache_size(s) for s in ("32K", "2M", "1G", "2048", "x", "")] == [32, 2048, 1024 * 1024, 2, None, None]


class _Node:
  """A reference cycle: only the cyclic collector frees it."""
  def __init__(self):
    self.me = self


def test_freeze_heap_hides_live_objects_from_the_collector_until_unfrozen():
  import gc
  import weakref
  from superinfer_jax.util import freeze_heap, unfreeze_heap
  assert gc.get_freeze_count() == 0
  node = _Node()
  ref = weakref.ref(node)
  try:
    frozen = freeze_heap()
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is node for o in gc.get_objects())   # full collections no longer walk it
    del node
    gc.collect()
    assert ref() is not None   # a frozen cycle outlives its last reference: why engines are built after the freeze
    unfreeze_heap()
    assert gc.get_freeze_count() == 0 and ref() is None
  finally:
    gc.unfreeze()
