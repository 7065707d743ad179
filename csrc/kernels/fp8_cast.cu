// FP8 casts with current scaling (csrc/include/flux/fp8_cast.h): the choice of kernels for a cast
// (plan_quantize_fp8: one pass where it applies, fp8_cast_onepass.cu and fp8_cast_rowwise.cu), and the two-pass
// kernels, an amax pass and a cast pass each reading the input once, with tile transposes through shared memory for
// the K-major copies a backward needs.
//
//   amax      : 16-byte loads (8 elements), a block's max by warp shuffles, combined across blocks by an integer
//               atomicMax on the float's bits (non-negative floats order as their bit patterns)
//   cast      : 16-byte loads, 8-byte stores; the scale computed by every thread from the amax (no extra launch)
//   transpose : 64 x 64 tiles; rows written straight out, the tile's FP8 bytes staged in shared memory and written
//               transposed
#include <cstdint>

#include "flux/check.h"
#include "flux/fp8_cast.h"
#include "fp8_cast_math.cuh"
#include "fp8_cast_onepass.h"

namespace flux {

namespace {

using namespace fp8cast;  // NOLINT: the shared element arithmetic (fp8_cast_math.cuh)

constexpr int kThreads = 256;
constexpr int kTile = 64;  // transpose tile (rows and columns)

__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_max[kThreads / 32];
  v = warp_amax(v);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) v = warp_amax(threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0.f);
  return v;  // valid in thread 0
}

template <class T>
__global__ void amax_kernel(const T* x, int64_t rows, int64_t cols, int64_t ld, bool per_row, float* amax) {
  float m = 0.f;
  int64_t const vecs = cols / kVec;
  if (per_row) {
    int64_t const r = blockIdx.x;
    for (int64_t c = threadIdx.x; c < vecs; c += kThreads) {
      float v[kVec];
      load8(x + r * ld + c * kVec, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) m = abs_max(m, v[i]);
    }
    m = block_max(m);
    if (threadIdx.x == 0) amax[r] = m;
    return;
  }
  int64_t const total = rows * vecs;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    int64_t const r = i / vecs, c = i - r * vecs;
    float v[kVec];
    load8(x + r * ld + c * kVec, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = abs_max(m, v[j]);
  }
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

template <class T, __nv_fp8_interpretation_t kFormat>
__global__ void cast_kernel(const T* x, int64_t rows, int64_t cols, int64_t ld, const float* amax, bool per_row,
                            float margin_factor, uint8_t* data, float* scale) {
  int64_t const vecs = cols / kVec;
  int64_t const total = rows * vecs;
  float const tensor_scale = per_row ? 1.f : scale_of<kFormat>(amax[0], margin_factor);
  float const tensor_inv = inverse_of(tensor_scale);
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    int64_t const r = i / vecs, c = i - r * vecs;
    float const s = per_row ? scale_of<kFormat>(amax[r], margin_factor) : tensor_scale;
    float const inv = per_row ? inverse_of(s) : tensor_inv;
    if (c == 0 && (per_row || r == 0)) scale[per_row ? r : 0] = s;
    *reinterpret_cast<uint2*>(data + r * cols + c * kVec) =
        cast8<T, kFormat>(*reinterpret_cast<const uint4*>(x + r * ld + c * kVec), inv);
  }
}

