"""Decode-step time of the paged JAX forward vs transformers' forward on the same weights, in one run.

  JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 python scripts/bench_model.py --model=smollm2-135m \
      --batch_sizes=1,16 --context=128 --steps=20

For each batch size B: prefill B random prompts of ``--context`` tokens, then time ``--steps`` decode steps
(one new token per sequence) after ``--warmup`` untimed ones, JAX and torch steps interleaved so both see
the same machine load. JAX: host ``build_batch`` + jitted ``step`` (cache donated) + reading the logits
back. transformers: ``model(input_ids[B,1], <DynamicCache>)`` under ``torch.no_grad()``. Prints one JSON
line per batch size with median and min step times and the ratios torch/jax.
"""
import json
import os
import time

from absl import app, flags
import numpy as np

from superinfer_jax import configtree
from superinfer_jax.engine.config import EngineConfig
from superinfer_jax.sweep import SweepSpec

configtree.define_flags(SweepSpec, only={"model"})   # a built-in name or a .gguf path (transformers loads it)
configtree.define_flags(EngineConfig, only={"block_size"})
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "16"], "Decode batch sizes.")
_CONTEXT = flags.DEFINE_integer("context", 128, "Prompt tokens per sequence before decoding.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed decode steps.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed decode steps (compilation, caches).")
_ATTENTION = flags.DEFINE_string("attention", "reference", "Attention backend.")
_SKIP_TORCH = flags.DEFINE_bool("skip_torch", False, "Time only the JAX forward.")


class JaxDecoder:
  """B sequences prefilled with random prompts in a paged cache; ``step()`` decodes one token each."""

  def __init__(self, cfg, params, batch, context, max_steps, block_size, attention):
    from superinfer_jax.model import build_batch, init_kv_cache, step
    self._build, self._step = build_batch, step
    self.cfg, self.params, self.block_size, self.attention = cfg, params, block_size, attention
    per_seq = -(-(context + max_steps + 1) // block_size)
    self.cache = init_kv_cache(cfg, batch * per_seq + 1, block_size, "float32")
    self.tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size, size=context) for _ in range(batch)]
    b, rows = build_batch([(p, 0, t) for p, t in zip(prompts, self.tables)], block_size)
    logits, self.cache = step(params, self.cache, b, cfg, attention)
    self.tokens = np.asarray(logits)[:rows].argmax(-1)
    self.pos = context

  def step(self):
    b, rows = self._build([([int(tok)], self.pos, t) for tok, t in zip(self.tokens, self.tables)],
                          self.block_size)
    logits, self.cache = self._step(self.params, self.cache, b, self.cfg, self.attention)
    self.tokens = np.asarray(logits)[:rows].argmax(-1)   # waits for the step
    self.pos += 1


class TorchDecoder:
  """Same for a transformers model with a ``DynamicCache``."""

  def __init__(self, model, vocab, batch, context):
    import inspect
    import torch
    from transformers import DynamicCache
    self.torch, self.model = torch, model
    params = inspect.signature(model.forward).parameters
    self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
    self.kv = DynamicCache()
    ids = torch.tensor(np.random.RandomState(0).randint(0, vocab, size=(batch, context)))
    self.tokens = self._forward(ids)

  def _forward(self, ids):
    with self.torch.no_grad():
      out = self.model(input_ids=ids, use_cache=True, **{self.cache_kw: self.kv})
    return out.logits[:, -1].argmax(-1, keepdim=True)

  def step(self):
    self.tokens = self._forward(self.tokens)


def timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def main(argv):
  del argv
  import jax
  from superinfer_jax.model import load_model
  from superinfer_jax.model.api import resolve_model_path
  cfg, params = load_model(flags.FLAGS.model, "float32")
  model = None
  if not _SKIP_TORCH.value:
    import torch
    from transformers import AutoModelForCausalLM
    d, name = os.path.split(resolve_model_path(flags.FLAGS.model))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
  info = {"jax": jax.__version__, "backend": jax.default_backend(), "model": cfg.name,
          "context": _CONTEXT.value, "steps": _STEPS.value}
  n = _WARMUP.value + _STEPS.value
  for b in (int(x) for x in _BATCH_SIZES.value):
    jd = JaxDecoder(cfg, params, b, _CONTEXT.value, n, flags.FLAGS.block_size, _ATTENTION.value)
    td = None if model is None else TorchDecoder(model, cfg.vocab_size, b, _CONTEXT.value)
    jt, tt = [], []
    for _ in range(n):  # interleaved, so both see the same machine load
      jt.append(timed(jd.step))
      if td is not None:
        tt.append(timed(td.step))
    jt, tt = jt[_WARMUP.value:], tt[_WARMUP.value:]
    row = dict(info, batch=b, jax_ms_median=1e3 * float(np.median(jt)), jax_ms_min=1e3 * float(np.min(jt)),
               load_avg_1m=os.getloadavg()[0])
    if td is not None:
      row.update(torch_ms_median=1e3 * float(np.median(tt)), torch_ms_min=1e3 * float(np.min(tt)),
                 torch_over_jax_median=float(np.median(tt) / np.median(jt)),
                 torch_over_jax_min=float(np.min(tt) / np.min(jt)))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
