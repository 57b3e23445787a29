// Owning handles for device memory, pinned host memory and CUDA streams, and
// a test-pattern kernel: what tests and benchmarks need to drive the GPU
// without including CUDA headers (test files compile in every build).
//
// Without CUDA at build time every allocation fails with Unavailable and
// gpu_count() is 0.
//
// Thread-safety: handles are move-only values; free functions are
// thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "cascade/status.h"

namespace cascade {

// Visible CUDA devices (0 without CUDA or without a driver).
int gpu_count();

class DeviceBuffer {
 public:
  static Result<DeviceBuffer> Allocate(int device, size_t bytes);  // cudaMalloc
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    swap(o);
    return *this;
  }
  ~DeviceBuffer();
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void swap(DeviceBuffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(device_, o.device_);
  }
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int device_ = 0;
};

class PinnedBuffer {
 public:
  static Result<PinnedBuffer> Allocate(size_t bytes);  // cudaHostAlloc (portable, mapped)
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept { swap(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    swap(o);
    return *this;
  }
  ~PinnedBuffer();
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void swap(PinnedBuffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
  }
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

class GpuStream {
 public:
  static Result<GpuStream> Create(int device);  // non-blocking stream
  GpuStream() = default;
  GpuStream(GpuStream&& o) noexcept { swap(o); }
  GpuStream& operator=(GpuStream&& o) noexcept {
    swap(o);
    return *this;
  }
  ~GpuStream();
  void* handle() const { return stream_; }  // cudaStream_t
  Status synchronize() const;

 private:
  void swap(GpuStream& o) noexcept {
    std::swap(stream_, o.stream_);
    std::swap(device_, o.device_);
  }
  void* stream_ = nullptr;
  int device_ = 0;
};

// Synchronous copies (cudaMemcpy, any direction).
Status copy_to_host(void* dst, const void* src_device, size_t n);
Status copy_to_device(void* dst_device, const void* src, size_t n);
Status device_synchronize(int device);

// Byte i of pattern `seed`: what fill_device_pattern writes.
inline uint8_t pattern_byte(uint64_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ULL ^ seed * 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

// Queues on `stream` (cudaStream_t; nullptr = legacy default stream) a
// kernel that first spins for about spin_us microseconds, then writes
// pattern_byte(seed, i) to dst[i] for i < n. The spin makes a missing
// stream dependency visible: a copy not ordered after it reads stale bytes.
Status fill_device_pattern(void* dst, size_t n, uint64_t seed, void* stream, uint32_t spin_us = 0);

// Milliseconds between two points of a stream, measured with CUDA events;
// for benchmarks. start() records the first event, stop() the second and
// waits for it.
class GpuTimer {
 public:
  static Result<GpuTimer> Create(int device);
  GpuTimer() = default;
  GpuTimer(GpuTimer&& o) noexcept { swap(o); }
  GpuTimer& operator=(GpuTimer&& o) noexcept {
    swap(o);
    return *this;
  }
  ~GpuTimer();
  Status start(void* stream);
  Result<double> stop(void* stream);

 private:
  void swap(GpuTimer& o) noexcept {
    std::swap(begin_, o.begin_);
    std::swap(end_, o.end_);
  }
  void* begin_ = nullptr;
  void* end_ = nullptr;
};

// A fixed set of events on one device, to mark points of a stream that
// other streams wait for on the GPU (no host wait). Events never recorded
// are complete: a wait on one returns at once.
class GpuEvents {
 public:
  static Result<GpuEvents> Create(int device, int count);
  GpuEvents() = default;
  GpuEvents(GpuEvents&& o) noexcept { swap(o); }
  GpuEvents& operator=(GpuEvents&& o) noexcept {
    swap(o);
    return *this;
  }
  ~GpuEvents();
  int size() const { return static_cast<int>(events_.size()); }
  // Marks the point of `stream` (cudaStream_t; nullptr = legacy default)
  // reached by the work queued on it so far.
  Status record(int i, void* stream);
  // Work queued on `stream` from now on starts after event i's point.
  Status make_wait(int i, void* stream) const;
  // Blocks this thread until event i's point is reached.
  Status synchronize(int i) const;

 private:
  void swap(GpuEvents& o) noexcept {
    std::swap(events_, o.events_);
    std::swap(device_, o.device_);
  }
  std::vector<void*> events_;
  int device_ = -1;
};

}  // namespace cascade