// One 64 x 64 tile: FP8 bytes of x (16-bit, cast by the tensor's scale) or of an FP8 input (re-cast by its block's
// ratio to the common scale) into `data` (row-major, optional) and `data_t` (transposed).
template <class T, __nv_fp8_interpretation_t kFormat, bool kFromFp8>
__global__ void transpose_kernel(const T* x, int64_t rows, int64_t cols, int64_t ld, const float* amax,
                                 float margin_factor, const float* block_scale, int blocks, uint8_t* data,
                                 uint8_t* data_t, float* scale) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  int64_t const r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  float inv = 1.f, common = 0.f;
  if constexpr (kFromFp8) {
    for (int b = 0; b < blocks; ++b) common = fmaxf(common, block_scale[b]);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) scale[0] = common;
  } else {
    float const s = scale_of<kFormat>(amax[0], margin_factor);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) scale[0] = s;
    inv = inverse_of(s);
  }
  int64_t const rows_per_block = kFromFp8 ? rows / blocks : 1;
  // Load: 64 rows x 8 vectors of 8 elements; 256 threads, two vectors each.
  for (int v = threadIdx.x; v < kTile * kTile / kVec; v += kThreads) {
    int const tr = v / (kTile / kVec), tc = (v % (kTile / kVec)) * kVec;
    int64_t const r = r0 + tr, c = c0 + tc;
    alignas(8) uint8_t q[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (r < rows && c < cols) {  // cols is a multiple of 8: a vector lies inside or outside whole
      if constexpr (kFromFp8) {
        float const ratio = block_scale[r / rows_per_block] / common;
        uint2 raw = *reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(x) + r * ld + c);
        const uint8_t* e = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
        for (int j = 0; j < kVec; ++j) q[j] = to_fp8<kFormat>(from_fp8<kFormat>(e[j]) * ratio);
      } else {
        *reinterpret_cast<uint2*>(q) = cast8<T, kFormat>(*reinterpret_cast<const uint4*>(x + r * ld + c), inv);
        if (data != nullptr) *reinterpret_cast<uint2*>(data + r * cols + c) = *reinterpret_cast<const uint2*>(q);
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) tile[tr][tc + j] = q[j];
  }
  __syncthreads();
  // Store transposed: output row c0 + tc holds input column tc; 4 threads per output row, 16 bytes each.
  int const tc = threadIdx.x / 4, part = (threadIdx.x % 4) * 16;
  int64_t const out_row = c0 + tc;
  if (out_row >= cols) return;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    int64_t const r = r0 + part + j;
    if (r < rows) data_t[out_row * rows + r] = tile[part + j][tc];
  }
}

int grid_for(int64_t vectors) {
  int64_t const blocks = (vectors + kThreads - 1) / kThreads;
  return int(blocks < 132 * 16 ? (blocks > 0 ? blocks : 1) : 132 * 16);
}

template <class T>
void amax_typed(const CastInput& in, bool per_row, float* amax, cudaStream_t s) {
  const T* x = static_cast<const T*>(in.x);
  int const grid = per_row ? int(in.rows) : grid_for(in.rows * (in.cols / kVec));
  amax_kernel<T><<<grid, kThreads, 0, s>>>(x, in.rows, in.cols, in.ld, per_row, amax);
  FLUX_CUDA_CHECK(cudaGetLastError());
}

template <class T, __nv_fp8_interpretation_t kFormat>
void cast_typed(const CastInput& in, const float* amax, bool per_row, float margin_factor, void* data, void* data_t,
                float* scale, cudaStream_t s) {
  const T* x = static_cast<const T*>(in.x);
  if (data_t == nullptr) {
    cast_kernel<T, kFormat><<<grid_for(in.rows * (in.cols / kVec)), kThreads, 0, s>>>(
        x, in.rows, in.cols, in.ld, amax, per_row, margin_factor, static_cast<uint8_t*>(data), scale);
  } else {
    dim3 grid(unsigned((in.cols + kTile - 1) / kTile), unsigned((in.rows + kTile - 1) / kTile));
    transpose_kernel<T, kFormat, false><<<grid, kThreads, 0, s>>>(x, in.rows, in.cols, in.ld, amax, margin_factor,
                                                                  nullptr, 1, static_cast<uint8_t*>(data),
                                                                  static_cast<uint8_t*>(data_t), scale);
  }
  FLUX_CUDA_CHECK(cudaGetLastError());
}

void check_input(const CastInput& in) {
  FLUX_CHECK(in.dtype == DType::kBF16 || in.dtype == DType::kFP16, "FP8 casts read bfloat16 or float16");
  FLUX_CHECK(in.cols % kVec == 0, "FP8 casts need a multiple of 8 columns, got ", in.cols);
  FLUX_CHECK(in.ld % kVec == 0 && reinterpret_cast<uintptr_t>(in.x) % 16 == 0, "FP8 casts need 16-byte aligned rows");
}

}  // namespace

void launch_amax(const CastInput& in, bool per_row, float* amax, cudaStream_t stream) {
  check_input(in);
  if (in.rows == 0) return;
  if (in.dtype == DType::kBF16) return amax_typed<__nv_bfloat16>(in, per_row, amax, stream);
  amax_typed<__half>(in, per_row, amax, stream);
}

