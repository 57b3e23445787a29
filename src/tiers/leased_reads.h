// Copies out of blocks a memory tier holds under leases (a host arena, the
// node pool's arena), for a batch of reads: the copies of requests that
// share a destination kind and stream go through one device_copy_batch,
// so loads into GPU memory move as one batched operation instead of one
// DMA call per block.
//
// Thread-safety: a plain function of its arguments. Ownership: the blocks
// stay leased by the caller until it returns.
#pragma once

#include <cstdint>
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

// For each i whose statuses[i] is OK on entry (a hit): sets
// results[i].block_size, checks reqs[i] against the block
// (ReadRequest::span) and copies that span out of blocks[i]. On return
// statuses[i] says how item i ended and results[i].copied what it wrote
// (when a batched copy fails, its items are copied again one by one, so a
// failure is reported for the blocks it concerns); items not OK on entry
// are left alone. Returns the bytes copied.
// REQUIRES: the device memory of the requests sharing a stream is on one
// GPU (device_copy_batch).
uint64_t copy_leased_blocks(std::span<const LeasedBytes> blocks, MemoryKind src_kind,
                            std::span<const ReadRequest> reqs, std::span<ReadResult> results,
                            std::span<Status> statuses);

// True when some request of the batch writes to device memory.
bool any_device_out(std::span<const ReadRequest> reqs);

}  // namespace cascade
