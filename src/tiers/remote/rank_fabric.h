// RankFabric: the MPI plumbing under one rank's remote tier.
//
// It owns:
//   - a duplicate of the caller's communicator (our messages never match
//     the application's) and the node communicator (ranks sharing memory);
//   - the shared-memory window (MPI_Win_allocate_shared over the node) that
//     holds this rank's arena segment, and the addresses at which the
//     segments of the other ranks of the node are mapped here, so a local
//     peer's block is a load away;
//   - an RMA window (MPI_Win_create over the same segment, every rank) for
//     ranks on other nodes — created only when the group spans nodes or
//     node_local_loads is off — in one passive-target epoch (lock_all) for
//     its whole life;
//   - the progress thread. It receives every message (MPI_Improbe +
//     MPI_Mrecv), hands replies to the waiting callers (PendingCalls) and
//     requests to the attached RequestHandler (the owner side of the tier),
//     sends replies, and completes sends. Every send is nonblocking and the
//     fabric owns its buffer until the send completes, so no thread ever
//     blocks on a peer that stopped receiving; waits are bounded by
//     deadlines.
//
// Lifetime: created collectively by OpenDistributed and shared (shared_ptr)
// by the tier and by an attribute on MPI_COMM_SELF, whose delete callback
// runs at the start of MPI_Finalize on every rank: it leaves the group if
// the tier is still attached, stops the progress thread and frees windows
// and communicators (collective, in the same order everywhere). After that
// every operation fails with Unavailable. A tier that closes earlier only
// detaches (closing is local); the windows live until MPI_Finalize.
//
// Thread-safety: all methods are thread-safe (MPI_THREAD_MULTIPLE).
// Use (a shared lock) keeps windows and memory mapped while an operation
// runs; shutdown() takes it exclusively.
// Lock order: lifecycle_ (shared) -> recv_mu_ -> handler_mu_ ->
// PendingCalls / sends_mu_.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "cascade/status.h"
#include "tiers/remote/hash_ring.h"
#include "tiers/remote/pending_calls.h"
#include "tiers/remote/wire_format.h"

