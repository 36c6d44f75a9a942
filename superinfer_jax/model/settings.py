"""``ModelSettings``: how the engine runs a model (attention backend, dtype, context cap). No JAX.

Backend names come from ``model/attention.py``'s registry, dtype names from ``model/config.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from superinfer_jax.configtree import check_choices, knob
from superinfer_jax.model.attention import attention_backend_names
from superinfer_jax.model.config import DTYPE_NAMES


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """How the engine runs its model: attention backend, weights / KV dtype, context cap (``None``: the model's)."""
  attention: str = knob("auto", "attention backend (auto: pallas on a GPU, else reference)",
                        choices=attention_backend_names)
  dtype: str = knob("float32", "weights / KV cache dtype", choices=DTYPE_NAMES)
  max_model_len: Optional[int] = knob(None, "most tokens per request (unset: the model's max positions)",
                                      none_as=0)

  def __post_init__(self):
    check_choices(self)
    v = self.max_model_len
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(f"ModelSettings.max_model_len must be None or an int >= 1, got {v!r}")
