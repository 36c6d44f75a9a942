"""The prefix reuse a workload's prompts allow: the hit rate of an unlimited block-granular prefix cache.

``prefix_reuse_bound(specs, block_size)`` is computed from the prompts' token ids alone, independently of the
engine and its block manager, so that a prefix cache measured with a pool large enough to hold everything
can be checked against it. The definition, as vLLM v1's automatic prefix caching behaves:

  * Requests are taken in arrival order: the specs stably sorted by ``arrival_s`` (a closed-loop turn, whose
    ``arrival_s`` is its conversation's start, keeps its place after its predecessor in a workload's order).
  * A prompt of ``P`` tokens has ``P // block_size`` FULL blocks; block ``i`` holds tokens
    ``[i * block_size, (i + 1) * block_size)``. A partial last block is never cached or counted.
  * Block ``i`` of a prompt is a HIT when the whole token prefix through its end, ``tokens[0 : (i + 1) *
    block_size]``, equals the same prefix of an EARLIER prompt (content and position: the hash chain over
    full blocks; the same tokens at another offset, or after a different prefix, are no hit), and the block
    ends before the prompt's last token, ``(i + 1) * block_size <= P - 1``: the last prompt token is always
    recomputed (its logits give the first output token), so a prompt that ends exactly on a block boundary
    can hit at most ``P // block_size - 1`` blocks. That block still enters the cache for later prompts.
  * The cache is unlimited and holds every full block of every earlier PROMPT. Generated tokens are not in
    it: their KV is the model's own answer, which a workload with recorded answers (``multiturn.py``) never
    sends back, so the bound neither counts nor needs them.

Returns ``block_hit_rate = hit_blocks / full_blocks`` (the figure to compare with a cache's recorded hit rate)
and the token view: ``hit_tokens = hit_blocks * block_size`` prefill tokens a perfect cache saves out of
``prompt_tokens``. Requests without ``prompt_token_ids`` are refused. Pure Python, no JAX.
"""
from __future__ import annotations

from typing import Any, Sequence


def prefix_reuse_bound(specs: Sequence[Any], block_size: int) -> dict:
  """The unlimited-cache prefix hit rate of ``specs``' prompts (see the module docstring).

  Returns a dict: ``block_size``, ``num_requests``, ``prompt_tokens``, ``full_blocks``, ``hit_blocks``,
  ``block_hit_rate``, ``hit_tokens``, ``token_hit_rate`` (hit tokens / prompt tokens), ``prefill_tokens``
  (prompt tokens a perfect cache still computes) and ``requests_with_hit``.
  """
  if not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
  order = sorted(range(len(specs)), key=lambda i: (float(specs[i].arrival_s), i))
  chain: dict[tuple[int, tuple[int, ...]], int] = {}   # (parent block's id, block tokens) -> block id
  prompt_tokens = full_blocks = hit_blocks = with_hit = 0
  for i in order:
    ids = specs[i].prompt_token_ids
    if ids is None:
      raise ValueError(f"{specs[i].request_id}: prefix_reuse_bound needs prompt_token_ids")
    n = len(ids)
    prompt_tokens += n
    nfull = n // block_size
    full_blocks += nfull
    parent, hits, missed = -1, 0, False
    for b in range(nfull):
      key = (parent, tuple(int(t) for t in ids[b * block_size:(b + 1) * block_size]))
      block_id = chain.get(key)
      if block_id is None:
        missed = True
        block_id = chain[key] = len(chain)
      elif not missed and (b + 1) * block_size <= n - 1:
        hits += 1
      parent = block_id
    hit_blocks += hits
    with_hit += hits > 0
  hit_tokens = hit_blocks * block_size
  return {"block_size": block_size, "num_requests": len(specs), "prompt_tokens": prompt_tokens,
          "full_blocks": full_blocks, "hit_blocks": hit_blocks,
          "block_hit_rate": hit_blocks / full_blocks if full_blocks else 0.0,
          "hit_tokens": hit_tokens, "token_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
          "prefill_tokens": prompt_tokens - hit_tokens, "requests_with_hit": with_hit}
