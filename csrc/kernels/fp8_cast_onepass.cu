// Tensor-wise FP8 cast in one pass over the input (rules: csrc/include/flux/fp8_cast.h). A cooperative grid of at
// most one CTA per SM reads the input once, keeps what fits on chip, combines its amax across the grid, then writes
// the FP8 data (and the transposed copy) from what it kept; only the units beyond the grid's capacity are read twice.
//
//   unit    : 512 vectors of 8 elements (8 KB): 512 consecutive vectors of a contiguous input (FlatMap), or a 64 x 64
//             tile (TileMap: strided rows, and every transposed cast); thread t takes vector t of each unit
//   held    : CTA b holds units [b * held, (b + 1) * held): the first kRegUnits in registers, the rest in shared
//             memory (cp.async); units from grid * held on are the spill, read grid-strided in both phases
//   amax    : each CTA writes its max to partial[blockIdx.x] (every slot written by every launch: nothing to zero,
//             nothing kept between launches), a grid barrier (cooperative_groups grid sync), then every warp reduces
//             the grid's maxima itself
//   phase 2 : the spill first (its lines were read last, so L2 may still hold them), then the held units; the
//             transposed copy goes through a double-buffered 64 x 64 FP8 tile in shared memory
#include <cooperative_groups.h>

#include <cstdint>
#include <mutex>

#include "flux/check.h"
#include "fp8_cast_math.cuh"
#include "fp8_cast_onepass.h"

