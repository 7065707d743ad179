#!/usr/bin/env bash
# GPU verification and benchmarks in one call, for a GPU machine without a package index.
#
#   scripts/gpu_check.sh OUTDIR [STEP ...]
#
# Steps (default: all, in this order): env gemm_test ag_test rs_test graph_test reliability_test layers_test gemm_bench
# ag_bench rs_bench overhead_bench layer_bench layer_bench_conn1. Also: sweep_bench (benchmarks/bench_sweep.py),
# split_tests (only the stream-K tail's GPU tests), layer_ops_7b, nccl_test, nccl_bench, hybrid_bench, e2e_compare
# ($E2E_MODELS, $E2E_ARGS: e.g. --cuda-graphs), reliability_bench (benchmarks/reliability.py: every reliability scenario
# in its own process group, $RELIABILITY_ARGS added; with one GPU its two ranks share it), layer_ops_bench
# (benchmarks/bench_layer_ops.py), e2e_ceiling (examples/gpt/ceiling.py), layer_profile (benchmarks/profile_layer.py),
# stock_bench, stock_fp8_bench (benchmarks/bench_cutlass_stock.py [--fp8]), one_queue_probe
# (experiments/one_queue_probe.py $ONE_QUEUE_PROBE_ARGS: what waits for a running kernel under one hardware queue),
# one_queue_stand_in (experiments/one_queue_stand_in.py $ONE_QUEUE_ARGS: the one-queue failure of the NCCL transport on
# emulated nodes, one change at a time), api_cost (experiments/cuda_api_cost.cu: the host cost of each CUDA operation
# and of a graphed call; carry build/cuda_api_cost, built with the command in its header, where the machine has no
# nvcc), fp8_ab (op-library builds of the FP8 GEMM side by side: carry each as build/<name>_C.abi3.so and name them in
# $FP8_AB_LIBS, e.g. "base variant"; bench_gemm_fp8.py with each by FLUX_LAYERS_OPS_LIB, split accumulation, two
# alternating rounds, then scripts/fp8_ab_summary.py; the names also in $FP8_AB_BOUNDS are timing bounds, whose results
# bench_gemm_fp8.py --bound records without checking them).
# GRAPH_TEST_K / LAYERS_TEST_K narrow graph_test / layers_test to a pytest -k expression.
# On a machine with ONE GPU: env gemm_test shared_tests shared_overhead baseline_overhead reliability_bench, and
# shared_tp shared_nodes.
# shared_tests runs the fused ops' GPU tests with their ranks as processes sharing the GPU
# (FLUX_LAYERS_TEST_SHARED_GPU=1; results checked, timings meaningless; SHARED_TESTS_K narrows it). shared_tp runs
# them (the fused ops in 16 bits and FP8, CUDA graphs, direct and compiled calls, reliability, layers) at each TP of
# $SHARED_TP (default "2 4 8"; lean matrices above 2, tests/gpu/gpu_support.py lean()); shared_nodes runs the NCCL
# transports' tests on emulated nodes, their send/recv by the host-staged stand-in, for each TPxNODES of $SHARED_NODES
# (default "4x2 8x2 8x4": 2x2, 2x4 and 4x2 ranks; internode and numa2d orders). Both write
# OUTDIR/gpu_tests_shared_h200.json from the runs' own pytest counts (scripts/shared_gpu_runs.py; $SHARED_RUNS_MERGE:
# the summary of an earlier call of the same commit, to add up; a run that wrote no report, cut by its time limit, is
# counted from its -vv log's result lines and marked from_log, with the tests it did not reach). shared_overhead times
# the host cost per call that way (benchmarks/bench_overhead.py --shared-gpu $OVERHEAD_ARGS), baseline_overhead the
# same for a prebuilt older tree in .baseline/ (its flux_layers package and configs). Set FLUX_LAYERS_COMMIT where the
# repository is: a copy of the tree on the GPU machine may report another commit. Each step runs under its own time
# limit; a failing step does not stop the others. Logs and JSON go to a work folder, packed at the end into
# OUTDIR/gpu_check.tgz (plus OUTDIR/summary.txt).
#
# Every pytest step writes a JUnit report (PYTEST_ADDOPTS: --junitxml, and -rs for the skip reasons in its log); its
# summary line gives passed / failed / errors / skipped (scripts/junit_summary.py) and each skip reason. A step whose
# tests all skipped, or that collected none, is reported NOTHING RAN and counts as failed, even though pytest exits 0
# (e.g. every 2-GPU test on a machine with one GPU). The script exits 1 when any step failed, ran nothing or was
# skipped for the budget, else 0.
# A failure's report is written to the step's log when it happens (tests/gpu/conftest.py), so a step killed by its
# time limit keeps the messages of the failures before it.
#
# Wheels the machine lacks (megatron-core for the layer steps) are installed from .whl/ if present; the
# op library is taken prebuilt from flux_layers/_C*.so, else built here (needs nvcc and nvidia-cutlass).
set -u
OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR [STEP ...]}
shift
STEPS=${*:-env gemm_test ag_test rs_test graph_test reliability_test layers_test gemm_bench ag_bench rs_bench overhead_bench layer_bench layer_bench_conn1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
mkdir -p "$OUTDIR" "$WORK/results"
cd "$ROOT"

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLUX_LAYERS_COMMIT=${FLUX_LAYERS_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/flux_site .whl/*.whl \
    && export PYTHONPATH=/tmp/flux_site
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ! $PY -c "import flux_layers._library as l, sys; sys.exit(0 if l.load() else 1)"; then
  echo "no loadable prebuilt op library: building it here"
  FLUX_LAYERS_BUILD_OPS=1 $PY setup.py build_ext --inplace > "$WORK/build.log" 2>&1 || echo "build failed (build.log)"
fi

GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
GPU_TAG=h200x$GPUS
summary="$WORK/summary.txt"
: > "$summary"
not_passed=0  # steps that failed, ran no test or did not run
# Whole-run budget (seconds): steps are shortened or skipped so that results always come back.
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-560} ))

pack() {
  cp "$summary" "$OUTDIR/summary.txt"
  tar czf "$OUTDIR/gpu_check.tgz" -C "$WORK" .
}

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) - 15 ))
  if [ "$left" -lt 20 ]; then
    echo "$name skipped (budget spent)" | tee -a "$summary"
    not_passed=$(( not_passed + 1 ))
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  local junit="$WORK/$name.junit.xml"
  rm -f "$junit"
  echo "=== $name (limit ${limit}s)"
  # A pytest run anywhere in the step's command writes its report; other commands ignore the variable.
  PYTEST_ADDOPTS="${PYTEST_ADDOPTS:+$PYTEST_ADDOPTS }-rs --junitxml=$junit" \
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  local verdict="rc=$rc" tests="" jrc=0
  if [ -f "$junit" ]; then
    tests=$($PY "$ROOT/scripts/junit_summary.py" "$junit")
    jrc=$?
    [ "$jrc" -eq 3 ] && verdict="rc=$rc NOTHING RAN"
  fi
  { [ "$rc" -ne 0 ] || [ "$jrc" -ne 0 ]; } && not_passed=$(( not_passed + 1 ))
  echo "$name $verdict $(( $(date +%s) - t0 ))s${tests:+: $tests}" | tee -a "$summary"
  tail -n 25 "$WORK/$name.log"
  pack
}

shared_runs=""  # TP:NODES:REPORT of each shared_tp / shared_nodes run, for the summary

shared_limit() {  # shared_limit tp|nodes TP: a step's time limit (seconds), larger with more ranks time-slicing
  local kind=$1 tp=$2
  if [ "$kind" = tp ]; then echo $(( 300 + 30 * tp )); else echo $(( 150 + 30 * tp )); fi
}

shared_run() {  # shared_run TP NODES STEP: the step's report joins the summary, else (no report) its -vv log
  if [ -f "$WORK/$3.junit.xml" ]; then
    shared_runs="$shared_runs $1:$2:$WORK/$3.junit.xml"
  elif [ -f "$WORK/$3.log" ]; then
    shared_runs="$shared_runs $1:$2:$WORK/$3.log"
  fi
}

for s in $STEPS; do
  case $s in
    env) step env 60 bash -c "nvidia-smi; nvidia-smi topo -m; $PY -c 'import torch, flux_layers; \
print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), flux_layers.fused_ops_available(), \
flux_layers._library.path(), flux_layers._library.unavailable_reason())'" ;;
    gemm_test) step gemm_test 240 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemm_gpu.py ;;
    ag_test) step ag_test 300 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_ag_gemm_gpu.py ;;
    rs_test) step rs_test 300 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemm_rs_gpu.py ;;
    graph_test) step graph_test 300 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graph_ops_gpu.py \
      tests/gpu/test_compile_ops_gpu.py tests/gpu/test_direct_calls_gpu.py tests/gpu/test_layers_gpu.py \
      -k "${GRAPH_TEST_K:-graph or compile or direct}" ;;
    reliability_test) step reliability_test 360 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_reliability_gpu.py ;;
    shared_tests) step shared_tests 540 env FLUX_LAYERS_TEST_SHARED_GPU=1 FLUX_LAYERS_TIMEOUT_S=${SHARED_TIMEOUT_S:-60} \
      $PY -m pytest -q -p no:cacheprovider tests/gpu/test_ag_gemm_gpu.py tests/gpu/test_gemm_rs_gpu.py \
      tests/gpu/test_cuda_graph_ops_gpu.py tests/gpu/test_compile_ops_gpu.py tests/gpu/test_direct_calls_gpu.py \
      tests/gpu/test_reliability_gpu.py tests/gpu/test_fused_fp8_gpu.py \
      ${SHARED_TESTS_K:+-k "$SHARED_TESTS_K"} ;;
    shared_tp)  # ranks sharing one GPU at each TP of $SHARED_TP: the fused ops' GPU tests (the NCCL ones: shared_nodes)
      for tp in ${SHARED_TP:-2 4 8}; do
        step "shared_tp$tp" "$(shared_limit tp "$tp")" env FLUX_LAYERS_TEST_SHARED_GPU=1 FLUX_LAYERS_TEST_TP="$tp" \
          FLUX_LAYERS_TIMEOUT_S=${SHARED_TIMEOUT_S:-60} $PY -m pytest -q -p no:cacheprovider \
          tests/gpu/test_ag_gemm_gpu.py tests/gpu/test_gemm_rs_gpu.py tests/gpu/test_cuda_graph_ops_gpu.py \
          tests/gpu/test_compile_ops_gpu.py tests/gpu/test_direct_calls_gpu.py tests/gpu/test_reliability_gpu.py \
          tests/gpu/test_layers_gpu.py tests/gpu/test_fused_fp8_gpu.py tests/gpu/test_layers_fp8_gpu.py \
          ${SHARED_TESTS_K:+-k "$SHARED_TESTS_K"}
        shared_run "$tp" 1 "shared_tp$tp"
      done ;;
    shared_nodes)  # emulated nodes on one GPU (TPxNODES of $SHARED_NODES): the NCCL and hybrid transports over the
      # stand-in, 16-bit and FP8
      for layout in ${SHARED_NODES:-4x2 8x2 8x4}; do
        tp=${layout%x*} nodes=${layout#*x}
        step "shared_nodes_$layout" "$(shared_limit nodes "$tp")" env FLUX_LAYERS_TEST_SHARED_GPU=1 \
          FLUX_LAYERS_TEST_TP="$tp" FLUX_LAYERS_TEST_NODES="$nodes" FLUX_LAYERS_TIMEOUT_S=${SHARED_TIMEOUT_S:-60} \
          $PY -m pytest -q -p no:cacheprovider tests/gpu/test_sendrecv_gpu.py tests/gpu/test_nccl_transport_gpu.py \
          tests/gpu/test_hybrid_transport_gpu.py tests/gpu/test_hybrid_rs_gpu.py \
          tests/gpu/test_external_transfers_fp8_gpu.py ${SHARED_TESTS_K:+-k "$SHARED_TESTS_K"}
        shared_run "$tp" "$nodes" "shared_nodes_$layout"
      done ;;
    reliability_bench)  # one GPU: two ranks sharing it (--shared-gpu), results checked, times not TP times
      if [ "$GPUS" -ge 2 ]; then
        step reliability_bench 540 $PY -m benchmarks.reliability ${RELIABILITY_ARGS:-} \
          --out "$WORK/results/reliability_$GPU_TAG.json"
      else
        step reliability_bench 540 $PY -m benchmarks.reliability --shared-gpu ${RELIABILITY_ARGS:-} \
          --out "$WORK/results/reliability_shared.json"
      fi ;;
    shared_overhead) step shared_overhead 200 $PY -m benchmarks.bench_overhead --shared-gpu ${OVERHEAD_ARGS:-} \
      --out "$WORK/results/op_overhead_shared.json" ;;
    baseline_overhead)
      if [ -d .baseline/flux_layers ]; then
        mkdir -p .baseline/benchmarks && cp benchmarks/bench_overhead.py benchmarks/harness.py .baseline/benchmarks/ \
          && touch .baseline/benchmarks/__init__.py
        step baseline_overhead 200 bash -c "cd .baseline && PYTHONPATH=. FLUX_LAYERS_COMMIT=baseline $PY -m \
benchmarks.bench_overhead --shared-gpu ${OVERHEAD_ARGS:-} --out $WORK/results/op_overhead_shared_baseline.json"
      else
        echo "baseline_overhead skipped (no .baseline/flux_layers)" | tee -a "$summary"
      fi ;;
    split_tests) step split_tests 300 $PY -m pytest -q -x -p no:cacheprovider tests/gpu -k stream_k ;;
    layers_test) step layers_test 300 $PY -m pytest -q -p no:cacheprovider tests/gpu -k "${LAYERS_TEST_K:-layer or spec or norm}" ;;
    gemm_bench) step gemm_bench 300 $PY -m benchmarks.bench_gemm --out "$WORK/results/gemm_h200.json" ;;
    ag_bench) step ag_bench 400 $PY -m benchmarks.bench_ag_gemm --out "$WORK/results/ag_gemm_$GPU_TAG.json" ;;
    rs_bench) step rs_bench 400 $PY -m benchmarks.bench_gemm_rs --out "$WORK/results/gemm_rs_$GPU_TAG.json" ;;
    nccl_test)  # both operators over their NCCL transports, and the hybrid all-gather (2+ GPUs; not default)
      step nccl_test 420 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_nccl_transport_gpu.py \
        tests/gpu/test_hybrid_transport_gpu.py tests/gpu/test_hybrid_rs_gpu.py tests/gpu/test_external_transfers_fp8_gpu.py ;;
    nccl_bench)  # both NCCL transports, every peer on another "node" (not in the default steps)
      step nccl_ag_bench 400 env FLUX_LAYERS_TRANSPORT=nccl FLUX_LAYERS_NODE_SIZE=1 $PY -m benchmarks.bench_ag_gemm \
        --out "$WORK/results/ag_gemm_internode_$GPU_TAG.json"
      step nccl_rs_bench 400 env FLUX_LAYERS_TRANSPORT=nccl FLUX_LAYERS_NODE_SIZE=1 $PY -m benchmarks.bench_gemm_rs \
        --out "$WORK/results/gemm_rs_internode_$GPU_TAG.json" ;;
    hybrid_bench)  # 4+ GPUs as two emulated nodes: the hybrid transports beside the flat NCCL ones (not default)
      step hybrid_ag_bench 400 env FLUX_LAYERS_TRANSPORT=hybrid FLUX_LAYERS_NODE_SIZE=$((GPUS / 2)) \
        $PY -m benchmarks.bench_ag_gemm --out "$WORK/results/ag_gemm_hybrid_$GPU_TAG.json"
      step hybrid_rs_bench 400 env FLUX_LAYERS_TRANSPORT=hybrid FLUX_LAYERS_NODE_SIZE=$((GPUS / 2)) \
        $PY -m benchmarks.bench_gemm_rs --out "$WORK/results/gemm_rs_hybrid_$GPU_TAG.json" ;;
    overhead_bench) step overhead_bench 400 $PY -m benchmarks.bench_overhead --breakdown \
        --out "$WORK/results/op_overhead_$GPU_TAG.json" ;;
    sweep_bench) step sweep_bench 560 env CUDA_DEVICE_MAX_CONNECTIONS=1 $PY -m benchmarks.bench_sweep \
        --out "$WORK/results/layer_sweep_$GPU_TAG.json" ;;
    layer_bench) step layer_bench 400 $PY -m benchmarks.bench_layer --out "$WORK/results/layer_$GPU_TAG.json" ;;
    layer_bench_conn1)  # megatron-core's recommended setting for its SP overlap, one hardware queue per GPU
      step layer_bench_conn1 400 env CUDA_DEVICE_MAX_CONNECTIONS=1 $PY -m benchmarks.bench_layer \
        --out "$WORK/results/layer_${GPU_TAG}_conn1.json" ;;
    layer_ops_bench)  # the layer's fused calls at its shapes, each beside cuBLAS alone (not in the default steps)
      step layer_ops_bench 200 $PY -m benchmarks.bench_layer_ops --out "$WORK/results/layer_ops_$GPU_TAG.json" ;;
    layer_ops_7b)  # the same at the 7B-like layer (hidden 4096, SwiGLU ffn 11008, seq 4096; not default)
      step layer_ops_7b 200 $PY -m benchmarks.bench_layer_ops --hidden 4096 --ffn 11008 --seq 4096 \
        --out "$WORK/results/layer_ops_7b_$GPU_TAG.json" ;;
    e2e_compare)  # the example's --compare on $E2E_MODELS (default gpt-1b llama-7b), one JSON each (not default)
      for model in ${E2E_MODELS:-gpt-1b llama-7b}; do
        step "e2e_$model" 400 $PY examples/pretrain_gpt.py --model "$model" --compare --train-iters ${E2E_ITERS:-30} \
          --results-dir "$WORK/results" --tag "${model}_$GPU_TAG" ${E2E_ARGS:-}
      done ;;
    layer_profile)  # kernel time per category and traces, flux vs baseline (not in the default steps)
      step layer_profile 300 env CUDA_DEVICE_MAX_CONNECTIONS=1 $PY -m benchmarks.profile_layer \
        --out "$WORK/results/layer_profile_${GPU_TAG}.json" --trace-dir "$WORK/traces" ;;
    e2e_ceiling)  # the example's training: megatron-core's linears, flux's, megatron-core's without communication (not default)
      step e2e_ceiling 400 $PY -m examples.gpt.ceiling --model h8192 --train-iters ${E2E_CEILING_ITERS:-40} \
        --out "$WORK/results/e2e_ceiling_$GPU_TAG.json" ;;
    stock_bench)  # stock CUTLASS kernel schedules beside cuBLAS and ours (not in the default steps)
      [ -f build/cutlass_stock/libstock_gemm.so ] || step stock_build 300 env PYTHON=$PY bash benchmarks/cutlass_stock/build.sh
      step stock_bench 200 $PY -m benchmarks.bench_cutlass_stock --out "$WORK/results/gemm_stock_cutlass_h200.json" ;;
    stock_fp8_bench)  # stock CUTLASS FP8 schedules beside cuBLASLt and ours ($STOCK_FP8_ARGS added)
      [ -f build/cutlass_stock/libstock_gemm_fp8.so ] || step stock_build 300 env PYTHON=$PY bash benchmarks/cutlass_stock/build.sh
      step stock_fp8_bench 300 $PY -m benchmarks.bench_cutlass_stock --fp8 ${STOCK_FP8_ARGS:-} \
        --out "$WORK/results/gemm_stock_cutlass_fp8.json" ;;
    fp8_ab)  # op-library builds of the FP8 GEMM side by side: build/<name>_C.abi3.so for each name of $FP8_AB_LIBS
      # (carried), processes alternating over two rounds, split accumulation, $FP8_AB_SHAPES
      if [ -z "${FP8_AB_LIBS:-}" ]; then
        echo "fp8_ab skipped (FP8_AB_LIBS names no build)" | tee -a "$summary"
        not_passed=$(( not_passed + 1 ))
      else
        for r in 1 2; do
          for lib in $FP8_AB_LIBS; do
            step "fp8_ab_${lib}_$r" 150 env FLUX_LAYERS_OPS_LIB="$ROOT/build/${lib}_C.abi3.so" FLUX_LAYERS_COMMIT="$lib" \
              $PY -m benchmarks.bench_gemm_fp8 --accums split --reps 8 --rounds 3 \
              $(case " ${FP8_AB_BOUNDS:-} " in *" $lib "*) echo --bound ;; esac) \
              --shapes "${FP8_AB_SHAPES:-4096x2048x4096,4096x4096x6144,8192x4096x4096,4096x8192x4096,8192x8192x14336}" \
              --out "$WORK/results/fp8_ab_${lib}_$r.json"
          done
        done
        $PY "$ROOT/scripts/fp8_ab_summary.py" "$WORK"/results/fp8_ab_*.json | tee -a "$summary"
      fi ;;
    one_queue_probe) step one_queue_probe 200 $PY -m experiments.one_queue_probe ${ONE_QUEUE_PROBE_ARGS:-} \
        --out "$WORK/results/one_queue_probe.json" ;;
    api_cost)  # experiments/cuda_api_cost.cu, prebuilt as build/cuda_api_cost (carried), else built here with nvcc
      if [ ! -x build/cuda_api_cost ] && command -v nvcc > /dev/null; then
        mkdir -p build && nvcc -O2 -std=c++17 -arch=sm_90a -o build/cuda_api_cost experiments/cuda_api_cost.cu
      fi
      if [ -x build/cuda_api_cost ]; then
        step api_cost 120 bash -c "set -o pipefail; build/cuda_api_cost | tee $WORK/results/cuda_api_cost.txt"
      else
        echo "api_cost skipped (no build/cuda_api_cost and no nvcc)" | tee -a "$summary"
        not_passed=$(( not_passed + 1 ))
      fi ;;
    one_queue_stand_in) step one_queue_stand_in 400 env FLUX_LAYERS_TEST_SHARED_GPU=1 $PY -m experiments.one_queue_stand_in \
        ${ONE_QUEUE_ARGS:-} --out "$WORK/results/one_queue_stand_in.json" ;;
    *) echo "unknown step $s" | tee -a "$summary"; not_passed=$(( not_passed + 1 )) ;;
  esac
done

if [ -n "$shared_runs" ]; then
  $PY scripts/shared_gpu_runs.py "$OUTDIR/gpu_tests_shared_h200.json" $shared_runs \
    ${SHARED_RUNS_MERGE:+--merge "$SHARED_RUNS_MERGE"} | tee -a "$summary"
fi
echo "steps not passed: $not_passed" >> "$summary"
pack
echo "=== summary"
cat "$summary"
[ "$not_passed" -eq 0 ]
