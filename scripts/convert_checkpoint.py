"""Converts an HF checkpoint dir, a GGUF file or a built-in model name to an orbax checkpoint dir.

  python scripts/convert_checkpoint.py --input=smollm2-135m --output=/tmp/smollm2_orbax --dtype=float32

The output is loadable with ``superinfer_jax.model.load_model(output)`` (and ``load_tokenizer(output)``).
"""
from absl import app, flags

from superinfer_jax.model.convert import convert_to_orbax

_INPUT = flags.DEFINE_string("input", None, "HF model dir, .gguf file or built-in model name.")
_OUTPUT = flags.DEFINE_string("output", None, "Output directory (must be empty or absent).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype to store.")
flags.mark_flags_as_required(["input", "output"])


def main(argv):
  del argv
  cfg = convert_to_orbax(_INPUT.value, _OUTPUT.value, _DTYPE.value)
  print(f"wrote {_OUTPUT.value}: {cfg.name or cfg.family} ({cfg.num_params() / 1e6:.1f}M params, "
        f"{_DTYPE.value})")


if __name__ == "__main__":
  app.run(main)