namespace flux {
namespace fp8cast {

namespace {

constexpr int kThreads = 512;
constexpr int kRegUnits = 16;  // units held in registers: 16 x 16 bytes = 64 of a thread's 128 registers
constexpr int kTile = 64;
constexpr int kTileVecs = kTile / kVec;  // vectors per tile row
constexpr int kStagePitch = kTile + 8;   // bytes per staged row: rows stay 8-byte aligned
constexpr int kStageBytes = kTile * kStagePitch;
constexpr int kUnitBytes = kThreads * 16;
constexpr int kSpillBatch = 8;  // spill units in flight per thread in phase 1
constexpr int kEmitBatch = 2;   // and in phase 2, beside the held registers
constexpr int kMaxDevices = 64;
static_assert(kThreads * kVec == kTile * kTile, "a tile is one vector per thread");

struct Args {
  const void* x;
  int64_t rows, cols, ld;
  int units, tiles_x, held;
  float margin_factor;
  uint8_t* data;
  uint8_t* data_t;
  float* scale;
  float* partial;
};

// Where this thread's vector of a unit lies: element offsets in x and in data, and (TileMap) the tile's origin.
struct Pos {
  int64_t in, out, r0, c0;
  bool valid;
};

struct FlatMap {
  __device__ static Pos at(const Args& a, int u) {
    int64_t const v = int64_t(u) * kThreads + threadIdx.x;
    Pos p;
    p.in = p.out = v * kVec;
    p.r0 = p.c0 = 0;
    p.valid = p.in < a.rows * a.cols;
    return p;
  }
};

struct TileMap {
  __device__ static Pos at(const Args& a, int u) {
    int const ty = u / a.tiles_x, tx = u - ty * a.tiles_x;
    Pos p;
    p.r0 = int64_t(ty) * kTile;
    p.c0 = int64_t(tx) * kTile;
    int64_t const r = p.r0 + threadIdx.x / kTileVecs, c = p.c0 + (threadIdx.x % kTileVecs) * kVec;
    p.valid = r < a.rows && c < a.cols;  // cols is a multiple of 8: a vector lies inside or outside whole
    p.in = r * a.ld + c;
    p.out = r * a.cols + c;
    return p;
  }
};

// Vectors outside the matrix read as zeros: they leave the amax as it is and are never written.
template <class T>
__device__ __forceinline__ uint4 load_vec(const Args& a, const Pos& p) {
  if (!p.valid) return make_uint4(0, 0, 0, 0);
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + p.in));
}

__device__ __forceinline__ void copy_async(uint4* dst, const void* src, bool valid) {
  unsigned const d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// One unit's FP8 bytes: this thread's 8 of the row-major data and, with kTranspose, its share of the transposed
// tile. CTA-uniform calls only (the transposed copy synchronises the CTA).
template <class T, __nv_fp8_interpretation_t kFormat, bool kTranspose>
__device__ __forceinline__ void emit(const Args& a, const Pos& p, const uint4& raw, float inv, uint8_t* stage,
                                     int& buf) {
  uint2 const q = cast8<T, kFormat>(raw, inv);
  if (p.valid) *reinterpret_cast<uint2*>(a.data + p.out) = q;
  if constexpr (kTranspose) {
    // Two staged tiles: a thread writes tile i + 2 only after the barrier of tile i + 1, which every thread reaches
    // after reading tile i, so one barrier per tile suffices.
    uint8_t* const tile = stage + buf * kStageBytes;
    buf ^= 1;
    *reinterpret_cast<uint2*>(tile + (threadIdx.x / kTileVecs) * kStagePitch + (threadIdx.x % kTileVecs) * kVec) = q;
    __syncthreads();
    // Output row c0 + oc is input column oc; this thread writes its input rows r0 + part * 8 .. + 8. A warp reads
    // 32 consecutive bytes of each staged row: no bank conflicts.
    int const oc = threadIdx.x % kTile, part = threadIdx.x / kTile;
    int64_t const orow = p.c0 + oc, ocol = p.r0 + part * kVec;
    if (orow < a.cols && ocol < a.rows) {
      uint8_t b[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) b[j] = tile[(part * kVec + j) * kStagePitch + oc];
      uint8_t* const dst = a.data_t + orow * a.rows + ocol;
      if (a.rows % kVec == 0) {  // ocol is a multiple of 8 below rows: the 8 bytes are in range and aligned
        uint2 w;
        w.x = b[0] | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
        w.y = b[4] | uint32_t(b[5]) << 8 | uint32_t(b[6]) << 16 | uint32_t(b[7]) << 24;
        *reinterpret_cast<uint2*>(dst) = w;
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (ocol + j < a.rows) dst[j] = b[j];
      }
    }
  }
}

template <class T, __nv_fp8_interpretation_t kFormat, class Map, bool kTranspose>
__global__ void __launch_bounds__(kThreads, 1) onepass_kernel(Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* const stage = smem;  // kTranspose: two staged FP8 tiles
  uint4* const held_smem = reinterpret_cast<uint4*>(smem + (kTranspose ? 2 * kStageBytes : 0));
  __shared__ float warp_max[kThreads / 32];
  int const lane = threadIdx.x % 32;

  // Phase 1: load the held units, read the spill, the CTA's max.
  int const first = int(blockIdx.x) * a.held;
  int const mine = max(0, min(a.held, a.units - first));  // CTA-uniform
  for (int k = kRegUnits; k < mine; ++k) {  // shared memory first: those copies run while the registers load
    Pos const p = Map::at(a, first + k);
    copy_async(held_smem + (k - kRegUnits) * kThreads + threadIdx.x, static_cast<const T*>(a.x) + (p.valid ? p.in : 0),
               p.valid);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  uint4 reg[kRegUnits];
#pragma unroll
  for (int k = 0; k < kRegUnits; ++k)
    reg[k] = k < mine ? load_vec<T>(a, Map::at(a, first + k)) : make_uint4(0, 0, 0, 0);

  uint32_t m = 0;  // packed amax (amax_bits8)
  int const spill = int(gridDim.x) * a.held;
  for (int u = spill + int(blockIdx.x); u < a.units; u += kSpillBatch * int(gridDim.x)) {
    uint4 v[kSpillBatch];
#pragma unroll
    for (int j = 0; j < kSpillBatch; ++j) {
      int const uj = u + j * int(gridDim.x);
      v[j] = uj < a.units ? load_vec<T>(a, Map::at(a, uj)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kSpillBatch; ++j) m = amax_bits8(m, v[j]);
  }
#pragma unroll
  for (int k = 0; k < kRegUnits; ++k) m = amax_bits8(m, reg[k]);
  // Each thread reads back only the shared-memory vectors it copied itself: waiting for its own copies suffices.
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  for (int k = kRegUnits; k < mine; ++k) m = amax_bits8(m, held_smem[(k - kRegUnits) * kThreads + threadIdx.x]);
  float cta_max = warp_amax(amax_of_bits<T>(m));
  if (lane == 0) warp_max[threadIdx.x / 32] = cta_max;
  __syncthreads();
  if (threadIdx.x < 32) {
    cta_max = warp_amax(lane < kThreads / 32 ? warp_max[lane] : 0.f);
    if (lane == 0) a.partial[blockIdx.x] = cta_max;
  }

  // The grid's amax: every CTA's partial is written before any CTA passes the barrier.
  cooperative_groups::this_grid().sync();
  float amax = 0.f;
  for (int i = lane; i < int(gridDim.x); i += 32) amax = amax_combine(amax, __ldcg(a.partial + i));
  float const s = scale_of<kFormat>(warp_amax(amax), a.margin_factor);
  if (blockIdx.x == 0 && threadIdx.x == 0) a.scale[0] = s;
  float const inv = inverse_of(s);

  // Phase 2: the spill (read again), then the held units.
  int buf = 0;
  for (int u = spill + int(blockIdx.x); u < a.units; u += kEmitBatch * int(gridDim.x)) {
    Pos p[kEmitBatch];
    uint4 v[kEmitBatch];
#pragma unroll
    for (int j = 0; j < kEmitBatch; ++j) {
      int const uj = u + j * int(gridDim.x);
      p[j] = Map::at(a, uj < a.units ? uj : u);
      v[j] = uj < a.units ? load_vec<T>(a, p[j]) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kEmitBatch; ++j)
      if (u + j * int(gridDim.x) < a.units) emit<T, kFormat, kTranspose>(a, p[j], v[j], inv, stage, buf);
  }
#pragma unroll
  for (int k = 0; k < kRegUnits; ++k)
    if (k < mine) emit<T, kFormat, kTranspose>(a, Map::at(a, first + k), reg[k], inv, stage, buf);
  for (int k = kRegUnits; k < mine; ++k)
    emit<T, kFormat, kTranspose>(a, Map::at(a, first + k), held_smem[(k - kRegUnits) * kThreads + threadIdx.x], inv,
                                 stage, buf);
}

using Kernel = void (*)(Args);

template <class T, __nv_fp8_interpretation_t kFormat>
Kernel pick_layout(bool tiled, bool transposed) {
  if (transposed) return onepass_kernel<T, kFormat, TileMap, true>;
  if (tiled) return onepass_kernel<T, kFormat, TileMap, false>;
  return onepass_kernel<T, kFormat, FlatMap, false>;
}

// Variants: input type x format x layout (flat, tiled, tiled with the transposed copy).
constexpr int kVariants = 12;

int variant_of(DType in, DType out, bool tiled, bool transposed) {
  int const layout = transposed ? 2 : (tiled ? 1 : 0);
  return ((in == DType::kBF16 ? 0 : 1) * 2 + (out == DType::kE4M3 ? 0 : 1)) * 3 + layout;
}

Kernel kernel_of(DType in, DType out, bool tiled, bool transposed) {
  bool const e4m3 = out == DType::kE4M3;
  if (in == DType::kBF16)
    return e4m3 ? pick_layout<__nv_bfloat16, __NV_E4M3>(tiled, transposed)
                : pick_layout<__nv_bfloat16, __NV_E5M2>(tiled, transposed);
  return e4m3 ? pick_layout<__half, __NV_E4M3>(tiled, transposed) : pick_layout<__half, __NV_E5M2>(tiled, transposed);
}

// What one kernel variant can do on one device, asked once: its co-resident grid and the units a CTA can hold in
// shared memory. The dynamic shared memory limit is raised to the most any launch asks for, before any launch (the
// attribute is the function's, so later launches, captured ones too, need no further host calls).
struct Capacity {
  int max_grid = 0;
  int smem_units = 0;
};

Capacity capacity(int device, DType in, DType out, bool tiled, bool transposed) {
  static std::once_flag once[kMaxDevices][kVariants];
  static Capacity cap[kMaxDevices][kVariants];
  FLUX_CHECK(device >= 0 && device < kMaxDevices, "device ", device, " is past the cast kernels' table");
  int const v = variant_of(in, out, tiled, transposed);
  std::call_once(once[device][v], [&] {
    int coop = 0, sms = 0, optin = 0;
    FLUX_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
    FLUX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    FLUX_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    Kernel const k = kernel_of(in, out, tiled, transposed);
    cudaFuncAttributes attr{};
    FLUX_CUDA_CHECK(cudaFuncGetAttributes(&attr, k));
    int const stage = transposed ? 2 * kStageBytes : 0;
    int const room = optin - int(attr.sharedSizeBytes) - stage;
    Capacity c;
    c.smem_units = room > 0 ? room / kUnitBytes : 0;
    int const dynamic = stage + c.smem_units * kUnitBytes;
    FLUX_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic));
    int per_sm = 0;
    FLUX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, dynamic));
    c.max_grid = coop ? per_sm * sms : 0;
    cap[device][v] = c;
  });
  return cap[device][v];
}

