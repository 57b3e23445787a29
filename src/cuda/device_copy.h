// Copies that touch device memory, and the GPU probe. Implemented with the
// CUDA runtime in device_copy_cuda.cc; without CUDA at build time
// device_copy_cuda_stub.cc reports Unavailable, so everything else works.
#pragma once

#include <cstddef>

#include "cascade/memory_kind.h"
#include "cascade/status.h"

namespace cascade {

// Copies n bytes when at least one side is device memory. Ordered after the
// work already queued on `stream` (nullptr: the legacy default stream) and
// complete when the call returns.
Status device_copy(void* dst, MemoryKind dst_kind, const void* src, MemoryKind src_kind, size_t n,
                   void* stream);

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
