// PoolTier: the node pool as a tier of this process's store.
//
// The blocks live in the host arena of a `cascade serve` process (and the
// tiers below it there); every process of the node that connects with the
// same namespace sees the same blocks. The arena is mapped into this process
// (and registered with the GPU when one is usable), so block bytes are copied
// straight in and out of it; only metadata goes to the server, in batches,
// over shared-memory channels (pool_wire.h):
//   put_batch:  reserve (1 request) -> copy every block in -> commit (1)
//   read_batch: lease (1) -> copy every hit out -> release (batched later)
//   acquire:    lease (1) -> a BlockView on the arena; release when it ends
// A batch of many small blocks is cut into parts that the I/O threads take
// in turn; each thread sends the reserve (or lease) of its next part, and
// the commit of its last, while it copies one, so that its waits are for
// replies that have usually come already, and a thread left without a part
// copies blocks of the others' so that all end together.
// Reads into host memory lease with kLeaseRead: when the server is a member
// of a cluster and a block is held by a member on this host, the server
// leases it there and the client copies it from that member's arena, which
// it maps read-only (asking the server where its file is), checking the
// block's checksum on the way and that the lease held until the copy ended;
// a block that fails either check is a miss. Mappings of arenas the server
// no longer maps are dropped within a second or two.
// Lease releases are queued and sent in batches (when many are queued, by a
// background thread shortly after, and at close): a lease only keeps a block
// from being evicted a little longer.
//
// The server chooses what to evict, so claim_victims() returns nothing, and
// clear() drops nothing (the blocks are other processes' too; the store
// refuses a clear() of a pipeline with a pool tier). A server that
// dies or stops answering turns every call into Unavailable; the mapped
// arena stays valid for views already held.
//
// Thread-safety: all methods are thread-safe; a call takes one free channel
// (a batch's I/O threads up to two each, the second only when one is free).
// Ownership: views must not outlive the tier.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "cascade/config.h"
#include "cascade/tier.h"
#include "os/file_mapping.h"
#include "tiers/pool/pool_channel.h"
#include "tiers/tier_counters.h"
#include "util/fork_generation.h"
#include "util/thread_pool.h"

namespace cascade {

using pool::Op;

class PoolTier final : public Tier {
 public:
  // Connects to config.pool_socket. Unavailable when no server listens;
  // InvalidArgument when the server refuses the namespace or the peer is
  // not a server of an allowed user. `cancel`, when given and set while the
  // server has not welcomed this client yet, ends the wait (Unavailable).
  // `loss_fd` (an eventfd), when given, is written to once when the tier
  // finds its server lost, whichever thread finds it (a call, the
  // releasing or the mapping thread).
  static Result<std::unique_ptr<PoolTier>> Open(const CascadeConfig& config, ThreadPool* pool,
                                                const std::atomic<bool>* cancel = nullptr,
                                                int loss_fd = -1);
  ~PoolTier() override;

