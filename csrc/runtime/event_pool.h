// A few CUDA events per device, reused call after call: a recorded event is only ever waited on within the
// call that recorded it, and cudaStreamWaitEvent captures the event's state at the time of the call.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <mutex>

#include "flux/check.h"

namespace flux {

constexpr int kEventsPerCall = 12;

inline std::array<cudaEvent_t, kEventsPerCall>& call_events() {
  static std::mutex mu;
  static std::array<cudaEvent_t, kEventsPerCall> events[64];
  static bool created[64] = {false};
  int device = 0;
  FLUX_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (!created[device]) {
    for (auto& e : events[device]) FLUX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    created[device] = true;
  }
  return events[device];
}

}  // namespace flux
