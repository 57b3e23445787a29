// CascadeStore::Impl: the state of one store and the methods behind its
// public calls; private to src/store. The methods are defined by job:
//   placement.cc      the put side: which tier a put goes to, making room by
//                     demotion, dedup of puts, batch puts
//   reads.cc          the get side: reads down the tiers, promotion on a hit,
//                     batch gets
//   cascade_store.cc  the public CascadeStore methods, open, close, flush,
//                     stats, remove, write-down, async tasks
//
// Lock order: lifecycle_ (shared for every public call, exclusive in close)
// is taken first and only by public entry points; then one stripe of
// content_mu (with dedup, a put from its fingerprint until its link and a
// remove of an alias until the bytes are gone; with write-through, a put or
// commit of an id until it is written through or taken back); below it,
// tiers and the dedup table take their own locks one at a time. No thread
// takes a stripe of content_mu while it holds a copy guard (copies). Work run on the pool calls the
// *_impl functions, which take no lifecycle lock.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <unordered_set>
#include <vector>

#include "cascade/store.h"
#include "cascade/tier.h"
#include "cuda/device_copy.h"
#include "store/copy_registry.h"
#include "store/dedup_table.h"
#include "store/tier_factory.h"
#include "store/write_down.h"
#include "util/thread_pool.h"

namespace cascade {

class CascadeStore::Impl {
 public:
  CascadeConfig config;
  std::unique_ptr<ThreadPool> pool;
  std::vector<std::unique_ptr<Tier>> tiers;
  // Present with dedup_enabled, and when the persistent tier reported
  // aliases at open: then ids resolve through it even if new puts are not
  // deduplicated (dedup_puts false). An id with no alias names itself.
  std::unique_ptr<DedupTable> dedup;
  bool dedup_puts = false;
  // A put linking an id to stored bytes and a remove of their last alias
  // must not interleave, or the link would name bytes just removed: both
  // hold the stripe of the physical id. Write-through puts of one id hold
  // it too (placement.cc).
  std::array<std::mutex, 256> content_mu;
  std::mutex& content_lock(const BlockId& phys);
  // Copies between tiers in flight (evictions, write-downs, promotions): a
  // remove waits for those of its id before it returns (copy_registry.h).
  CopyRegistry copies;
  // Blocks the persistent tier dropped while write-downs ran (write_down.h).
  DropLog drops;
  // Blocks a memory tier kept across a restart (reattached) that a tier
  // below holds too: the copy below may be older, its removal never having
  // been written down. The first time such a block moves down, the copies
  // below are removed and it is written again (take_kept_above).
  std::mutex kept_above_mu;
  std::unordered_set<BlockId> kept_above;  // guarded by kept_above_mu
  // REQUIRES for take: the caller holds a lease on the block above.
  bool take_kept_above(const BlockId& id);
  bool stored_below_top(const BlockId& p) const;
  void undo_if_gone_below(size_t from, const BlockId& phys);
  bool is_kept_above(const BlockId& id);
  std::atomic<bool> any_kept_above{false};  // kept_above is not empty
  // At open: sorts what reattached memory tiers kept against the tiers
  // below (docs/design.md, "Durability contract").
  void find_kept_above();
  // Per tier, set by find_kept_above: a reattached tier that does not
  // agree with the persistent tier, whose blocks are taken as the newer.
  std::vector<bool> kept_tier;
  size_t remote = SIZE_MAX;      // index of the remote tier (distributed stores), or SIZE_MAX
  size_t persistent = SIZE_MAX;  // index of the first persistent tier, or SIZE_MAX

  std::mutex close_mu;
  Status close_status;  // guarded by close_mu

  mutable std::shared_mutex lifecycle;
  std::atomic<bool> closed{false};
  std::mutex inflight_mu;
  std::condition_variable inflight_cv;
  size_t inflight = 0;  // async tasks submitted and not finished; guarded by inflight_mu

  std::atomic<uint64_t> puts{0}, put_failures{0}, gets{0}, hits{0}, misses{0}, dedup_hits{0};
  std::atomic<uint64_t> bytes_put{0}, bytes_got{0};
  std::atomic<uint64_t> batch_room_rounds{0};

