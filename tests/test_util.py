"""superinfer_jax.util: ceil division and power-of-two rounding."""
from hypothesis import given
from hypothesis import strategies as st

from superinfer_jax.util import cdiv, next_power_of_2


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
