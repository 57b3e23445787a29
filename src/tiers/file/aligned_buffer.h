// AlignedBuffer: heap memory aligned for O_DIRECT (4 KiB), grown on demand.
//
// Contents are unspecified after reserve() grows the buffer. Move-only.
// Thread-safety: none; one owner at a time.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <utility>

#include "cascade/env.h"

namespace cascade::file {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t n) { (void)reserve(n); }
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), capacity_(o.capacity_) {
    o.data_ = nullptr;
    o.capacity_ = 0;
  }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(capacity_, o.capacity_);
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  // Makes room for n bytes (rounded up to 4 KiB). false when out of memory.
  bool reserve(size_t n) {
    if (n <= capacity_) return true;
    size_t cap = (n + kDirectIoAlignment - 1) & ~(kDirectIoAlignment - 1);
    void* p = nullptr;
    if (posix_memalign(&p, kDirectIoAlignment, cap) != 0) return false;
    std::free(data_);
    data_ = static_cast<uint8_t*>(p);
    capacity_ = cap;
    return true;
  }
  uint8_t* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
};

inline bool is_aligned(const void* p, uint64_t a = kDirectIoAlignment) {
  return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0;
}

}  // namespace cascade::file
