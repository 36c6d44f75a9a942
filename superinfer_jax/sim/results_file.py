"""A markdown results file whose tables the figure runs regenerate (``docs/results/simulator.md``).

A block is the text between ``<!-- results:KEY -->`` and ``<!-- /results:KEY -->`` lines (each marker alone on
its line). ``replace_block(path, key, body)`` puts ``body`` between the markers of ``key``, keeping every other
line of the file as it was; a key the file does not have yet is appended at the end as a new block under a
``### KEY`` heading. It never touches another block, and refuses (``ValueError``) a file whose markers for
``key`` are missing their pair, repeated or out of order. Pure Python, no JAX.
"""
from __future__ import annotations

import os


def _markers(key: str) -> tuple[str, str]:
  return f"<!-- results:{key} -->", f"<!-- /results:{key} -->"


def replace_block(path: str, key: str, body: str) -> None:
  """Writes ``body`` (markdown, no trailing newline needed) as block ``key`` of the results file at ``path``
  (created if absent); see the module docstring."""
  start, end = _markers(key)
  lines = []
  if os.path.exists(path):
    with open(path) as f:
      lines = f.read().splitlines()
  starts = [i for i, ln in enumerate(lines) if ln.strip() == start]
  ends = [i for i, ln in enumerate(lines) if ln.strip() == end]
  new = [start, *body.rstrip("\n").splitlines(), end]
  if not starts and not ends:
    lines += ["", f"### {key}", "", *new]
  elif len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0]:
    lines[starts[0]:ends[0] + 1] = new
  else:
    raise ValueError(f"{path}: the markers of results block {key!r} are unpaired, repeated or out of order "
                     f"(start lines {starts}, end lines {ends})")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
