#!/usr/bin/env bash
# GPU check of the Pallas kernels with their shared-memory caps (run from the repo root; H200).
# Pallas tests compiled for the GPU, then a short XLA-vs-Pallas KDA speed check.
# Budget: <= 230 s in all. Run: `bash experiments/gpu_pallas_check.sh`. Everything goes to $OUT/rerun.log.
set -u
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/rerun.log"
START=$(date +%s)
step() {  # step NAME LIMIT_S CMD...
  local name=$1 lim=$2; shift 2
  echo "===== [$(( $(date +%s) - START ))s] $name (limit ${lim}s): $*" | tee -a "$LOG"
  timeout -k 5 "$lim" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "===== [$(( $(date +%s) - START ))s] $name rc=$rc" | tee -a "$LOG"
}
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" 2>&1 | tee -a "$LOG"
step pallas_tests 150 env JAX_DEFAULT_MATMUL_PRECISION=highest \
  python3 -m pytest -q -p no:cacheprovider --durations=5 tests/pallas_kernels
LEFT=$(( 225 - ($(date +%s) - START) ))
if [ "$LEFT" -ge 25 ]; then
  step bench_kda_pallas $(( LEFT < 70 ? LEFT : 70 )) \
    python3 -m experiments.bench_kda --sizes 8192x16x128 --impls chunked,pallas --repeats 2
else
  echo "skipped bench_kda_pallas: only ${LEFT}s left" | tee -a "$LOG"
fi
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
