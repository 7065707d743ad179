// A table that only grows and is read without a lock (the workspaces' plans, the binding's registry of workspaces):
// entries are added one at a time under the writer's own lock, each filled before the size that covers it is
// published (release), so a reader that loads the size (acquire) sees every entry below it. Entries never move:
// they live in blocks allocated as the table grows. Torch-free.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>

#include "flux/check.h"

namespace flux {

template <class T, int kBlockSize = 64, int kBlocks = 4096>
class AppendOnlyTable {
 public:
  static constexpr int64_t kCapacity = int64_t(kBlockSize) * kBlocks;

  // The index of a new entry, filled by fill(T&) before it is published. One writer at a time (the caller's lock).
  template <class Fill>
  int64_t push(Fill&& fill) {
    int64_t const index = size_.load(std::memory_order_relaxed);
    FLUX_CHECK(index < kCapacity, "a table of ", kCapacity, " entries is full");
    std::unique_ptr<T[]>& block = blocks_[size_t(index / kBlockSize)];
    if (!block) block = std::make_unique<T[]>(kBlockSize);
    fill(block[size_t(index % kBlockSize)]);
    size_.store(index + 1, std::memory_order_release);
    return index;
  }

  // Null where index is outside [0, size()).
  T* find(int64_t index) const {
    if (index < 0 || index >= size_.load(std::memory_order_acquire)) return nullptr;
    return &blocks_[size_t(index / kBlockSize)][size_t(index % kBlockSize)];
  }

  int64_t size() const { return size_.load(std::memory_order_acquire); }

 private:
  std::array<std::unique_ptr<T[]>, kBlocks> blocks_{};
  std::atomic<int64_t> size_{0};
};

}  // namespace flux
