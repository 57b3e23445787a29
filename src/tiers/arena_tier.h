// ArenaTier: the base of every tier whose blocks live in one mapped arena
// (host: a shared-memory file; gpu: device memory; the remote tier's local
// share: this rank's segment of the node's window).
//
// The base keeps what these tiers have in common: a BlockIndex from ids to
// arena ranges (leases, eviction order), the traffic counters, the read
// range check, and the calls built on them: acquire, size_of, contains,
// remove, claim_victims / unclaim, stats, clear. Its put and read are the
// plain sequences
//   put:  contains? -> allocate -> commit -> copy in -> insert (or free the
//         range when another thread stored the id first)
//   read: lease -> check the range -> copy out -> release
// (a batch of reads into device memory leases all, copies in one batched
// GPU operation, then releases all),
// which a tier whose copies are batched or pipelined (gpu) replaces with
// its own, built on publish() and the same index.
//
// A tier supplies its memory and its copies through the hooks below:
// allocate / commit / free_space (ranges and their backing), copy_in /
// copy_out, and the reserved and committed bytes for stats. HostArenaTier
// supplies the allocator and the copies of tiers whose arena is host memory.
//
// Leases: a leased block is never chosen for eviction; removing it hides it
// at once and frees its range when the last lease ends (BlockIndex).
// Thread-safety: all methods are thread-safe (see BlockIndex for locking);
// hooks may be called from any thread. Ownership: the arena at base() must
// outlive the tier; the derived tier's memory must be usable until its own
// destructor ends (no lease may be released after that).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cascade/config.h"
#include "cascade/tier.h"
#include "index/block_index.h"
#include "tiers/tier_counters.h"
#include "util/extent_allocator.h"
#include "util/thread_pool.h"

namespace cascade {

class ArenaTier : public Tier {
 public:
  Status put(const BlockId& id, const void* data, uint64_t size,
             const PutOptions& options) override;
  Status read(const BlockId& id, const ReadRequest& req, ReadResult* result) override;
  // Reads into host memory are read() per item; a batch with reads into
  // device memory goes a part at a time, each part's blocks leased, copied
  // out as one batched GPU operation while the next part is leased, and
  // released (read_leased_in_parts).
  void read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                  std::span<ReadResult> results, std::span<Status> statuses) override;
  Result<BlockView> acquire(const BlockId& id) override;
  Result<BlockView> acquire_to_copy(const BlockId& id) override;
  Result<uint64_t> size_of(const BlockId& id) override;
  bool contains(const BlockId& id) const override { return index_.contains(id); }
  Status remove(const BlockId& id) override;
  std::vector<Victim> claim_victims(uint64_t bytes) override;
  Status remove_victim(const Victim& victim) override;
  bool removed_by_user(const BlockView& view) const override {
    return view && index_.removed_by_name(view.token());
  }
  void unclaim(Victim victim) override;
  uint64_t capacity_bytes() const override { return capacity_; }
  TierStats stats() const override;
  void clear() override { index_.clear(); }
  void for_each_block(const std::function<void(const BlockId&, uint64_t)>& fn) const override;
  Result<Reservation> reserve(const BlockId& id, uint64_t size, const PutOptions& options) override;
  void reserve_batch(std::span<const BlockId> ids, std::span<const uint64_t> sizes,
                     const PutOptions& options, std::span<Reservation> reservations,
                     std::span<Status> statuses) override;
  Status commit_reserved(const Reservation& r, const PutOptions& options) override;
  void abort_reserved(const Reservation& r) override;

  uint8_t* arena_base() const { return base_; }
  uint64_t capacity() const { return capacity_; }
  BlockIndex& index() { return index_; }
  const BlockIndex& index() const { return index_; }
  // Ends a lease taken through index() or a view's token.
  void release(uint64_t token) { index_.release(token); }

 protected:
  // Puts from device memory into a host arena, a part at a time: a part is
  // reserved, its copies into the arena queued as one batched GPU operation,
  // the next part reserved while they run, and a part's blocks committed
  // (or, where a copy failed, aborted) once its copies are complete.
  // copy_in() is not called: for tiers whose copy_in only copies.
  // REQUIRES: the arena is host memory; options.src_kind is kDevice.
  void put_batch_from_device(std::span<const BlockId> ids, std::span<const void* const> data,
                             std::span<const uint64_t> sizes, const PutOptions& options,
                             std::span<Status> statuses);

  // where: how messages name the tier ("the host tier").
  ArenaTier(const CascadeConfig& config, uint8_t* base, uint64_t capacity, MemoryKind memory,
            std::string where);

 public:
  ~ArenaTier() override;

