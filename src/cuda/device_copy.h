// Copies that touch device memory, and the GPU probe. Implemented with the
// CUDA runtime in device_copy_cuda.cc; without CUDA at build time
// device_copy_cuda_stub.cc reports Unavailable, so everything else works.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "cascade/memory_kind.h"
#include "cascade/status.h"

namespace cascade {

// One copy of a batch: `bytes` from src to dst.
struct CopyItem {
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t bytes = 0;
};

// Copies n bytes when at least one side is device memory. Ordered after the
// work already queued on `stream` (nullptr: the legacy default stream) and
// complete when the call returns.
Status device_copy(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind, size_t n,
                   void* stream);

// Copies every item, all with these kinds, in as few GPU operations as their
// sizes allow (the batched copy kernel for small items, one batched DMA call
// for the rest; see device_transfers.h): one copy per item pays a per-call
// cost that items below a few MiB do not hide. Ordered after the work
// already queued on `stream` (nullptr: the legacy default stream of the
// items' GPU) and complete when the call returns; on an error some items
// may have been copied, and the status does not say which.
// REQUIRES: the device memory of every item is on one GPU (the device of
// the first item's device side; only that GPU's legacy stream orders a
// batch without a stream).
Status device_copy_batch(std::span<const CopyItem> items, MemoryKind dst_kind, MemoryKind src_kind,
                         void* stream);

// The work a GPU's legacy default stream holds at one moment, for a batch
// that runs later on another thread: take() records it (on the calling
// thread, at the call); stream() is then a stream of that GPU's own that
// waits for exactly that work, so the batch's copies, queued there, come
// after what the caller queued before the call and not after what it
// queued since. Empty (stream() nullptr: the legacy stream at the time the
// copies are queued) where there is no GPU or the pointer is not device
// memory. Thread-safety: one thread uses an object at a time; take() and
// the other calls may be on different threads.
class DeviceOrderPoint {
 public:
  DeviceOrderPoint() = default;
  static DeviceOrderPoint take(const void* device_memory);
  DeviceOrderPoint(DeviceOrderPoint&& o) noexcept;
  DeviceOrderPoint& operator=(DeviceOrderPoint&& o) noexcept;
  DeviceOrderPoint(const DeviceOrderPoint&) = delete;
  ~DeviceOrderPoint();  // REQUIRES: the copies queued on stream() are complete

  // Made on first use. nullptr where empty.
  void* stream();
  // The GPU whose legacy stream was recorded; -1 where empty.
  int device() const { return device_; }

 private:
  void reset();
  int device_ = -1;
  void* event_ = nullptr;
  void* stream_ = nullptr;
};

// A batch of copies queued a part at a time, for callers that prepare a
// batch piece by piece (leasing blocks, say): each add() queues its part on
// the GPU and returns, so the CPU prepares the next part while the GPU
// copies this one, and wait() returns once the parts up to one are copied.
// All parts go on one stream: `stream`, or where it is nullptr one of the
// GPU's context streams ordered after the work queued on its legacy default
// stream when the first part is added.
//
// Statuses: add() takes a status per item, which the caller keeps alive
// until a wait() covers the part. A part whose copies could not be queued
// is copied again one item at a time during add(), so each failure is
// reported for the item it concerns; a part whose queued copies fail on the
// GPU reports that failure for each of its items.
//
// Thread-safety: one thread uses an object at a time. The destructor waits
// for every part. REQUIRES: the device memory of every item of every part
// is on one GPU (as device_copy_batch).
class DeviceCopyPipeline {
 public:
  DeviceCopyPipeline(MemoryKind dst_kind, MemoryKind src_kind, void* stream);
  ~DeviceCopyPipeline();
  DeviceCopyPipeline(const DeviceCopyPipeline&) = delete;
  DeviceCopyPipeline& operator=(const DeviceCopyPipeline&) = delete;

