"""``ModelSettings``: how the engine runs a model (attention backend, dtype, context cap). No JAX.

Backend names come from ``model/attention.py``'s registry, dtype names from ``model/config.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from superinfer_jax.configtree import check_choices, knob
from superinfer_jax.model.attention import attention_backend_names
from superinfer_jax.model.config import DTYPE_NAMES

DENSE_BACKENDS = ("auto", "cpu_kernel", "xla")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  attention: str = knob("auto", "attention backend (auto: pallas on a GPU, cpu_kernel on a CPU where it "
                        "builds, else reference)", choices=attention_backend_names)
  dtype: str = knob("float32", "weights / KV cache dtype", choices=DTYPE_NAMES)
  dense: str = knob("auto", "dense projections and output head of small steps: cpu_kernel (the C++ kernel over "
                    "packed weights, for steps of at most --dense_max_rows tokens; XLA:CPU, float32 dense "
                    "models, unrolled layers; keeps a second copy of those weights), xla, or auto (cpu_kernel "
                    "where it applies and builds, else xla)", choices=DENSE_BACKENDS)
  dense_max_rows: int = knob(64, "largest token bucket whose projections and head run on the cpu_dense kernel")
  max_model_len: Optional[int] = knob(None, "most tokens per request (unset: the model's max positions)",
                                      none_as=0)

  def __post_init__(self):
    check_choices(self)
    if isinstance(self.dense_max_rows, bool) or not isinstance(self.dense_max_rows, int) or self.dense_max_rows < 1:
      raise ValueError(f"ModelSettings.dense_max_rows must be an int >= 1, got {self.dense_max_rows!r}")
    v = self.max_model_len
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(f"ModelSettings.max_model_len must be None or an int >= 1, got {v!r}")
