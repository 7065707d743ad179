// Element arithmetic every FP8 cast kernel shares (csrc/include/flux/fp8_cast.h gives the rules): one definition of
// the scale, the conversion and the amax, so that the one-pass and the two-pass kernels give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace flux {
namespace fp8cast {

constexpr int kVec = 8;  // 16-bit elements per 16-byte load

template <class T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}

template <__nv_fp8_interpretation_t kFormat>
struct Fp8Format;
template <>
struct Fp8Format<__NV_E4M3> {
  static constexpr float kMax = 448.f;
};
template <>
struct Fp8Format<__NV_E5M2> {
  static constexpr float kMax = 57344.f;
};

template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFormat);  // round to nearest, saturated to the finite range
}

// Two at once (one cvt instruction on sm_89 and later, the same rounding): a's byte low, b's high.
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint32_t to_fp8x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFormat);
}

template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ float from_fp8(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(b, kFormat);
  return __half2float(__half(h));
}

// NaN amax (NaN > 0 is false) gives 1, as torch.where(amax > 0, ...) does.
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ float scale_of(float amax, float margin_factor) {
  return amax > 0.f ? amax * margin_factor / Fp8Format<kFormat>::kMax : 1.f;
}

// What the casts multiply by: 1 / scale, one correctly rounded division per scale (torch's 1 / scale gives the same
// float), so each element costs a multiply where a division would cost about ten instructions.
__device__ __forceinline__ float inverse_of(float scale) { return 1.f / scale; }

// |NaN| keeps NaN: fmaxf would drop it, so NaN propagates through its bit pattern instead (larger than any finite).
__device__ __forceinline__ float abs_max(float m, float v) {
  return isnan(v) ? __int_as_float(0x7fc00000) : (isnan(m) ? m : fmaxf(m, fabsf(v)));
}

// Max of two partial amaxes (non-negative floats or the canonical NaN of abs_max): their bit patterns order as the
// values, NaN above infinity, so the integer max keeps a NaN where fmaxf would drop it.
__device__ __forceinline__ float amax_combine(float a, float b) {
  return __int_as_float(max(__float_as_int(a), __float_as_int(b)));
}

__device__ __forceinline__ float warp_amax(float v) {
  for (int o = 16; o > 0; o /= 2) v = amax_combine(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}

template <class T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[kVec]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = to_float(e[i]);
}

template <class T>
__device__ __forceinline__ void load8(const T* p, float (&v)[kVec]) {
  unpack8<T>(*reinterpret_cast<const uint4*>(p), v);
}

// Packed amax of 16-bit elements (bfloat16 and float16 alike): |x| is the bit pattern without its sign, and
// non-negative values order as those patterns, NaN above infinity; to_float is exact and monotone, so the float of
// the largest pattern is the float amax of the elements. Two lanes of 16 bits in one word, one SIMD max per pair.
__device__ __forceinline__ uint32_t amax_bits8(uint32_t acc, const uint4& raw) {
  acc = __vmaxu2(acc, raw.x & 0x7fff7fffu);
  acc = __vmaxu2(acc, raw.y & 0x7fff7fffu);
  acc = __vmaxu2(acc, raw.z & 0x7fff7fffu);
  return __vmaxu2(acc, raw.w & 0x7fff7fffu);
}

// The float amax of a packed amax_bits8 accumulator; NaN as abs_max writes it.
template <class T>
__device__ __forceinline__ float amax_of_bits(uint32_t acc) {
  uint32_t const hi = acc >> 16, lo = acc & 0xffffu;
  uint16_t const bits = static_cast<uint16_t>(hi > lo ? hi : lo);
  float const f = to_float(*reinterpret_cast<const T*>(&bits));
  return isnan(f) ? __int_as_float(0x7fc00000) : f;
}

// The eight FP8 bytes of eight 16-bit elements times the inverse scale (inverse_of), in element order.
template <class T, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint2 cast8(const uint4& raw, float inv) {
  float v[kVec];
  unpack8<T>(raw, v);
  uint2 q;
  q.x = to_fp8x2<kFormat>(v[0] * inv, v[1] * inv) | to_fp8x2<kFormat>(v[2] * inv, v[3] * inv) << 16;
  q.y = to_fp8x2<kFormat>(v[4] * inv, v[5] * inv) | to_fp8x2<kFormat>(v[6] * inv, v[7] * inv) << 16;
  return q;
}

}  // namespace fp8cast
}  // namespace flux
