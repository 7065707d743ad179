// Persistent warp-specialized sm90 GEMM that the fused operators are built on.
//
//   config   : GemmConfig<ElementA, ElementB, ElementD, WeightLayout, TileM, TileN, ClusterM, Accumulation>
//              (one TU per operand types and layout)
//   params   : KernelParams = two TMA mainloop descriptors (shard-batched A, own A; B) + GemmProblem + schedule
//   roles    : warp group 0 = producer (one elected thread issues TMA loads; in AllGather mode it first waits
//              on the readiness flag of the chunk the A tile reads), warp groups 1-2 = consumers (wgmma via
//              CUTLASS's sm90 TMA/GMMA collective mainloop, then this file's epilogue)
//   epilogue : accumulators -> bf16/fp16 sub-tile in shared memory (stmatrix, one per 16 x 16 block of a warp's
//              fragment; TMA's 128-byte swizzle, conflict-free; 128 x 256 tiles have a buffer per sub-tile) ->
//              one TMA store per sub-tile, draining under the next tile's mainloop. A ReduceScatter tile for a
//              peer goes to the peer's receive slot (NVLink P2P) and is followed by a release flag in the peer's
//              memory (epilogue transport), or goes to a local staging area and is counted into its chunk, which
//              the host-side copy engine moves and flags (copy-engine transport); flag and count wait for the
//              stores to complete and are deferred by a tile. A tile of own rows waits for the peers' flags of
//              its chunk and TMA-loads the first peer's partial into the sub-tile buffers (128 x 256 tiles:
//              before its mainloop, so the loads run under it; else in the epilogue), adds each peer's partial
//              to the fp32 accumulators in rank order (ldmatrix, the inverse of the staging stmatrix), then
//              stages and stores like any tile.
//   tail     : stream-K (tile_schedule.cuh StreamK; 128 x 256 tiles): the items of a last, partial wave are
//              split along K over every cluster; a segment without k = 0 stores its fp32 accumulators to the
//              split workspace and flags them, the segment with k = 0 adds them in cluster order (same bits
//              every run) and runs the epilogue. Producer and consumers walk the same segment list.
//   launcher : gemm_sm90_launch.cuh, Launcher<Config>::launch(GemmProblem, stream), C-style, no torch.
//
// Invariants
//   * all CTAs of the persistent grid are co-resident (grid = max active clusters), so a CTA waiting on a
//     peer's tile never blocks the CTA that would produce it;
//   * a tile never spans two shards (TMA clips rows at the shard edge), so M/tp need not divide the tile;
//   * N and K are multiples of 8 (16-byte rows for TMA and the vector epilogue), checked by the binding.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flux/check.h"
#include "flux/gemm_params.h"
#include "subtile_window.cuh"
#include "sync_primitives.cuh"
#include "tile_schedule.cuh"

namespace flux::sm90 {

using namespace cute;

// ------------------------------------------------------------------------------------------------ config
template <class ElementA_, class ElementB_, class ElementD_, WeightLayout kLayout_, int kTileM_, int kTileN_,
          int kClusterM_, Accumulation kAccumulation_ = Accumulation::kSplit>
struct GemmConfig {
  using ElementA = ElementA_;  // x: bf16, fp16, e4m3 or e5m2
  using ElementB = ElementB_;  // W: the same as x, or the other FP8 format
  using ElementD = ElementD_;  // out and the reduce-scatter's partials: bf16 or fp16; fp32 accumulation
  static constexpr bool kFp8 = sizeof(ElementA) == 1;
  static_assert(sizeof(ElementA) == sizeof(ElementB), "both operands 16-bit, or both FP8");
  static_assert(sizeof(ElementD) == 2, "the epilogue stages 16-bit outputs");
  static constexpr WeightLayout kLayout = kLayout_;
  static_assert(!kFp8 || kLayout == WeightLayout::kNT, "FP8 wgmma reads both operands K-major (the 'nt' layout)");
  static constexpr Accumulation kAccumulation = kAccumulation_;
  static constexpr int kTileM = kTileM_;
  static constexpr int kTileN = kTileN_;
  static constexpr int kTileK = 128 / int(sizeof(ElementA));  // 128-byte rows: the SW128 smem atom
  static constexpr int kClusterM = kClusterM_;                // CTAs along M sharing (multicasting) the B tile
  static constexpr int kEpiCols = 64;                         // epilogue sub-tile width (one 128-byte smem row)
  // 128 x 256 tiles: one sub-tile buffer per sub-tile (64 KB, the whole tile), so the epilogue's TMA stores
  // drain under the next tile's mainloop and no consumer waits for them; this costs a mainloop stage (3 instead
  // of 4), and measured 1.7-6.2% faster GEMMs than two buffers with SIMT stores (docs/experiments.md, epilogue).
  // 256 x 128 tiles (a 32 KB sub-tile) keep one buffer and four stages.
  static constexpr int kEpiBuffers = kTileM == 128 ? kTileN / kEpiCols : 1;

  using LayoutA = cutlass::layout::RowMajor;  // x [M, K]
  using LayoutB = cute::conditional_t<kLayout == WeightLayout::kNT,
                                      cutlass::layout::ColumnMajor,  // W [N, K]: B(k, n) at n*ldb + k
                                      cutlass::layout::RowMajor>;    // W [K, N]: B(k, n) at k*ldb + n
  using TileShape = Shape<Int<kTileM>, Int<kTileN>, Int<kTileK>>;
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;

  static constexpr int kEpiSmemBytes = kEpiBuffers * kTileM * kEpiCols * int(sizeof(ElementD));
  static constexpr int kCarveoutBytes = kEpiSmemBytes + 1024;  // epilogue sub-tiles + alignment slack
  // A sub-tile in shared memory as TMA's 128-byte swizzle lays it out (epi_offset computes the same on a
  // 1024-byte aligned buffer).
  using EpiSmemLayout =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<ElementD>{}, Shape<Int<kTileM>, Int<kEpiCols>>{}));
  using StoreD = decltype(make_tma_copy(
      SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<ElementD*>(nullptr)), make_shape(int(0), int(0)), Stride<int64_t, _1>{}),
      EpiSmemLayout{}));
  // A peer's partial of a ReduceScatter's own rows, loaded a sub-tile at a time into an epilogue buffer.
  using LoadPartial = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                             make_tensor(make_gmem_ptr(static_cast<ElementD const*>(nullptr)),
                                                         make_shape(int(0), int(0)), Stride<int64_t, _1>{}),
                                             EpiSmemLayout{}));

  // FP8: CUTLASS's FP8 mainloop promotes the tensor cores' partial sums into the fp32 accumulators once per k tile
  // (split accumulation; it holds a second accumulator fragment, which only 128 x 128 tiles leave registers for),
  // or, with fast accumulation, lets the tensor cores accumulate the whole K.
  using Schedule = cute::conditional_t<kFp8 && kAccumulation == Accumulation::kFast,
                                       cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                                       cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  static constexpr int kAlignment = 16 / int(sizeof(ElementA));  // 16-byte aligned rows for TMA
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignment, ElementB, LayoutB, kAlignment,
      float,  // accumulator
      TileShape, ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<kCarveoutBytes>,
      Schedule>::CollectiveOp;
};

