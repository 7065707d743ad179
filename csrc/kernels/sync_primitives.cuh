// Cross-GPU signalling used inside the fused kernels: 32-bit epoch flags (a flag is "set" for call e when it
// holds a value >= e, so nothing is ever cleared and back-to-back calls cannot race on a reset), bounded
// waits that record who timed out instead of hanging.
#pragma once

#include <cstdint>

#include "flux/gemm_params.h"

namespace flux {

// Scope of a flag's observers: kSys for other GPUs and the copy engine, kGpu for other CTAs of this grid.
enum class Scope { kGpu, kSys };

template <Scope kScope>
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  if constexpr (kScope == Scope::kSys) {
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}

template <Scope kScope>
__device__ __forceinline__ void st_release(uint32_t* p, uint32_t v) {
  if constexpr (kScope == Scope::kSys) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  } else {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
}

// Counter raised for an observer outside the SMs (the copy engine's stream wait): release at system scope.
__device__ __forceinline__ void red_add_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool epoch_reached(uint32_t flag, uint32_t epoch) {
  return static_cast<int32_t>(flag - epoch) >= 0;  // wrap-safe
}

// Every wait on this rank's flags returns (GemmProblem::release_words; 0x7f7f7f7f is ahead of any epoch, as the
// host's release writes). One thread; the words are few (flags, handshakes, chunk counts of one workspace).
__device__ __forceinline__ void release_own_flags(const GemmProblem& p) {
  volatile uint32_t* words = p.release_words;
  for (int64_t i = 0; i < p.release_count; ++i) words[i] = 0x7f7f7f7fu;
  __threadfence_system();
}

// The error record is host-mapped pinned memory (gemm_params.h kErrorRecordWords), readable by the host without a
// synchronisation. The first failing waiter claims it through a device-memory word (error_claim), fills in
// fields[i] at rec[1 + i] and the snapshot of this rank's flags, publishes the code last, and releases this rank's
// waits. False: already claimed (or no record: the plain GEMM).
template <int kFields>
__device__ __forceinline__ bool publish_error(const GemmProblem& p, int code, const int (&fields)[kFields]) {
  static_assert(kFields < kErrorRecordWords, "the record holds the code and kErrorRecordWords - 1 fields");
  if (p.error_record == nullptr || p.error_claim == nullptr) return false;
  if (atomicCAS(p.error_claim, 0, code) != 0) return false;
  volatile int* rec = p.error_record;
  for (int i = 0; i < kFields; ++i) rec[1 + i] = fields[i];
  if (p.release_snapshot != nullptr) {  // this rank's flags as they stood, before release_own_flags overwrites them
    volatile const uint32_t* words = p.release_words;
    volatile uint32_t* snapshot = p.release_snapshot;
    for (int64_t i = 0; i < p.release_count; ++i) snapshot[i] = words[i];
  }
  __threadfence_system();
  rec[0] = code;
  __threadfence_system();
  release_own_flags(p);
  return true;
}

// A timed-out wait: {code, rank, index, epoch, observed flag}.
__device__ __forceinline__ void record_timeout(const GemmProblem& p, int code, int index, uint32_t observed) {
  publish_error(p, code, {p.rank, index, static_cast<int>(p.epoch), static_cast<int>(observed)});
}

// After a flag of rank `src` for this call: the signature src wrote here before that flag must equal ours
// (gemm_params.h). A mismatch claims the error record with both signatures; the claim makes every other wait of the
// call give up, so the ranks stop within microseconds instead of exchanging data of different calls.
__device__ __forceinline__ void check_signature(const GemmProblem& p, int src) {
  if (!(p.signature_sources >> src & 1u)) return;
  volatile const uint32_t* theirs = p.peer_signatures + src * kSignatureWords;
  uint32_t const w0 = theirs[0], w1 = theirs[1], w2 = theirs[2];
  if (w0 == p.signature[0] && w1 == p.signature[1] && w2 == p.signature[2]) return;
  publish_error(p, kSignatureMismatch,
                {p.rank, src, static_cast<int>(p.epoch), static_cast<int>(w0), static_cast<int>(w1),
                 static_cast<int>(w2), static_cast<int>(p.signature[1]), static_cast<int>(p.signature[2])});
}

// This rank's signature into a peer's slot for it (ReduceScatter's epilogue transport). The same thread's later
// system-scope release of a flag at that peer orders these stores before the flag.
__device__ __forceinline__ void write_signature(uint32_t* slot, const GemmProblem& p) {
  volatile uint32_t* out = slot;
  for (int i = 0; i < kSignatureWords; ++i) out[i] = p.signature[i];
}

// Spin until ready(load(flag)), giving up after limit_ns (then the timeout is recorded under `code`, `index`).
// Returns false on timeout or when another waiter already timed out (then the result of this call is garbage
// and the host raises).
template <class Load, class Ready>
__device__ __forceinline__ bool bounded_wait(const uint32_t* flag, Load load, Ready ready, uint64_t limit_ns,
                                             const GemmProblem& p, int code, int index) {
  if (ready(load(flag))) return true;
  uint64_t start = global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    uint32_t v = load(flag);
    if (ready(v)) return true;
    if ((spin & 255) == 0) {
      if (p.error_claim != nullptr && *reinterpret_cast<volatile int*>(p.error_claim) != 0) return false;
      if (global_timer_ns() - start > limit_ns) {
        record_timeout(p, code, index, v);
        return false;
      }
    }
  }
}

