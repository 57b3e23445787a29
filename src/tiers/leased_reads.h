// Copies out of blocks a memory tier holds under leases (a host arena, the
// node pool's arena), for a batch of reads. The batch goes a part at a
// time: a part's blocks are leased, its copies are queued on the GPU as one
// batched operation (DeviceCopyPipeline), and while the GPU copies them the
// next part is leased; a part's leases are given back once its copies are
// complete. The per-block work of leasing and checking then runs while the
// GPU copies, instead of before the first copy.
//
// Thread-safety: a plain function of its arguments, run by one thread; the
// lease and release functions run on it.
// Ownership: the caller's lease and release functions own the leases.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "cascade/memory_kind.h"
#include "cascade/status.h"
#include "cascade/tier.h"

namespace cascade {

// A leased block's bytes.
struct LeasedBytes {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
};

// Leases the blocks of items [begin, end): sets statuses[i] (OK for a hit,
// with blocks[i] its bytes) and may set results[i].is_prefix.
using LeasePart = std::function<void(size_t begin, size_t end, std::span<LeasedBytes> blocks)>;
// Gives back the leases of items [begin, end); called once their copies
// are complete (or failed).
using ReleasePart = std::function<void(size_t begin, size_t end)>;

// Reads reqs out of leased blocks, a part at a time (PipelineParts). For
// each hit: sets results[i].block_size, checks reqs[i] against the block
// (ReadRequest::span) and copies that span out. On return statuses[i] says
// how item i ended and results[i].copied what it wrote. Returns the bytes
// copied. The copies of the requests sharing a destination kind and stream
// are queued together; two parts at most are leased at once.
// REQUIRES: the device memory of the requests sharing a stream is on one
// GPU (DeviceCopyPipeline).
uint64_t read_leased_in_parts(MemoryKind src_kind, std::span<const ReadRequest> reqs,
                              std::span<ReadResult> results, std::span<Status> statuses,
                              const LeasePart& lease, const ReleasePart& release);

// True when some request of the batch writes to device memory.
bool any_device_out(std::span<const ReadRequest> reqs);

}  // namespace cascade