  // Queues the copies of items; returns the part's number (0, 1, ...).
  size_t add(std::span<const CopyItem> items, std::span<Status> statuses);
  // Returns once every part numbered up to `part` is copied and its
  // statuses are final.
  void wait(size_t part);
  void wait_all();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// One part's copies for a DeviceCopyPipeline, each with the batch item it
// is for; kept (with its statuses) until settled.
struct PipelinePart {
  std::vector<CopyItem> items;
  std::vector<size_t> of;        // the batch item of each copy
  std::vector<Status> statuses;  // the copies' outcomes, once settled
  size_t ticket = 0;

  void push(size_t item, const CopyItem& copy) {
    of.push_back(item);
    items.push_back(copy);
  }
  // Queues the copies (DeviceCopyPipeline::add).
  void queue(DeviceCopyPipeline& copies) {
    statuses.resize(items.size());
    ticket = copies.add(items, statuses);
  }
  // Waits for them, and sets out[of[k]] to copy k's outcome.
  void settle(DeviceCopyPipeline& copies, std::span<Status> out) {
    copies.wait(ticket);
    for (size_t k = 0; k < items.size(); ++k) out[of[k]] = statuses[k];
  }
};

// The parts a batch is cut into for a DeviceCopyPipeline: the first small,
// so that the GPU starts copying after little preparation, each next twice
// as large up to a bound that keeps the per-part costs (a batched call, an
// event, a wait) a small share of its copies.
class PipelineParts {
 public:
  // True when a part of `items` items and `bytes` bytes is full.
  bool full(size_t items, uint64_t bytes) const { return items >= items_ || bytes >= bytes_; }
  // Moves on to the next part's bounds.
  void next() {
    items_ = items_ * 2 < kLastItems ? items_ * 2 : kLastItems;
    bytes_ = bytes_ * 2 < kLastBytes ? bytes_ * 2 : kLastBytes;
  }

  static constexpr size_t kLastItems = 1024;
  static constexpr uint64_t kLastBytes = 32ULL << 20;

 private:
  size_t items_ = 32;
  uint64_t bytes_ = 1ULL << 20;
};

// Runs a batch of `count` units through a DeviceCopyPipeline two parts
// deep. The units are cut into parts by PipelineParts' bounds
// (`size(u)` gives unit u's items and bytes), and for each part k in turn
// start(k, begin, end) prepares units [begin, end) and queues their copies,
// then finish(k - 1, ...) settles the part before it, whose copies ran while
// part k was prepared; the last part is finished last. A part is finished
// before part k + 2 starts, so callers keep a part's state in slot k % 2.
template <class Size, class Start, class Finish>
void for_each_part_two_deep(size_t count, Size size, Start start, Finish finish) {
  PipelineParts bounds;
  size_t k = 0, begin = 0, prev_begin = 0;
  while (begin < count) {
    size_t end = begin, items = 0;
    uint64_t bytes = 0;
    while (end < count && !bounds.full(items, bytes)) {
      const auto [i, b] = size(end++);
      items += i;
      bytes += b;
    }
    bounds.next();
    start(k, begin, end);
    if (k > 0) finish(k - 1, prev_begin, begin);
    prev_begin = begin;
    begin = end;
    ++k;
  }
  if (k > 0) finish(k - 1, prev_begin, count);
}

// True when CUDA is compiled in and device `device` can be used. A negative
// device is never usable, and asking about one does not initialize CUDA.
bool gpu_usable(int device);

// Sets up now what copies with `device` need (its streams, argument ring
// and kernels), instead of on the first copy: that setup waits for all work
// queued on the device, which would hold a first async batch back behind
// the caller's later work. Only where the process has made the device's
// context already (an engine has by the time it opens a store); elsewhere
// nothing is queued there, and a context would take GPU memory. A device
// that cannot be used fails its copies later, as it would without this.
// No-op without CUDA.
void prepare_device(int device);

// Registers host memory with the GPU so DMA reads and writes it directly
// (cudaHostRegister). OK and a no-op without CUDA.
Status register_host_memory(void* base, size_t bytes);
void unregister_host_memory(void* base);

// Registers now (instead of on the first copy) the parts of a range recorded
// by register_host_memory that hold [p, p + n): a store puts a block here so
// that its first load to the GPU does not pay for the registration. No-op
// outside recorded ranges and without CUDA.
void prepare_host_for_device(const void* p, size_t n);

}  // namespace cascade