void launch_cast_fp8(const CastInput& in, const float* amax, bool per_row, float margin_factor, DType out, void* data,
                     void* data_t, float* scale, cudaStream_t stream) {
  check_input(in);
  FLUX_CHECK(is_fp8(out), "FP8 casts write float8_e4m3fn or float8_e5m2");
  FLUX_CHECK(data_t == nullptr || !per_row, "a transposed copy takes the tensor-wise scale");
  if (in.rows == 0) return;
  bool const bf16 = in.dtype == DType::kBF16;
  if (out == DType::kE4M3) {
    if (bf16)
      return cast_typed<__nv_bfloat16, __NV_E4M3>(in, amax, per_row, margin_factor, data, data_t, scale, stream);
    return cast_typed<__half, __NV_E4M3>(in, amax, per_row, margin_factor, data, data_t, scale, stream);
  }
  if (bf16) return cast_typed<__nv_bfloat16, __NV_E5M2>(in, amax, per_row, margin_factor, data, data_t, scale, stream);
  cast_typed<__half, __NV_E5M2>(in, amax, per_row, margin_factor, data, data_t, scale, stream);
}

QuantizePlan plan_quantize_fp8(const CastInput& in, DType out, bool per_row, bool transposed, bool two_pass) {
  check_input(in);
  FLUX_CHECK(is_fp8(out), "FP8 casts write float8_e4m3fn or float8_e5m2");
  FLUX_CHECK(!(per_row && transposed), "a transposed copy takes the tensor-wise scale");
  QuantizePlan plan;
  if (in.rows == 0) return plan;
  if (!two_pass && per_row) {
    plan.kernel = CastKernel::kRowOnePass;
    return plan;
  }
  if (!two_pass) {
    fp8cast::OnePassShape const shape = fp8cast::onepass_shape(in, out, transposed);
    if (shape.grid > 0) {
      plan.kernel = CastKernel::kOnePass;
      plan.grid = shape.grid;
      plan.held = shape.held;
      plan.smem = shape.smem;
      plan.scratch_floats = shape.grid;
      return plan;
    }
  }
  plan.kernel = CastKernel::kTwoPass;
  plan.scratch_floats = per_row ? in.rows : 1;
  return plan;
}

void launch_quantize_fp8(const QuantizePlan& plan, const CastInput& in, bool per_row, float margin_factor, DType out,
                         void* data, void* data_t, float* scale, float* scratch, cudaStream_t stream) {
  switch (plan.kernel) {
    case CastKernel::kNone:
      return;
    case CastKernel::kOnePass: {
      fp8cast::OnePassShape shape;
      shape.grid = plan.grid;
      shape.held = plan.held;
      shape.smem = plan.smem;
      if (fp8cast::launch_onepass(shape, in, margin_factor, out, data, data_t, scale, scratch, stream)) return;
      break;  // the grid did not fit: the two passes (scratch holds at least the one amax they need)
    }
    case CastKernel::kRowOnePass:
      return fp8cast::launch_rowwise_onepass(in, margin_factor, out, data, scale, stream);
    case CastKernel::kTwoPass:
      break;
  }
  // The tensor-wise amax combines blocks by atomicMax: it starts from 0. A row's amax is written whole.
  if (!per_row) FLUX_CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof(float), stream));
  launch_amax(in, per_row, scratch, stream);
  launch_cast_fp8(in, scratch, per_row, margin_factor, out, data, data_t, scale, stream);
}

void launch_transpose_to_common_scale(const void* data, DType dtype, int64_t rows, int64_t cols,
                                      const float* block_scale, int blocks, void* out, float* out_scale,
                                      cudaStream_t stream) {
  FLUX_CHECK(is_fp8(dtype), "the transposed re-cast reads FP8");
  FLUX_CHECK(cols % kVec == 0 && reinterpret_cast<uintptr_t>(data) % 8 == 0,
             "the transposed re-cast needs a multiple "
             "of 8 columns and 8-byte aligned rows");
  FLUX_CHECK(blocks >= 1 && rows % blocks == 0, rows, " rows do not split into ", blocks, " scale blocks");
  if (rows == 0 || cols == 0) return;
  dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned((rows + kTile - 1) / kTile));
  auto const* x = static_cast<const uint8_t*>(data);
  if (dtype == DType::kE4M3) {
    transpose_kernel<uint8_t, __NV_E4M3, true><<<grid, kThreads, 0, stream>>>(
        x, rows, cols, cols, nullptr, 1.f, block_scale, blocks, nullptr, static_cast<uint8_t*>(out), out_scale);
  } else {
    transpose_kernel<uint8_t, __NV_E5M2, true><<<grid, kThreads, 0, stream>>>(
        x, rows, cols, cols, nullptr, 1.f, block_scale, blocks, nullptr, static_cast<uint8_t*>(out), out_scale);
  }
  FLUX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flux
