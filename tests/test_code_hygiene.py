"""Library code states contracts, not history: no date stamps and no pointers to the lab notebook.

Scans every ``.py`` file under ``superinfer_jax/`` and ``pallas_kernels/`` (code, docstrings and comments) for a
calendar date (``YYYY-MM`` or ``YYYY-MM-DD`` with a year 2000-2099) and for the string ``WORKSPACE_NOTES``.
History and measurements belong in WORKSPACE_NOTES.md and the git log.
"""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATE = re.compile(r"\b20\d\d-(0?[1-9]|1[0-2])(-\d\d)?\b")
POINTER = "WORKSPACE_NOTES"


def _library_files() -> list[str]:
  out = []
  for top in ("superinfer_jax", "pallas_kernels"):
    for d, _, fs in os.walk(os.path.join(ROOT, top)):
      out += [os.path.relpath(os.path.join(d, f), ROOT) for f in fs if f.endswith(".py")]
  return sorted(out)


def _findings(text: str) -> list[tuple[int, str]]:
  return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)
          if DATE.search(line) or POINTER in line]


@pytest.mark.parametrize("rel", _library_files())
def test_no_date_stamp_or_notes_pointer(rel):
  found = _findings(open(os.path.join(ROOT, rel), encoding="utf-8").read())
  assert not found, f"{rel}: history belongs in WORKSPACE_NOTES.md / git, found {found}"


@pytest.mark.parametrize("text, hit", [
    ("# measured 2026-12-05 on the H200", True),
    ("  see WORKSPACE_NOTES.md for the numbers", True),
    ("x = 2026 - 12  # arithmetic", False),
    ("block ids 2048-4095 are host blocks", False),
    ('"""Fits the 2026-12 calibration."""', True),
])
def test_the_scan_catches_dates_and_pointers(text, hit):
  assert bool(_findings(text)) is hit
