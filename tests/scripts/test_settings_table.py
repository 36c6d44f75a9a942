"""docs/settings.md is generated and current; scripts take config settings from the tree, not their own flags."""
import glob
import os

from superinfer_jax import settings_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Script-only flags that share a name with a config setting but mean something else in that script (a count
# of untimed steps, not SweepSpec.warmup's bool; a kernel benchmark's own shapes). Each should get a name of
# its own; the list must stay exact, so a new collision, or a renamed one left here, fails the test.
SAME_NAME_OTHER_MEANING = {
    "bench_attention.py": {"block_size", "dtype", "seed"},
    "bench_engine.py": {"repeats"},
    "bench_model.py": {"attention", "warmup"},
    "bench_scheduler.py": {"num_requests", "repeats", "seed", "warmup"},
    "bench_transfer.py": {"warmup"},
    "calibrate.py": {"repeats", "warmup"},
    "convert_checkpoint.py": {"dtype"},
    "generate.py": {"seed"},
}


def _scripts():
  for path in sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py"))):
    with open(path, encoding="utf-8") as fh:
      yield os.path.basename(path), fh.read()


def test_committed_settings_table_is_current():
  with open(os.path.join(ROOT, "docs", "settings.md"), encoding="utf-8") as fh:
    committed = fh.read()
  assert committed == settings_table.render(os.path.join(ROOT, "scripts")), \
      "docs/settings.md is stale: run python scripts/settings_table.py"


def test_no_script_defines_its_own_flag_for_a_config_setting():
  names = {name for _, name in settings_table.settings()}
  found = {}
  for script, source in _scripts():
    own = settings_table.script_flags(source) & names
    if own:
      found[script] = own
  assert found == SAME_NAME_OTHER_MEANING


def test_every_script_flag_of_the_config_tree_is_in_the_table():
  text = settings_table.render(os.path.join(ROOT, "scripts"))
  roots = settings_table.trees()
  _, source = next((s, src) for s, src in _scripts() if s == "serve.py")
  reads = settings_table.script_reads(source, roots)
  assert ("superinfer_jax.sweep.SweepSpec", "model") in reads
  assert ("superinfer_jax.sweep.SweepSpec", "num_requests") not in reads   # serve.py takes --model only
  for owner, name in reads:
    assert f"| `--{name}` |" in text and f"## `{owner}`" in text


def test_script_reads_honours_only():
  roots = settings_table.trees()
  src = ("configtree.define_flags(SimConfig)\n"
         "configtree.define_flags(SweepSpec)\n"
         "configtree.define_flags(SchedulerConfig, only={'ttft_slo'})\n")
  reads = settings_table.script_reads(src, roots)
  assert ("superinfer_jax.sim.config.SimConfig", "trace") in reads
  assert ("superinfer_jax.sweep.SweepSpec", "hardware") in reads
  assert {n for o, n in reads if o.endswith("SchedulerConfig")} == {"ttft_slo"}
