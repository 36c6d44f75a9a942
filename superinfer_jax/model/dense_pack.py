"""Every dense projection of a model packed into one float32 buffer for the ``cpu_dense`` kernel
(``pallas_kernels/cpu_dense.py``), and the forward's use of it for steps with few token rows.

Layout: per layer, in order, ``qkv`` (``[H, Hq*D + 2*Hkv*D]``, q | k | v on the output axis), ``o``
(``[Hq*D, H]``), ``gate_up`` (``[H, 2F]``, gate | up) and ``down`` (``[F, H]``), each ``W [K, N]`` packed as
``cpu_dense.pack(W)`` (panels of 16 output columns) and laid end to end; then the output head ``W_out [H, V]``
(the embedding transposed when tied, else ``lm_head``), its vocabulary padded with zero columns to a multiple of
16 (the logits are sliced back to V). ``layout(cfg)`` / ``head_layout(cfg)`` give each one's ``(offset, panels,
K)``, computed from the config alone, so the jitted step needs no table. The buffer is one jit argument, and each
kernel call reads its own range in place.

When: ``packable(cfg, dtype)`` — a dense (not MoE) float32 model whose every projection has a multiple of 16
outputs. The engine's unrolled CPU step keeps its XLA weights too, and ``forward`` uses the kernel for steps of at
most ``dense_max_rows`` token rows (decode), XLA's dots above (prefill): the 30 SmolLM2 layers' projections plus
the head took 15.2 / 23.2 / 62.7 ms at 1 / 16 / 64 rows against XLA's 19.5 / 47.2 / 68.9
(WORKSPACE_NOTES 2026-12-04). The cost is a second copy of the projection and head weights in host memory
(``packed_bytes(cfg)``; SmolLM2-135M: 538 MB).
"""
from __future__ import annotations

import numpy as np

from superinfer_jax.model.config import ModelConfig

LANES = 16
NAMES = ("qkv", "o", "gate_up", "down")


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """``{name: (K, N)}`` of one layer's projections (``W [K, N]``, ``y = x @ W``)."""
  h, f = cfg.hidden_size, cfg.intermediate_size
  return {"qkv": (h, cfg.q_size + 2 * cfg.kv_size), "o": (cfg.q_size, h), "gate_up": (h, 2 * f), "down": (f, h)}


def packable(cfg: ModelConfig, dtype: str = "float32") -> bool:
  """Whether the model's projections can run on the kernel: dense, float32, every N a multiple of 16."""
  return (not cfg.is_moe and str(dtype) == "float32"
          and all(n % LANES == 0 and n > 0 and k > 0 for k, n in shapes(cfg).values()))


def on_kernel(tokens: int, dense_max_rows: int) -> bool:
  """Whether a step of ``tokens`` token rows (its static bucket) runs its projections and head on the kernel."""
  return 0 < tokens <= dense_max_rows


def head_panels(cfg: ModelConfig) -> int:
  """Panels of the packed output head: the vocabulary rounded up to a multiple of 16 columns, over 16."""
  return -(-cfg.vocab_size // LANES)


def head_layout(cfg: ModelConfig) -> tuple[int, int, int]:
  """``(offset, panels, K)`` of the output head ``W_out [H, 16 * head_panels]`` in the packed buffer (after
  every layer's projections)."""
  return sum(k * n for k, n in shapes(cfg).values()) * cfg.num_layers, head_panels(cfg), cfg.hidden_size


def packed_size(cfg: ModelConfig) -> int:
  """Elements (float32) of the packed buffer."""
  offset, panels, k = head_layout(cfg)
  return offset + panels * LANES * k


def packed_bytes(cfg: ModelConfig) -> int:
  """Bytes of the packed buffer: the host memory the kernel's copy of the weights costs."""
  return packed_size(cfg) * 4


def layout(cfg: ModelConfig) -> list[dict[str, tuple[int, int, int]]]:
  """Per layer, ``{name: (offset, panels, K)}`` in the packed buffer (module docstring)."""
  out, offset = [], 0
  for _ in range(cfg.num_layers):
    layer = {}
    for name in NAMES:
      k, n = shapes(cfg)[name]
      layer[name] = (offset, n // LANES, k)
      offset += k * n
    out.append(layer)
  return out


def _weights(lp) -> dict[str, np.ndarray]:
  """One layer's projections as ``W [K, N]`` numpy arrays, from the fused layout (``model/fused.py``; the MLP
  either ``[in, out]`` or transposed)."""
  def a(name):
    return np.asarray(lp[name], dtype=np.float32)
  gate_up = a("w_gate_up_t").T if "w_gate_up_t" in lp else a("w_gate_up")
  down = a("w_down_t").T if "w_down_t" in lp else a("w_down")
  return {"qkv": a("wqkv"), "o": a("wo"), "gate_up": gate_up, "down": down}


def pack_params(params, cfg: ModelConfig) -> np.ndarray:
  """The packed buffer (float32, 1-D) of fused params (``layers``: per-layer dicts or stacked ``[L, ...]``)."""
  if not packable(cfg):
    raise ValueError("pack_params: the model is not packable (MoE, not float32, or an output size that is not "
                     f"a multiple of {LANES})")
  layers = params["layers"]
  per_layer = (list(layers) if isinstance(layers, (list, tuple))
               else [{k: v[i] for k, v in layers.items()} for i in range(cfg.num_layers)])
  lay = layout(cfg)
  buf = np.empty(packed_size(cfg), np.float32)
  for i, lp in enumerate(per_layer):
    w = _weights(lp)
    for name in NAMES:
      offset, panels, k = lay[i][name]
      if w[name].shape != (k, panels * LANES):
        raise ValueError(f"layer {i} {name}: expected [{k}, {panels * LANES}], got {list(w[name].shape)}")
      buf[offset:offset + k * panels * LANES] = (
          w[name].reshape(k, panels, LANES).transpose(1, 0, 2).reshape(-1))
  offset, panels, k = head_layout(cfg)
  w_out = (np.asarray(params["embed"], np.float32).T if cfg.tie_word_embeddings
           else np.asarray(params["lm_head"], np.float32))                     # [H, V]
  if w_out.shape != (k, cfg.vocab_size):
    raise ValueError(f"output head: expected [{k}, {cfg.vocab_size}], got {list(w_out.shape)}")
  padded = np.zeros((k, panels * LANES), np.float32)
  padded[:, :cfg.vocab_size] = w_out
  buf[offset:] = padded.reshape(k, panels, LANES).transpose(1, 0, 2).reshape(-1)
  return buf


def projector(packed, cfg: ModelConfig, layer: int):
  """``proj(name, x)`` -> ``x @ W_name`` of ``layer`` (float32) by the ``cpu_dense`` kernel, reading ``packed``."""
  from pallas_kernels.cpu_dense import cpu_dense  # pylint: disable=import-outside-toplevel
  lay = layout(cfg)[layer]

  def proj(name, x):
    offset, panels, k = lay[name]
    return cpu_dense(x, packed, offset=offset, panels=panels, k=k)
  return proj


def head_logits(packed, cfg: ModelConfig, x):
  """``x [R, H]`` (float32, final-normed) -> logits ``[R, V]`` float32 by the ``cpu_dense`` kernel, reading the
  packed output head (the padding columns sliced off)."""
  from pallas_kernels.cpu_dense import cpu_dense  # pylint: disable=import-outside-toplevel
  offset, panels, k = head_layout(cfg)
  return cpu_dense(x.astype("float32"), packed, offset=offset, panels=panels, k=k)[:, :cfg.vocab_size]
