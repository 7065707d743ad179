// A small cache of host-side TMA descriptors (and the mainloop parameters holding them), keyed by what they
// encode: address, extents and strides. Encoding a descriptor is host work on every launch; a layer's weights and
// a workspace's buffers keep their addresses, and the caching allocator hands activations the same blocks step
// after step, so most launches find every descriptor here. Torch-free, host only.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>

namespace flux {

template <class Value, int kEntries = 16, int kKeyWords = 9>
class DescriptorCache {
 public:
  using Key = std::array<int64_t, kKeyWords>;

  // The value for `key`, made by make() (and kept, replacing the oldest entry) when absent.
  template <class Make>
  Value get(Key const& key, Make&& make) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int i = 0; i < filled_; ++i)
        if (keys_[i] == key) return values_[i];
    }
    Value value = make();
    std::lock_guard<std::mutex> lock(mu_);
    keys_[next_] = key;
    values_[next_] = value;
    next_ = (next_ + 1) % kEntries;
    if (filled_ < kEntries) ++filled_;
    return value;
  }

 private:
  std::mutex mu_;
  std::array<Key, kEntries> keys_{};
  std::array<Value, kEntries> values_{};
  int filled_ = 0;
  int next_ = 0;
};

}  // namespace flux
