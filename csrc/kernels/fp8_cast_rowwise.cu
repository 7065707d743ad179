// Row-wise FP8 cast in one pass (rules: csrc/include/flux/fp8_cast.h): one block per row loads the row into
// registers (16-byte loads, up to kRowRegs vectors a thread), takes its max, and writes the FP8 row and its scale
// from the registers. Rows longer than the block holds read their remainder a second time, right after the first
// (from L2).
#include <cstdint>

#include "flux/check.h"
#include "fp8_cast_math.cuh"
#include "fp8_cast_onepass.h"

namespace flux {
namespace fp8cast {

namespace {

constexpr int kRowMaxThreads = 256;
constexpr int kRowRegs = 8;  // vectors a thread holds: rows up to 256 x 8 x 8 = 16384 elements are read once

template <class T>
__device__ __forceinline__ uint4 load_row_vec(const T* row, int c, int vecs) {
  if (c >= vecs) return make_uint4(0, 0, 0, 0);
  return __ldg(reinterpret_cast<const uint4*>(row + int64_t(c) * kVec));
}

// blockDim.x: a multiple of 32, at most kRowMaxThreads.
template <class T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kRowMaxThreads)
    rowwise_kernel(const T* x, int64_t cols, int64_t ld, float margin_factor, uint8_t* data, float* scale) {
  __shared__ float warp_max[kRowMaxThreads / 32];
  __shared__ float row_inv;  // inverse_of the row's scale
  int64_t const r = blockIdx.x;
  const T* const row = x + r * ld;
  uint8_t* const out = data + r * cols;
  int const vecs = int(cols / kVec), step = int(blockDim.x), lane = threadIdx.x % 32;

  uint4 reg[kRowRegs];
#pragma unroll
  for (int k = 0; k < kRowRegs; ++k) reg[k] = load_row_vec(row, int(threadIdx.x) + k * step, vecs);
  uint32_t bits = 0;  // packed amax (amax_bits8)
  for (int c = int(threadIdx.x) + kRowRegs * step; c < vecs; c += step)
    bits = amax_bits8(bits, load_row_vec(row, c, vecs));
#pragma unroll
  for (int k = 0; k < kRowRegs; ++k) bits = amax_bits8(bits, reg[k]);  // zeros past the row's end
  float m = warp_amax(amax_of_bits<T>(bits));
  if (lane == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = warp_amax(lane < step / 32 ? warp_max[lane] : 0.f);
    if (lane == 0) {
      float const s = scale_of<kFormat>(m, margin_factor);
      row_inv = inverse_of(s);
      scale[r] = s;
    }
  }
  __syncthreads();
  float const inv = row_inv;
#pragma unroll
  for (int k = 0; k < kRowRegs; ++k) {
    int const c = int(threadIdx.x) + k * step;
    if (c < vecs) *reinterpret_cast<uint2*>(out + int64_t(c) * kVec) = cast8<T, kFormat>(reg[k], inv);
  }
  for (int c = int(threadIdx.x) + kRowRegs * step; c < vecs; c += step)
    *reinterpret_cast<uint2*>(out + int64_t(c) * kVec) = cast8<T, kFormat>(load_row_vec(row, c, vecs), inv);
}

template <class T, __nv_fp8_interpretation_t kFormat>
void launch_typed(const CastInput& in, float margin_factor, void* data, float* scale, cudaStream_t stream) {
  // About four vectors a thread, whole warps: short rows take fewer threads, so more rows share an SM.
  int64_t const vecs = in.cols / kVec;
  int64_t const want = ((vecs + 3) / 4 + 31) / 32 * 32;
  int const threads = int(want < 32 ? 32 : (want > kRowMaxThreads ? kRowMaxThreads : want));
  rowwise_kernel<T, kFormat><<<unsigned(in.rows), threads, 0, stream>>>(
      static_cast<const T*>(in.x), in.cols, in.ld, margin_factor, static_cast<uint8_t*>(data), scale);
  FLUX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_rowwise_onepass(const CastInput& in, float margin_factor, DType out, void* data, float* scale,
                            cudaStream_t stream) {
  FLUX_CHECK(in.rows < (int64_t(1) << 31) && in.cols / kVec < (int64_t(1) << 31),
             "row-wise FP8 casts take fewer than 2^31 rows and 2^34 columns, got ", in.rows, " x ", in.cols);
  bool const e4m3 = out == DType::kE4M3;
  if (in.dtype == DType::kBF16) {
    if (e4m3) return launch_typed<__nv_bfloat16, __NV_E4M3>(in, margin_factor, data, scale, stream);
    return launch_typed<__nv_bfloat16, __NV_E5M2>(in, margin_factor, data, scale, stream);
  }
  if (e4m3) return launch_typed<__half, __NV_E4M3>(in, margin_factor, data, scale, stream);
  launch_typed<__half, __NV_E5M2>(in, margin_factor, data, scale, stream);
}

}  // namespace fp8cast
}  // namespace flux
