"""Every document the code, tests, configs and notes point at exists in the repository, and every cited
section of docs/paper.md is a heading there."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = [p for pattern in ("superinfer_jax/**/*.py", "pallas_kernels/**/*.py", "scripts/*", "tests/**/*.py",
                             "configs/**/*.flags", "*.md", "docs/*.md", "Makefile", ".ci/run")
           for p in glob.glob(os.path.join(ROOT, pattern), recursive=True) if os.path.isfile(p)]
DOC_REF = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[A-Za-z][\w-]*\.md)\b")
PAPER_SECTION = re.compile(r"paper\.md §(\d+(?:\.\d+)?)")


def _text(path):
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def test_sources_found():
  assert len(SOURCES) > 50


def test_every_referenced_document_exists_in_the_repo():
  missing = []
  for path in SOURCES:
    for m in DOC_REF.finditer(_text(path)):
      ref = m.group(1)
      here = os.path.dirname(path)
      candidates = [os.path.join(ROOT, ref), os.path.join(here, ref), os.path.join(ROOT, "docs", ref)]
      if not any(os.path.isfile(c) for c in candidates):
        missing.append(f"{os.path.relpath(path, ROOT)}: {ref}")
  assert not missing, missing


def test_no_reference_to_documents_outside_the_repo():
  bad = [os.path.relpath(p, ROOT) for p in SOURCES
         if p != __file__ and re.search(r"shared/docs|\bPAPER\.md|\bARCHITECTURE\.md|\bPLATFORM\.md", _text(p))]
  assert not bad, bad


def test_cited_paper_sections_exist():
  headings = set(re.findall(r"^#+ (\d+(?:\.\d+)?)[. ]", _text(os.path.join(ROOT, "docs", "paper.md")), re.M))
  missing = []
  for path in SOURCES:
    for sec in PAPER_SECTION.findall(_text(path)):
      if sec not in headings:
        missing.append(f"{os.path.relpath(path, ROOT)}: §{sec}")
  assert not missing, (missing, sorted(headings))


def test_one_name_for_the_host_parked_state():
  # The paper's "rotary": no module names the state "swapped" or "rotated_out" any more.
  offenders = []
  for path in glob.glob(os.path.join(ROOT, "superinfer_jax", "**", "*.py"), recursive=True):
    text = _text(path)
    if re.search(r"\bSWAPPED\b|[\"']swapped[\"']", text):
      offenders.append(os.path.relpath(path, ROOT))
  assert not offenders, offenders


def _architecture_section(title):
  text = _text(os.path.join(ROOT, "docs", "architecture.md"))
  m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.M | re.S)
  assert m, f"docs/architecture.md has no section '## {title}'"
  return m.group(1)


def test_module_map_lists_every_module_once():
  """docs/architecture.md "Module map": one row per module of the library, the kernels and the scripts."""
  modules = sorted(os.path.relpath(p, ROOT) for top in ("superinfer_jax", "pallas_kernels", "scripts")
                   for p in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)
                   if os.path.basename(p) != "__init__.py")
  rows = re.findall(r"^\| `([^`]+\.py)` \| (.*) \|$", _architecture_section("Module map"), re.M)
  listed = [path for path, _ in rows]
  assert len(listed) == len(set(listed)), [p for p in listed if listed.count(p) > 1]
  assert sorted(set(modules) - set(listed)) == [], "modules missing from the map"
  assert sorted(set(listed) - set(modules)) == [], "the map lists modules that do not exist"
  assert all(len(what.strip()) >= 10 for _, what in rows), [p for p, w in rows if len(w.strip()) < 10]


def test_one_request_walk_fits_a_page():
  walk = _architecture_section("One request, end to end").strip().splitlines()
  assert 10 <= len(walk) <= 60, len(walk)
  for stage in ("Plan", "Copies", "Step", "Outputs"):
    assert any(f"**{stage}.**" in line for line in walk), stage
