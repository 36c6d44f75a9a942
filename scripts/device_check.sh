#!/usr/bin/env bash
# The one device check (scripts/device_check.py): GPU tests, attention / transfer / engine benchmarks and a
# simulator profile and the contended experiment (gpu.flags) in $OUT/device_check.json. All six stages are
# estimated at about 11 minutes on one H100 / H200 (unmeasured); --stages=a,b runs a subset within 8.
#   bash scripts/device_check.sh              # on the GPU machine (results in $OUT, or ./out)
#   bash scripts/device_check.sh --dry_run    # CPU: the tiny model through the same stages and JSON keys
set -uo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
exec "$PY" scripts/device_check.py --out="${OUT:-out}" "$@"
