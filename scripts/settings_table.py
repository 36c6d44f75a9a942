"""Writes docs/settings.md: every config setting, its default, its owner and the scripts that read it.

  python scripts/settings_table.py            # rewrites docs/settings.md
  python scripts/settings_table.py --check    # exit 1 if docs/settings.md is not current
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from superinfer_jax import settings_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "settings.md")


def main(argv) -> int:
  text = settings_table.render(os.path.join(ROOT, "scripts"))
  if "--check" in argv:
    with open(DOC, encoding="utf-8") as fh:
      current = fh.read() == text
    print("docs/settings.md is current" if current else "docs/settings.md is stale: run scripts/settings_table.py")
    return 0 if current else 1
  with open(DOC, "w", encoding="utf-8") as fh:
    fh.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
