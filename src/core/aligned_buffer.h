// AlignedBuffer: 4 KiB-aligned host memory that O_DIRECT can read into and write from.
//
// Thread-safety: a plain owner; not shared.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <utility>

namespace tierzero {

// 4 KiB-aligned host memory (O_DIRECT-able), freed on destruction.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  static AlignedBuffer Allocate(uint64_t bytes) {
    AlignedBuffer b;
    const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
    b.data_ = std::aligned_alloc(4096, rounded == 0 ? 4096 : rounded);
    b.bytes_ = b.data_ != nullptr ? rounded : 0;
    return b;
  }
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~AlignedBuffer() { std::free(data_); }
  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace tierzero
