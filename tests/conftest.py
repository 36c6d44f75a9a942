"""Shared test setup: CPU JAX, hypothesis profile, offline asset fixtures."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")


@pytest.fixture(scope="session")
def smollm2_path():
  from superinfer_jax.assets import smollm2_gguf_path
  return smollm2_gguf_path()


@pytest.fixture(scope="session")
def sharegpt_file():
  from superinfer_jax.assets import sharegpt_path
  return sharegpt_path()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
  """A random-weight tiny Llama saved as an HF dir (safetensors + config), for script tests."""
  from superinfer_jax.model.testing import save_tiny_hf_model
  path = str(tmp_path_factory.mktemp("tiny_llama"))
  save_tiny_hf_model(path, "llama", max_position_embeddings=512)
  return path
