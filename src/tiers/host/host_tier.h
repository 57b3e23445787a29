// HostTier: blocks in a shared-memory arena (the seeds' ShmBackend).
//
// Bytes live in a ShmArena at config.shm_path; ranges come from an
// ExtentAllocator (no system call per block); a BlockIndex maps ids to
// ranges, holds leases and the eviction order. Copies of large blocks are
// split across the store's I/O threads. When a GPU is present the arena is
// registered with it so host<->GPU copies are single DMAs.
//
// Thread-safety: all methods are thread-safe (see BlockIndex for locking).
// Ownership: the pool must outlive the tier.
#pragma once

#include <atomic>
#include <memory>

#include "util/extent_allocator.h"
#include "cascade/tier.h"
#include "tiers/tier_counters.h"
#include "index/block_index.h"
#include "util/thread_pool.h"
#include "os/shm_arena.h"

namespace cascade {

class HostTier final : public Tier {
 public:
  static Result<std::unique_ptr<HostTier>> Open(const CascadeConfig& config, ThreadPool* pool);
  ~HostTier() override;

  TierKind kind() const override { return TierKind::kHost; }
  Status put(const BlockId& id, const void* data, uint64_t size, const PutOptions& options) override;
  Status read(const BlockId& id, const ReadRequest& req, ReadResult* result) override;
  Result<BlockView> acquire(const BlockId& id) override;
  bool contains(const BlockId& id) const override;
  Status remove(const BlockId& id) override;
  std::vector<Victim> claim_victims(uint64_t bytes) override;
  void unclaim(Victim victim) override;
  uint64_t capacity_bytes() const override { return arena_->capacity(); }
  TierStats stats() const override;
  void clear() override;
  void for_each_block(const std::function<void(const BlockId&, uint64_t)>& fn) const override;

  uint8_t* arena_base() const { return arena_->base(); }
  const ExtentAllocator& allocator() const { return alloc_; }
  const BlockIndex& index() const { return index_; }

 protected:
  void release_lease(uint64_t token) override { index_.release(token); }

 private:
  HostTier(const CascadeConfig& config, std::unique_ptr<ShmArena> arena, ThreadPool* pool);
  Status copy_in(uint8_t* dst, const void* src, uint64_t n, MemoryKind kind, void* stream);
  Status copy_out(void* dst, const uint8_t* src, uint64_t n, MemoryKind kind, void* stream);

  std::unique_ptr<ShmArena> arena_;
  ExtentAllocator alloc_;
  BlockIndex index_;
  ThreadPool* pool_;
  uint64_t parallel_threshold_;
  bool registered_ = false;
  TierCounters counters_;
};

}  // namespace cascade