bool tiled_layout(const CastInput& in) { return in.rows > 1 && in.ld != in.cols; }

}  // namespace

OnePassShape onepass_shape(const CastInput& in, DType out, bool transposed) {
  int device = 0;
  FLUX_CUDA_CHECK(cudaGetDevice(&device));
  bool const tiled = transposed || tiled_layout(in);
  Capacity const c = capacity(device, in.dtype, out, tiled, transposed);
  OnePassShape s;
  if (c.max_grid <= 0) return s;
  int64_t const units = tiled ? ((in.rows + kTile - 1) / kTile) * ((in.cols + kTile - 1) / kTile)
                              : (in.rows * in.cols / kVec + kThreads - 1) / kThreads;
  if (units >= (int64_t(1) << 30)) return s;  // unit indices are ints
  s.grid = int(units < c.max_grid ? (units > 0 ? units : 1) : c.max_grid);
  int64_t const per_cta = (units + s.grid - 1) / s.grid;
  s.held = int(per_cta < kRegUnits + c.smem_units ? per_cta : kRegUnits + c.smem_units);
  s.smem = size_t(transposed ? 2 * kStageBytes : 0) + size_t(s.held > kRegUnits ? s.held - kRegUnits : 0) * kUnitBytes;
  return s;
}

bool launch_onepass(const OnePassShape& shape, const CastInput& in, float margin_factor, DType out, void* data,
                    void* data_t, float* scale, float* partial, cudaStream_t stream) {
  bool const transposed = data_t != nullptr;
  bool const tiled = transposed || tiled_layout(in);
  Args a;
  a.x = in.x;
  a.rows = in.rows;
  a.cols = in.cols;
  a.ld = in.ld;
  a.tiles_x = int((in.cols + kTile - 1) / kTile);
  a.units = tiled ? int((in.rows + kTile - 1) / kTile) * a.tiles_x
                  : int((in.rows * in.cols / kVec + kThreads - 1) / kThreads);
  a.held = shape.held;
  a.margin_factor = margin_factor;
  a.data = static_cast<uint8_t*>(data);
  a.data_t = static_cast<uint8_t*>(data_t);
  a.scale = scale;
  a.partial = partial;
  void* params[] = {&a};
  cudaError_t const err =
      cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel_of(in.dtype, out, tiled, transposed)),
                                  dim3(unsigned(shape.grid)), dim3(kThreads), params, shape.smem, stream);
  if (err == cudaErrorCooperativeLaunchTooLarge) {  // fewer SMs than the device has (MPS, green contexts)
    cudaGetLastError();                             // not sticky: clear it, the caller runs the two passes
    return false;
  }
  FLUX_CUDA_CHECK(err);
  return true;
}

}  // namespace fp8cast
}  // namespace flux
