#!/usr/bin/env bash
# The prepared GPU check (written for an NVIDIA H200), < 8 minutes.
#
#   bash experiments/gpu_check.sh      (from the repo root, `.whl/` present; allow 540 s)
#
# Runs, each part under its own time limit and independent of the others' failure:
#   1. environment: GPU, jax/jaxlib/flax/triton/torch/fla versions, jax devices;
#   2. Pallas tests compiled for the GPU (non-interpreted Triton kernels) against the XLA path
#      and the recurrence: tests/pallas_kernels/test_kda_chunk.py, then test_moe_gmm.py and the
#      export tests (jax.export lowering with the machine's jax);
#   3. python -m experiments.bench_kda --gpu_suite (B=1, H=96, K=V=128, bf16, T=8K: XLA
#      chunked vs Pallas vs flash-linear-attention's Triton chunk_kda) with --roofline (the
#      forward's FLOPs and bytes over its time, as fractions of the matmul rate and memory
#      bandwidth measured in the same process);
#   4. python -m experiments.bench_moe at the GPU check's expert shape: SiTU-GLU experts E 64, k 8,
#      D = F = 2048, 16K tokens, bf16, fwd+bwd vs a dense MLP of equal active FLOPs (sorted
#      dropless, capacity 1.1, ragged_dot, Pallas gmm);
#   5. one training run of configs/gpu_1b.py (~1B-parameter K3-shaped, bf16): tokens/s and MFU
#      against the bf16 matmul rate measured at start-up (metrics.jsonl per step);
#   6. the KDA benchmark again at T=32K (long sequences), last: the least needed figure.
# Everything lands in $OUT (8 files at most): summary.txt, env.txt, tests.log, bench.log (every
# benchmark's output), bench_kda_8k.json, bench_kda_32k.json, bench_moe.json, train_1b.jsonl.
# Needs `.whl/` carried: flash_linear_attention-0.6.0 and fla_core-0.6.0 wheels (pure Python;
# torch, triton, einops and transformers are on the machine). See docs/notes/pallas_kda.md.
#
# Local dry run (CPU, fake OUT, short limits):  GPU_CHECK_DRY=1 OUT=/tmp/gc bash experiments/gpu_check.sh

set -u
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
START=$(date +%s)
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
# Torch (fla) and JAX share the GPU in one process: no JAX preallocation of 75% of the memory.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Tests only: fp32 references at full precision (XLA's default fp32 dot on Hopper may use
# TF32); the benchmarks keep the default so the XLA baseline is not slowed down.
TESTENV="env JAX_DEFAULT_MATMUL_PRECISION=highest"

DRY="${GPU_CHECK_DRY:-0}"
if [ "$DRY" = "1" ]; then
  # CPU rehearsal: every part, at shapes a 2-core machine runs in minutes.
  PLATFORM=cpu; T_ENV=60; T_TESTS=400; T_MOE_TESTS=200; T_KDA8=120; T_KDA32=5; T_MOE=200
  T_TRAIN=400
  KDA_8K_ARGS="--sizes 256x2x64 --impls chunked,pallas --repeats 1 --roofline"
  KDA_32K_ARGS="--sizes 512x2x64 --impls chunked,pallas --repeats 1"
  MOE_ARGS="--tokens 512 --dim 64 --ffn 64 --dtype bfloat16 --repeats 1"
  TRAIN_ARGS="--config.train.steps=2 --config.train.seq_len=64 --config.train.batch_size=1
    --config.model.d_model=128 --config.model.num_layers=4 --config.model.kda_num_heads=1
    --config.model.num_heads=1 --config.model.num_experts=8 --config.model.experts_per_token=2
    --config.model.moe_intermediate_size=64 --config.model.latent_moe_dim=64
    --config.model.dense_intermediate_size=256 --config.model.q_lora_rank=64
    --config.model.kv_lora_rank=64"
else
  # Limits (s): 20 + 125 + 35 + 100 + 60 + 90 + 40 = 470 at worst (< 8 minutes), in the order
  # they run: the 32K KDA row, the least needed, comes last. The KDA tests compile five
  # kernels per configuration (the H200 run of 2026-11-30 took 104 s for two per configuration).
  PLATFORM=cuda; T_ENV=20; T_TESTS=125; T_MOE_TESTS=35; T_KDA8=100; T_KDA32=40; T_MOE=60
  T_TRAIN=90
  KDA_8K_ARGS="--gpu_suite --roofline --sizes 8192x96x128 --max_run_gib 60 --max_torch_tokens 40000"
  KDA_32K_ARGS="--gpu_suite --sizes 32768x96x128 --max_run_gib 60 --max_torch_tokens 40000 --repeats 2"
  MOE_ARGS="--tokens 16384 --dim 2048 --ffn 2048 --dtype bfloat16 --repeats 5"
  TRAIN_ARGS="--config.train.steps=4"
