// RemoteTier: the host-memory level of a distributed store — this rank's
// arena and, through MPI, the arenas of every other rank.
//
// Each block id has one owner rank (HashRing over the ranks present). A
// block owned here lives in this rank's LocalShare and is handled like the
// host tier handles its blocks. A block owned by a peer is stored and read
// with the owner's help:
//   put:  PutBegin -> the owner grants a range of its arena (or answers
//         Exists: the id is stored once, whoever puts it) -> the writer
//         copies the bytes into the range (a store into the shared window on
//         the same node; MPI_Put + flush across nodes) -> PutCommit -> the
//         owner publishes the block in its index. put returns after the
//         commit is acknowledged, so every rank can read the block then.
//   read: Lookup (with a lease) -> the owner answers where the block is and
//         leases it (it cannot be evicted or its range reused) -> the reader
//         copies it straight into the caller's buffer (loads on the same
//         node, MPI_Get across nodes), verifies the checksum where the
//         options ask for it -> Release.
// Readers never see half-written bytes: a block is in the owner's index only
// after its writer finished (commit after copy), and a leased range is never
// reused. read_batch sends one Lookup per owner and 64 ids, all at once.
//
// A rank that closes its store leaves the group: peers treat its blocks as
// misses at once (or after request_timeout_ms when it leaves silently).
// An owner that does not answer within request_timeout_ms is treated as
// gone: reads are misses, puts fail with Unavailable, and its ids move to
// the next rank on the ring.
//
// Thread-safety: all Tier methods are thread-safe. The owner side
// (RequestHandler) runs on the fabric's progress thread only; the state only
// it touches is marked so.
// Ownership: the store owns the tier; the tier and the MPI_Finalize hook
// share the fabric.
#pragma once

#include <atomic>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "cascade/distributed.h"
#include "cascade/tier.h"
#include "tiers/remote/hash_ring.h"
#include "tiers/remote/local_share.h"
#include "tiers/remote/rank_fabric.h"
#include "tiers/remote/reservation_table.h"
#include "tiers/tier_counters.h"
#include "util/thread_pool.h"

namespace cascade::remote {

class RemoteTier final : public Tier, private RequestHandler {
 public:
  // REQUIRES: options validated and equal on every rank.
  RemoteTier(std::shared_ptr<RankFabric> fabric, const CascadeConfig& config,
             const DistributedOptions& options, ThreadPool* pool);
  ~RemoteTier() override;  // leaves the group

  TierKind kind() const override { return TierKind::kRemote; }
  Status put(const BlockId& id, const void* data, uint64_t size,
             const PutOptions& options) override;
  Status read(const BlockId& id, const ReadRequest& req, ReadResult* result) override;
  void read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                  std::span<ReadResult> results, std::span<Status> statuses) override;
  // One PutBegin and one PutCommit per owner and 64 blocks, the copies in
  // parallel: two round trips per batch instead of two per block.
  void put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                 std::span<const uint64_t> sizes, const PutOptions& options,
                 std::span<Status> statuses) override;
  bool prefers_batches(MemoryKind) const override { return true; }
  // Zero-copy for blocks of this rank and of ranks on the same node;
  // NotSupported for blocks held on other nodes.
  Result<BlockView> acquire(const BlockId& id) override;
  Result<uint64_t> size_of(const BlockId& id) override;
  bool contains(const BlockId& id) const override;
  Status remove(const BlockId& id) override;
  // Victims come from this rank's own share.
  std::vector<Victim> claim_victims(uint64_t bytes) override;
  Status remove_victim(const Victim& victim) override;
  void unclaim(Victim victim) override;
  uint64_t capacity_bytes() const override { return share_.capacity(); }
  // The share's counters (blocks of this rank) plus this tier's (traffic
  // with peers).
  TierStats stats() const override;
  // Drops this rank's share. Every rank clearing clears the whole tier.
  void clear() override;

  int owner_of(const BlockId& id) const { return ring_.owner(id, fabric_->live()); }

 protected:
  void release_lease(uint64_t token) override;

 private:
  using Clock = std::chrono::steady_clock;

  // ---- client side ----------------------------------------------------------
  Clock::time_point deadline() const;
  // A failed call: an owner that timed out is treated as gone.
  Status call_failed(int owner, const Status& st) const;
  Status put_unlocked(const BlockId& id, const void* data, uint64_t size,
                      const PutOptions& options);
  void count_put(uint64_t size, const PutOptions& options);
  Status put_to_peer(int owner, const BlockId& id, const void* data, uint64_t size,
                     const PutOptions& options, Clock::time_point until, bool* retry);
  Status write_to_peer(int owner, uint64_t offset, const void* data, uint64_t size,
                       const PutOptions& options, uint64_t* checksum);
  // What a PutBegin answer other than Granted means for the put.
  Status begin_refused(int owner, const BlockId& id, uint64_t size, Outcome outcome, bool* retry);
  // Copies n bytes of a block a peer leased to us (item: the Lookup reply).
  Status copy_from_peer(int owner, const Item& found, const ReadRequest& req, uint64_t n);
  Status read_unlocked(const BlockId& id, const ReadRequest& req, ReadResult* result);
  // A view of the share's handed to the store: released through this tier,
  // which counts the views it has out.
  BlockView adopt(BlockView view);
  bool verifies(int owner) const;
  void release_remote(int owner, uint64_t token) const;

  // ---- owner side (progress thread) --------------------------------------
  std::optional<Message> serve(int peer, Message&& request) override;
  void on_stale_reply(int peer, const Message& reply) override;
  void on_peer_left(int peer) override;
  void on_tick() override;
  Item serve_put_begin(int peer, const Item& it);
  Item serve_put_commit(int peer, const Item& it);
  void serve_put_abort(int peer, const Item& it);
  Item serve_lookup(int peer, const Item& it);
  void serve_release(int peer, uint64_t token);
  void drop_peer_leases(int peer);
  void leave();

  std::shared_ptr<RankFabric> fabric_;
  DistributedOptions options_;
  HashRing ring_;
  ThreadPool* pool_;
  uint64_t parallel_threshold_;
  bool checksums_;  // blocks carry checksums (someone may verify them)
  LocalShare share_;
  const int me_;

  // Owner side, progress thread only.
  ReservationTable reservations_;
  std::unordered_map<int, std::unordered_multiset<uint64_t>> peer_leases_;
  // Mirrors for the closing thread (written by the progress thread).
  std::atomic<size_t> peer_lease_count_{0};
  std::atomic<size_t> open_reservations_{0};
  std::atomic<bool> leaving_{false};

  // Counters of the traffic with peers (the share counts its own blocks).
  mutable TierCounters counters_;
  mutable std::atomic<uint64_t> remote_hits_{0}, remote_misses_{0};
  mutable std::atomic<uint64_t> timeouts_{0}, corrupt_{0}, dedup_remote_{0};
  std::atomic<uint64_t> served_puts_{0}, served_lookups_{0};
  // BlockViews this rank holds (acquire, claimed victims): what stats()
  // reports as leased. Leases peers hold on this rank's blocks are not
  // counted there: the tier waits for them itself when it leaves.
  std::atomic<int64_t> views_{0};
};

}  // namespace cascade::remote
