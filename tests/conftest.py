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
  from support.tiny_models import save_tiny_hf_model
  path = str(tmp_path_factory.mktemp("tiny_llama"))
  save_tiny_hf_model(path, "llama", max_position_embeddings=512)
  return path


# Modules `make test-fast` leaves out (marker `heavy`, registered in pyproject.toml): they spawn scripts or
# servers, load the real SmolLM2, or compile many engine shapes. `make test` runs them like every other test.
HEAVY_MODULES = frozenset({
    "test_ablation_flagfiles", "test_bench_engine_script", "test_calibrate_script", "test_device_check",
    "test_engine_model_families", "test_engine_smollm2", "test_experiment", "test_generate_script",
    "test_mixtral", "test_model_hf_parity", "test_model_smollm2", "test_multihost", "test_multihost_serve",
    "test_pallas_bench", "test_pallas_ragged_attention", "test_rotation_bench",
    "test_serving", "test_serving_server", "test_serving_stall", "test_sim_figures", "test_sim_script",
    "test_sliding_window", "test_tensor_parallel", "test_trace_workload",
})


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.module.__name__.rsplit(".", 1)[-1] in HEAVY_MODULES:
      item.add_marker(pytest.mark.heavy)
