// Copies that touch device memory, and the GPU probe. Implemented with the
// CUDA runtime in device_copy_cuda.cc; without CUDA at build time
// device_copy_cuda_stub.cc reports Unavailable, so everything else works.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

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

// As device_copy_batch, with a status per item in statuses[k]: a batch that
// failed (a bad buffer, say) is copied again one item at a time, so that each
// failure is reported for the item it concerns.
inline void device_copy_each(std::span<const CopyItem> items, MemoryKind dst_kind,
                             MemoryKind src_kind, void* stream, std::span<Status> statuses) {
  const Status st = device_copy_batch(items, dst_kind, src_kind, stream);
  for (size_t k = 0; k < items.size(); ++k)
    statuses[k] = st.ok() || items.size() == 1 ? st
                                               : device_copy(items[k].dst, dst_kind, items[k].src,
                                                             src_kind, items[k].bytes, stream);
}

// True when CUDA is compiled in and device `device` can be used. A negative
// device is never usable, and asking about one does not initialize CUDA.
bool gpu_usable(int device);

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