  TierKind kind() const override { return TierKind::kPool; }
  Status put(const BlockId& id, const void* data, uint64_t size,
             const PutOptions& options) override;
  void put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                 std::span<const uint64_t> sizes, const PutOptions& options,
                 std::span<Status> statuses) override;
  Status read(const BlockId& id, const ReadRequest& req, ReadResult* result) override;
  void read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                  std::span<ReadResult> results, std::span<Status> statuses) override;
  bool prefers_batches(MemoryKind) const override { return true; }
  Result<BlockView> acquire(const BlockId& id) override;
  bool contains(const BlockId& id) const override;
  void contains_batch(std::span<const BlockId> ids, std::span<uint8_t> found) const override;
  void sizes_batch(std::span<const BlockId> ids, std::span<uint8_t> found,
                   std::span<uint64_t> sizes) override;
  Result<uint64_t> size_of(const BlockId& id) override;
  Status remove(const BlockId& id) override;
  std::vector<Victim> claim_victims(uint64_t) override { return {}; }
  void unclaim(Victim victim) override { victim.view.reset(); }
  uint64_t capacity_bytes() const override { return capacity_; }
  TierStats stats() const override;
  void clear() override {}
  Status flush() override { return flush(false); }
  // everything: every block of the pool, not only those this connection
  // committed since its last flush.
  Status flush(bool everything);
  bool persistent() const override { return persistent_; }
  // The server's Welcome::kept_since.
  uint64_t kept_since() const { return kept_since_; }
  // Blocks stored through this connection, as its owner counts them.
  void add_stored(uint64_t n) { stored_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t stored() const { return stored_.load(std::memory_order_relaxed); }

  // Leases many blocks at once (one request per kMaxItems): views[i] is a
  // view on a hit, empty on a miss (statuses[i] NotFound) or an error.
  void acquire_batch(std::span<const BlockId> ids, std::span<BlockView> views,
                     std::span<Status> statuses) override;
  // Looks many ids up at once: sizes[i] on a hit, statuses[i] NotFound on a miss.
  void lookup_batch(std::span<const BlockId> ids, std::span<uint64_t> sizes,
                    std::span<Status> statuses) const;
  // The server's counters (clients, leases, reservations, requests).
  Result<pool::ServerStatsReply> server_stats() const;
  uint64_t client_id() const { return client_id_; }
  // Sends the queued lease releases now.
  void release_queued();

  // ---- the connection, for a tier that connects again (ReconnectingPoolTier)
  // True once the server is gone or stopped answering: every later call
  // fails with Unavailable.
  bool lost() const {
    return server_gone_.load(std::memory_order_acquire) ||
           server_stalled_.load(std::memory_order_acquire);
  }
  // Waits up to timeout_ms (-1: no limit) until the server closes the
  // connection, or `wake_fd` (when >= 0) becomes readable; then true when
  // the server is lost. A closed connection makes it so, and so does a
  // server whose heartbeat stood still for pool::kStillHeartbeatMs across
  // these waits (looked at every kWatchBeatMs at least), so that a stopped
  // server is noticed with no call made to it. One thread at a time.
  bool wait_for_loss(int wake_fd, int timeout_ms);
  static constexpr int kWatchBeatMs = 250;
  // Views acquire handed out that their holders still hold.
  uint64_t views_held() const { return views_held_.load(std::memory_order_acquire); }

 protected:
  void release_lease(uint64_t token) override;

 private:
  PoolTier(const CascadeConfig& config, ThreadPool* pool);
  Status connect(const CascadeConfig& config, const std::atomic<bool>* cancel);
  // Takes the server as gone (stalled: as not answering); true when it was
  // so taken already. The first time, writes to loss_fd_.
  bool mark_lost(bool stalled) const;
  // acquire_batch, counting hits and misses when `count`.
  void acquire_views(std::span<const BlockId> ids, std::span<BlockView> views,
                     std::span<Status> statuses, bool count);
  uint64_t releases_sent() const;
  bool send_releases_before_asking_again(uint64_t sent_before);
  // read_batch's requests to the server, once.
  void read_batch_once(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                       std::span<ReadResult> results, std::span<Status> statuses);
  // acquire_batch's requests to the server, once.
  void lease_views(std::span<const BlockId> ids, std::span<BlockView> views,
                   std::span<Status> statuses, bool count);
  // `fence` is started before the descriptors are received.
  Status greet(const CascadeConfig& config, const pool::Hello& hello, pool::Welcome* w,
               std::vector<int>* fds, bool* cut_off, const std::atomic<bool>* cancel,
               std::optional<ForkFence>* fence);
  // Connections a client makes to a server that closes them unanswered.
  static constexpr int kGreetings = 7;

  // A channel held by the caller for one request (or, in a batch's
  // pipeline, for a request in flight).
  struct Slot;
  class Held;
  // A free channel, waiting for one when all are taken. A thread that holds
  // a channel must not wait for another: it asks try_hold().
  Held hold() const;
  // A free channel, the first from `start` on; none when all are taken.
  // `mine`, a channel the caller holds already, is passed over.
  Held try_hold(uint32_t start = 0, const Slot* mine = nullptr) const;
  // Sends the request written in the slot's request area (a header with
  // `flags` and `count` items of item_bytes); await_reply() then waits for
  // the reply header. Unavailable when the server is gone, does not answer
  // within timeout_us, or is stopped (its heartbeat stood still for
  // pool::kStillHeartbeatMs); the channel is not used again. call() does
  // both.
  Status post(Slot* slot, Op op, uint32_t count, uint64_t item_bytes, uint32_t flags = 0) const;
  // On failure reply->count is 0, except where the server answered with
  // another count than asked: then it is the server's count (see
  // items_to_give_back).
  Status await_reply(Slot* slot, pool::ReplyHeader* reply, int64_t timeout_us) const;
  // How many items of a failed call's reply name what the server granted
  // (reservations, leases) and must be given back: those of a reply whose
  // count was not the one asked, up to the count asked. 0 when the call
  // succeeded or no reply came.
  static uint32_t items_to_give_back(const Status& st, const pool::ReplyHeader& reply,
                                     size_t asked);
  Status call(Slot* slot, Op op, uint32_t count, uint64_t item_bytes, pool::ReplyHeader* reply,
              int64_t timeout_us, uint32_t flags = 0) const;
  // Sends op with ids as its items on slot's channel (at most kMaxItems);
  // Unavailable for no slot. The reply's header goes to *reply, its items
  // are in the channel's reply area.
  Status call_with_ids(Slot* slot, Op op, std::span<const BlockId> ids,
                       pool::ReplyHeader* reply) const;
  // Queues releases: sent with the next batch (at once when kReleaseBatch
  // are queued, else by the releasing thread shortly after).
  void release_leases(std::span<const uint64_t> tokens);
  // Queues releases for the releasing thread alone (the caller may hold a
  // channel): it sends them when kReleaseBatch are queued, or shortly after.
  void queue_releases(std::span<const uint64_t> tokens);
  void send_releases(std::vector<uint64_t> tokens, uint32_t flags = 0);
  // A queue taken out under release_mu_ (releases_on_the_way_) is sent.
  void sent_releases();
  void release_loop();
  void map_arena();
  size_t sub_batch(std::span<const uint64_t> sizes) const;

  // The copies of a part of a batch, shared by the batch's threads: once
  // its owner has the part's reserve or lease (share()), any thread takes
  // its copies in turn, and the owner waits until all are done before it
  // commits or releases.
  struct SharedCopies {
    size_t items = 0;  // set before `ready`
    std::atomic<bool> ready{false};
    std::atomic<size_t> next{0}, done{0};
    void share(size_t n) {
      items = n;
      ready.store(true, std::memory_order_release);
    }
  };
  // A batch's parts of `sub` items, which its threads claim in turn.
  template <typename Part>
  struct Parts {
    Parts(size_t n, size_t sub) : count((n + sub - 1) / sub), at(new Part[count]) {
      for (size_t c = 0; c < count; ++c) {
        at[c].begin = c * sub;
        at[c].count = std::min(sub, n - c * sub);
      }
    }
    Part* claim() {
      const size_t c = claimed.fetch_add(1, std::memory_order_relaxed);
      return c < count ? &at[c] : nullptr;
    }
    const size_t count;
    std::unique_ptr<Part[]> at;
    std::atomic<size_t> claimed{0};
    // The parts' copies are long enough to cover a round trip to the
    // server: requests sent before a copy go as pool::kAhead.
    bool ahead = false;
  };
  // The reply to a part's request in flight, or `sent` when that request
  // did not go out (then *reply is all zero).
  Status take_reply(Slot* slot, const Status& sent, pool::ReplyHeader* reply) const;
  template <typename Part, typename CopyOne>
  static void take_copies(Part* p, CopyOne& copy_one);
  template <typename Part, typename CopyOne>
  static void copy_own(Part* p, CopyOne& copy_one);
  template <typename Part, typename CopyOne>
  static void share_copies(Parts<Part>* parts, CopyOne& copy_one, bool wait);

  // A put batch, and a part of it (at most kMaxItems items) on its way:
  // reserved, copied, committed.
  struct PutBatch {
    std::span<const BlockId> ids;
    std::span<const void* const> data;
    std::span<const uint64_t> sizes;
    const PutOptions& options;
    std::span<Status> statuses;
  };
  struct Placed {
    size_t i;  // the item of the batch
    uint64_t offset, token;
  };
  struct PutPart : SharedCopies {
    size_t begin = 0, count = 0;     // items [begin, begin + count) of the batch
    Status sent;                     // of the request in flight
    std::vector<Placed> placed;      // reserved: to copy and commit
    std::vector<size_t> committing;  // indexes into placed, in the commit sent
  };
  void put_stream(const PutBatch& b, Parts<PutPart>* parts);
  void put_from_devices(const PutBatch& b, size_t sub);
  // The requests of a part; `ahead`: sent before the caller waits for them
  // (pool::kAhead).
  Status post_reserve(Slot* slot, const PutBatch& b, const PutPart& part, bool ahead);
  void take_reserve(Slot* slot, const PutBatch& b, PutPart* part);
  void copy_placed(const PutBatch& b, const Placed& t);
  void copy_part(const PutBatch& b, PutPart* part);
  Status post_commit(Slot* slot, const PutBatch& b, PutPart* part, bool ahead);
  void take_commit(Slot* slot, const PutBatch& b, PutPart* part);

  void read_chunk(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                  std::span<ReadResult> results, std::span<Status> statuses);
  void read_to_devices(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                       std::span<ReadResult> results, std::span<Status> statuses, size_t sub);
  void each_part(size_t c0, size_t c1, const std::function<void(size_t)>& fn) const;
  Status copy_in(uint8_t* dst, const void* src, uint64_t n, const PutOptions& options);

  // Reads of host destinations: leases where a block may also be in a
  // cluster member's arena of this host (kLeaseRead), copies, releases. A
  // read batch, and a part of it (at most kMaxItems items) on its way.
  struct ReadBatch {
    std::span<const BlockId> ids;
    std::span<const ReadRequest> reqs;
    std::span<ReadResult> results;
    std::span<Status> statuses;
  };
  struct Leased {
    pool::LeaseReadReply lease{};                   // as the server answered
    const uint8_t* data = nullptr;                  // where the block is in this process
    std::shared_ptr<const ReadOnlyMapping> member;  // lease.arena != 0: its mapping
    // A member's block read through the server (its arena could not be
    // mapped here): the server's lease on its own copy (lease.arena is 0).
    BlockView through_server;
    bool failed = false;  // its copy failed the owner's checksum (written by its copier)
  };
  struct ReadPart : SharedCopies {
    size_t begin = 0, count = 0;   // items [begin, begin + count) of the batch
    Status sent;                   // of the lease request in flight
    std::vector<Leased> got;       // per item
    std::vector<uint64_t> tokens;  // every lease granted, to release
    bool members = false;          // some block is in a member's arena
  };
  void read_stream(const ReadBatch& b, Parts<ReadPart>* parts);
  Status post_lease_read(Slot* slot, const ReadBatch& b, const ReadPart& part, bool ahead);
  void take_lease_read(Slot* slot, const ReadBatch& b, ReadPart* part);
  void map_members(const ReadBatch& b, ReadPart* part);
  void copy_leased(const ReadBatch& b, ReadPart* part, size_t k);
  // Once a part's copies are done: queues the leases whose copies failed
  // their checksum for a release that says so (the server counts them),
  // and takes them out of part->tokens.
  void release_failed(ReadPart* part);
  // The member arena the server numbered `index`, mapped read-only here.
  Result<std::shared_ptr<const ReadOnlyMapping>> member_arena(uint32_t index);
  // Drops the mappings of member arenas the server no longer maps.
  void forget_gone_arenas();

  ThreadPool* const pool_;
  const int64_t timeout_us_;
  const uint64_t parallel_threshold_;
  int sock_ = -1;
  pid_t opened_by_ = ::getpid();  // the process that connected sock_
  const uint64_t generation_;     // fork_generation() of that process
  int loss_fd_ = -1;
  uint64_t client_id_ = 0;
  uint8_t* arena_map_ = nullptr;
  uint64_t arena_map_bytes_ = 0;
  uint8_t* base_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t arena_committed_ = 0;  // backed by the server when this client connected
  std::thread mapper_;
  std::atomic<bool> stop_mapping_{false};
  std::atomic<uint64_t> mapped_bytes_{0};
  // Views handed out by acquire that their holders have not released yet
  // (stats().leased_blocks: the store refuses to close under them).
  std::atomic<uint64_t> views_held_{0};
  // Blocks copied from a member's arena whose checksum did not match
  // (misses; stats().corrupt_blocks). The servers never see these copies.
  std::atomic<uint64_t> corrupt_{0};
  bool persistent_ = false;
  uint64_t kept_since_ = 0;
  std::atomic<uint64_t> stored_{0};
  bool registered_ = false;
  uint8_t* channel_map_ = nullptr;
  uint64_t channel_map_bytes_ = 0;
  uint32_t channel_count_ = 0;
  pool::Doorbell* doorbell_ = nullptr;  // the server's, shared by every client
  struct Slot {
    std::mutex mu;  // held for one request
    pool::Channel ch;
    uint32_t seq = 0;
    Op op = Op::kPing;                             // of the request last posted
    uint32_t count = 0;                            // its items
    uint32_t flags = 0;                            // its RequestHeader::flags
    std::chrono::steady_clock::time_point posted;  // when it was posted
    bool broken = false;
  };
  mutable std::unique_ptr<Slot[]> slots_;
  mutable std::atomic<bool> server_gone_{false};
  // A request went unanswered past its deadline: the server is taken as
  // gone (a stalled server would otherwise cost every request in flight,
  // and every later one, a deadline each).
  mutable std::atomic<bool> server_stalled_{false};
  // The heartbeat as wait_for_loss last saw it change, and when.
  uint64_t watched_beat_ = 0;
  std::chrono::steady_clock::time_point watched_beat_seen_{};

  mutable std::mutex release_mu_;
  std::condition_variable release_cv_;
  std::condition_variable map_cv_;  // the mapper's pause (with release_mu_)
  std::vector<uint64_t> release_queue_;
  // Leases whose copies failed their checksums, released with a flag that
  // says so (by the releasing thread: the reader may hold a channel).
  std::vector<uint64_t> failed_queue_;
  // Queues taken out and being sent, and those sent (guarded by release_mu_).
  int releases_on_the_way_ = 0;
  uint64_t releases_sent_ = 0;
  bool stopping_ = false;
  std::thread releaser_;

  // Cluster members' arenas of this host mapped here, by the server's index.
  std::mutex members_mu_;
  std::map<uint32_t, std::shared_ptr<const ReadOnlyMapping>> member_arenas_;
  // Member arenas this process could not map (another user's file, a path
  // removed or replaced), and why: their blocks are read through the
  // server. Indexes are never reused.
  std::map<uint32_t, Status> unmappable_arenas_;

  mutable TierCounters counters_;
};

}  // namespace cascade
