"""Import structure of superinfer_jax.model: no cycles (function-local imports included), and the
tokenizer / workload side imports no JAX."""
import ast
import os
import subprocess
import sys

import superinfer_jax

PKG = "superinfer_jax.model"
ROOT = os.path.dirname(os.path.dirname(superinfer_jax.__file__))


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _model_modules() -> dict[str, str]:
  base = os.path.join(ROOT, *PKG.split("."))
  out = {}
  for d, _, files in os.walk(base):
    for f in files:
      if f.endswith(".py"):
        out[_module_name(os.path.join(d, f))] = os.path.join(d, f)
  return out


def _imports(path: str, modules: set[str]) -> set[str]:
  """Modules of ``modules`` that ``path`` imports anywhere (module top, functions, TYPE_CHECKING)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    found.update(n for n in names if n in modules)
  return found


def import_graph() -> dict[str, set[str]]:
  """module -> the model modules it imports. A package's own ``__init__`` (re-exporting its children,
  lazily for superinfer_jax.model) is left out: a child importing a sibling does not run through it."""
  mods = _model_modules()
  packages = {m for m, p in mods.items() if p.endswith("__init__.py")}
  graph = {}
  for m, p in mods.items():
    if m in packages:
      continue
    graph[m] = {d for d in _imports(p, set(mods)) if d != m and d not in packages}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}  # 1 = on the stack, 2 = done
  stack: list[str] = []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for d in sorted(graph.get(m, ())):
      if state.get(d) == 1:
        return stack[stack.index(d):] + [d]
      if d not in state and (cycle := visit(d)):
        return cycle
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state and (cycle := visit(m)):
      return cycle
  return None


def test_model_import_graph_is_acyclic():
  graph = import_graph()
  assert f"{PKG}.api" in graph and f"{PKG}.loaders.orbax_io" in graph  # the walk found the modules
  assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_loaders_never_import_api_or_tokenizer():
  graph = import_graph()
  for m, deps in graph.items():
    if m.startswith(f"{PKG}.loaders."):
      assert not deps & {f"{PKG}.api", f"{PKG}.tokenizer", f"{PKG}.convert"}, (m, deps)


def test_find_cycle_sees_function_local_imports(tmp_path):
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
  assert find_cycle(graph) == ["a", "b", "c", "a"]
  p = tmp_path / "m.py"
  p.write_text("def f():\n  from superinfer_jax.model.api import load_model\n")
  assert _imports(str(p), {"superinfer_jax.model.api"}) == {"superinfer_jax.model.api"}


def test_tokenizer_and_workload_import_no_jax():
  code = ("import sys; sys.modules['jax'] = None\n"  # any `import jax` now raises ImportError
          "import superinfer_jax.model.tokenizer\n"
          "from superinfer_jax.model.tokenizer import Tokenizer, encode_text, load_tokenizer\n"
          "from superinfer_jax.model import encode_text, load_tokenizer\n"
          "import superinfer_jax.workload, superinfer_jax.workload.datasets, superinfer_jax.util\n"
          "assert sys.modules['jax'] is None\n"
          "assert not any(m.startswith('jax.') for m in sys.modules), 'jax submodule imported'\n")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_lazy_package_exports():
  code = ("import sys\n"
          "import superinfer_jax.model as model\n"
          "assert 'jax' not in sys.modules\n"
          "from superinfer_jax.model.forward import step\n"          # binds the submodule first
          "from superinfer_jax.model import (BatchInputs, ConfigError, ModelConfig, Tokenizer,\n"
          "    UnsupportedModelError, WeightLoadError, bucket, build_batch, encode_text, forward,\n"
          "    get_attention_backend, greedy_generate, init_kv_cache, load_config, load_model,\n"
          "    load_tokenizer, score, step as step2, validate_token_ids)\n"
          "assert callable(forward) and model.forward is forward, model.forward\n"
          "assert step2 is step\n"
          "assert all(hasattr(model, n) for n in model.__all__)\n"
          "assert set(model.__all__) <= set(dir(model))\n")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
