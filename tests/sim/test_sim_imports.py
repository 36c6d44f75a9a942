"""The simulator's import graph: ``sim/`` builds on host-side modules only (issue 35, item 7).

Allowed: the scheduler, the block manager and KV layout, workloads, metrics, the shared sweep spec
(``superinfer_jax.sweep``), the config machinery, and the host-side descriptions the cost model reads (a model's
shape in ``model.config``, its tokenizer and chat template for token counts, the transfer-mode names in
``rotation.config``).
Not allowed: JAX, the real-run harness (``experiment``), the engine, the model's forward pass, serving, with no
exemption (the comparison with the real engine is ``experiment/sim_validation.py``). ``calibration.py`` is the profile format and fits only (the measurement is
``experiment/calibrate.py``), so it follows the rule with no exemption.
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIM = os.path.join(ROOT, "superinfer_jax", "sim")
ALLOWED = ("superinfer_jax.sim", "superinfer_jax.sched", "superinfer_jax.kv", "superinfer_jax.workload",
           "superinfer_jax.metrics", "superinfer_jax.sweep", "superinfer_jax.configtree", "superinfer_jax.util",
           "superinfer_jax.assets", "superinfer_jax.model.config", "superinfer_jax.model.config_fields",
           "superinfer_jax.model.config_hf", "superinfer_jax.model.config_gguf", "superinfer_jax.model.memory",
           "superinfer_jax.model.paths",
           "superinfer_jax.model.tokenizer", "superinfer_jax.model.chat_template", "superinfer_jax.rotation.config")


def _allowed(name: str) -> bool:
  return any(name == a or name.startswith(a + ".") for a in ALLOWED)


def _imports(path: str) -> list[tuple[int, str]]:
  """(line, module) of every ``superinfer_jax`` import in ``path``, at any depth (functions too)."""
  out = []
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      mods = [node.module]
      if node.module == "superinfer_jax":   # from superinfer_jax import configtree
        mods = [f"superinfer_jax.{a.name}" for a in node.names]
      out += [(node.lineno, m) for m in mods]
  return [(ln, m) for ln, m in out if m.startswith("superinfer_jax")]


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(SIM) if f.endswith(".py")))
def test_sim_modules_import_only_host_side_modules(name):
  path = os.path.join(SIM, name)
  bad = [(ln, m) for ln, m in _imports(path) if not _allowed(m)]
  assert not bad, f"sim/{name} imports {bad}"


def test_importing_the_simulator_loads_no_jax_and_no_real_harness():
  code = ("import sys\n"
          "import superinfer_jax.sim, superinfer_jax.sim.sim_sweep, superinfer_jax.sim.figures\n"
          "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('superinfer_jax', 'jax')))))\n")
  env = dict(os.environ, PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                       check=True).stdout.split()
  assert "superinfer_jax.sim.sim_sweep" in out
  assert not [m for m in out if m == "jax" or m.startswith("jax.")]
  loaded = [m for m in out if m.startswith("superinfer_jax.")]
  bad = [m for m in loaded if not _allowed(m) and m not in ("superinfer_jax.model", "superinfer_jax.rotation")]
  assert not bad, bad


def test_the_checker_catches_a_forbidden_import(tmp_path):
  p = tmp_path / "x.py"
  p.write_text("from superinfer_jax.experiment.real_sweep import SweepSpec\n"
               "def f():\n  from superinfer_jax.engine import config\n"
               "from superinfer_jax import configtree\n")
  mods = sorted(m for _, m in _imports(str(p)))
  assert mods == ["superinfer_jax.configtree", "superinfer_jax.engine", "superinfer_jax.experiment.real_sweep"]
  assert [m for m in mods if not _allowed(m)] == ["superinfer_jax.engine", "superinfer_jax.experiment.real_sweep"]
