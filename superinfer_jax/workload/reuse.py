"""Prefix-reuse information of a workload: recorded block ids at the engine's block size, and the reuse bound.

A trace that records prefix reuse (the Mooncake conversation trace, ``workload/data/``) gives each prompt one
hash id per ``block_ids_tokens`` (512) tokens (``RequestSpec.block_ids``); ids are chained, so two prompts
that share their first k ids share their first k x 512 tokens. The engine hashes blocks of ``block_size``
tokens, so:

* ``expand_block_ids(block_ids, block_ids_tokens, prompt_len, block_size)``: the engine's block hashes.
  ``block_size`` must divide ``block_ids_tokens`` (a coarser engine block would mix the contents of several
  recorded ids; ``ValueError`` naming both values otherwise). Recorded id ``h`` covering tokens
  ``[i * T, ...)`` gives derived ids for its sub-blocks ``s = 0 .. T / block_size - 1``:
  ``mix64((h << 16) | s)``, where ``mix64`` is the splitmix64 finalizer (``z ^= z >> 30; z *= 0xbf58476d1ce4e5b9;
  z ^= z >> 27; z *= 0x94d049bb133111eb; z ^= z >> 31``, mod 2^64), a bijection of 64-bit words. The key
  ``(h << 16) | s`` is one-to-one for ``0 <= h < 2^48`` and ``s < 2^16``, so identical (id, position) give
  identical derived ids and different ones **never** collide (checked: an id or a ratio outside those ranges
  is a ``ValueError``). The last, partial recorded block gets only the sub-blocks its remaining tokens need:
  ``ceil(prompt_len / block_size)`` derived ids in all. Deterministic across processes (no salted
  ``hash()``).
* ``reuse_bound(specs, block_size)``: what an unlimited prefix cache could reuse, in arrival order (below).

The reuse bound. Requests are taken in arrival order (stable); each prompt's blocks are its derived ids at
``block_size``. A block **hits** when its id was stored by an earlier request **and every block before it in
the same prompt hits** (a prefix cache reuses whole prefixes); after a request is looked up, all its blocks
are stored (unlimited cache, nothing evicted). Two readings:

* ``hit_rate`` (the engine's): **full** blocks only (``block_size`` tokens; a prefix cache keeps full blocks),
  both looked up and stored, and a block hits only if it ends before the prompt's last token (that token is
  always computed: a prompt ending on a block boundary cannot hit its last full block, which is still stored).
  ``hit_tokens = hit_blocks x block_size``; ``token_hit_rate`` is that over all prompt tokens.
* ``hit_rate_with_partial`` (the trace README's "36.6% of prompt blocks already seen", at 512): every block,
  the partial last one too, is looked up and stored; the denominator is all blocks (``sum ceil(prompt_len /
  block_size)``).

Numpy and the standard library only (no JAX). ``python -m superinfer_jax.workload.reuse --trace=mooncake``
prints the bound.
"""
from __future__ import annotations

import argparse
from typing import Iterable, Sequence

import numpy as np

ID_BITS = 48          # recorded ids must be < 2^48
SUB_BITS = 16         # block_ids_tokens / block_size must be <= 2^16
_M1 = np.uint64(0xbf58476d1ce4e5b9)
_M2 = np.uint64(0x94d049bb133111eb)


def mix64(z: np.ndarray) -> np.ndarray:
  """The splitmix64 finalizer on a uint64 array (a bijection of 64-bit words; wraps mod 2^64)."""
  z = np.asarray(z, dtype=np.uint64)
  with np.errstate(over="ignore"):
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
  return z ^ (z >> np.uint64(31))


