#!/usr/bin/env bash
# The one device check (scripts/device_check.py): engine decode speed, the GPU tests, transfer and attention
# benchmarks, the contended experiment (gpu.flags), a simulator profile and serve.py's start-up, under one
# deadline (--budget_s, default 420 s: one call of at most 7 minutes on an H100 / H200, the machine's start
# excluded). $OUT receives device_check.json (rewritten after every stage) and one archive of everything else.
#   bash scripts/device_check.sh              # on the GPU machine (results in $OUT, or ./out)
#   bash scripts/device_check.sh --dry_run    # CPU: the tiny model through the same stages, a 240 s budget
# The interpreter: $PYTHON, else the repository's .venv/bin/python, else python3 (PYTHON=/path/to/venv/bin/python
# for a checkout without its own .venv, e.g. a git worktree). docs/gpu_experiment.md reads the JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
exec "$PY" scripts/device_check.py --out="${OUT:-out}" "$@"
