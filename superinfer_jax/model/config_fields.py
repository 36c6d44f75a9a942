"""The errors and field coercions every ``ModelConfig`` source (repo JSON, HF, GGUF) shares. No JAX."""
from __future__ import annotations

# ``rope_type`` values the forward implements (transformers' names); ``default`` is plain RoPE.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class ConfigError(ValueError):
  """A config is missing a field, has an unknown field, or a field has a bad value."""


class UnsupportedModelError(ValueError):
  """The architecture (family, activation, rope scaling, ...) is not implemented here."""


def opt_int(v) -> int | None:
  """``v`` as an int; None stays None."""
  return None if v is None else int(v)


def as_id_tuple(v) -> tuple[int, ...]:
  """Token id(s) as a tuple of ints: None -> (), one id -> (id,), a list -> its ids in order."""
  if v is None:
    return ()
  if isinstance(v, (list, tuple)):
    return tuple(int(x) for x in v)
  return (int(v),)
