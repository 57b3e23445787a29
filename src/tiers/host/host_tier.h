// HostTier: blocks in a shared-memory arena (an ArenaTier).
//
// Bytes live in a ShmArena at config.shm_path, committed as the allocator's
// high-water mark rises and ahead of it in the background
// (config.shm_populate); ranges come from HostArenaTier's
// ExtentAllocator (no system call per block). Copies of large blocks are split across the
// store's I/O threads. When a GPU is present the arena is registered with it
// so host<->GPU copies are single DMAs.
//
// Thread-safety: all methods are thread-safe (see ArenaTier).
// Ownership: the pool must outlive the tier.
#pragma once

#include <memory>

#include "os/shm_arena.h"
#include "tiers/arena_tier.h"

namespace cascade {

class HostTier final : public HostArenaTier {
 public:
  static Result<std::unique_ptr<HostTier>> Open(const CascadeConfig& config, ThreadPool* pool);
  ~HostTier() override;

  TierKind kind() const override { return TierKind::kHost; }
  SharedArena shared_arena() const override;
  TierStats stats() const override;

 private:
  HostTier(const CascadeConfig& config, std::unique_ptr<ShmArena> arena, ThreadPool* pool);
  Status commit(uint64_t end) override { return arena_->commit(end); }
  void free_space(uint64_t offset, uint64_t size) override { alloc_.free(offset, size); }
  Status copy_in(uint64_t offset, const void* src, uint64_t n, const PutOptions& options) override;
  uint64_t committed_bytes() const override { return arena_->committed(); }

  std::unique_ptr<ShmArena> arena_;
  bool registered_ = false;
};

}  // namespace cascade
