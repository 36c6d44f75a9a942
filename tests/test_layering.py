"""The package's import graph runs one way: each ``superinfer_jax`` package imports only its own tier or lower.

Tiers, bottom up: the shared machinery (util, assets, configtree); the concept packages (metrics, kv, sched,
model, rotation, workload, and the shared sweep spec); parallel; engine; the harnesses (experiment, serving,
sim); the generated settings table, which reads every config. Within a tier some arrows are forbidden too
(``FORBIDDEN``): the simulator imports neither the engine nor the other harnesses (the one module that runs
both, the simulator-vs-engine validation, lives in ``experiment``). ``pallas_kernels`` depends on nothing of the
library above its shared machinery, and no library module imports ``scripts``. Imports inside functions count
too: a deferred import is still an arrow.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIERS = (
    ("util", "assets", "configtree"),
    ("metrics", "kv", "sched", "model", "rotation", "workload", "sweep"),
    ("parallel",),
    ("engine",),
    ("experiment", "serving", "sim"),
    ("settings_table",),
)
TIER = {name: i for i, names in enumerate(TIERS) for name in names}
# (importer, imported) pairs that the tiers allow but the design does not.
FORBIDDEN = {("sim", "engine"), ("sim", "experiment"), ("sim", "serving"), ("serving", "experiment"),
             ("serving", "sim")}


def _targets(path: str) -> list[tuple[int, str]]:
  """(line, module) of every absolute import in ``path``, at any depth."""
  out = []
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == "superinfer_jax":
        out += [(node.lineno, f"superinfer_jax.{a.name}") for a in node.names]
      else:
        out.append((node.lineno, node.module))
  return out


def _files(top: str) -> list[str]:
  base = os.path.join(ROOT, top)
  return sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(base) for f in fs
                if f.endswith(".py"))


def _package(rel: str) -> str:
  parts = rel.split(os.sep)[1:]
  return parts[0] if len(parts) > 1 else parts[0][:-3]


def test_every_package_has_a_tier():
  packages = {_package(f) for f in _files("superinfer_jax")} - {"__init__"}
  assert packages <= set(TIER), f"packages without a tier in TIERS: {sorted(packages - set(TIER))}"


@pytest.mark.parametrize("rel", _files("superinfer_jax"))
def test_no_upward_import(rel):
  src = _package(rel)
  if src == "__init__":
    return
  bad = []
  for line, mod in _targets(os.path.join(ROOT, rel)):
    if mod.split(".")[0] == "scripts":
      bad.append((line, mod))
    elif mod.startswith("superinfer_jax."):
      dst = mod.split(".")[1]
      if dst in TIER and (TIER[dst] > TIER[src] or (src, dst) in FORBIDDEN):
        bad.append((line, mod))
  assert not bad, f"{rel} (tier {TIER[src]}, {src}) imports upward or across a forbidden arrow: {bad}"


@pytest.mark.parametrize("rel", _files("pallas_kernels"))
def test_kernels_use_only_the_shared_machinery(rel):
  bad = [(ln, m) for ln, m in _targets(os.path.join(ROOT, rel))
         if m.startswith("superinfer_jax.") and TIER.get(m.split(".")[1], 99) > 0 or m.split(".")[0] == "scripts"]
  assert not bad, f"{rel} imports library packages: {bad}"


def test_the_check_sees_an_upward_arrow(tmp_path):
  """The parser finds deferred imports (inside a function) and both import forms."""
  p = tmp_path / "m.py"
  p.write_text("def f():\n  from superinfer_jax.engine import core\n  import superinfer_jax.sim.event_loop\n"
               "from superinfer_jax import experiment\n")
  assert sorted(m for _, m in _targets(str(p))) == ["superinfer_jax.engine", "superinfer_jax.experiment",
                                                 "superinfer_jax.sim.event_loop"]


def test_the_check_sees_a_forbidden_arrow_within_a_tier():
  assert ("sim", "experiment") in FORBIDDEN and TIER["sim"] == TIER["experiment"]


def test_only_the_step_loop_calls_the_scheduler():
  """One owner of the request lifecycle: in ``engine/``, only ``step_loop.py`` calls a scheduler method."""
  import re
  calls = re.compile(r"\bscheduler\.(add_request|abort|schedule|on_step_done|pop_finished|has_unfinished|stats|"
                     r"check_invariants)\(")
  bad = [rel for rel in _files(os.path.join("superinfer_jax", "engine"))
         if not rel.endswith("step_loop.py") and calls.search(open(os.path.join(ROOT, rel)).read())]
  assert not bad, bad
