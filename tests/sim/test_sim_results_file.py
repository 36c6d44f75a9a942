"""The results file's blocks are regenerated in place and nothing else in the file moves."""
import pytest

from superinfer_jax.sim.figure_summary import claims_markdown
from superinfer_jax.sim.results_file import replace_block

DOC = """# Results

intro line

<!-- results:headline-splitwise -->
| old | table |
<!-- /results:headline-splitwise -->

text after
"""


def test_replace_block_rewrites_only_its_block(tmp_path):
  p = tmp_path / "results.table.md"
  p.write_text(DOC)
  replace_block(str(p), "headline-splitwise", "| new | table |\n|---|---|")
  assert p.read_text() == DOC.replace("| old | table |", "| new | table |\n|---|---|")
  replace_block(str(p), "budget-splitwise", "| b |")
  text = p.read_text()
  assert text.startswith(DOC.replace("| old | table |", "| new | table |\n|---|---|").rstrip("\n"))
  assert text.endswith("### budget-splitwise\n\n<!-- results:budget-splitwise -->\n| b |\n"
                       "<!-- /results:budget-splitwise -->\n")


def test_replace_block_refuses_broken_markers(tmp_path):
  p = tmp_path / "results.table.md"
  p.write_text("<!-- results:a -->\nx\n")
  with pytest.raises(ValueError, match="unpaired"):
    replace_block(str(p), "a", "y")
  assert p.read_text() == "<!-- results:a -->\nx\n"


def test_claims_markdown_rows():
  claims = [dict(text="rotasched SLO >= fcfs's", ratios={0: 1.1, 1: 1.3, 2: None}, holds=False,
                 holds_on=[0, 1], seeds=[0, 1, 2]),
            dict(text="wf TTFT <= 1/3", ratios={0: 0.1}, holds=True, holds_on=[0], seeds=[0])]
  md = claims_markdown("headline", "splitwise", claims).splitlines()
  assert md[0] == "| figure | workload | claim | holds on | ratio mean [min, max] |"
  assert md[2] == "| headline | splitwise | rotasched SLO >= fcfs's | no 2/3 | 1.2 [1.1, 1.3] |"
  assert md[3] == "| headline | splitwise | wf TTFT <= 1/3 | **yes** 1/1 | 0.1 [0.1, 0.1] |"
