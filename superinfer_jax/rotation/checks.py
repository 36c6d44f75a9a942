"""Argument checks of ``DuplexKV.issue()``: copy lists as ``PairList``s, id ranges, duplicate destinations.

Pure Python (no JAX). Device block ids are valid in ``[1, num_blocks)`` (block 0 is ``PADDING_BLOCK``), host
block ids in ``[0, num_host_blocks)``.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from superinfer_jax.kv.layout import PADDING_BLOCK
from superinfer_jax.kv.pairs import PairList, columns


def as_pairs(pairs: Iterable[Sequence[int]] | None) -> PairList:
  """A fresh PairList of Python ints: a PairList is copied column-wise (no per-pair tuple), anything else is
  read as an iterable of ``(src, dst)`` pairs; None is empty."""
  if pairs is None:
    return PairList()
  if isinstance(pairs, PairList):
    return PairList.from_columns(list(map(int, pairs.srcs)), list(map(int, pairs.dsts)))
  srcs, dsts = [], []
  for a, b in pairs:
    srcs.append(int(a))
    dsts.append(int(b))
  return PairList.from_columns(srcs, dsts)


def check_host_id(h: int, num_host_blocks: int) -> None:
  """``ValueError`` unless ``0 <= h < num_host_blocks``."""
  if not 0 <= h < num_host_blocks:
    raise ValueError(f"host block id {h} out of range [0, {num_host_blocks})")


def _ids_ok(devs: Sequence[int], hosts: Sequence[int], num_blocks: int, num_host_blocks: int) -> bool:
  """True when every device id is in ``[1, num_blocks)`` and every host id in the pool (min/max, in C)."""
  if not devs:
    return True
  return (PADDING_BLOCK < min(devs) and max(devs) < num_blocks and 0 <= min(hosts)
          and max(hosts) < num_host_blocks)


def validate_step(num_blocks: int, num_host_blocks: int, d2h: PairList, h2d: PairList) -> None:
  """Checks one issue()'s D2H ``(device, host)`` and H2D ``(host, device)`` pairs.

  Raises:
    ValueError: an id out of range (the first bad pair is named), the padding block used, a duplicate
      destination, or a host block that is both an H2D source and a D2H destination.
  """
  out_devs, out_hosts = columns(d2h)
  in_hosts, in_devs = columns(h2d)
  if not _ids_ok(out_devs, out_hosts, num_blocks, num_host_blocks):
    for d, h in zip(out_devs, out_hosts):
      if not PADDING_BLOCK < d < num_blocks:
        raise ValueError(f"D2H source device block {d} out of range [1, {num_blocks})")
      check_host_id(h, num_host_blocks)
  if not _ids_ok(in_devs, in_hosts, num_blocks, num_host_blocks):
    for h, d in zip(in_hosts, in_devs):
      if not PADDING_BLOCK < d < num_blocks:
        raise ValueError(f"H2D destination device block {d} out of range [1, {num_blocks})")
      check_host_id(h, num_host_blocks)
  out_set = set(out_hosts)
  if len(out_set) != len(out_hosts):
    raise ValueError(f"a host block is the D2H destination twice: {sorted(out_hosts)}")
  if len(set(in_devs)) != len(in_devs):
    raise ValueError(f"a device block is the H2D destination twice: {sorted(in_devs)}")
  both = out_set.intersection(in_hosts)
  if both:
    raise ValueError(f"host blocks {sorted(both)} are both H2D sources and D2H destinations in one step")
