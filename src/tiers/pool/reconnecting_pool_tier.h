// ReconnectingPoolTier: the node pool tier of a store (pipeline "pool"),
// which connects again when its server is lost.
//
// A PoolTier is one connection: once its server dies, or stops answering
// past a request's deadline, every call on it fails with Unavailable. This
// tier holds the connection in use and a watcher thread that
//   - notices the server closing the connection at once, even while no
//     call is made (it waits on the socket), and a stall when the
//     connection reports one (it writes to the watcher's eventfd, whichever
//     of its threads found it);
//   - then sets the connection aside: calls made from then on fail at once
//     with Unavailable (no call waits for the server to come back), and the
//     old connection is closed as soon as no call runs on it and no view it
//     handed out is held. Closing it unmaps the old arena, which lets a
//     restarted server reattach that arena with its blocks (a server finds
//     an arena still mapped by its predecessor's clients in use, and starts
//     on a new one);
//   - connects again, soon and then less often (kFirstRetry doubling up to
//     kLastRetry), with the store's configuration, until a server welcomes
//     it; calls use the new connection from then on.
// A flush made while the server is lost does not fail at once: it asks the
// watcher to try to connect now and waits for that attempt (a server just
// started again is then flushed to, as a close() of the store asks).
// A view held across the loss stays valid: it keeps its connection, and
// that connection's mapping of the old arena, until it is released.
// A child forked from the process that opened the tier inherits none of
// its mappings (PoolTier maps them MADV_DONTFORK, so that a child cannot
// keep the arena's lock held either): its calls fail with
// Unavailable, saying so.
//
// stats() adds up the traffic counters of every connection this tier made;
// `reconnects` counts the connections made again, and `disconnected` says
// that the server is lost and no new connection is made yet.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cascade/config.h"
#include "cascade/tier.h"
#include "tiers/pool/pool_tier.h"

namespace cascade {

class ReconnectingPoolTier final : public Tier {
 public:
  // The first connection is made here: Open fails as PoolTier::Open does.
  static Result<std::unique_ptr<ReconnectingPoolTier>> Open(const CascadeConfig& config,
                                                            ThreadPool* pool);
  ~ReconnectingPoolTier() override;

  // How soon a lost connection is made again, and the longest wait between
  // attempts while the server does not answer.
  static constexpr auto kFirstRetry = std::chrono::milliseconds(20);
  static constexpr auto kLastRetry = std::chrono::milliseconds(1000);
  // How long a flush made while the server is lost waits for its attempt
  // to connect at once.
  static constexpr auto kConnectNowWait = std::chrono::milliseconds(250);

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
  void acquire_batch(std::span<const BlockId> ids, std::span<BlockView> views,
                     std::span<Status> statuses) override;
  bool contains(const BlockId& id) const override;
  void contains_batch(std::span<const BlockId> ids, std::span<uint8_t> found) const override;
  void sizes_batch(std::span<const BlockId> ids, std::span<uint8_t> found,
                   std::span<uint64_t> sizes) override;
  Result<uint64_t> size_of(const BlockId& id) override;
  Status remove(const BlockId& id) override;
  std::vector<Victim> claim_victims(uint64_t) override { return {}; }
  void unclaim(Victim victim) override { victim.view.reset(); }
  uint64_t capacity_bytes() const override { return capacity_.load(std::memory_order_relaxed); }
  TierStats stats() const override;
  void clear() override {}
  Status flush() override;
  bool persistent() const override { return persistent_.load(std::memory_order_relaxed); }

 protected:
  // Views are the connections' own: they release their leases there.
  void release_lease(uint64_t) override {}

 private:
  ReconnectingPoolTier(const CascadeConfig& config, ThreadPool* pool);
  // The connection in use; null while the server is lost.
  std::shared_ptr<PoolTier> link() const;
  Status lost_status() const;
  void watch();
  // Sets the connection in use aside when it is lost (true: it was).
  bool set_aside_if_lost();
  // Closes the connections set aside that nothing uses any more.
  void close_unused();
  void wake() const;
  // Makes `t` the connection in use. REQUIRES: mu_ held.
  void adopt(std::unique_ptr<PoolTier> t);
  // The connection in use, after one attempt to connect that starts after
  // this call (when the server is lost); null when that attempt fails.
  std::shared_ptr<PoolTier> link_or_connect_now();

  const CascadeConfig config_;
  ThreadPool* const pool_;
  int wake_fd_ = -1;  // an eventfd: the watcher's wake-up
  mutable std::mutex mu_;
  std::shared_ptr<PoolTier> current_;             // guarded by mu_
  std::vector<std::shared_ptr<PoolTier>> aside_;  // watcher only, and stats() under mu_
  TierStats closed_;          // the counters of connections closed (guarded by mu_)
  std::string last_attempt_;  // why the last attempt to connect again failed (guarded by mu_)
  // Attempts to connect again started and ended (guarded by mu_; the
  // watcher notifies attempt_cv_ at each end), and a caller's wish for an
  // attempt now rather than at the next retry.
  uint64_t attempts_started_ = 0, attempts_ended_ = 0;
  std::condition_variable attempt_cv_;
  std::atomic<bool> attempt_now_{false};
  std::atomic<uint64_t> capacity_{0};
  std::atomic<bool> persistent_{false};
  std::atomic<uint64_t> reconnects_{0};
  // Connections lost (set aside), and how many of those losses a flush of
  // every block of the pool has covered since.
  std::atomic<uint64_t> losses_{0};
  std::atomic<uint64_t> flushed_losses_{0};
  // The kept_since of the server as of this client's last flush (or its
  // first connection); blocks stored through connections closed since they
  // were lost (guarded by mu_), and through every connection as of the
  // last flush.
  std::atomic<uint64_t> kept_since_{0};
  uint64_t stored_on_closed_ = 0;
  std::atomic<uint64_t> stored_at_flush_{0};
  // Blocks stored through the connections other than `current`.
  uint64_t stored_elsewhere(const PoolTier* current) const;
  // fork_generation() of the process that opened the tier.
  const uint64_t generation_;
  std::atomic<bool> stopping_{false};
  std::thread watcher_;
};

}  // namespace cascade
