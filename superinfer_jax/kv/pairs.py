"""``PairList``: a list of ``(src, dst)`` block-id pairs stored as two parallel columns.

The block manager's copy lists (``swap_out``, ``swap_in``, ``take_writebacks``), the scheduler's
``StepPlan.swap_out`` / ``swap_in`` / ``writeback`` and DuplexKV's inputs are sequences of block-id pairs:
D2H ``(device, host)``, H2D ``(host, device)``. Under heavy rotation a step moves thousands of blocks, and one
``tuple`` per pair costs an allocation each and drives Python's cyclic GC (its pauses land inside
``Scheduler.schedule()``). A ``PairList`` keeps the pairs as two plain Python lists of ints instead, so
building one is a couple of slice copies / ``list.extend`` calls in C and no per-pair object.

It behaves like a ``list`` of 2-tuples for reading: ``len``, ``bool``, iteration (yields ``(src, dst)``
tuples lazily, in order), indexing (a tuple) and slicing (a ``PairList``), ``in``, ``index``, ``count``,
``==`` / ``!=`` against another ``PairList`` or a ``list`` of 2-tuples (element-wise, like ``list.__eq__``:
a ``list`` of 2-lists is not equal, neither is a ``tuple``), ``+`` (a new ``PairList``), ``repr``. For
writing: ``append((src, dst))``, ``extend(pairs)`` and ``+=`` (column-wise ``list.extend`` when ``pairs`` is a
``PairList``; otherwise any iterable of 2-sequences), ``clear()``, ``copy()``. Fast consumers read the
columns ``srcs`` / ``dsts`` directly.

Invariants:
  * ``srcs`` and ``dsts`` are int columns of equal length, each a ``list[int]`` or an ``array('i')``
    (``h2d_pairs``); pair ``i`` is ``(srcs[i], dsts[i])``.
  * The columns are owned by the ``PairList``: ``from_columns`` takes the lists it is given (no copy), so a
    caller must not mutate them afterwards; readers of ``srcs`` / ``dsts`` must not mutate them either
    unless they own the ``PairList``.
  * Unhashable (mutable), like ``list``.

Not a ``list`` subclass: ``isinstance(p, list)`` is False (it is a ``collections.abc.Sequence``), and
``json`` needs ``p.tolist()``. No scheduler, engine or test code relies on either.
"""
from __future__ import annotations

import array
import collections.abc
import operator
from typing import Iterable, Iterator, Sequence


