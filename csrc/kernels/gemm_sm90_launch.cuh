// Host launcher of the persistent sm90 GEMM (csrc/kernels/gemm_sm90.cuh): TMA descriptors (cached by what they
// encode), the persistent grid's size, the stream-K tail and the launch. C-style entry `Launcher<Cfg>::launch(
// GemmProblem, stream)`; no torch.
#pragma once

#include <algorithm>
#include <mutex>

#include "descriptor_cache.cuh"
#include "flux/check.h"
#include "flux/gemm_params.h"
#include "gemm_sm90.cuh"

namespace flux::sm90 {

// ------------------------------------------------------------------------------------------------ launcher
template <class Cfg>
struct Launcher {
  using Kernel = GemmKernel<Cfg>;
  using Mainloop = typename Cfg::Mainloop;
  using StrideA = typename Mainloop::StrideA;
  using StrideB = typename Mainloop::StrideB;
  using ElementA = typename Cfg::ElementA;
  using ElementB = typename Cfg::ElementB;
  using ElementD = typename Cfg::ElementD;

  static StrideB stride_b(int64_t ldb, int64_t batch) {
    if constexpr (Cfg::kLayout == WeightLayout::kNT) {
      return make_stride(ldb, Int<1>{}, batch);  // (n, k, l)
    } else {
      return make_stride(Int<1>{}, ldb, batch);
    }
  }

  // Launch configuration of `clusters` clusters of kClusterM CTAs along x; `attr` must outlive the config.
  static cudaLaunchConfig_t launch_config(int clusters, cudaStream_t stream, cudaLaunchAttribute* attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(clusters * Cfg::kClusterM, 1, 1);
    cfg.blockDim = dim3(Kernel::kThreads, 1, 1);
    cfg.dynamicSmemBytes = Kernel::kSmemBytes;
    cfg.stream = stream;
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = Cfg::kClusterM;
    attr->val.clusterDim.y = 1;
    attr->val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
  }