 protected:
  // ---- what a tier supplies ---------------------------------------------------
  // A stream for copies out of a victim's bytes (Victim::cuda_stream);
  // tiers whose arena is host memory need none.
  virtual void* copy_out_stream() { return nullptr; }
  // Gives a range back: a failed put, a duplicate, or a block whose last
  // lease ended after its removal.
  virtual void free_space(uint64_t offset, uint64_t size) = 0;
  // Bytes handed out by the allocator, and bytes backed by memory.
  virtual uint64_t reserved_bytes() const = 0;
  virtual uint64_t committed_bytes() const = 0;
  // For the plain put and read (a tier that replaces both needs none):
  // a free range of `size` (> 0) bytes, or nullopt when the arena has none
  // (the put is then NoSpace); backing of [0, end) for a range just
  // allocated; the copies into a block's range at `offset` and out of the
  // arena.
  virtual std::optional<uint64_t> allocate(uint64_t /*size*/) { return std::nullopt; }
  // allocate() of each size, in order (one lock for all where the
  // allocator has one).
  virtual void allocate_batch(std::span<const uint64_t> sizes,
                              std::span<std::optional<uint64_t>> out) {
    for (size_t i = 0; i < sizes.size(); ++i) out[i] = allocate(sizes[i]);
  }
  virtual Status commit(uint64_t /*end*/) { return Status::OK(); }
  virtual Status copy_in(uint64_t /*offset*/, const void* /*src*/, uint64_t /*n*/,
                         const PutOptions& /*options*/) {
    return Status::NotSupported("no plain put");
  }
  virtual Status copy_out(void* /*dst*/, const uint8_t* /*src*/, uint64_t /*n*/,
                          const ReadRequest& /*req*/) {
    return Status::NotSupported("no plain read");
  }
  // Called by publish() for every block about to become visible, its bytes
  // complete in the range, before the index has it. When publish() then
  // finds the id stored already, the range goes back through free_space()
  // like any other.
  virtual void on_publish(const BlockId& /*id*/, const Location& /*loc*/, bool /*is_prefix*/) {}
  // Called for every block a removal (remove, an eviction, clear) takes out
  // of the index, before its range can be freed: at once, while readers may
  // still hold leases on it (BlockIndex::Unlist; it must not call back into
  // the index).
  virtual void on_unpublish(const BlockId& /*id*/, const Location& /*loc*/) {}

  // ---- for tiers with their own put and read paths ------------------------
  // InvalidArgument when a block of `size` can never fit.
  Status check_fits(uint64_t size) const;
  // NoSpace when an empty block may not be added: the tier holds
  // capacity / kEntryBytes empty blocks already.
  Status room_for_entry() const;
  static constexpr uint64_t kEntryBytes = 4096;
  // Makes a copied block visible and counts it. false when the id was
  // stored meanwhile: the caller frees its range.
  bool publish(const BlockId& id, const Location& loc, const PutOptions& options);
  // A lease on id, counted as a hit or a miss.
  std::optional<BlockIndex::Lease> lease_counted(const BlockId& id);
  // The block a lease holds, as a view that releases it when it ends.
  BlockView view_of(const BlockIndex::Lease& lease);
  Status not_found() const { return Status::NotFound("not in " + where_); }
  void release_lease(uint64_t token) override { index_.release(token); }

  TierCounters counters_;

 private:
  uint8_t* const base_;
  const uint64_t capacity_;
  const MemoryKind memory_;
  const std::string where_;
  BlockIndex index_;
  const uint64_t max_blocks_;
};

// An ArenaTier whose arena is host memory handed out by an ExtentAllocator
// (the host tier, the remote tier's local share): copies out of it are
// memcpy split over the I/O threads, or device copies for device buffers.
class HostArenaTier : public ArenaTier {
 public:
  static constexpr uint64_t kUnit = 4096;  // allocation unit: page, DMA and O_DIRECT friendly

  const ExtentAllocator& allocator() const { return alloc_; }

 protected:
  // pool: the store's I/O threads (may be null: copies on the caller's thread).
  HostArenaTier(const CascadeConfig& config, uint8_t* base, uint64_t capacity, ThreadPool* pool,
                std::string where);

  std::optional<uint64_t> allocate(uint64_t size) override { return alloc_.allocate(size); }
  void allocate_batch(std::span<const uint64_t> sizes,
                      std::span<std::optional<uint64_t>> out) override {
    alloc_.allocate_batch(sizes, out);
  }
  uint64_t reserved_bytes() const override { return alloc_.used(); }
  Status copy_out(void* dst, const uint8_t* src, uint64_t n, const ReadRequest& req) override;
  // Copies n bytes of the caller's (options.src_kind) to dst in the arena.
  Status copy_to_arena(uint8_t* dst, const void* src, uint64_t n, const PutOptions& options);

  ThreadPool* const pool_;
  const uint64_t parallel_threshold_;
  ExtentAllocator alloc_;
};

}  // namespace cascade