  // ---- placement (placement.cc) ---------------------------------------------
  // `why`: the tier's NoSpace that asked for the room (its own reason, such
  // as a full file system, is kept when nothing can be moved out).
  Status make_room(size_t t, uint64_t need, const Status& why);
  // One round of make_room; *all_refused: every victim stayed, the
  // persistent tier having refused each.
  Status move_out_victims(size_t t, uint64_t claim, uint64_t need, const Status& why,
                          bool* all_refused);
  Status put_into(size_t t, const BlockId& id, const void* data, uint64_t size,
                  const PutOptions& o);
  bool fits(size_t t, uint64_t size) const;
  // Write-through of the copy tier `top` holds to every tier below it.
  Status write_through(size_t top, const BlockId& phys, const void* data, uint64_t size,
                       bool stored_here, PutOptions o);
  void undo_put(const BlockId& phys);
  Status put_impl(const BlockId& id, const void* data, uint64_t size, const PutOptions& options);
  Status fail(Status st);
  bool stale_alias_dropped(const BlockId& id);
  Status remove_everywhere(const BlockId& phys, bool* any);
  bool contains_phys(const BlockId& p) const;
  bool same_content_stored(const BlockId& p, const void* data, uint64_t size);
  size_t put_batch_impl(std::span<const BlockId> ids, std::span<const ConstBuffer> data,
                        std::vector<Status>* statuses, const PutOptions& options);
  void put_batch_making_room(std::span<const BlockId> ids, std::span<const void* const> ptrs,
                             std::span<const uint64_t> sizes, const PutOptions& options,
                             std::vector<Status>* statuses);
  Result<Reservation> reserve_impl(const BlockId& id, uint64_t size, const PutOptions& options);
  // What reserve_impl decides before the top tier is asked: a present
  // reservation or an error, or nothing (the tier places it).
  std::optional<Result<Reservation>> reserve_decided(const BlockId& id, uint64_t size,
                                                     const PutOptions& options);
  // The top tier's reserve, making room while it is full.
  Result<Reservation> reserve_making_room(const BlockId& id, uint64_t size,
                                          const PutOptions& options);
  void reserve_batch_impl(std::span<const BlockId> ids, std::span<const uint64_t> sizes,
                          const PutOptions& options, std::vector<Reservation>* reservations,
                          std::vector<Status>* statuses);
  Status commit_impl(const Reservation& r, const PutOptions& options);
  void publish_batch(std::span<const BlockId> ids, const std::vector<const void*>& ptrs,
                     const std::vector<uint64_t>& sizes, const PutOptions& options,
                     std::vector<Status>* statuses);

  // ---- reads (reads.cc) -----------------------------------------------------
  BlockId physical(const BlockId& id) const;
  bool settle(size_t t, const ReadRequest& rq, const Status& st, const ReadResult& rr, GetResult* r,
              Status* out_st);
  // REQUIRES: the caller entered phys in `copies` before it read the block.
  void maybe_promote(size_t t, const BlockId& phys, const void* data, uint64_t size, bool prefix,
                     MemoryKind kind, void* cuda_stream = nullptr);
  Status read_whole(size_t t, const BlockId& phys, std::vector<uint8_t>* buf, ReadRequest* rq,
                    ReadResult* rr);
  Status get_impl(const BlockId& id, ReadRequest rq, GetResult* r,
                  std::vector<uint8_t>* whole = nullptr);
  size_t get_batch_impl(std::span<const BlockId> ids, std::span<const MutableBuffer> out,
                        std::vector<GetResult>* results, std::vector<Status>* statuses,
                        MemoryKind out_kind, void* cuda_stream = nullptr);
  Status promote(const BlockId& phys);

  // ---- removal, durability, async (cascade_store.cc) ------------------------
  Status remove_impl(const BlockId& id);
  Status write_down(const WriteDownOptions& o);
  void submit(std::function<void()> job);
  // At an async call with device buffers: the order its copies keep (see
  // DeviceOrderPoint), or none where a gpu tier lives on another device.
  DeviceOrderPoint order_point(const void* device_memory) const;
};

}  // namespace cascade