  // Largest number of clusters that can be resident at once (cached per device).
  static int max_resident_clusters(int device) {
    static std::mutex mu;
    static int cached[64] = {0};
    std::lock_guard<std::mutex> lock(mu);
    if (cached[device] > 0) return cached[device];
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = launch_config(64, nullptr, &attr);
    int clusters = 0;
    FLUX_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, gemm_kernel<Cfg>, &cfg));
    FLUX_CHECK(clusters > 0, "the GEMM kernel cannot be resident (", Kernel::kSmemBytes,
               " bytes of shared memory, cluster ", Cfg::kClusterM, ")");
    cached[device] = clusters;
    return clusters;
  }

  static void launch(GemmProblem const& prob, cudaStream_t stream) {
    FLUX_CHECK(prob.num_shards >= 1 && prob.num_shards <= kMaxTp, "num_shards ", prob.num_shards, " outside [1, ",
               kMaxTp, "]");
    if (prob.rows_per_shard == 0 || prob.n == 0) return;
    FLUX_CHECK(prob.k > 0, "K must be positive, got ", prob.k);

    int device = 0;
    FLUX_CUDA_CHECK(cudaGetDevice(&device));
    static std::once_flag attr_once;
    std::call_once(attr_once, [] {
      FLUX_CUDA_CHECK(
          cudaFuncSetAttribute(gemm_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes));
    });

    KernelParams<Cfg> params;
    params.prob = prob;
    params.sched = TileSchedule::make(prob, Cfg::kTileM, Cfg::kTileN, Cfg::kClusterM);
    if (prob.rs_own_shard >= 0) {
      auto check_grid = [&](char const* which, int tiles_m, int tiles_n, int chunks_n) {
        FLUX_CHECK(tiles_m > 0 && tiles_n > 0 && chunks_n > 0, "reduce-scatter ", which, " chunk grid not set (",
                   tiles_m, " x ", tiles_n, " tiles, ", chunks_n, " along N)");
        int64_t const chunks = int64_t((params.sched.tiles_m + tiles_m - 1) / tiles_m) * chunks_n;
        FLUX_CHECK(chunks_n * tiles_n >= params.sched.tiles_n, "reduce-scatter ", which, " chunk grid (", chunks_n,
                   " x ", tiles_n, " tiles) does not cover ", params.sched.tiles_n, " tiles along N");
        FLUX_CHECK(chunks <= prob.rs_flags_per_source, "reduce-scatter workspace holds ", prob.rs_flags_per_source,
                   " flags per rank, this call needs ", chunks);
      };
      check_grid("signal", prob.rs_chunk_tiles_m, prob.rs_chunk_tiles_n, prob.rs_chunks_n);
      check_grid("staged", prob.rs_staged_chunk_tiles_m, prob.rs_staged_chunk_tiles_n, prob.rs_staged_chunks_n);
      FLUX_CHECK(prob.rs_reduce_mask >> prob.rs_own_shard & 1u, "reduce-scatter: the own shard is not reduced");
      FLUX_CHECK(prob.rs_staged_mask == 0 || prob.rs_stage_counters != nullptr,
                 "reduce-scatter: staged shards without counters");
      for (int g = 0; g < prob.num_shards; ++g) {
        int const first = prob.rs_first_partial[g], count = prob.rs_partial_count[g];
        bool const reduced = prob.rs_reduce_mask >> g & 1u;
        FLUX_CHECK(!reduced || (count >= 1 && first >= 0 && first + count <= prob.rs_num_partials),
                   "reduce-scatter: shard ", g, " adds partials [", first, ", ", first + count, ") of ",
                   prob.rs_num_partials);
        FLUX_CHECK(g == prob.rs_own_shard || (prob.rs_staged_mask >> g & 1u) || prob.rs_signal[g] != nullptr,
                   "reduce-scatter: shard ", g, " is neither staged nor signalled");
      }
    }

    auto const* b = static_cast<ElementB const*>(prob.b);
    auto const* a_own = static_cast<ElementA const*>(prob.a_own != nullptr ? prob.a_own : prob.a);
    auto const* a_batched = static_cast<ElementA const*>(prob.a != nullptr ? prob.a : prob.a_own);
    int64_t lda_batched = prob.a != nullptr ? prob.lda : prob.lda_own;
    int64_t lda_own = prob.a_own != nullptr ? prob.lda_own : prob.lda;
    int shards = prob.a != nullptr ? prob.num_shards : 1;
    int64_t shard_stride = prob.a != nullptr ? prob.a_shard_stride : int64_t(prob.rows_per_shard) * lda_own;
    // The B batch stride is never used (every tile reads batch 0); a non-zero value keeps the TMA
    // descriptor ordinary.
    int64_t b_batch = int64_t(prob.n) * prob.k;

    // Every descriptor is encoded on the host; each is kept by what it encodes (descriptor_cache.cuh).
    static DescriptorCache<typename Mainloop::Params> mainloops;
    static DescriptorCache<typename Cfg::StoreD, 32> stores;
    static DescriptorCache<typename Cfg::LoadPartial> partial_loads;
    auto mainloop = [&](ElementA const* a, int64_t lda, int64_t a_shard_stride, int a_shards) {
      return mainloops.get(
          {int64_t(a), lda, a_shard_stride, a_shards, prob.rows_per_shard, prob.n, prob.k, int64_t(b), prob.ldb}, [&] {
            typename Mainloop::Arguments args{a, StrideA{lda, Int<1>{}, a_shard_stride}, b,
                                              stride_b(prob.ldb, b_batch)};
            return Mainloop::to_underlying_arguments(make_shape(prob.rows_per_shard, prob.n, prob.k, a_shards), args,
                                                     nullptr);
          });
    };
    params.mainloop = mainloop(a_batched, lda_batched, shard_stride, shards);
    // The own-rows parameters only where they differ (AllGather): a plain GEMM's batched A is its own A, and a
    // ReduceScatter never reads own rows (own_shard = -1); B is the same.
    params.mainloop_own = prob.a != nullptr && prob.a_own != nullptr
                              ? mainloop(a_own, lda_own, int64_t(prob.rows_per_shard) * lda_own, 1)
                              : params.mainloop;

    for (int g = 0; g < prob.num_shards; ++g) {
      FLUX_CHECK(prob.d[g] != nullptr, "shard ", g, " has no destination");
      params.store_d[g] = stores.get({int64_t(prob.d[g]), prob.rows_per_shard, prob.n, prob.ldd}, [&] {
        Tensor mD = make_tensor(make_gmem_ptr(static_cast<ElementD*>(prob.d[g])),
                                make_shape(prob.rows_per_shard, prob.n), make_stride(prob.ldd, Int<1>{}));
        return make_tma_copy(SM90_TMA_STORE{}, mD, typename Cfg::EpiSmemLayout{});
      });
    }
    if (prob.rs_own_shard >= 0) {
      FLUX_CHECK(prob.rs_num_partials >= 1 && prob.rs_num_partials < kMaxTp, "reduce-scatter with ",
                 prob.rs_num_partials, " partials");
      for (int s = 0; s < prob.rs_num_partials; ++s) {  // laid out like the destinations: [Mg, N], ldd
        params.load_partial[s] =
            partial_loads.get({int64_t(prob.rs_partials[s]), prob.rows_per_shard, prob.n, prob.ldd}, [&] {
              Tensor mP = make_tensor(make_gmem_ptr(static_cast<ElementD const*>(prob.rs_partials[s])),
                                      make_shape(prob.rows_per_shard, prob.n), make_stride(prob.ldd, Int<1>{}));
              return make_tma_copy(SM90_TMA_LOAD{}, mP, typename Cfg::EpiSmemLayout{});
            });
      }
    }

    int clusters = max_resident_clusters(device);
    LaunchOptions const& opts = prob.launch;
    if (opts.sm_count > 0) clusters = std::min(clusters, opts.sm_count / Cfg::kClusterM);
    clusters = std::max(1, clusters);
    int const ctas = clusters * Cfg::kClusterM;
    int const k_tiles = (prob.k + Cfg::kTileK - 1) / Cfg::kTileK;
    bool split_ok = Kernel::kSplitCapable && opts.split_workspace != nullptr &&
                    opts.split_workspace_bytes >= split_workspace_bytes(ctas);
    params.split = StreamK::make(params.sched.total_work, clusters, k_tiles, split_ok, opts.split_max_fill_pct);
    // ReduceScatter: split items must all be own rows (the last shard), which no peer waits on; a reducer
    // of a peer's rows could otherwise hold back a flag that the peer's own reducers wait for.
    if (prob.rs_own_shard >= 0 && params.sched.total_work - params.split.dp_work > params.sched.work_per_shard)
      params.split = StreamK::make(params.sched.total_work, clusters, k_tiles, false, 0);
    if (params.split.active()) {
      params.split_flags = static_cast<uint32_t*>(opts.split_workspace);
      params.split_partials =
          reinterpret_cast<float4*>(static_cast<char*>(opts.split_workspace) + split_flags_bytes(ctas));
      FLUX_CUDA_CHECK(cudaMemsetAsync(params.split_flags, 0, size_t(ctas) * 4, stream));
    } else {
      params.split_flags = nullptr;
      params.split_partials = nullptr;
      clusters = std::min(clusters, params.sched.total_work);
    }

    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = launch_config(clusters, stream, &attr);
    FLUX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemm_kernel<Cfg>, params));
  }
};

}  // namespace flux::sm90