def _check(block_ids: Sequence[int], block_ids_tokens: int, prompt_len: int, block_size: int) -> int:
  """The ratio ``block_ids_tokens / block_size`` after checking every argument (``ValueError`` naming them)."""
  for name, v in (("block_ids_tokens", block_ids_tokens), ("prompt_len", prompt_len), ("block_size", block_size)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")
  if block_ids_tokens % block_size:
    raise ValueError(f"block_size {block_size} does not divide block_ids_tokens {block_ids_tokens}: the engine's "
                     "block size must divide the tokens each recorded id covers")
  ratio = block_ids_tokens // block_size
  if ratio > 1 << SUB_BITS:
    raise ValueError(f"block_ids_tokens / block_size = {block_ids_tokens} / {block_size} = {ratio} is over "
                     f"2^{SUB_BITS}")
  want = -(-prompt_len // block_ids_tokens)
  if len(block_ids) != want:
    raise ValueError(f"{len(block_ids)} block_ids but prompt_len {prompt_len} needs ceil({prompt_len} / "
                     f"{block_ids_tokens}) = {want}")
  return ratio


def expand_block_ids_array(block_ids: Sequence[int], block_ids_tokens: int, prompt_len: int,
                           block_size: int) -> np.ndarray:
  """``expand_block_ids`` as a uint64 array."""
  ratio = _check(block_ids, block_ids_tokens, prompt_len, block_size)
  ids = np.asarray(block_ids, dtype=np.int64)
  if ids.size and (ids.min() < 0 or ids.max() >= 1 << ID_BITS):
    raise ValueError(f"block ids must lie in [0, 2^{ID_BITS}), got {int(ids.min())} .. {int(ids.max())}")
  n = -(-prompt_len // block_size)
  k = np.arange(n, dtype=np.uint64)
  r = np.uint64(ratio)
  keys = (ids.astype(np.uint64)[(k // r).astype(np.int64)] << np.uint64(SUB_BITS)) | (k % r)
  return mix64(keys)


def expand_block_ids(block_ids: Sequence[int], block_ids_tokens: int, prompt_len: int,
                     block_size: int) -> tuple[int, ...]:
  """The prompt's ``ceil(prompt_len / block_size)`` block hashes at the engine's ``block_size``: engine block
  ``k`` lies in recorded block ``k // r`` at position ``k % r`` (``r = block_ids_tokens / block_size``) and
  its id is ``mix64((block_ids[k // r] << 16) | (k % r))`` (module docstring). ``ValueError`` if
  ``block_size`` does not divide ``block_ids_tokens``, if ``len(block_ids) != ceil(prompt_len /
  block_ids_tokens)``, or if an id is outside ``[0, 2^48)``."""
  return tuple(expand_block_ids_array(block_ids, block_ids_tokens, prompt_len, block_size).tolist())


def _hits(values: np.ndarray, req: np.ndarray, starts: np.ndarray) -> np.ndarray:
  """Whole-prefix hits of blocks ``values`` (request ``req`` of each, non-decreasing; ``starts[i]`` the index
  of request i's first block): seen in an earlier request, and every earlier block of the request a hit."""
  if not values.size:
    return np.zeros(0, dtype=bool)
  _, first, inverse = np.unique(values, return_index=True, return_inverse=True)
  seen_before = req[first][inverse.reshape(-1)] < req           # first stored by an earlier request
  misses = np.cumsum(~seen_before)
  before = np.concatenate(([0], misses))[starts]                 # misses before each request's first block
  return misses - before[req] == 0


def reuse_bound(specs: Iterable, block_size: int) -> dict:
  """The reuse bound of ``specs`` (``RequestSpec``s with ``block_ids``; a ``Workload``) at ``block_size``,
  with an unlimited cache, in arrival order (module docstring): ``hit_rate`` = hit full blocks / full
  blocks, plus ``requests``, ``prompt_tokens``, ``blocks``, ``hit_blocks``, ``hit_tokens``,
  ``token_hit_rate``, and the reading with the partial last blocks (``blocks_with_partial``,
  ``hit_blocks_with_partial``, ``hit_tokens_with_partial``, ``hit_rate_with_partial``). ``ValueError`` for
  a request without ``block_ids``."""
  specs = sorted(specs, key=lambda r: r.arrival_s)        # stable: ties keep their order
  parts, full_mask, tokens = [], [], []
  prompt_tokens = 0
  for r in specs:
    if r.block_ids is None:
      raise ValueError(f"{r.request_id}: no block_ids: the reuse bound needs a trace that records them")
    d = expand_block_ids_array(r.block_ids, r.block_ids_tokens, r.prompt_len, block_size)
    parts.append(d)
    nfull = r.prompt_len // block_size
    m = np.zeros(len(d), dtype=bool)
    m[:nfull] = True
    full_mask.append(m)
    t = np.full(len(d), block_size, dtype=np.int64)
    if len(d) > nfull:
      t[-1] = r.prompt_len - nfull * block_size
    tokens.append(t)
    prompt_tokens += r.prompt_len
  n = len(parts)
  if not n:
    raise ValueError("reuse_bound of no requests")
  values = np.concatenate(parts)
  full = np.concatenate(full_mask)
  tok = np.concatenate(tokens)
  lens = np.array([len(p) for p in parts], dtype=np.int64)
  req = np.repeat(np.arange(n), lens)
  starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
  hit_all = _hits(values, req, starts)
  full_lens = np.array([int(m.sum()) for m in full_mask], dtype=np.int64)
  full_starts = np.concatenate(([0], np.cumsum(full_lens)[:-1]))
  hit_full = _hits(values[full], req[full], full_starts)
  # The last prompt token is always computed (its logits give the first output token): a prompt that ends
  # on a block boundary cannot hit its last full block, though that block is stored for later prompts.
  p_len = np.array([r.prompt_len for r in specs], dtype=np.int64)
  capped = (p_len % block_size == 0) & (full_lens > 0)
  hit_full[(full_starts + full_lens - 1)[capped]] = False
  blocks, hit_blocks = int(full.sum()), int(hit_full.sum())
  out = dict(block_size=block_size, requests=n, prompt_tokens=prompt_tokens, blocks=blocks, hit_blocks=hit_blocks,
             hit_tokens=hit_blocks * block_size,
             hit_rate=hit_blocks / blocks if blocks else 0.0,
             token_hit_rate=hit_blocks * block_size / prompt_tokens,
             blocks_with_partial=int(values.size), hit_blocks_with_partial=int(hit_all.sum()),
             hit_tokens_with_partial=int(tok[hit_all].sum()))
  out["hit_rate_with_partial"] = out["hit_blocks_with_partial"] / out["blocks_with_partial"]
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description="The reuse bound of a trace that records block ids "
                               "(superinfer_jax.workload.reuse docstring).")
  ap.add_argument("--trace", default="mooncake", help="a trace path or a packaged trace's name")
  ap.add_argument("--block_size", type=int, action="append",
                  help="engine block size (repeatable; default 512 and 16)")
  ap.add_argument("--num_requests", type=int, default=None, help="the first N requests (default all)")
  args = ap.parse_args(argv)
  from superinfer_jax.workload.traces import read_trace  # pylint: disable=import-outside-toplevel
  w, info = read_trace(args.trace, token_ids=False, num_requests=args.num_requests)
  print(f"{info.path}: {info.kept} requests, {info.duration_s:.0f} s")
  for b in args.block_size or [512, 16]:
    s = reuse_bound(w, b)
    print(f"block_size {b}: full blocks {s['hit_blocks']:,} / {s['blocks']:,} hit = {s['hit_rate']:.2%} "
          f"({s['token_hit_rate']:.2%} of {s['prompt_tokens']:,} prompt tokens); with the partial last blocks "
          f"{s['hit_blocks_with_partial']:,} / {s['blocks_with_partial']:,} = {s['hit_rate_with_partial']:.2%}")


__all__ = ["ID_BITS", "SUB_BITS", "expand_block_ids", "expand_block_ids_array", "mix64", "reuse_bound"]


if __name__ == "__main__":
  main()
