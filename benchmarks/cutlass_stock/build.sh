#!/usr/bin/env bash
# Builds benchmarks/cutlass_stock/stock_gemm.cu into a C-ABI shared library (no torch, no Python):
#   bash benchmarks/cutlass_stock/build.sh [OUT.so]      (default: build/cutlass_stock/libstock_gemm.so)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/build/cutlass_stock/libstock_gemm.so}
PY=${PYTHON:-python3}
if [ -z "${NVCC:-}" ]; then
  if [ -n "${CUDA_HOME:-}" ]; then NVCC=$CUDA_HOME/bin/nvcc; else NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); fi
fi
INC=$($PY -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")
mkdir -p "$(dirname "$OUT")"
"$NVCC" -O3 -std=c++17 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
  -Xcompiler -fPIC -shared -I"$INC/include" -I"$INC/tools/util/include" \
  "$ROOT/benchmarks/cutlass_stock/stock_gemm.cu" -o "$OUT"
echo "built $OUT"
