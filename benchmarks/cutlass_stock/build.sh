#!/usr/bin/env bash
# Builds benchmarks/cutlass_stock/stock_gemm.cu (bf16) and stock_gemm_fp8.cu (FP8) into C-ABI shared libraries (no
# torch, no Python), the two at once:
#   bash benchmarks/cutlass_stock/build.sh [OUT.so [OUT_FP8.so]]
#   (default: build/cutlass_stock/libstock_gemm.so and libstock_gemm_fp8.so)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/build/cutlass_stock/libstock_gemm.so}
OUT_FP8=${2:-$(dirname "$OUT")/libstock_gemm_fp8.so}
PY=${PYTHON:-python3}
if [ -z "${NVCC:-}" ]; then
  if [ -n "${CUDA_HOME:-}" ]; then NVCC=$CUDA_HOME/bin/nvcc; else NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); fi
fi
INC=$($PY -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")
mkdir -p "$(dirname "$OUT")"
build() {
  "$NVCC" -O3 -std=c++17 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
    -Xcompiler -fPIC -shared -I"$INC/include" -I"$INC/tools/util/include" "$1" -o "$2"
}
build "$ROOT/benchmarks/cutlass_stock/stock_gemm.cu" "$OUT" &
bf16=$!
build "$ROOT/benchmarks/cutlass_stock/stock_gemm_fp8.cu" "$OUT_FP8"
wait $bf16
echo "built $OUT $OUT_FP8"
