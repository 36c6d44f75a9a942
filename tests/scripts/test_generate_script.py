"""scripts/generate.py contract: absl flags, --json output, on a tiny HF-format model dir (subprocess)."""
import json
import os
import subprocess
import sys

import pytest

from support.tiny_models import word_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 96


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
  import torch
  import transformers
  from superinfer_jax.model.tokenizer import Tokenizer, save_tokenizer
  d = str(tmp_path_factory.mktemp("tiny_llama"))
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 rms_norm_eps=1e-5, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1,
                                 tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(cfg)
  model.save_pretrained(d, safe_serialization=True)
  save_tokenizer(Tokenizer(backend=word_tokenizer(VOCAB), bos_id=VOCAB - 2, eos_ids=(VOCAB - 1,)), d)
  return d


def _run(args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py")] + args,
                        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


ENGINE_ARGS = ["--block_size=4", "--num_device_blocks=12", "--num_host_blocks=64", "--max_num_batched_tokens=16",
               "--token_bucket_floor=16", "--seq_bucket_floor=4", "--blocks_bucket_floor=16"]


def test_generate_json_text_and_ids(tiny_hf_dir):
  r = _run([f"--model={tiny_hf_dir}", "--prompt=w1 w2 w3 w4 w5", "--prompt=w7 w8",
            "--prompt_token_ids=3,4,5,6,7,8,9", "--prompt_token_ids=10,11", "--max_tokens=9", "--ignore_eos",
            "--json", "--policy=rotasched"] + ENGINE_ARGS)
  assert r.returncode == 0, r.stderr[-3000:]
  lines = [json.loads(l) for l in r.stdout.strip().splitlines()]
  assert len(lines) == 4
  for rec in lines:
    assert set(rec) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
    assert len(rec["token_ids"]) == 9 and rec["finish_reason"] == "length"
    assert all(0 <= t < VOCAB for t in rec["token_ids"])
  assert lines[0]["prompt_token_ids"] == [1, 2, 3, 4, 5]
  assert lines[2]["prompt_token_ids"] == [3, 4, 5, 6, 7, 8, 9]
  assert lines[3]["prompt_token_ids"] == [10, 11]
  # Text is the detokenized ids (word-level: "w<id>" joined by spaces; special tokens skipped).
  words = [f"w{t}" for t in lines[0]["token_ids"] if t < VOCAB - 2]
  assert lines[0]["text"].split() == words

  # Same prompts, one at a time with ample memory and another policy: identical greedy tokens.
  for i, args in enumerate([["--prompt=w1 w2 w3 w4 w5"], ["--prompt_token_ids=10,11"]]):
    r1 = _run([f"--model={tiny_hf_dir}", "--max_tokens=9", "--ignore_eos", "--json", "--policy=fcfs",
               "--num_device_blocks=64", "--block_size=4", "--token_bucket_floor=16", "--seq_bucket_floor=4",
               "--blocks_bucket_floor=16", "--max_num_batched_tokens=16"] + args)
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert json.loads(r1.stdout.strip())["token_ids"] == lines[[0, 3][i]]["token_ids"]


def test_generate_errors(tiny_hf_dir):
  r = _run([f"--model={tiny_hf_dir}", "--prompt_token_ids=", "--prompt_token_ids=5,6", "--max_tokens=3",
            "--json"] + ENGINE_ARGS)
  assert r.returncode == 1
  recs = [json.loads(l) for l in r.stdout.strip().splitlines()]
  assert recs[0]["finish_reason"] == "error" and "empty prompt" in recs[0]["error"]
  assert recs[1]["finish_reason"] in ("length", "stop") and recs[1]["token_ids"]
  r = _run([f"--model={tiny_hf_dir}", "--prompt=w1", "--policy=bogus"] + ENGINE_ARGS)
  assert r.returncode != 0 and "--policy=bogus" in r.stderr and "rotasched" in r.stderr  # an enum flag


def test_generate_readable_output(tiny_hf_dir):
  r = _run([f"--model={tiny_hf_dir}", "--prompt=w1 w2", "--max_tokens=4", "--temperature=0.7", "--top_k=5",
            "--top_p=0.9", "--seed=3"] + ENGINE_ARGS)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "completion:" in r.stdout and "prompt:" in r.stdout
