#!/usr/bin/env bash
# GPU checks and benchmarks for a lent H200, prepared to finish in under 8 minutes.
# Run from the repo root on the device: bash scripts/device_check.sh   (results land in $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
run() {  # name cmd...: runs with a timeout, tees the log into $OUT
 local name=$1; shift; echo "=== $name: $*"; timeout "${STEP_TIMEOUT:-150}" "$@" 2>&1 | tee "$OUT/$name.log"; }
python -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/env.log"
# 1. GPU-marked tests (kernels compiled for real, transfers through pinned_host)
JAX_PLATFORMS=cuda run gpu_tests python -m pytest -q -x tests -k "gpu or pallas or rotation" -p no:cacheprovider
# 2. attention kernel vs jnp reference vs jax's paged_attention
STEP_TIMEOUT=240 run bench_attention python scripts/bench_attention.py --json_out="$OUT/bench_attention.json"
# 3. DuplexKV transfers vs torch pinned copies
run bench_transfer python scripts/bench_transfer.py --json --max_segment_mb=64
# 4. Triton compile of the kernel's IR for sm_90 (also runnable on a CPU box with triton installed)
run triton_check python -m pallas_kernels.triton_check
