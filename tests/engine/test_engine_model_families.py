"""The paper's three model families through the serving engine: tiny random transformers Mixtral (MoE),
Llama-3.1-style (llama3 rope scaling) and Qwen2 with a sliding window, loaded from safetensors dirs, generate
greedily under KV rotation pressure exactly what transformers' greedy ``generate`` gives, one prompt at a
time; and scripts/generate.py prints the memory estimate and the same tokens."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from superinfer_jax.engine.config import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from support.tiny_models import save_tiny_hf_model, torch_greedy
from test_engine_utils import TickClock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BS = 4
NEW = 12
FAMILIES = {
    "mixtral": dict(family="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "llama3-rope": dict(family="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2-window": dict(family="qwen2", use_sliding_window=True, sliding_window=10, max_window_layers=1),
}


def _save(name, tmp_path_factory):
  kw = dict(FAMILIES[name])
  path = str(tmp_path_factory.mktemp(name))
  model = save_tiny_hf_model(path, kw.pop("family"), max_position_embeddings=128, seed=11, **kw)
  return name, model, path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_model(request, tmp_path_factory):
  return _save(request.param, tmp_path_factory)


def _prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 128, size=int(rng.integers(4, 26))).tolist() for _ in range(n)]


def test_engine_greedy_under_rotation_equals_transformers_generate(hf_model):
  name, model, path = hf_model
  prompts = _prompts(7, seed=len(name))
  want = [torch_greedy(model, p, NEW) for p in prompts]
  config = EngineConfig.create(num_device_blocks=16, num_host_blocks=128, block_size=BS, policy="rotasched",
                               max_num_batched_tokens=32, max_num_seqs=8, token_bucket_floor=32,
                               seq_bucket_floor=8, blocks_bucket_floor=16, ttft_slo=0.05, tbt_slo=0.02,
                               proactive_swap_budget=8, rotation_min_bucket=8, attention="reference")
  eng = LLMEngine(path, config, clock=TickClock())
  if name == "qwen2-window":
    assert eng.model_config.layer_windows() == (0, 10)
  assert eng.model_config.is_moe == (name == "mixtral")
  outs = eng.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
  assert [o.token_ids for o in outs] == want
  assert eng.stats.rotations_out > 0 and eng.stats.rotations_in > 0, eng.stats
  assert max(len(p) for p in prompts) + NEW > 3 * 10     # contexts well past the Qwen2 window


def test_generate_script_prints_memory_estimate_and_transformers_tokens(tmp_path_factory):
  _, model, path = _save("mixtral", tmp_path_factory)
  prompt = _prompts(1, seed=3)[0]
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"), f"--model={path}",
                      "--prompt_token_ids=" + ",".join(map(str, prompt)), f"--max_tokens={NEW}", "--ignore_eos",
                      "--json", "--block_size=4", "--num_device_blocks=12", "--num_host_blocks=64",
                      "--token_bucket_floor=16", "--seq_bucket_floor=4", "--blocks_bucket_floor=16",
                      "--max_num_batched_tokens=16"],
                     capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(r.stdout.strip())["token_ids"] == torch_greedy(model, prompt, NEW)
  line = next(l for l in r.stderr.splitlines() if "memory estimate" in l)
  assert "weights" in line and "per block of 4 tokens" in line, line
