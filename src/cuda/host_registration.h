// Host memory the GPU can reach: lazy registration of large host ranges, and
// the test every host<->GPU copy makes before choosing its path.
//
// cudaHostRegister pins every page of a range, which on a sparse /dev/shm
// arena would commit the whole arena at open and take seconds. A range
// recorded with register_host_range() is therefore registered in 64 MiB
// chunks, each on the first copy that touches it (an arena only copies
// blocks it has already committed). host_range_device_accessible() answers
// whether [p, p + n) can be used by DMA and, at the same address, by
// kernels: inside a recorded range (registering chunks as needed), or memory
// CUDA already knows (cudaHostAlloc, another library's registration, device
// or managed memory). Pageable memory answers false and goes through the
// pinned staging ring instead. A chunk of which another library registered
// some part stays theirs: it is never unregistered here, and its copies go
// through the staging ring.
//
// Private: included only by files compiled with CUDA.
// Thread-safety: all functions are thread-safe. Ownership: the caller keeps
// the memory mapped until unregister_host_range() returns, and stops all
// copies touching it before calling it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cascade/status.h"

namespace cascade {

inline constexpr uint64_t kHostRegistrationChunk = 64ULL << 20;

// Records [base, base + bytes) for lazy registration. InvalidArgument when it
// overlaps a recorded range.
Status register_host_range(void* base, size_t bytes);

// Unregisters the chunks registered so far and forgets the range. No-op for
// an unknown base.
void unregister_host_range(void* base);

// See the header comment. n == 0 answers for the byte at p.
bool host_range_device_accessible(const void* p, size_t n);

// The recorded range holding p, [*lo, *hi); false outside every one.
bool host_range_bounds(const void* p, uintptr_t* lo, uintptr_t* hi);

// How many of the n bytes at p one DMA copy may cover: a copy must not
// cross from one registered chunk into the next (the driver rejects it),
// though kernels may. n when p is not in a recorded range.
size_t host_registration_run(const void* p, size_t n);

// Registered chunks and their bytes, over all recorded ranges (for stats).
struct HostRegistrationStats {
  uint64_t ranges = 0;
  uint64_t chunks_registered = 0;
  uint64_t bytes_registered = 0;
};
HostRegistrationStats host_registration_stats();

}  // namespace cascade
