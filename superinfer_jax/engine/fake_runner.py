"""``FakeRunner``: a host-only ``ModelRunner`` (``engine/model_runner.py``) that checks the KV plumbing it is driven by.

It keeps a pretend KV cache of token ids, ``[num_device_blocks + 1, block_size]`` (block 0 = padding), and a
host pool of the same blocks; its "model" samples, for each sequence that samples, ``next_token(context)``, a
hash of the token ids the sequence's block table holds at positions ``0 .. context_len - 1``. So a request's
outputs are ``next_token(prompt + outputs so far)`` exactly when every block it reads holds what was written
there, through chunked prefill, rotation to host and back, write-back, recompute preemption and the
zero-bubble loop's on-device token feed. A wrong block table, slot, copy order or feed changes the tokens.

Step time comes from a cost model: ``step_time(num_tokens) -> seconds``, added to a ``VirtualClock`` at each
dispatch (the simulator's clock), so an engine driven by it runs in virtual time. Transfers are recorded
(``transfers``: one ``(num_swap_out, num_writeback, num_swap_in)`` per issue). Host-side only; no JAX.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Callable, Optional

import numpy as np

from superinfer_jax.engine import packing
from superinfer_jax.kv.layout import KVCacheSpec


def next_token(context: list[int], vocab_size: int) -> int:
  """The fake model: a stable hash of the whole context, in ``[1, vocab_size)``."""
  return 1 + zlib.crc32(np.asarray(context, np.int64).tobytes()) % (vocab_size - 1)


@dataclasses.dataclass(frozen=True)
class FakeModelConfig:
  """The model facts the engine core reads from ``runner.model_config``."""
  vocab_size: int = 1000
  max_position_embeddings: int = 4096
  eos_token_ids: tuple = ()


class FakeRunner:
  """See the module docstring. ``out_rows``: rows of the sampled ids, at least the largest sequence bucket a
  plan can have (``bucket(max_num_seqs, seq_bucket_floor)``, as the real runner sizes them)."""

  def __init__(self, *, num_device_blocks: int, num_host_blocks: int, block_size: int, out_rows: int,
               model_config: Optional[FakeModelConfig] = None, clock=None,
               step_time: Callable[[int], float] = lambda n: 0.01 + 1e-5 * n):
    self.model_config = model_config or FakeModelConfig()
    self.kv_spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size)
    self.num_device_blocks, self.num_host_blocks, self.out_rows = num_device_blocks, num_host_blocks, out_rows
    self.device = np.full((num_device_blocks + 1, block_size), -1, np.int64)
    self.host = np.full((max(num_host_blocks, 1), block_size), -1, np.int64)
    self.clock, self.step_time = clock, step_time
    self.transfers: list[tuple[int, int, int]] = []
    self.steps = 0

  def issue_transfers(self, swap_out, writeback, swap_in, round_trip: bool) -> None:
    """D2H (swap-out + write-back) gathered before the H2D scatter, as ``DuplexKV.issue`` orders them."""
    outs = [(int(s), int(d)) for s, d in list(swap_out) + list(writeback)]
    gathered = [self.device[s].copy() for s, _ in outs]
    for (_, d), row in zip(outs, gathered):
      self.host[d] = row
    for s, d in swap_in:
      self.device[int(d)] = self.host[int(s)]
    self.transfers.append((len(swap_out), len(writeback), len(swap_in)))

  def dispatch(self, packed: np.ndarray, dims, mode: str, prev: Optional[packing.StepHandle],
               processing: Optional[np.ndarray] = None, num_logprobs: int = 0) -> packing.StepHandle:
    """Writes the step's tokens at their slots, then samples each sampling row from its context. The fake
    model has no logits: a step asking for logit processing or logprobs raises ``NotImplementedError``."""
    if processing is not None or num_logprobs:
      raise NotImplementedError("FakeRunner has no logits: logit_bias, penalties and logprobs need a real model")
    f = {name: packed[a:b] for name, (a, b) in packing.offsets(dims).items()}
    S, MB = dims[1], dims[2]
    del mode                                              # the fake model samples greedily
    tokens = f["token_ids"].astype(np.int64)
    fed = f["feed"] >= 0
    if fed.any():
      tokens[fed] = prev.tokens[f["feed"][fed]]
    bs = self.kv_spec.block_size
    self.device[f["slot_mapping"] // bs, f["slot_mapping"] % bs] = tokens
    self.device[0] = -1                                   # padding tokens land in block 0: never read
    tables, ctx, qsl = f["block_tables"].reshape(S, MB), f["context_lens"], f["query_start_loc"]
    out = np.zeros(self.out_rows, np.int64)
    for s in range(S):                                    # logits row s = sequence s's last token
      if ctx[s] == 0 or qsl[s + 1] == qsl[s]:             # a padding sequence
        continue
      n = int(ctx[s])
      context = self.device[tables[s, :-(-n // bs)]].ravel()[:n]
      if (context < 0).any():
        raise AssertionError(f"step {self.steps}: sequence {s} reads an unwritten slot: {context.tolist()}")
      out[s] = next_token(context.tolist(), self.model_config.vocab_size)
    self.steps += 1
    if self.clock is not None:
      self.clock.advance(self.step_time(int(dims[0])))
    return packing.StepHandle(out)

  def read_step(self, handle: packing.StepHandle):
    return handle.tokens.tolist(), None

  def precompile_step(self, packed: np.ndarray, dims, mode: str = "greedy") -> None:
    pass

  def precompile_rotation(self) -> None:
    pass

  def num_compiled_shapes(self) -> int:
    return 0
