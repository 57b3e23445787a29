// HostTier: blocks in a shared-memory arena (an ArenaTier).
//
// Bytes live in a ShmArena at config.shm_path, committed in steps as the
// allocator's high-water mark rises; ranges come from an ExtentAllocator
// (no system call per block). Copies of large blocks are split across the
// store's I/O threads. When a GPU is present the arena is registered with it
// so host<->GPU copies are single DMAs.
//
// Thread-safety: all methods are thread-safe (see ArenaTier).
// Ownership: the pool must outlive the tier.
#pragma once

#include <memory>

#include "os/shm_arena.h"
#include "tiers/arena_tier.h"
#include "util/extent_allocator.h"
#include "util/thread_pool.h"

namespace cascade {

class HostTier final : public ArenaTier {
 public:
  static Result<std::unique_ptr<HostTier>> Open(const CascadeConfig& config, ThreadPool* pool);
  ~HostTier() override;

  TierKind kind() const override { return TierKind::kHost; }
  const ExtentAllocator& allocator() const { return alloc_; }

 private:
  HostTier(const CascadeConfig& config, std::unique_ptr<ShmArena> arena, ThreadPool* pool);
  std::optional<uint64_t> allocate(uint64_t size) override { return alloc_.allocate(size); }
  Status commit(uint64_t end) override { return arena_->commit(end); }
  void free_space(uint64_t offset, uint64_t size) override { alloc_.free(offset, size); }
  Status copy_in(uint64_t offset, const void* src, uint64_t n, const PutOptions& options) override;
  Status copy_out(void* dst, const uint8_t* src, uint64_t n, const ReadRequest& req) override;
  uint64_t reserved_bytes() const override { return alloc_.used(); }
  uint64_t committed_bytes() const override { return arena_->committed(); }

  std::unique_ptr<ShmArena> arena_;
  ExtentAllocator alloc_;
  ThreadPool* pool_;
  uint64_t parallel_threshold_;
  bool registered_ = false;
};

}  // namespace cascade