// ------------------------------------------------------------------------------------------------ params
template <class Cfg>
struct KernelParams {
  typename Cfg::Mainloop::Params mainloop;      // A: shard-batched [Mg, K, shards]
  typename Cfg::Mainloop::Params mainloop_own;  // A: own rows [Mg, K, 1]; B: W (used for every tile)
  GemmProblem prob;
  TileSchedule sched;
  typename Cfg::StoreD store_d[kMaxTp];            // TMA store of shard g's destination
  typename Cfg::LoadPartial load_partial[kMaxTp];  // ReduceScatter: TMA load of prob.rs_partials[s]
  StreamK split;
  uint32_t* split_flags;   // [CTAs] (valid when split.active())
  float4* split_partials;  // [CTAs][kTileM * kTileN / 4]
};

// ------------------------------------------------------------------------------------------------ kernel
template <class Cfg>
struct GemmKernel {
  using ElementD = typename Cfg::ElementD;
  using Mainloop = typename Cfg::Mainloop;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  using TiledMma = typename Mainloop::TiledMma;
  using MainloopPipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using Params = KernelParams<Cfg>;

  static constexpr int kTileM = Cfg::kTileM;
  static constexpr int kTileN = Cfg::kTileN;
  static constexpr int kTileK = Cfg::kTileK;
  static constexpr int kClusterM = Cfg::kClusterM;
  static constexpr int kEpiCols = Cfg::kEpiCols;
  static constexpr int kMmaThreads = 256;
  static constexpr int kThreads = 128 + kMmaThreads;
  static constexpr int kEpiBarrierId = 1;  // named barrier of the 256 consumer threads (0 is __syncthreads)
  static_assert(size(TiledMma{}) == kMmaThreads, "cooperative mainloop: two consumer warp groups");
  static_assert(kTileN % kEpiCols == 0, "epilogue sub-tiles must divide the tile");
  static_assert(kTileM * kTileN <= kSplitTileFloats, "split workspace sized for 32768 accumulators per CTA");
  // Only 128 x 256 tiles leave the consumers registers to spare: with 256 x 128 tiles the stream-K partial
  // adds made ptxas spill, and the whole kernel ran ~8% slower. The tail is built for 128 x 256 tiles only.
  static constexpr bool kRegisterSlack = kTileM == 128;
  // Registers per thread after setmaxnreg (the CTA's pool is 168 x 384). 128 x 256 tiles: the producer warp group
  // gets 56, the consumers 224, which they fit without spilling. Against 40 / 232 it measured within one run's
  // resolution (docs/experiments.md, register split).
  static constexpr uint32_t kLoadRegs = kRegisterSlack ? 56 : 40;
  static constexpr uint32_t kMmaRegs = kRegisterSlack ? 224 : 232;
  static_assert(kLoadRegs * 128 + kMmaRegs * kMmaThreads <= 168 * kThreads, "register pool exceeded");
  static constexpr bool kSplitCapable = kRegisterSlack;
  static constexpr int kEpiBuffers = Cfg::kEpiBuffers;
  static constexpr int kEpiTileElems = kTileM * kEpiCols;
  static_assert(kEpiBuffers == 1 || kEpiBuffers == kTileN / kEpiCols, "one buffer, or one per sub-tile");
  static_assert(Mainloop::DispatchPolicy::Stages >= 3, "the epilogue buffers may cost one mainloop stage, not two");

  struct SharedStorage {
    typename Mainloop::TensorStorage mainloop;                // aligned to 128 bytes by its type
    alignas(1024) ElementD epi[kEpiBuffers * kEpiTileElems];  // epilogue sub-tile buffers (TMA swizzle period)
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    // ReduceScatter own rows: buffer b holds a peer's partial sub-tile once partial_full[b] completes a phase
    // (one arrival with the TMA load's byte count).
    alignas(8) uint64_t partial_full[kEpiBuffers];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one sm90 CTA exceeded");

  // Row r, column c (< kEpiCols) of the epilogue sub-tile. 16-byte chunks are XOR-swizzled by row so that
  // both the stmatrix writes (eight consecutive rows, one 16-byte chunk each) and the 16-byte row reads are
  // conflict-free.
  CUTLASS_DEVICE static int epi_offset(int r, int c) { return r * kEpiCols + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7); }

  CUTLASS_DEVICE static void epi_barrier() {
    asm volatile("bar.sync %0, %1;" ::"r"(kEpiBarrierId), "r"(kMmaThreads) : "memory");
  }

  CUTLASS_DEVICE static uint32_t pack2(float lo, float hi) {
    ElementD e[2] = {ElementD(lo), ElementD(hi)};
    uint32_t packed;
    memcpy(&packed, e, sizeof(packed));
    return packed;
  }