fi
export JAX_PLATFORMS="$PLATFORM"

log() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/summary.txt"; }

# run NAME LIMIT LOGFILE CMD... : one part, time-limited, its status in summary.txt.
run() {
  local name="$1" limit="$2" logfile="$3"; shift 3
  log "start $name (limit ${limit}s): $*"
  echo "===== $name: $* =====" >>"$logfile"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$logfile" 2>&1
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then log "TIMEOUT $name after ${limit}s"
  elif [ $rc -ne 0 ]; then log "FAIL $name rc=$rc (see $(basename "$logfile"))"
  else log "ok $name"; fi
  tail -n 3 "$logfile" | sed 's/^/    | /' | cut -c1-400 | tee -a "$OUT/summary.txt" >/dev/null
  return 0
}

# 0. wheels carried in .whl/ (pure-Python ones: unpacked, no pip or network needed).
if ls .whl/*.whl >/dev/null 2>&1; then
  mkdir -p /tmp/gc_site
  for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/gc_site >/dev/null 2>&1 || log "could not unpack $w"; done
  export PYTHONPATH="/tmp/gc_site:${PYTHONPATH:-}"
  log "unpacked $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/gc_site"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

# 1. environment
{
  date -u; uname -a; nvidia-smi 2>&1 | head -15
  "$PY" -m pip list 2>/dev/null | grep -i -E "^(jax|jaxlib|jax-cuda|flax|optax|chex|triton|torch |torch$|fla|flash|hypothesis|pytest |einops|transformers|ml.collections|numpy)" || true
} >"$OUT/env.txt" 2>&1
run env "$T_ENV" "$OUT/env.txt" "$PY" -c "
import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())
from jax.experimental.pallas import triton as pltriton; print('pallas triton', pltriton.CompilerParams)
try:
  import fla, fla.ops.kda; print('fla', getattr(fla, '__version__', '?'), 'chunk_kda ok')
except Exception as e: print('fla not importable:', type(e).__name__, e)
"

# 2. tests on the GPU (JAX_PLATFORMS=cuda overrides tests/conftest.py's cpu default).
run kda_tests "$T_TESTS" "$OUT/tests.log" $TESTENV "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
  tests/pallas_kernels/test_kda_chunk.py tests/pallas_kernels/test_export.py
if [ -f tests/pallas_kernels/test_moe_gmm.py ]; then
  run moe_tests "$T_MOE_TESTS" "$OUT/tests.log" $TESTENV "$PY" -m pytest -q -p no:cacheprovider \
    tests/pallas_kernels/test_moe_gmm.py
fi

# 3. KDA benchmark at 8K (its own process: a failure elsewhere keeps these figures).
run bench_kda_8k "$T_KDA8" "$OUT/bench.log" "$PY" -m experiments.bench_kda $KDA_8K_ARGS \
  --json --out "$OUT/bench_kda_8k.json"

# 4. Expert MLP vs a dense MLP of equal active FLOPs (no ragged_dot/QAT extras, no layer row).
run bench_moe "$T_MOE" "$OUT/bench.log" "$PY" -m experiments.bench_moe $MOE_ARGS \
  --methods sort,sort@1.1,ragged,gmm --small_methods= --nolayer --noextras --json \
  --out "$OUT/bench_moe.json"

# 5. A ~1B K3-shaped model's training steps (tokens/s, MFU per step in metrics.jsonl).
rm -rf /tmp/gpu_check_1b
run train_1b "$T_TRAIN" "$OUT/bench.log" "$PY" -m experiments.train --config=configs/gpu_1b.py \
  --workdir=/tmp/gpu_check_1b $TRAIN_ARGS
cp /tmp/gpu_check_1b/metrics.jsonl "$OUT/train_1b.jsonl" 2>/dev/null || log "no train_1b metrics"

# 6. KDA at 32K (the long-sequence regime), last.
run bench_kda_32k "$T_KDA32" "$OUT/bench.log" "$PY" -m experiments.bench_kda $KDA_32K_ARGS \
  --json --out "$OUT/bench_kda_32k.json"

log "done in $(( $(date +%s) - START ))s; files: $(ls "$OUT" | tr '\n' ' ')"