class PairList:
  """A sequence of ``(src, dst)`` int pairs kept as two columns (see the module docstring).

  Registered as a ``collections.abc.Sequence`` rather than derived from it, so that ``isinstance(x, PairList)``
  stays a plain type check (an ABC's check is a Python-level call).

  Attributes:
    srcs: ``list[int]`` or ``array('i')``, the first element of every pair, in order.
    dsts: ``list[int]`` or ``array('i')``, the second element of every pair; ``len(dsts) == len(srcs)``.
  """
  __slots__ = ("srcs", "dsts")
  __hash__ = None  # mutable, like list

  def __init__(self, pairs: Iterable[Sequence[int]] | None = None):
    """Creates a PairList holding ``pairs`` (any iterable of 2-sequences; a PairList is copied)."""
    if pairs is None:
      self.srcs = []
      self.dsts = []
      return
    if isinstance(pairs, PairList):
      self.srcs = list(pairs.srcs)
      self.dsts = list(pairs.dsts)
      return
    self.srcs = []
    self.dsts = []
    self.extend(pairs)

  @classmethod
  def from_columns(cls, srcs: list[int], dsts: list[int]) -> PairList:
    """A PairList over the given columns (taken, not copied; equal lengths required)."""
    if len(srcs) != len(dsts):
      raise ValueError(f"columns differ in length: {len(srcs)} != {len(dsts)}")
    self = cls.__new__(cls)
    self.srcs = srcs
    self.dsts = dsts
    return self

  # ------------------------------------------------------------------ reading
  def __len__(self) -> int:
    return len(self.srcs)

  def __bool__(self) -> bool:
    return bool(self.srcs)

  def __iter__(self) -> Iterator[tuple[int, int]]:
    return zip(self.srcs, self.dsts)

  def __reversed__(self) -> Iterator[tuple[int, int]]:
    return zip(reversed(self.srcs), reversed(self.dsts))

  def __getitem__(self, index):
    if isinstance(index, slice):
      return PairList.from_columns(self.srcs[index], self.dsts[index])
    return (self.srcs[index], self.dsts[index])

  def __contains__(self, pair) -> bool:
    try:
      s, d = pair
    except (TypeError, ValueError):
      return False
    dsts = self.dsts
    srcs = self.srcs
    i = -1
    while True:
      try:
        i = srcs.index(s, i + 1)
      except ValueError:
        return False
      if dsts[i] == d:
        return True

  def index(self, pair, start: int = 0, stop: int | None = None) -> int:
    """The first ``i`` in ``[start, stop)`` with ``self[i] == pair`` (``ValueError`` if none), like list."""
    n = len(self.srcs)
    start, stop, _ = slice(start, stop).indices(n)
    try:
      s, d = pair
    except (TypeError, ValueError):
      raise ValueError(f"{pair!r} is not in PairList") from None
    srcs, dsts = self.srcs, self.dsts
    i = start - 1
    while True:
      try:
        i = srcs.index(s, i + 1, stop)
      except ValueError:
        raise ValueError(f"{pair!r} is not in PairList") from None
      if dsts[i] == d:
        return i

  def count(self, pair) -> int:
    """How many pairs equal ``pair``."""
    try:
      s, d = pair
    except (TypeError, ValueError):
      return 0
    return sum(1 for a, b in zip(self.srcs, self.dsts) if a == s and b == d)

  def __eq__(self, other) -> bool:
    if isinstance(other, PairList):
      return _col_eq(self.srcs, other.srcs) and _col_eq(self.dsts, other.dsts)
    if isinstance(other, list):
      if len(other) != len(self.srcs):
        return False
      for p, q in zip(other, zip(self.srcs, self.dsts)):
        if p != q:
          return False
      return True
    return NotImplemented

  def __add__(self, other: Iterable[Sequence[int]]) -> PairList:
    out = PairList.from_columns(list(self.srcs), list(self.dsts))
    out.extend(other)
    return out

  def __radd__(self, other: Iterable[Sequence[int]]) -> PairList:
    out = PairList(other)
    out.extend(self)
    return out

  def __repr__(self) -> str:
    return f"PairList({list(zip(self.srcs, self.dsts))!r})"

  def tolist(self) -> list[tuple[int, int]]:
    """The pairs as a list of tuples."""
    return list(zip(self.srcs, self.dsts))

  def copy(self) -> PairList:
    return PairList.from_columns(list(self.srcs), list(self.dsts))

  def __copy__(self) -> PairList:
    return self.copy()

  def __deepcopy__(self, memo) -> PairList:
    return self.copy()  # the columns hold ints only

  def __reduce__(self):
    return (PairList.from_columns, (list(self.srcs), list(self.dsts)))

  # ------------------------------------------------------------------ writing
  def append(self, pair: Sequence[int]) -> None:
    s, d = pair
    self.srcs.append(s)
    self.dsts.append(d)

  def extend(self, pairs: Iterable[Sequence[int]]) -> None:
    """Appends ``pairs`` in order: column-wise if ``pairs`` is a PairList, else pair by pair."""
    if isinstance(pairs, PairList):
      _col_extend(self.srcs, pairs.srcs)
      _col_extend(self.dsts, pairs.dsts)
      return
    srcs = self.srcs
    dsts = self.dsts
    n = len(srcs)
    try:
      for s, d in pairs:
        srcs.append(s)
        dsts.append(d)
    except BaseException:
      del srcs[n:], dsts[n:]  # all or nothing: never leave the columns different in length
      raise

  def __iadd__(self, pairs: Iterable[Sequence[int]]) -> PairList:
    self.extend(pairs)
    return self

  def clear(self) -> None:
    self.srcs.clear()
    self.dsts.clear()


collections.abc.Sequence.register(PairList)


def _col_eq(a, b) -> bool:
  """Element-wise equality of two int columns (``list`` or ``array``; ``list == array`` is always False)."""
  return a == b if type(a) is type(b) else len(a) == len(b) and all(map(operator.eq, a, b))


def _col_extend(col, other) -> None:
  """``col += other`` for int columns of either kind (an ``array`` cannot be extended with a ``list``)."""
  if type(col) is type(other) or type(col) is list:
    col += other
  else:
    col.fromlist(list(other))


DEV_IDS = "i"  # array typecode of device block-id columns (the block manager's device lists, block tables, ``h2d_pairs().dsts``)
HOST_IDS = "i"  # array typecode of host block-id columns (the block manager's host lists, ``h2d_pairs().srcs``)


def h2d_pairs() -> PairList:
  """An empty PairList whose columns are ``array``s: ``srcs`` of host ids (typecode ``HOST_IDS``), ``dsts`` of
  device ids (``DEV_IDS``), so that the block manager appends a swapped-in request's host ids and new device
  ids (arrays too) with one ``memcpy`` each: no Python int is created or touched per block."""
  return PairList.from_columns(array.array(HOST_IDS), array.array(DEV_IDS))

EMPTY_COLUMNS = ((), ())


def columns(pairs: Iterable[Sequence[int]] | None) -> tuple[Sequence[int], Sequence[int]]:
  """``(srcs, dsts)`` of ``pairs``: a PairList's own columns (no copy; do not mutate), else unzipped."""
  if pairs is None:
    return EMPTY_COLUMNS
  if isinstance(pairs, PairList):
    return pairs.srcs, pairs.dsts
  srcs = []
  dsts = []
  for s, d in pairs:
    srcs.append(s)
    dsts.append(d)
  return srcs, dsts

