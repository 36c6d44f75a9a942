"""The per-segment transfer paths of ``DuplexKV`` (modes ``naive`` and ``merged``): one copy per segment.

These are the ablation's slow baselines (docs/duplexkv.md): every segment is its own ``device_put`` (and,
for ``merged``, its own gather/scatter launch), and each direction is waited for before the next starts.
The waits are booked as blocked (exposed) time through the ``DuplexKV``'s ``CopyGroups`` (``eng.copies``).

* ``naive`` (vLLM): per block, per layer, per K/V: segments ``[BS, H, D]``, one blocking ``device_put``
  each. Host blocks are then kept as ``2 * L`` segment arrays.
* ``merged`` (merged segments): per block, one gather launch (the engine's smallest bucket) and one
  ``device_put`` of the whole block ``[L, 2, BS, H, D]``; per swap-in block one ``device_put`` and one
  scatter launch.

Functions of a ``DuplexKV`` (``eng``): they read and write its host pool, stats and clock.
"""
from __future__ import annotations

from typing import Sequence

import jax

from superinfer_jax.rotation import kernels


def naive_d2h(eng, cache: jax.Array, devs: Sequence[int], hosts: Sequence[int]) -> None:
  """Copies device blocks ``devs`` to host blocks ``hosts`` segment by segment, each copy waited for."""
  if not devs:
    return
  staged = eng.gather(cache, devs)
  eng.note_variant(("split", eng.block_shape))
  for h, blk in zip(hosts, staged):
    segs = []
    for seg in kernels.split_block(blk):
      seg = jax.device_put(seg, seg.sharding.with_memory_kind(eng.host_memory_kind))
      eng.copies.block(seg)
      segs.append(seg)
    eng.set_host_entry(h, tuple(segs))
    eng.stats.batches_out += len(segs)
    eng.stats.segments_out += len(segs)


def naive_h2d(eng, hosts: Sequence[int]) -> list[jax.Array]:
  """Device copies ``[L, 2, BS, H, D]`` of host blocks ``hosts``, segment by segment, each waited for."""
  blocks = []
  device_kind = eng.device_sharding.memory_kind
  for h in hosts:
    segs = []
    for seg in eng.host_entry(h):
      seg = jax.device_put(seg, seg.sharding.with_memory_kind(device_kind))
      eng.copies.block(seg)
      segs.append(seg)
    blocks.append(kernels.join_block(tuple(segs)))
    eng.note_variant(("join", eng.block_shape))
    eng.stats.batches_in += len(segs)
    eng.stats.segments_in += len(segs)
  return blocks


def merged_d2h(eng, cache: jax.Array, devs: Sequence[int], hosts: Sequence[int]) -> None:
  """Per block: one gather launch and one D2H ``device_put``; then waits for them all."""
  if not devs:
    return
  staged = eng.gather(cache, devs, per_launch=1)
  on_host = [jax.device_put(blk, eng.host_sharding) for blk in staged]
  for h, arr in zip(hosts, on_host):
    eng.set_host_entry(h, arr)
  eng.stats.batches_out += len(on_host)
  eng.stats.segments_out += len(devs)   # one staged block = one contiguous segment
  eng.copies.block(on_host)


def merged_h2d(eng, hosts: Sequence[int]) -> list[jax.Array]:
  """Per block: one H2D ``device_put``; then waits for them all. Returns the device blocks."""
  incoming = [jax.device_put(eng.host_entry(h), eng.device_sharding) for h in hosts]
  eng.stats.batches_in += len(incoming)
  eng.stats.segments_in += len(hosts)
  eng.copies.block(incoming)
  return incoming
