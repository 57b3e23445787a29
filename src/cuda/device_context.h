// DeviceContext: the per-GPU resources every transfer shares.
//
// One per device, created on first use and kept for the life of the process
// (never destroyed, so no CUDA call runs during static destruction):
//   - a few non-blocking streams for work that has no caller stream;
//   - a pool of timing-free events, to wait for one piece of work without
//     synchronizing a stream or the device;
//   - an argument ring: pinned host memory mirrored in device memory, from
//     which kernels read their tables (block lists, pointer lists). Space is
//     reused once the event recorded after the last kernel using it fires;
//   - a stream-ordered memory pool for scratch (bounce) buffers;
//   - the pinned staging ring for copies from and to pageable host memory:
//     fixed slots, each with an event, handed out and returned whole.
//
// Private: included only by files compiled with CUDA.
// Thread-safety: all methods are thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "cascade/status.h"

namespace cascade {

// Makes `device` current for the scope; restores the previous device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

class DeviceContext {
 public:
  static constexpr int kStreams = 4;
  static constexpr size_t kArgRingBytes = 8ULL << 20;
  // Largest table one upload may carry; callers split bigger work.
  static constexpr size_t kMaxUploadBytes = kArgRingBytes / 4;
  static constexpr size_t kStagingSlotBytes = 4ULL << 20;
  static constexpr int kStagingSlots = 16;

  // The context of `device`; Unavailable when it cannot be used.
  static Result<DeviceContext*> For(int device);

  int device() const { return device_; }
  // Registered and pinned host memory can be dereferenced by kernels at its
  // host address (unified addressing).
  bool kernels_reach_host_memory() const { return kernels_reach_host_; }

  cudaStream_t next_stream();  // round robin over the internal streams

  cudaEvent_t take_event();
  void give_event(cudaEvent_t e);
  // Records an event on s and waits for it on this thread.
  Status wait_for(cudaStream_t s);

  // ---- argument ring ---------------------------------------------------
  struct Upload {
    const void* device = nullptr;  // the table, readable by kernels queued on s after this
    uint64_t ticket = 0;
  };
  // Copies `bytes` (<= kMaxUploadBytes) from host memory to device memory on
  // stream s. REQUIRES: retire(ticket, s) after the last kernel using it is queued.
  Result<Upload> upload(const void* host, size_t bytes, cudaStream_t s);
  void retire(uint64_t ticket, cudaStream_t s);

  // ---- scratch -----------------------------------------------------------
  Result<void*> scratch_alloc(size_t bytes, cudaStream_t s);
  void scratch_free(void* p, cudaStream_t s);

  // ---- staging -----------------------------------------------------------
  struct StagingSlot {
    uint8_t* host = nullptr;  // pinned, kStagingSlotBytes
    cudaEvent_t done = nullptr;
    int index = -1;
  };
  // Blocks until a slot is free. The caller waits on slot.done before reusing
  // it and before giving it back.
  Result<StagingSlot> acquire_staging();
  // A slot if one is free now (callers wanting a second slot use this, so
  // two callers can never each hold one and wait for the other's).
  bool try_acquire_staging(StagingSlot* slot);
  void release_staging(const StagingSlot& slot);

 private:
  explicit DeviceContext(int device) : device_(device) {}
  Status init();
  Status init_staging();  // REQUIRES: staging_mu_ held

  const int device_;
  bool kernels_reach_host_ = false;
  cudaStream_t streams_[kStreams] = {};
  std::atomic<uint32_t> next_stream_{0};

  std::mutex events_mu_;
  std::vector<cudaEvent_t> free_events_;  // guarded by events_mu_

  struct ArgEntry {
    size_t offset = 0, bytes = 0;
    uint64_t ticket = 0;
    bool retired = false;
    cudaEvent_t done = nullptr;  // set by retire(); null once retired: complete
  };
  bool place_arg(size_t bytes, size_t* offset) const;  // REQUIRES: args_mu_ held
  std::mutex args_mu_;
  uint8_t* args_host_ = nullptr;  // pinned
  uint8_t* args_device_ = nullptr;
  std::deque<ArgEntry> args_live_;  // allocation order; guarded by args_mu_
  uint64_t next_ticket_ = 1;        // guarded by args_mu_

  cudaMemPool_t scratch_pool_ = nullptr;  // null: plain cudaMallocAsync

  std::mutex staging_mu_;
  std::condition_variable staging_cv_;
  uint8_t* staging_host_ = nullptr;        // guarded by staging_mu_
  std::vector<StagingSlot> staging_free_;  // guarded by staging_mu_
  bool staging_failed_ = false;
};

}  // namespace cascade