// Spin until *flag (written by another GPU or the copy engine) reaches `epoch`, bounded by p.timeout_ns.
__device__ __forceinline__ bool wait_flag(const uint32_t* flag, uint32_t epoch, const GemmProblem& p, int code,
                                          int index) {
  return bounded_wait(
      flag, [](const uint32_t* f) { return ld_acquire<Scope::kSys>(f); },
      [epoch](uint32_t v) { return epoch_reached(v, epoch); }, p.timeout_ns, p, code, index);
}

// The start of an eager push all-gather of FP8 rows, by one warp of CTA 0 before started_flag is set: this rank's
// x scales into every peer's slot for them (GemmProblem::scale_push_dst). Each lane's fence makes its stores visible
// to the whole system before the warp's started_flag store, which the comm stream waits for before its chunk flags.
__device__ __forceinline__ void push_scales(const GemmProblem& p, int lane) {
  for (int i = lane; i < p.scale_push_count; i += 32) {
    float const s = p.scale_push_src[i];
    for (int q = 0; q < kMaxTp; ++q)
      if (p.scale_push_dst[q] != nullptr) p.scale_push_dst[q][i] = s;
  }
  __threadfence_system();
  __syncwarp();
}

// The end of an eager push all-gather, by one thread of each CTA once the CTA has read everything it reads
// (GemmProblem::finished_ctas). The last CTA to get here ends the call: once the comm stream's transfers are
// complete (sent_flag), the peers may write into our buffer again (done_out) and the watchdog sees the call end.
// The reset of the counter is safe: the stream's next grid starts after this one ends.
__device__ __forceinline__ void finish_call(const GemmProblem& p) {
  __threadfence();
  if (atomicAdd(p.finished_ctas, 1u) != gridDim.x - 1) return;
  atomicExch(p.finished_ctas, 0u);
  wait_flag(p.sent_flag, p.epoch, p, kSentTimeout, 0);  // a timeout is recorded and releases this rank's waits
  for (int q = 0; q < kMaxTp; ++q)
    if (p.done_out[q] != nullptr) st_release<Scope::kSys>(p.done_out[q], p.epoch);
  if (p.completion_word != nullptr) st_release<Scope::kSys>(p.completion_word, p.epoch);
}

// ---- flags inside one grid (stream-K partials): 0 = empty, 1 = written; cleared before each launch.

// Wait for another CTA of this grid (all CTAs are co-resident, so only a bug can make this time out). The
// fused operators record the timeout and the host raises; the plain GEMM has no error record and traps
// rather than return wrong numbers.
__device__ __forceinline__ void wait_grid_flag(const uint32_t* flag, const GemmProblem& p, int index) {
  uint64_t const limit_ns = p.timeout_ns > 0 ? p.timeout_ns : uint64_t(20) * 1000000000ull;
  bool ok = bounded_wait(
      flag, [](const uint32_t* f) { return ld_acquire<Scope::kGpu>(f); }, [](uint32_t v) { return v != 0; }, limit_ns,
      p, kSplitTimeout, index);
  if (!ok && p.error_record == nullptr) __trap();
}

}  // namespace flux
