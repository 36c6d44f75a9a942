"""Real SmolLM2-135M through the engine (slow): under heavy memory pressure every policy (the rotating
ones by rotation, fcfs by recompute), in the zero-bubble loop and in the non-pipelined one, gives exactly
the greedy tokens of running each request alone with ample memory."""
import pytest

from superinfer_jax.engine.config import EngineConfig, SamplingParams
from superinfer_jax.engine.engine import LLMEngine
from test_engine_utils import TickClock

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about memory:", "def fibonacci(n):",
           "Once upon a time,", "The speed of light is"]
SP = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def smol(smollm2_path):
  from superinfer_jax.model import load_model, load_tokenizer
  cfg, params = load_model(smollm2_path)
  return cfg, params, load_tokenizer(smollm2_path)


def _engine(smol, **kw):
  # Static shape buckets: every step has the same shapes, so XLA's numerics cannot depend on the batch.
  base = dict(num_device_blocks=64, num_host_blocks=128, block_size=8, policy="fcfs",
              max_num_batched_tokens=32, max_num_seqs=4, token_bucket_floor=32, seq_bucket_floor=4,
              blocks_bucket_floor=8, ttft_slo=0.05, tbt_slo=0.02, proactive_swap_budget=8,
              rotation_min_bucket=8)
  base.update(kw)
  return LLMEngine(smol, EngineConfig.create(**base), clock=TickClock())


@pytest.fixture(scope="module")
def reference(smol):
  eng = _engine(smol)
  return [eng.generate([p], SP)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("zero_bubble", [True, False])
@pytest.mark.parametrize("policy", ["rotasched", "fcfs", "fcfs_swap", "wf", "sf", "rotasched_code", "edf"])
def test_smollm2_memory_pressure_token_identical(smol, reference, policy, zero_bubble):
  loop = dict(pipeline=True, zero_bubble=True) if zero_bubble else dict(pipeline=False)
  eng = _engine(smol, policy=policy, num_device_blocks=6, **loop)   # ~2 of the 5 requests fit at a time
  eng.loop.host_batch.verify = True   # pylint: disable=protected-access
  outs = eng.generate(PROMPTS, SP)
  assert [o.token_ids for o in outs] == reference
  if policy != "fcfs":
    assert eng.stats.rotations_out > 0 and eng.stats.blocks_in > 0, eng.stats
  else:
    assert eng.stats.recompute_preemptions > 0, eng.stats
  eng.check_invariants()
  print(policy, eng.stats.as_dict())
  assert outs[0].text.strip().startswith("Paris")
