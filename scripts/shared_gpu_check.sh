#!/usr/bin/env bash
# GPU checks for a machine with ONE GPU: the plain GEMM tests on it, the fused operators' GPU tests with their
# ranks as processes sharing that GPU (FLUX_LAYERS_TEST_SHARED_GPU=1, correctness only: the processes share
# one GPU), and the per-call host cost (benchmarks/bench_overhead.py --shared-gpu) of this tree and, where a
# prebuilt baseline tree sits in .baseline/ (its flux_layers package and configs), of that one too.
#
#   FLUX_LAYERS_COMMIT=<commit> scripts/shared_gpu_check.sh OUTDIR [STEP ...]
# (set FLUX_LAYERS_COMMIT where the repository is: the copy of the tree on the GPU machine may report another)
#   steps: env gemm_test op_tests graph_tests reliability_tests overhead baseline_overhead
set -u
OUTDIR=${1:?usage: scripts/shared_gpu_check.sh OUTDIR [STEP ...]}
shift
STEPS=${*:-env gemm_test op_tests graph_tests reliability_tests overhead baseline_overhead}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLUX_LAYERS_COMMIT=${FLUX_LAYERS_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DEADLINE=$(( $(date +%s) + ${CHECK_BUDGET_S:-540} ))
summary="$OUTDIR/summary.txt"
: > "$summary"

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) - 10 ))
  if [ "$left" -lt 20 ]; then echo "$name skipped (budget spent)" | tee -a "$summary"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$summary"
  tail -n 15 "$OUTDIR/$name.log"
}

for s in $STEPS; do
  case $s in
    env) step env 60 bash -c "nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv; \
$PY -c 'import torch, flux_layers; print(torch.__version__, torch.cuda.device_count(), flux_layers.fused_ops_available(), \
flux_layers._library.unavailable_reason())'" ;;
    gemm_test) step gemm_test 150 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemm_gpu.py ;;
    op_tests) step op_tests 300 env FLUX_LAYERS_TEST_SHARED_GPU=1 FLUX_LAYERS_TIMEOUT_S=${SHARED_TIMEOUT_S:-60} \
      $PY -m pytest -q -p no:cacheprovider tests/gpu/test_ag_gemm_gpu.py tests/gpu/test_gemm_rs_gpu.py \
      ${OP_TESTS_K:+-k "$OP_TESTS_K"} ;;
    graph_tests) step graph_tests 200 env FLUX_LAYERS_TEST_SHARED_GPU=1 FLUX_LAYERS_TIMEOUT_S=${SHARED_TIMEOUT_S:-60} \
      $PY -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graph_ops_gpu.py ;;
    reliability_tests) step reliability_tests 200 env FLUX_LAYERS_TEST_SHARED_GPU=1 \
      $PY -m pytest -q -p no:cacheprovider tests/gpu/test_reliability_gpu.py ;;
    overhead) step overhead 200 $PY -m benchmarks.bench_overhead --shared-gpu ${OVERHEAD_ARGS:-} \
      --out "$OUTDIR/op_overhead_shared.json" ;;
    baseline_overhead)
      if [ -d .baseline/flux_layers ]; then
        mkdir -p .baseline/benchmarks && cp benchmarks/bench_overhead.py .baseline/benchmarks/ \
          && touch .baseline/benchmarks/__init__.py
        step baseline_overhead 200 bash -c "cd .baseline && PYTHONPATH=. FLUX_LAYERS_COMMIT=baseline $PY -m \
benchmarks.bench_overhead --shared-gpu ${OVERHEAD_ARGS:-} --out $OUTDIR/op_overhead_shared_baseline.json"
      else
        echo "baseline_overhead skipped (no .baseline/flux_layers)" | tee -a "$summary"
      fi ;;
    *) echo "unknown step $s" | tee -a "$summary" ;;
  esac
done
echo "=== summary"
cat "$summary"
