// HostTier: blocks in a shared-memory arena (an ArenaTier).
//
// Bytes live in a ShmArena at config.shm_path, committed as the allocator's
// high-water mark rises and ahead of it in the background
// (config.shm_populate); ranges come from HostArenaTier's
// ExtentAllocator (no system call per block). Copies of large blocks are split across the
// store's I/O threads. When a GPU is present the arena is registered with it
// so host<->GPU copies are single DMAs.
//
// With config.shm_persist the arena file outlives the tier (warm restart):
// every published block gets a slot in the file's BlockTable (on_publish),
// a background thread seals it (checksums its bytes), flush() seals every
// block published before it, and a block's slot is cleared as it is removed
// (on_unpublish), before any lease on it ends and its range is freed. Opening a tier on an arena
// file that ShmArena reattaches adopts every sealed block whose bytes still match its checksum
// (verified in parallel on the pool's threads), in publication order; the rest are dropped. The
// figures are in stats() (reattached_blocks, reattach_dropped, reattach_bytes, reattach_seconds);
// checksum failures also count as corrupt_blocks.
//
// Thread-safety: all methods are thread-safe (see ArenaTier).
// Ownership: the pool must outlive the tier.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "os/shm_arena.h"
#include "tiers/arena_tier.h"
#include "tiers/host/block_table.h"

namespace cascade {

class HostTier final : public HostArenaTier {
 public:
  static Result<std::unique_ptr<HostTier>> Open(const CascadeConfig& config, ThreadPool* pool);
  ~HostTier() override;

  TierKind kind() const override { return TierKind::kHost; }
  // From device memory: in parts of batched GPU copies
  // (ArenaTier::put_batch_from_device; the copies register the arena's
  // chunks as copy_in would). From host memory: put() per item.
  void put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                 std::span<const uint64_t> sizes, const PutOptions& options,
                 std::span<Status> statuses) override;
  // Batches of device buffers: their copies go as batched GPU operations.
  bool prefers_batches(MemoryKind buffers) const override { return buffers != MemoryKind::kHost; }
  SharedArena shared_arena() const override;
  // Seals every block published before the call (shm_persist).
  Status flush() override;
  TierStats stats() const override;

  // The block table's slots for this config (0 without shm_persist).
  static uint32_t table_slots_for(const CascadeConfig& config);

  // Names the run of this arena's owners, across restarts, in which none
  // lost a block held before it: kept by a start that reattached every
  // block of the arena's table, new when a start lost any (a block not
  // sealed or damaged, a new or replaced arena, blocks of another
  // configuration dropped) or the arena is not persistent. A pool client
  // whose server restarted compares it to learn whether what it stored
  // before may be gone (docs/design.md, "Warm restart").
  uint64_t kept_since() const { return kept_since_; }

  void note_all_below(uint64_t below) override;
  void adopt_place(uint64_t place) override;
  uint64_t unkept(std::span<const BlockId> ids) const override;
  void open_failed() override { arena_->remove_if_new(); }
  bool agrees_below(uint64_t below) const override { return below != 0 && below_mark_ == below; }

 private:
  HostTier(const CascadeConfig& config, std::unique_ptr<ShmArena> arena, ThreadPool* pool);
  Status commit(uint64_t end) override { return arena_->commit(end); }
  void free_space(uint64_t offset, uint64_t size) override;
  Status copy_in(uint64_t offset, const void* src, uint64_t n, const PutOptions& options) override;
  uint64_t committed_bytes() const override { return arena_->committed(); }
  void on_publish(const BlockId& id, const Location& loc, bool is_prefix) override;
  void on_unpublish(const BlockId& id, const Location& loc) override;

  static uint64_t new_kept_since();
  uint64_t kept_since_ = 0;  // decided at open (adopt_place may renew it)
  // The kept mark was unset since this store stored a block without a slot.
  std::atomic<bool> kept_mark_unset_{false};
  uint64_t below_mark_ = 0;  // the arena's mark, taken at open
  // The blocks kept across a restart were dropped at open: the arena was
  // kept over another persistent tier (adopt_place).
  bool dropped_for_place_ = false;
  // Blocks held with no slot in the table (empty, or stored while it was
  // full): a restart does not keep them.
  mutable std::mutex unslotted_mu_;
  std::unordered_set<BlockId> unslotted_;  // guarded by unslotted_mu_

  // Persistence (host_tier_persist.cc).
  void reattach();
  void start_sealer();
  void stop_sealer();
  void seal_loop();

  std::unique_ptr<ShmArena> arena_;
  bool registered_ = false;

  std::unique_ptr<BlockTable> table_;  // null without shm_persist
  std::mutex seal_mu_;
  std::condition_variable seal_cv_;        // work queued, or stop
  std::condition_variable done_cv_;        // the sealer finished an item
  std::deque<BlockTable::Pending> queue_;  // guarded by seal_mu_
  bool sealer_busy_ = false;               // guarded by seal_mu_
  uint64_t sealer_done_ = 0;               // items the sealer finished; guarded by seal_mu_
  bool stop_ = false;                      // guarded by seal_mu_
  std::thread sealer_;
  // What reattach() found; written before the tier is shared.
  uint64_t reattached_blocks_ = 0, reattach_dropped_ = 0, reattach_bytes_ = 0;
  uint64_t reattach_corrupt_ = 0;
  double reattach_seconds_ = 0;
};

}  // namespace cascade