namespace cascade::remote {

inline constexpr int kRequestTag = 7101;
inline constexpr int kReplyTag = 7102;

// The owner side of a tier, as the fabric sees it. Called by whichever
// thread is receiving (the progress thread, or a caller waiting for a
// reply), one call at a time.
class RequestHandler {
 public:
  virtual ~RequestHandler() = default;
  // Serves one request from `peer`; a returned message is sent back as the
  // reply.
  virtual std::optional<Message> serve(int peer, Message&& request) = 0;
  // A reply from `peer` that no caller waits for any more (it timed out):
  // undo what the reply granted.
  virtual void on_stale_reply(int peer, const Message& reply) = 0;
  // `peer` announced that it is leaving the group.
  virtual void on_peer_left(int peer) = 0;
  // Every few milliseconds.
  virtual void on_tick() = 0;
};

class RankFabric {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective over `comm`. segment_bytes: this rank's arena (ranks may
  // differ). REQUIRES: MPI initialized with MPI_THREAD_MULTIPLE.
  static Result<std::shared_ptr<RankFabric>> Open(MPI_Comm comm, uint64_t segment_bytes,
                                                  bool node_local_loads);
  ~RankFabric();
  RankFabric(const RankFabric&) = delete;
  RankFabric& operator=(const RankFabric&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int nodes() const { return nodes_; }
  // Peer reachable with loads and stores (same node, node_local_loads).
  bool loads_reach(int peer) const { return !peer_base_.empty() && peer_base_[peer] != nullptr; }
  uint8_t* local_base() const { return local_base_; }
  uint64_t segment_bytes() const { return segment_bytes_; }
  // REQUIRES: loads_reach(peer).
  uint8_t* peer_base(int peer) const { return peer_base_[peer]; }
  // Maps the pages of [offset, offset + n) of a peer's segment into this
  // process ahead of a copy, in 64 MiB steps, once per step: one
  // MADV_POPULATE_WRITE instead of a page fault per 4 KiB page (the owner
  // backed the memory; this only builds our page tables). The owner commits
  // whole 64 MiB steps, so a step holding a granted or leased range is
  // backed. REQUIRES: loads_reach(peer).
  void map_peer_range(int peer, uint64_t offset, uint64_t n);
  bool cuda_aware() const { return cuda_aware_; }

  LiveRanks& live() { return live_; }
  PendingCalls& calls() { return calls_; }

  // A peer that left no answer in time: calls to it fail at once for a
  // while (Unavailable), twice as long after each such failure in a row
  // (from `base` up to 30 s), and any reply from it ends the streak. It
  // keeps its place in every rank's ring: routing around it here alone
  // would put its ids at another owner for this rank only.
  void note_unanswered(int peer, std::chrono::milliseconds base);
  // Whether calls to the peer are skipped now.
  bool skipped(int peer) const;

  // Holds windows and memory mapped for the duration of an operation.
  class Use {
   public:
    explicit Use(std::shared_mutex& mu, const std::atomic<bool>& down) : lock_(mu) {
      ok_ = !down.load(std::memory_order_acquire);
    }
    bool ok() const { return ok_; }

   private:
    std::shared_lock<std::shared_mutex> lock_;
    bool ok_;
  };
  Use use() { return Use(lifecycle_, down_); }
  static Status finalized_status();

  // One-sided transfers, complete at the target when they return.
  // REQUIRES: a Use is held; the peer's range was granted or leased.
  Status rma_get(int peer, uint64_t offset, void* dst, uint64_t n);
  Status rma_put(int peer, uint64_t offset, const void* src, uint64_t n);

  // Sends without waiting for the peer (the fabric keeps the bytes).
  Status post(int peer, int tag, const Message& m);
  // Sends a request; wait for the reply with calls().wait(call, deadline).
  Result<std::shared_ptr<PendingCalls::Call>> start_call(int peer, Message request);
  // start_call + wait.
  Result<Message> call(int peer, Message request, Clock::time_point deadline);
  // Receives and dispatches what has arrived, unless another thread is at
  // it; for callers waiting on calls().wait(). Returns whether it did work.
  bool try_poll();

  // Whether `value` is the same on every rank (collective; open time only).
  Result<bool> all_equal(uint64_t value);
  // OK on every rank when `local` is OK on every rank; otherwise the
  // failing ranks keep their status and the others get Unavailable
  // (collective; open time only).
  Status agree(const Status& local);

  void attach(RequestHandler* handler);
  // After detach() the handler is never called again; requests are then
  // answered Gone, or not at all when `silent`.
  void detach(bool silent);
  // Tells every present peer that this rank leaves.
  void announce_leave();

  // Stops the progress thread and frees windows and communicators
  // (collective). Idempotent; the MPI_Finalize hook calls it.
  void shutdown();
  bool is_shut_down() const { return down_.load(std::memory_order_acquire); }

  uint64_t bad_messages() const { return bad_messages_.load(std::memory_order_relaxed); }

 private:
  RankFabric() : live_(1) {}
  void run();
  // Receives and dispatches what has arrived. Any thread may do it (callers
  // waiting for a reply do, saving a wake-up); recv_mu_ lets one at a time.
  bool poll_once();  // REQUIRES: recv_mu_ held
  void dispatch(int source, int tag, std::span<const uint8_t> bytes);
  void reap_sends(bool all);
  Status install_finalize_hook(const std::shared_ptr<RankFabric>& self);
  void free_mpi_objects();

  int rank_ = 0, size_ = 1, nodes_ = 1;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm node_comm_ = MPI_COMM_NULL;
  MPI_Win shared_win_ = MPI_WIN_NULL;
  MPI_Win rma_win_ = MPI_WIN_NULL;
  uint8_t* local_base_ = nullptr;
  uint64_t segment_bytes_ = 0;
  std::vector<uint8_t*> peer_base_;   // null: not reachable with loads
  std::vector<uint64_t> peer_bytes_;  // segment size of every rank
  // Per reachable peer, one flag per 64 MiB step: mapped here already.
  std::vector<std::unique_ptr<std::atomic<uint8_t>[]>> peer_mapped_;
  bool cuda_aware_ = false;

  LiveRanks live_;
  PendingCalls calls_;
  struct Unanswered {
    std::atomic<int64_t> skip_until_ns{0};  // steady clock
    std::atomic<uint32_t> streak{0};
    std::atomic<int64_t> base_ns{0};  // the deadline of the last call it left unanswered
  };
  std::unique_ptr<Unanswered[]> unanswered_;  // one per rank

  std::shared_mutex lifecycle_;
  std::atomic<bool> down_{false};
  std::atomic<bool> stop_{false};
  std::thread progress_;

  std::mutex recv_mu_;
  std::vector<uint8_t> recv_buf_;            // guarded by recv_mu_
  std::atomic<int64_t> last_message_ns_{0};  // steady clock of the last message received
  std::mutex handler_mu_;
  RequestHandler* handler_ = nullptr;  // guarded by handler_mu_
  bool silent_ = false;                // guarded by handler_mu_

  struct PendingSend {
    MPI_Request request;
    std::vector<uint8_t> bytes;
  };
  std::mutex sends_mu_;
  std::vector<std::unique_ptr<PendingSend>> new_sends_;  // guarded by sends_mu_
  std::vector<std::unique_ptr<PendingSend>> sends_;      // progress thread only

  std::atomic<uint64_t> bad_messages_{0};
};

}  // namespace cascade::remote