  // One warp stores a 16 x 16 block as four 8 x 8 matrices (rows 0-7 | 8-15 x columns 0-7 | 8-15); lane l gives
  // the address of row l % 8 of matrix l / 8 and holds, in register q, its two columns of matrix q.
  CUTLASS_DEVICE static void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
  }

  // The inverse of stmatrix_x4 with the same lane addresses: register q receives the lane's two columns of
  // matrix q, i.e. the values stmatrix_x4 would have taken from it.
  CUTLASS_DEVICE static void ldmatrix_x4(uint32_t smem_addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr)
                 : "memory");
  }

  CUTLASS_DEVICE static float2 unpack2(uint32_t packed) {
    ElementD e[2];
    memcpy(e, &packed, sizeof(packed));
    return make_float2(float(e[0]), float(e[1]));
  }

  // ---------------------------------------------------------------- producer: TMA loads of one tile
  CUTLASS_DEVICE static void load_tile(Params const& params, TileCoord t, int k_begin, int k_end,
                                       MainloopPipeline& pipeline, PipelineState& write_state, SharedStorage& ss,
                                       uint32_t block_rank_in_cluster) {
    GemmProblem const& p = params.prob;
    bool own = t.shard == p.own_shard;
    auto const& tma_a = own ? params.mainloop_own.tma_load_a : params.mainloop.tma_load_a;
    auto const& tma_b = params.mainloop_own.tma_load_b;
    int l_a = own ? 0 : t.shard;
    int a_shards = own ? 1 : p.num_shards;

    Tensor mA = tma_a.get_tma_tensor(make_shape(p.rows_per_shard, p.k, a_shards));        // (m, k, l)
    Tensor mB = tma_b.get_tma_tensor(make_shape(p.n, p.k, 1));                            // (n, k, l)
    Tensor gA_mkl = local_tile(mA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BM,BK,m,k,l)
    Tensor gB_nkl = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BN,BK,n,k,l)
    Tensor gA = gA_mkl(_, _, t.m, _, l_a);                                                // (BM,BK,k)
    Tensor gB = gB_nkl(_, _, t.n, _, 0);                                                  // (BN,BK,k)

    Tensor sA = make_tensor(make_smem_ptr(ss.mainloop.smem_A.data()), typename Mainloop::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(ss.mainloop.smem_B.data()), typename Mainloop::SmemLayoutB{});

    constexpr uint32_t cluster_x = kClusterM;
    uint32_t cluster_block_x = block_rank_in_cluster % cluster_x;  // position along M
    uint32_t cluster_block_y = block_rank_in_cluster / cluster_x;  // position along N (always 0 here)
    auto block_tma_a = tma_a.get_slice(cluster_block_y);
    auto block_tma_b = tma_b.get_slice(cluster_block_x);
    Tensor tAgA = block_tma_a.partition_S(gA);
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);

    // B is multicast to the CTAs of the cluster that share this N tile (the cluster spans M only).
    uint16_t mcast_mask_a = 0;
    uint16_t mcast_mask_b = 0;
    using GmemCopyA = typename Mainloop::GmemTiledCopyA;
    using GmemCopyB = typename Mainloop::GmemTiledCopyB;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (cute::is_same_v<GmemCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n)
        mcast_mask_a |= uint16_t(1) << block_layout(cluster_block_x, n, Int<0>{});
    }
    if constexpr (cute::is_same_v<GmemCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m)
        mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_block_y, Int<0>{});
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (int k = k_begin; k < k_end; ++k) {
      pipeline.producer_acquire(write_state);
      auto* tma_barrier = pipeline.producer_get_barrier(write_state);
      int stage = write_state.index();
      // B first: this CTA's half of the multicast B tile completes the peer's stage as well as its own, and
      // queued behind the A tile it held the peer back (FP8 split kernel: 0-3% faster,
      // docs/experiments.md, "The feed").
      copy(tma_b.with(*tma_barrier, mcast_mask_b), tBgB(_, _, _, k), tBsB(_, _, _, stage));
      copy(tma_a.with(*tma_barrier, mcast_mask_a), tAgA(_, _, _, k), tAsA(_, _, _, stage));
      ++write_state;
    }
  }

  // ---------------------------------------------------------------- consumer: FP8 split accumulation
  // The tensor cores accumulate one k tile (128 deep, as cuBLASLt does) into one of two temporary fragments, which is
  // added to the fp32 accumulators once its wgmmas have completed, while the next k tile's wgmmas run into the other
  // fragment. (CUTLASS's FP8 mainloop, which waits for every wgmma before each promotion, had ptxas serialize every
  // wgmma of this kernel, C7514, and ran 0.8x cuBLASLt.) Releases every stage it reads; advances read_state.
  // A warp group drains its tensor pipe once per kSplitFragmentsPerDrain fragments: each fragment is issued again as
  // soon as it was promoted, in straight-line code, and only a run's last promotion waits for every wgmma. A warp
  // group holds the stages of two fragments at most, and the two groups, one fragment apart, three of the six: the
  // producer can keep three loads ahead. (Two k tiles per fragment with the same long runs, which hold all six, ran
  // 3-12% slower, likely for that; 16 fragments per drain: faster at K = 8192, slower at K = 2048.) What is left
  // after the long runs goes in runs of 4, 2 and 1 fragments: against runs of 2 and a last one of 1, the second
  // group drains 5 times instead of 6 at K = 2048, and this measured 0.2-4.5% faster on 8 of 10 rows, the other
  // two within their rounds' spread (docs/experiments.md, runs of 4, 2 and 1).
  static constexpr int kSplitFragmentsPerDrain = 8;
  static constexpr int kSplitSecondGroupLead = 1;

  // One warp group's split accumulation of one tile: the fp32 accumulators, the two fragments and the stages read
  // and to release. Member functions, not lambdas, so that all of it is inlined into the kernel: a run compiled as a
  // function of its own had ptxas serialize its wgmmas (C7520).
  template <class Accum, class FragA, class FragB>
  struct SplitAccumulation {
    using Fragment = decltype(make_fragment_like(std::declval<Accum&>()));
    MainloopPipeline& pipeline;
    PipelineState& read_state;
    PipelineState release;
    TiledMma& tiled_mma;
    FragA& tCrA;  // (MMA, MMA_M, MMA_K, PIPE)
    FragB& tCrB;  // (MMA, MMA_N, MMA_K, PIPE)
    Accum& accum;
    Fragment even = make_fragment_like(accum);
    Fragment odd = make_fragment_like(accum);

    // The next k tile into `into` (one commit group).
    CUTLASS_DEVICE void issue(Fragment& into) {
      warpgroup_fence_operand(into);
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      pipeline.consumer_wait(read_state, pipeline.consumer_try_wait(read_state));
      int const stage = read_state.index();
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), into);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      ++read_state;
    }
    // Once the wgmmas of `done` completed: add them to accum and release their stage.
    CUTLASS_DEVICE void promote(Fragment& done) {
      warpgroup_fence_operand(done);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += done(i);
      pipeline.consumer_release(release);
      ++release;
    }
    // Fragment j of a run: even for even j.
    template <int J>
    CUTLASS_DEVICE Fragment& fragment() {
      if constexpr (J % 2 == 0)
        return even;
      else
        return odd;
    }
    // Fragments J..N-1 of a run after the first two: each reuses fragment J - 2's registers once it was promoted.
    template <int J, int N>
    CUTLASS_DEVICE void reissue() {
      if constexpr (J < N) {
        warpgroup_wait<1>();
        promote(fragment<J>());
        issue(fragment<J>());
        reissue<J + 1, N>();
      }
    }
    // A run of N fragments (N k tiles), each issued again as soon as it was promoted; only the run's last promotion
    // waits for every wgmma. Every wgmma issued in a run is retired inside it: nothing is in flight across a loop's
    // back edge or a branch, where ptxas would copy in-flight accumulator registers and serialize every wgmma of
    // the kernel.
    template <int N>
    CUTLASS_DEVICE void run() {
      issue(even);
      if constexpr (N > 1) {
        issue(odd);
        reissue<2, N>();
        warpgroup_wait<1>();
        promote(fragment<N - 2>());
      }
      warpgroup_wait<0>();
      promote(fragment<N - 1>());
    }
  };

  template <class Accum>
  CUTLASS_DEVICE static void mma_fp8_split(MainloopPipeline& pipeline, PipelineState& read_state, Accum& accum,
                                           int k_count, int mma_thread_idx, SharedStorage& ss) {
    Tensor sA = make_tensor(make_smem_ptr(ss.mainloop.smem_A.data()), typename Mainloop::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(ss.mainloop.smem_B.data()), typename Mainloop::SmemLayoutB{});
    TiledMma tiled_mma;
    int const warp_group = __shfl_sync(0xffffffff, mma_thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto thread_mma = tiled_mma.get_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    clear(accum);
    using Split = SplitAccumulation<Accum, decltype(tCrA), decltype(tCrB)>;
    Split split{pipeline, read_state, read_state, tiled_mma, tCrA, tCrB, accum};
    // Long runs, then runs of half, two and one fragment for what is left (each length a body of its own; a body
    // per remainder, 7 of them, made ptxas spill KBs and serialize the wgmmas). The second warp group starts with a
    // run of kSplitSecondGroupLead k tiles, so the two groups drain their tensor pipes at different times and each
    // one's drain runs under the other's wgmmas. (A lead of 4, which puts the drains 4 k tiles apart, measured no
    // faster than the loop before and spilled 12 bytes.)
    constexpr int R = kSplitFragmentsPerDrain;
    int kt = 0;
    if (warp_group == 1 && k_count > kSplitSecondGroupLead) {
      split.template run<kSplitSecondGroupLead>();
      kt = kSplitSecondGroupLead;
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (; kt + R <= k_count; kt += R) split.template run<R>();
    if (kt + R / 2 <= k_count) {
      split.template run<R / 2>();
      kt += R / 2;
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (; kt + 2 <= k_count; kt += 2) split.template run<2>();
    if (kt < k_count) split.template run<1>();
    warpgroup_fence_operand(accum);
  }

  // AllGather: the A tile of a peer's rows may only be loaded once every chunk it covers has landed. The first
  // time this CTA sees a shard's chunks, it compares the source's call signature with ours (signature_checked:
  // bit g once done).
  CUTLASS_DEVICE static void wait_chunks(GemmProblem const& p, TileCoord t, uint32_t& signature_checked) {
    int row_begin = t.m * kTileM;
    int row_end = min(row_begin + kTileM, p.rows_per_shard);
    if (row_begin >= row_end) return;  // a padding tile of the cluster: TMA reads zeros, nothing is stored
    int c_begin = row_begin / p.rows_per_chunk;
    int c_end = (row_end - 1) / p.rows_per_chunk;
    bool arrived = true;
    for (int c = c_begin; c <= c_end; ++c) {
      int index = t.shard * p.chunks_per_shard + c;
      arrived &= wait_flag(p.chunk_flags + index, p.epoch, p, kChunkTimeout, index);
    }
    if (arrived && !(signature_checked >> t.shard & 1u)) {
      check_signature(p, t.shard);
      signature_checked |= 1u << t.shard;
    }
    // The chunk was written by the copy engine; the TMA loads that follow read through the async proxy.
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }

  // ---------------------------------------------------------------- failed calls
  // A call whose workspace recorded a failure (a wait of this call or of an earlier one timed out, or a peer's
  // signature differed) produces NaN, not numbers that look right: its waits give up (bounded_wait), so the data
  // its tiles read may be missing or another call's. This matters for a CUDA-graph twin, whose replays run no host
  // check: every replay after its failure yields NaN until the host reports it (eager calls are refused by the host).
  // The schedule, the stores, the flags and the counts go on as usual, so no peer or copy stream waits for a tile
  // that never comes, and the CTAs of a cluster stay in step.
  CUTLASS_DEVICE static bool call_failed(GemmProblem const& p) {
    return p.error_claim != nullptr && *reinterpret_cast<volatile int const*>(p.error_claim) != 0;
  }
  template <class Accum>
  CUTLASS_DEVICE static void poison(Accum& accum) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) accum(i) = __int_as_float(0x7fc00000);
  }

  // ---------------------------------------------------------------- stream-K partials
  // Layout of a CTA's partial: float4 j of consumer thread i at [j * kMmaThreads + i] (coalesced; the reducer
  // reads it back with the same thread/fragment mapping, so no shuffle is needed).
  template <class Accum>
  CUTLASS_DEVICE static void store_partial(Params const& params, Accum const& accum, int slot, int mma_thread_idx) {
    float4* dst = params.split_partials + int64_t(slot) * (kTileM * kTileN / 4);
    constexpr int kVecs = decltype(size(accum))::value / 4;
    cute::for_each(make_int_sequence<kVecs>{}, [&](auto j) {
      constexpr int i = decltype(j)::value * 4;
      __stcg(dst + decltype(j)::value * kMmaThreads + mma_thread_idx,
             make_float4(accum(i), accum(i + 1), accum(i + 2), accum(i + 3)));
    });
    epi_barrier();  // every consumer thread's partial is written before the flag
    if (mma_thread_idx == 0) {
      __threadfence();
      st_release<Scope::kGpu>(params.split_flags + slot, 1u);
    }
  }

  // Adds the partials of clusters [first, last] (the same CTA rank) in cluster order.
  template <class Accum>
  CUTLASS_DEVICE static void add_partials(Params const& params, Accum& accum, int first, int last, int cluster_rank_m,
                                          int mma_thread_idx) {
    if (first > last) return;
    if (mma_thread_idx == 0) {
      for (int c = first; c <= last; ++c) {
        int slot = c * kClusterM + cluster_rank_m;
        wait_grid_flag(params.split_flags + slot, params.prob, slot);
      }
    }
    epi_barrier();
    constexpr int kVecs = decltype(size(accum))::value / 4;
    constexpr int kBatch = 8;  // float4 loads in flight at once: more would not fit beside the accumulators
    static_assert(kVecs % kBatch == 0);
    for (int c = first; c <= last; ++c) {
      float4 const* src = params.split_partials + int64_t(c * kClusterM + cluster_rank_m) * (kTileM * kTileN / 4);
      cute::for_each(make_int_sequence<kVecs / kBatch>{}, [&](auto b) {
        float4 v[kBatch];
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < kBatch; ++u)
          v[u] = __ldcg(src + (decltype(b)::value * kBatch + u) * kMmaThreads + mma_thread_idx);
        cute::for_each(make_int_sequence<kBatch>{}, [&](auto u) {
          constexpr int i = (decltype(b)::value * kBatch + decltype(u)::value) * 4;
          accum(i) += v[u].x;
          accum(i + 1) += v[u].y;
          accum(i + 2) += v[u].z;
          accum(i + 3) += v[u].w;
        });
        asm volatile("" ::: "memory");  // keep the next batch's loads behind these adds
      });
    }
  }

  // ---------------------------------------------------------------- consumer epilogue
  // ReduceScatter signals are deferred by one tile: the flag of a tile sent to a peer is raised at the end of the
  // next tile's epilogue, when its stores have long drained. Raising it at once would stall the consumer warps
  // for an NVLink round trip per tile. Tiles of reduced shards (which wait on the peers' flags) flush first, so no
  // rank waits on a flag another rank still holds back.
  struct PendingSignal {
    int shard = -1;
    int index = 0;
  };

  // Called by all consumer threads; thread 0, which issued the pending tile's stores, acts. Epilogue transport: raise
  // the tile's flag at the peer. Copy-engine transport: count the tile into its chunk, which the copy engine
  // moves once complete.
  // kNewerGroups: TMA-store groups thread 0 committed after the pending tile's (they may stay in flight).
  template <int kNewerGroups = 0>
  CUTLASS_DEVICE static void flush_signal(GemmProblem const& p, PendingSignal& pending, int mma_thread_idx) {
    if (pending.shard < 0) return;
    if (mma_thread_idx == 0) {
      // The tile went out as TMA stores issued by this thread: wait until they are complete (not only read
      // out of shared memory), order them before this thread's generic-proxy release, then publish. The
      // system-scope release orders them before the flag by itself; a separate fence before it measured 1-3%
      // slower on the large shapes.
      asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kNewerGroups) : "memory");
      asm volatile("fence.proxy.async.global;" ::: "memory");
      if (p.rs_staged_mask >> pending.shard & 1u) {
        red_add_release_sys(p.rs_stage_counters + int64_t(pending.shard) * p.rs_flags_per_source + pending.index, 1u);
      } else {
        st_release<Scope::kSys>(p.rs_signal[pending.shard] + pending.index, p.epoch);
      }
    }
    pending.shard = -1;
  }

  // A reduced shard of a ReduceScatter (own rows; two-level: a collected block): wait until every partial of
  // tile t that it adds has landed here (one consumer thread). The first time this CTA's partial of a source passed
  // its wait, the source's call signature is compared (bit kSignatureSeen + s of `seen`, the consumer's
  // per-destination bits: no register of its own).
  static constexpr int kSignatureSeen = kMaxTp;
  CUTLASS_DEVICE static bool reduced(GemmProblem const& p, int shard) { return p.rs_reduce_mask >> shard & 1u; }
  CUTLASS_DEVICE static bool staged(GemmProblem const& p, int shard) { return p.rs_staged_mask >> shard & 1u; }
  CUTLASS_DEVICE static void wait_partial_flags(GemmProblem const& p, TileCoord t, uint32_t& seen) {
    int const signal_chunk = rs_chunk_index(t.m, t.n, p.rs_chunk_tiles_m, p.rs_chunk_tiles_n, p.rs_chunks_n);
    int const staged_chunk =
        rs_chunk_index(t.m, t.n, p.rs_staged_chunk_tiles_m, p.rs_staged_chunk_tiles_n, p.rs_staged_chunks_n);
    int const first = p.rs_first_partial[t.shard];
    for (int s = first; s < first + p.rs_partial_count[t.shard]; ++s) {
      // A source that signs its calls wrote its signature before its flags (check_signature: signature_sources).
      int const src = p.rs_partial_source[s];
      int const index = p.rs_partial_staged_grid >> s & 1u ? staged_chunk : signal_chunk;
      uint32_t const bit = 1u << (kSignatureSeen + src);
      if (wait_flag(p.rs_partial_flags[s] + index, p.epoch, p, kTileTimeout, src * (1 << 24) + index) &&
          !(seen & bit)) {
        check_signature(p, src);
        seen |= bit;
      }
    }
    // The partials were written by a peer or a copy engine; the TMA loads that follow read through the async proxy.
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }

  // Own rows of a ReduceScatter: TMA-load sub-tiles [sub_begin, sub_end) of partial s into their epilogue buffers
  // (one consumer thread; the buffers' previous TMA stores have been read out and its readers are past a barrier).
  CUTLASS_DEVICE static void load_partial_subtiles(Params const& params, TileCoord t, int s, int sub_begin, int sub_end,
                                                   SharedStorage& ss) {
    GemmProblem const& p = params.prob;
    auto const& load = params.load_partial[s];
    Tensor mP = load.get_tma_tensor(make_shape(p.rows_per_shard, p.n));
    auto cta_load = load.get_slice(Int<0>{});
    for (int sub = sub_begin; sub < sub_end; ++sub) {
      int const buf = sub % kEpiBuffers;
      uint64_t* full = &ss.partial_full[buf];
      // Rows and columns past the shard's edge arrive as zeros and still count towards the bytes.
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, kEpiTileElems * int(sizeof(ElementD)));
      Tensor gP = subtile_window<kTileM, kTileN, kEpiCols>(mP, t.m, t.n, sub);
      Tensor sP = make_tensor(make_smem_ptr(ss.epi + buf * kEpiTileElems), typename Cfg::EpiSmemLayout{});
      copy(load.with(*full), cta_load.partition_S(gP), cta_load.partition_D(sP));
    }
  }

  // Calls f(Int<i>, Int<r_off>, Int<c_off>) for every warp-wide 16 x 16 block of the accumulator fragment that
  // lies in sub-tile kSub: values i .. i+7, at tile offset (r_off, c_off) from the thread's base coordinate.
  template <int kSub, class Accum, class Coords, class F>
  CUTLASS_DEVICE static void for_each_block(Accum const& accum, Coords const& tCcD, F&& f) {
    cute::for_each(make_int_sequence<decltype(size(accum))::value / 8>{}, [&](auto b) {
      constexpr int i = decltype(b)::value * 8;
      auto o = tCcD.layout()(Int<i>{});
      constexpr int r_off = decltype(get<0>(o))::value;
      constexpr int c_off = decltype(get<1>(o))::value;
      if constexpr (c_off / kEpiCols == kSub) f(Int<i>{}, Int<r_off>{}, Int<c_off>{});
    });
  }

  // FP8: the accumulators times the tile's A and B scales (gemm_params.h ScaleMode), before the bias and before a
  // ReduceScatter's own rows add the peers' partials (scaled by their ranks). Rows and columns past the edges are
  // padding (clipped by the stores): their scales are never read past the arrays. A scales may have been written by
  // a copy engine during this kernel (an all-gather's peers' scales, ahead of their rows' chunk flags): plain loads,
  // not the read-only path. Row and column scales are loaded a 16 x 16 block at a time (the fragment layout the
  // epilogue checks: rows r, r + 8, columns c, c + 1, c + 8, c + 9), each block's loads kept behind the previous
  // block's multiplies so that they do not all stay live at once.
  template <class Accum, class Coords>
  CUTLASS_DEVICE static void apply_scales(GemmProblem const& p, TileCoord t, Accum& accum, Coords const& tCcD) {
    float const* a_scale = t.shard == p.own_shard && p.a_scale_own != nullptr
                               ? p.a_scale_own
                               : p.a_scale + int64_t(t.shard) * p.a_scale_shard_stride;
    float alpha = 1.f;
    if (p.a_scale_mode == ScaleMode::kPerShard) alpha *= a_scale[0];
    if (p.b_scale_mode == ScaleMode::kPerShard) alpha *= __ldg(p.b_scale);
    bool const per_row = p.a_scale_mode == ScaleMode::kPerRow;
    bool const per_col = p.b_scale_mode == ScaleMode::kPerRow;
    if (!per_row && !per_col) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) *= alpha;
      return;
    }
    int const row0 = t.m * kTileM + get<0>(tCcD(0));
    int const col0 = t.n * kTileN + get<1>(tCcD(0));
    int const last_row = p.rows_per_shard - 1;
    int const last_col = p.n - 1;
    cute::for_each(make_int_sequence<decltype(size(accum))::value / 8>{}, [&](auto b) {
      constexpr int i = decltype(b)::value * 8;
      auto o = tCcD.layout()(Int<i>{});
      constexpr int r_off = decltype(get<0>(o))::value;
      constexpr int c_off = decltype(get<1>(o))::value;
      float sr[2] = {alpha, alpha};
      float sc[4] = {1.f, 1.f, 1.f, 1.f};
      if (per_row) {
        sr[0] *= a_scale[min(row0 + r_off, last_row)];
        sr[1] *= a_scale[min(row0 + r_off + 8, last_row)];
      }
      if (per_col) {
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < 4; ++u) sc[u] = __ldg(p.b_scale + min(col0 + c_off + u % 2 + 8 * (u / 2), last_col));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < 8; ++u) accum(i + u) *= sr[(u / 2) % 2] * sc[u % 2 + 2 * (u / 4)];
      asm volatile("" ::: "memory");
    });
  }

  // kReduceScatterPaths: the instance that can run a GEMM+ReduceScatter's tiles (GemmProblem::rs_own_shard >= 0). With
  // 128-row tiles the other calls' tiles run an instance without those paths, so that the code a tile's epilogue runs
  // through lies in one piece: it runs once per mainloop, whose code likely evicts it from the instruction cache, and
  // each branch over a path it does not take was an instruction-fetch stall (ncu; docs/experiments.md, "The epilogue's
  // code in one piece"). 256-row tiles keep one instance: the second made ptxas spill 16 bytes in the FP8
  // fast-accumulation kernel.
  template <bool kReduceScatterPaths, class Accum>
  CUTLASS_DEVICE static void epilogue(Params const& params, TileCoord t, Accum& accum, int mma_thread_idx,
                                      SharedStorage& ss, uint32_t& consumed_seen, PendingSignal& pending,
                                      uint32_t& partial_phase, bool partials_loading) {
    GemmProblem const& p = params.prob;
    int const row0 = t.m * kTileM;
    int const col0 = t.n * kTileN;
    if (row0 >= p.rows_per_shard) return;  // padding tile (uniform across the consumer threads)

    // (128-row tiles take this instance only for a ReduceScatter's tiles.)
    bool const is_rs = kReduceScatterPaths && (kRegisterSlack || p.rs_own_shard >= 0);
    bool const own = is_rs && t.shard == p.rs_own_shard;  // own rows: the output
    bool const reduce = is_rs && reduced(p, t.shard);     // own rows, or a collected block: add the partials
    bool const to_peer = is_rs && !own;                   // leaves this rank: signalled or counted afterwards
    bool const counted = staged(p, t.shard);              // staged locally: the copy engine or the caller moves it
    bool const add_bias = p.bias != nullptr && (!is_rs || own);
    int const flag_index =
        !is_rs    ? 0
        : counted ? rs_chunk_index(t.m, t.n, p.rs_staged_chunk_tiles_m, p.rs_staged_chunk_tiles_n, p.rs_staged_chunks_n)
                  : rs_chunk_index(t.m, t.n, p.rs_chunk_tiles_m, p.rs_chunk_tiles_n, p.rs_chunks_n);
    constexpr int kSubTiles = kTileN / kEpiCols;

    if (is_rs && mma_thread_idx == 0) {
      int const dest = p.rs_dest[t.shard];
      if (to_peer && !counted && !(consumed_seen & (1u << dest))) {
        // The destination must have finished reading its receive slots (and our signature) of the previous call
        // before we overwrite them (null: the host-side stream already waited).
        if (p.rs_consumed != nullptr) wait_flag(p.rs_consumed + dest, p.epoch - 1, p, kConsumedTimeout, dest);
        if (p.rs_signature_out[t.shard] != nullptr) write_signature(p.rs_signature_out[t.shard], p);
        consumed_seen |= 1u << dest;
      }
      if (reduce && !partials_loading) wait_partial_flags(p, t, consumed_seen);
    }

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(mma_thread_idx);
    Tensor cD = make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{}));
    Tensor tCcD = thr_mma.partition_C(cD);  // same shape as accum: tile coordinates of each accumulator
    // coordinate(i) = this thread's base + a compile-time offset. A thread's base column is < 8 and the
    // offsets are multiples of 8 plus 0/1, so which sub-tile an accumulator belongs to is static.
    int const r_base = get<0>(tCcD(0));
    int const c_base = get<1>(tCcD(0));
    if constexpr (Cfg::kFp8) apply_scales(p, t, accum, tCcD);
    ElementD const* bias = static_cast<ElementD const*>(p.bias);

    // The wgmma accumulator fragment comes in runs of 8 that make one warp-wide 16 x 16 block: values
    // (i, i+1) are columns (c, c+1) of row r, (i+2, i+3) the same columns of row r+8, (i+4 .. i+7) the same
    // again 8 columns right. Checked at compile time below; it is what lets stmatrix stage a block at once (and
    // ldmatrix read one back into the same registers).
    int const lane = mma_thread_idx % 32;
    int const warp_row0 = r_base - lane / 4;  // the warp's block origin before the compile-time offsets
    int const warp_col0 = c_base - 2 * (lane % 4);
    int const lane_row = (lane % 8) + 8 * ((lane / 8) % 2);  // the row (in a block) whose address lane gives
    int const lane_col = 8 * (lane / 16);

    cute::for_each(make_int_sequence<kSubTiles>{}, [&](auto j) {
      constexpr int kSub = decltype(j)::value;
      constexpr int kBuf = kSub % kEpiBuffers;
      ElementD* epi = ss.epi + kBuf * kEpiTileElems;
      uint32_t const epi_smem = uint32_t(__cvta_generic_to_shared(epi));
      // Shared-memory address of this lane's row of the warp's block at compile-time offset (r_off, c_off).
      auto block_addr = [&](int r_off, int c_off) {
        int const row = warp_row0 + r_off + lane_row;
        int const col = warp_col0 + c_off - kSub * kEpiCols + lane_col;
        return epi_smem + uint32_t(epi_offset(row, col) * int(sizeof(ElementD)));
      };
      // Before a buffer is written again: its TMA store must have read it (thread 0 issued them all; with a
      // buffer per sub-tile the last one went out a whole mainloop ago). Own rows then load the first peer's
      // partial into it (into all buffers at once when there is one per sub-tile). The barrier also orders
      // thread 0's flag waits above before what follows.
      if constexpr (kEpiBuffers == 1 || kSub == 0) {
        if (mma_thread_idx == 0) {
          cute::tma_store_wait<0>();
          if (reduce && !partials_loading)
            load_partial_subtiles(params, t, p.rs_first_partial[t.shard], kSub, kEpiBuffers == 1 ? kSub + 1 : kSubTiles,
                                  ss);
        }
        epi_barrier();
      }
      if (reduce) {
        // Add the partials of this sub-tile to the accumulators in the shard's order (the same bits on every run);
        // each lane reads back exactly the elements it stages below.
        int const first = p.rs_first_partial[t.shard];
        for (int s = first; s < first + p.rs_partial_count[t.shard]; ++s) {
          if (s > first) {  // the next partial replaces this one in the buffer once every thread has read it
            epi_barrier();
            if (mma_thread_idx == 0) load_partial_subtiles(params, t, s, kSub, kSub + 1, ss);
          }
          cutlass::arch::ClusterTransactionBarrier::wait(&ss.partial_full[kBuf], (partial_phase >> kBuf) & 1u);
          partial_phase ^= 1u << kBuf;
          for_each_block<kSub>(accum, tCcD, [&](auto i_, auto r_off, auto c_off) {
            constexpr int i = decltype(i_)::value;
            uint32_t q[4];
            ldmatrix_x4(block_addr(r_off, c_off), q[0], q[1], q[2], q[3]);
            CUTLASS_PRAGMA_UNROLL
            for (int u = 0; u < 4; ++u) {
              float2 const f = unpack2(q[u]);
              accum(i + 2 * u) += f.x;
              accum(i + 2 * u + 1) += f.y;
            }
          });
        }
      }
      // The bias in one pass over the sub-tile (one branch, where a test per block broke the staging below into
      // pieces), after the partials, so the sums keep their order.
      if (add_bias) {
        for_each_block<kSub>(accum, tCcD, [&](auto i_, auto, auto c_) {
          constexpr int i = decltype(i_)::value;
          int gc = col0 + c_base + decltype(c_)::value;  // this thread's columns gc, gc+1, gc+8, gc+9
          float b0 = gc < p.n ? float(bias[gc]) : 0.f, b1 = gc + 1 < p.n ? float(bias[gc + 1]) : 0.f;
          float b8 = gc + 8 < p.n ? float(bias[gc + 8]) : 0.f, b9 = gc + 9 < p.n ? float(bias[gc + 9]) : 0.f;
          accum(i) += b0, accum(i + 1) += b1, accum(i + 2) += b0, accum(i + 3) += b1;
          accum(i + 4) += b8, accum(i + 5) += b9, accum(i + 6) += b8, accum(i + 7) += b9;
        });
      }
      for_each_block<kSub>(accum, tCcD, [&](auto i_, auto r_, auto c_) {
        constexpr int i = decltype(i_)::value;
        constexpr int r_off = decltype(r_)::value;
        constexpr int c_off = decltype(c_)::value;
        static_assert(c_off % 16 == 0, "a block starts on a 16-column boundary");
        cute::for_each(make_int_sequence<8>{}, [&](auto u) {
          auto ou = tCcD.layout()(Int<i + decltype(u)::value>{});
          constexpr int ur = decltype(get<0>(ou))::value - r_off;
          constexpr int uc = decltype(get<1>(ou))::value - c_off;
          constexpr int uv = decltype(u)::value;
          static_assert(ur == 8 * ((uv / 2) % 2) && uc == uv % 2 + 8 * (uv / 4), "unexpected wgmma fragment");
        });
        stmatrix_x4(block_addr(r_off, c_off), pack2(accum(i), accum(i + 1)), pack2(accum(i + 2), accum(i + 3)),
                    pack2(accum(i + 4), accum(i + 5)), pack2(accum(i + 6), accum(i + 7)));
      });
      // The whole sub-tile in one TMA store, which drains while the consumers move on; rows and columns past
      // the shard's edge are clipped. A ReduceScatter tile for a peer is flagged (or counted) only once its
      // stores completed (flush_signal, deferred by a tile).
      cute::tma_store_fence();  // this thread's stmatrix writes, visible to the TMA unit
      epi_barrier();
      if (mma_thread_idx == 0) {
        auto const& store = params.store_d[t.shard];
        Tensor mD = store.get_tma_tensor(make_shape(p.rows_per_shard, p.n));
        Tensor gD = subtile_window<kTileM, kTileN, kEpiCols>(mD, t.m, t.n, kSub);
        Tensor sD = make_tensor(make_smem_ptr(epi), typename Cfg::EpiSmemLayout{});
        auto cta_store = store.get_slice(Int<0>{});
        copy(store, cta_store.partition_S(sD), cta_store.partition_D(gD));
        cute::tma_store_arrive();
      }
    });
    // The previous tile's signal: raised by thread 0 behind this tile's stores, so that its fence delays only
    // thread 0's warp group at the next mainloop's start (the other one goes ahead) and not every consumer.
    if constexpr (kReduceScatterPaths) flush_signal<kSubTiles>(p, pending, mma_thread_idx);

    if (to_peer) {
      // Release (deferred): flush_signal waits for the tile's TMA stores to complete before the flag.
      pending.shard = t.shard;
      pending.index = flag_index;
    }
  }

  // ---------------------------------------------------------------- entry
  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_buf);
    GemmProblem const& p = params.prob;
    TileSchedule const& sched = params.sched;
    // epi_offset's swizzle is computed from the row, TMA's from the address: they agree on 1024-byte alignment.
    if (threadIdx.x == 0 && (cute::cast_smem_ptr_to_uint(ss.epi) & 1023u) != 0) __trap();

    int const thread_idx = int(threadIdx.x);
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const warp_group = cutlass::canonical_warp_group_idx();
    int const warp_in_group = warp_idx % cutlass::NumWarpsPerWarpGroup;
    int const lane_predicate = cute::elect_one_sync();
    uint32_t const block_rank_in_cluster = cute::block_rank_in_cluster();

    if (warp_idx == 0 && lane_predicate) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Mainloop::prefetch_tma_descriptors(params.mainloop_own);
    }

    typename MainloopPipeline::Params pipeline_params;
    if (warp_group == 0 && warp_in_group == 0) pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (warp_group >= 1) pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    pipeline_params.is_leader = (thread_idx % cutlass::NumThreadsPerWarpGroup) == 0;
    pipeline_params.num_consumers = kMmaThreads;
    pipeline_params.num_producers = Mainloop::NumProducerThreadEvents;
    pipeline_params.transaction_bytes = params.mainloop_own.tma_transaction_bytes;
    MainloopPipeline pipeline(ss.pipeline, pipeline_params, ClusterShape{});
    if (warp_idx == 0 && lane_predicate) {
      for (int b = 0; b < kEpiBuffers; ++b) cutlass::arch::ClusterTransactionBarrier::init(&ss.partial_full[b], 1);
      cutlass::arch::fence_barrier_init();
    }

    // Barrier initialisation must be visible to the whole cluster before anyone arrives on a barrier.
    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }

    int const cluster_id = int(blockIdx.x) / kClusterM;
    int const num_clusters = int(gridDim.x) / kClusterM;
    int const cluster_rank_m = int(block_rank_in_cluster) % kClusterM;
    int const k_tiles = (p.k + kTileK - 1) / kTileK;

    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegs>();
      if constexpr (Cfg::kFp8) {
        if (warp_in_group == 0 && blockIdx.x == 0 && p.scale_push_count > 0) push_scales(p, thread_idx % 32);
      }
      if (warp_in_group == 0 && lane_predicate) {
        // Everything ahead of this grid on its stream is complete: x can be copied (GemmProblem::started_flag), and
        // its scales are at the peers (push_scales).
        if (blockIdx.x == 0 && p.started_flag != nullptr) st_release<Scope::kSys>(p.started_flag, p.epoch);
        PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
        uint32_t signature_checked = 0;
        Segment seg;
        for (SegmentCursor cur = params.split.begin(cluster_id, num_clusters); params.split.next(cur, seg);) {
          TileCoord t = sched.get(seg.work, cluster_rank_m);
          if (p.chunk_flags != nullptr && t.shard != p.own_shard) wait_chunks(p, t, signature_checked);
          load_tile(params, t, seg.k_begin, seg.k_end, pipeline, write_state, ss, block_rank_in_cluster);
        }
        // Keep the CTA alive until every stage was released by the cluster's consumers (no remote
        // arrivals on this CTA's barriers after it exits).
        pipeline.producer_tail(write_state);
        // Every stage this CTA loaded was consumed: it reads nothing more of A (GemmProblem::finished_ctas).
        if (p.finished_ctas != nullptr) finish_call(p);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
      int const mma_thread_idx = thread_idx - cutlass::NumThreadsPerWarpGroup;
      PipelineState read_state;
      Mainloop collective;
      TiledMma tiled_mma;
      uint32_t consumed_seen = 0;  // thread 0: bit g, destination g released (epilogue); bit kSignatureSeen + s
                                   // source s's signature compared (wait_partial_flags)
      uint32_t partial_phase = 0;  // bit b: parity of partial_full[b]'s next phase
      PendingSignal pending;
      Segment seg;
      for (SegmentCursor cur = params.split.begin(cluster_id, num_clusters); params.split.next(cur, seg);) {
        TileCoord t = sched.get(seg.work, cluster_rank_m);
        if (pending.shard >= 0 && reduced(p, t.shard)) {
          epi_barrier();
          flush_signal(p, pending, mma_thread_idx);
        }
        // A reduced shard of a ReduceScatter with a buffer per sub-tile: thread 0 loads the first partial into the
        // epilogue buffers now, so the loads run under the mainloop. Its warp group waits meanwhile (for the
        // previous tile's stores to leave the buffers, and for the flags), while the other one goes ahead.
        bool partials_loading = false;
        if constexpr (kEpiBuffers == kTileN / kEpiCols) {
          if (reduced(p, t.shard) && seg.k_begin == 0 && t.m * kTileM < p.rows_per_shard) {
            if (mma_thread_idx == 0) {
              cute::tma_store_wait<0>();
              wait_partial_flags(p, t, consumed_seen);
              load_partial_subtiles(params, t, p.rs_first_partial[t.shard], 0, kTileN / kEpiCols, ss);
            }
            partials_loading = true;
          }
        }
        int const k_count = seg.k_end - seg.k_begin;
        // The error claim is read once the tile's last stage arrived: after a claim made before the tile began, and
        // after one its own producer made when its chunk wait gave up (it then loaded whatever the buffer held, a
        // previous call's rows: numbers that look right), which the last stage's full barrier orders before the read.
        bool failed;
        Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
        if constexpr (Cfg::kFp8 && Cfg::kAccumulation == Accumulation::kSplit) {
          mma_fp8_split(pipeline, read_state, accum, k_count, mma_thread_idx, ss);
          failed = call_failed(p);
        } else {
          collective.mma(pipeline, read_state, accum, k_count, mma_thread_idx, ss.mainloop, params.mainloop_own);
          failed = call_failed(p);  // while the last MMAs run, which hides the load
          collective.mma_tail(pipeline, read_state, k_count);
          read_state.advance(k_count);
        }
        if (failed) poison(accum);
        if constexpr (kSplitCapable) {
          if (seg.k_begin > 0) {  // a later segment of a split item: hand the partial to the item's reducer
            store_partial(params, accum, cluster_id * kClusterM + cluster_rank_m, mma_thread_idx);
            continue;
          }
          if (seg.k_end < k_tiles) {  // reducer of a split item
            add_partials(params, accum, cluster_id + 1, params.split.last_contributor(seg.work), cluster_rank_m,
                         mma_thread_idx);
          }
        }
        if (!kRegisterSlack || p.rs_own_shard >= 0)
          epilogue<true>(params, t, accum, mma_thread_idx, ss, consumed_seen, pending, partial_phase, partials_loading);
        else
          epilogue<false>(params, t, accum, mma_thread_idx, ss, consumed_seen, pending, partial_phase,
                          partials_loading);
      }
      if (pending.shard >= 0) {
        epi_barrier();
        flush_signal(p, pending, mma_thread_idx);
      }
      // Shared memory must outlive the last TMA stores' reads (their writes complete with the grid).
      if (mma_thread_idx == 0) cute::tma_store_wait<0>();
      // A call on a failed workspace (a CUDA-graph replay after its twin failed) releases this rank's waits again at
      // its end: the replay cleared its handshake words at its start (CUDA-graph protocol), and the next replay's
      // handshake wait may come before anything else in the only hardware queue.
      if (mma_thread_idx == 0 && blockIdx.x == 0 && call_failed(p)) release_own_flags(p);
    }
#endif
  }
};

template <class Cfg>
__global__ void __launch_bounds__(GemmKernel<Cfg>::kThreads, 1)
    gemm_kernel(CUTE_GRID_CONSTANT KernelParams<Cfg> const params) {
  extern __shared__ char smem[];
  GemmKernel<Cfg>{}(params, smem);
}

}  // namespace flux::sm90
