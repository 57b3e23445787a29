// ClusterNode: a node server as a member of a cluster of node servers. It
// moves blocks between this server's arena and the other members' arenas
// over a Transport (one-sided gets and puts), with metadata in small
// messages (cluster_wire.h).
//
// Placement: every member knows the same ring (positions of the members'
// points on a 64-bit ring, and which member each point is; the membership
// service builds it, set_view() installs it). A block id belongs to the
// member of the first point at or after the id's position, and with two
// replicas also to the next distinct member.
//
// Data path, as the node server uses it:
//   - publish(ids): blocks this server's clients committed are pushed to
//     their owners in the background: reserve there, put the bytes straight
//     from this arena into the granted ranges, commit with the checksum the
//     owner checks before the block becomes visible there.
//   - lookup(ids): which of the ids an owner holds (for this server's
//     lookups that missed locally).
//   - fetch(ids): brings the ids from their owners into this server's store:
//     lease there (the owner answers where the block is and its checksum),
//     reserve here, get the bytes straight into the reserved ranges, verify
//     the checksum, commit here, release there. A block that fails its
//     checksum is a miss, never data.
// The owner side answers the other members' requests on threads of its own
// against the store, holding their leases and reservations until they
// release, commit or abort them, until their member leaves the view, or
// until they expire (lease_expiry_ms); a member that is not in the view at
// all loses them, and its connection, a deadline after its Hello.
//
// Failures: every call to a member has a deadline (request_timeout_ms),
// which also bounds the connect and Hellos the call needs first, and no
// call of a request starts once its budget (request_budget_ms) is spent;
// a member that missed one, or whose connection failed, is skipped for a
// while (its ids are misses) and reconnected afterwards. A block never
// becomes visible half-written: an owner publishes a pushed block only after
// its commit, with matching checksum.
//
// Thread-safety: every public method may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/status.h"
#include "cascade/tier.h"
#include "transport/transport.h"

namespace cascade {

class CascadeStore;

struct ClusterNodeOptions {
  std::string node_id;      // this member's id in the view
  uint64_t generation = 0;  // this process's generation (see the member records)
  // The transport's library: UCX (any member reaches any address), or MPI
  // when every member is a rank of one MPI job. With MPI, Start is
  // collective over mpi_communicator (each lane's Transport is created
  // together on every rank), so every rank starts its node at the same
  // time with the same number of lanes, and members' addresses come from
  // the job (e.g. an MPI_Allgather), not from a membership service. The
  // options are checked before the first lane opens, so ranks with the same
  // options fail together; a rank that fails while opening its lanes leaves
  // the others waiting in the collective creation.
  TransportBackend transport = TransportBackend::kUcx;
  int64_t mpi_communicator = TransportOptions::kMpiWorld;  // MPI_Comm_c2f; see TransportOptions
  // Transport fabrics in the backend's terms (UCX_TLS: "tcp", "sm,tcp");
  // empty: the backend's default (MPI: always empty).
  std::string fabrics;
  // Allow fabrics that cannot notice a dead peer (shared memory alone):
  // waits still end at deadlines, but a transfer that missed one is not
  // cancelled.
  bool allow_undetected_failures = false;
  uint32_t request_timeout_ms = 2000;  // deadline of each call to a member
  // How long one lookup, fetch or lease_mapped (one client request of the
  // node server) goes on making member calls: none starts after it (the ids
  // left are misses); a call under way keeps its own deadline. 0: two
  // request_timeout_ms; else request_timeout_ms to an hour.
  uint32_t request_budget_ms = 0;
  uint32_t lease_expiry_ms = 60000;  // what a member holds here ends after this long
  uint32_t retry_after_ms = 1000;    // a failed member is skipped this long
  bool verify = true;                // checksums on every transfer
  uint32_t service_threads = 2;      // threads answering the other members (at least lanes)
  // Transport endpoints, each with the arena registered: copies between
  // members run on as many threads at once.
  uint32_t lanes = 4;
  uint64_t publish_queue = 1 << 16;  // ids waiting to be pushed, at most
  // Members on this host (the same boot id) whose arena file this process
  // may open are read by mapping the file: a fetch copies from it in one
  // pass instead of over the transport.
  bool map_same_host = true;
};

struct ClusterMember {
  std::string node_id;
  uint64_t generation = 0;
  std::vector<uint8_t> address;  // the member's transport address; empty: none yet
};

// The ring as the membership built it: point positions in ascending order,
// and for each the index of its member in `members`.
struct ClusterView {
  uint64_t version = 0;
  // The view may lack members that hold blocks: this server is cut off from
  // the coordination service (it sees itself alone), or takes no part yet.
  // A remove cannot reach those members, and says so.
  bool partial = false;
  std::vector<ClusterMember> members;
  std::vector<uint64_t> positions;
  std::vector<uint32_t> owners;
  uint32_t replicas = 1;
};

struct ClusterStats {
  uint64_t members = 0;  // in the installed view
  uint64_t view_version = 0;
  uint64_t connected = 0;                   // members with a connection now
  uint64_t mapped = 0;                      // members whose arena is mapped here (same host) now
  uint64_t pushed = 0, pushed_bytes = 0;    // blocks this server stored at owners
  uint64_t push_dropped = 0;                // ids not pushed (queue full, failures)
  uint64_t fetched = 0, fetched_bytes = 0;  // blocks brought here from owners
  uint64_t fetched_mapped = 0;              // of them, copied from a mapped arena (same host)
  uint64_t mapped_leases = 0;               // leases clients read from a member's mapped arena
  uint64_t map_failures = 0;                // members on this host whose arena could not be mapped
  uint64_t remote_lookups = 0, remote_hits = 0;     // ids asked of owners
  uint64_t remote_removes = 0, remote_removed = 0;  // ids sent to members to remove; held there
  uint64_t served_removes = 0;                      // ids other members removed here
  uint64_t remove_incomplete = 0;  // removes that could not reach every member (Unavailable)
  uint64_t served_leases = 0, served_lease_bytes = 0;  // blocks other members read here
  uint64_t lease_hashes = 0;  // of them, hashed to answer (no checksum known yet)
  uint64_t served_commits = 0, served_commit_bytes = 0;  // blocks other members stored here
  uint64_t checksum_failures = 0;                        // transfers whose bytes did not match
  uint64_t timeouts = 0;  // calls that missed their deadline or failed
  // Calls not made because their request's budget was spent (a node
  // server's lease-read may count the same ids twice: its leases on mapped
  // arenas, then its fetch).
  uint64_t budget_cuts = 0;
  uint64_t expired = 0;       // leases and reservations of members that never ended them
  uint64_t bad_messages = 0;  // malformed requests or replies
  uint64_t late_replies = 0;  // replies that came after their call gave up, dropped
  uint64_t peer_leases = 0, peer_reservations = 0;  // held here by other members now
  // Local ranges held because a failed get may still write them (fabrics
  // without failure detection, MPI), until the transports close.
  uint64_t quarantined = 0, quarantined_bytes = 0;
};

// A lease at a member whose arena is mapped here (same host): where the
// block is in that arena, as the node server's clients map it too.
struct MappedLease {
  uint32_t arena = 0;  // the mapping's index (mapped_arena); 0: not leased
  uint32_t lane = 0;   // the lane the lease was taken on (for its release)
  uint32_t flags = 0;  // pool::kPrefix
  uint64_t offset = 0, size = 0;
  uint64_t token = 0;     // the owner's
  uint64_t checksum = 0;  // of the block's bytes; 0 when members do not verify
  // The owner keeps the lease at least until then (steady clock, which is
  // the same clock for every process of the host).
  int64_t valid_until_ns = 0;
};

// A member's arena as a file of this host, for a process that maps it.
struct MappedArenaFile {
  std::string path;
  uint64_t device = 0, inode = 0;
  uint64_t file_offset = 0;  // where the arena starts in the file
  uint64_t bytes = 0;
};

class ClusterNode {
 public:
  // Opens the transport and registers the store's shared arena.
  // Unavailable when this build has no transport.
  static Result<std::unique_ptr<ClusterNode>> Start(CascadeStore* store, SharedArena arena,
                                                    const ClusterNodeOptions& options);
  ~ClusterNode();  // close()
  ClusterNode(const ClusterNode&) = delete;
  ClusterNode& operator=(const ClusterNode&) = delete;

  // Where the other members reach this one.
  const std::vector<uint8_t>& address() const;
  std::string backend() const;

  // Installs a new view. Members that left (or came back with a new
  // generation) lose their connection and what they held here.
  // InvalidArgument for a view that is not well formed.
  Status set_view(ClusterView view);

  // The end of a request's budget for member calls, starting now: what a
  // caller that makes several of the calls below for one request passes
  // to each. The calls below take one of their own by default.
  Deadline request_deadline() const;
  static constexpr Deadline kOwnBudget = Deadline::max();

  // found[i]/sizes[i] for each id some owner (other than this member)
  // holds; ids whose owner is this member are left as they are.
  void lookup(std::span<const BlockId> ids, std::span<uint8_t> found, std::span<uint64_t> sizes,
              Deadline budget = kOwnBudget);
  // Removes the ids at every other member of the view: their owners, and
  // members that fetched them into their own stores. removed[i] set where
  // one held id i. Members that failed recently are asked too. Unavailable
  // when a member did not answer within its deadline or the view is
  // partial: a member not reached keeps its copy (and serves it until it is
  // evicted there), so the caller is told the remove may not be whole.
  Status remove(std::span<const BlockId> ids, std::span<uint8_t> removed,
                Deadline budget = kOwnBudget);
  // Brings the ids from their owners into the store; fetched[i] set for
  // those now in the store's top tier.
  void fetch(std::span<const BlockId> ids, std::span<uint8_t> fetched,
             Deadline budget = kOwnBudget);
  // For each id without out[i].arena whose owner's arena is mapped here:
  // leases it at the owner and fills out[i]. Ids of other owners, or that
  // the owner lacks, are left as they are.
  void lease_mapped(std::span<const BlockId> ids, std::span<MappedLease> out,
                    Deadline budget = kOwnBudget);
  // Ends leases lease_mapped granted. Those of arenas no longer mapped end
  // at the owner's expiry.
  void release_mapped(std::span<const MappedLease> leases);
  // Blocks this server's clients copied from mapped arenas whose bytes did
  // not match their checksums (stats().checksum_failures).
  void count_checksum_failures(uint64_t n);
  // The mapped arena with this index; NotFound once it is no longer mapped
  // (its member failed, left or came back as another generation).
  Result<MappedArenaFile> mapped_arena(uint32_t index) const;

  // Queues ids this server's clients committed (new blocks here) for their
  // owners (a no-op for ids owned here). A checksum remembered for an id is
  // forgotten: its new bytes may differ.
  void publish(std::span<const BlockId> ids);
  // Waits until every id published before the call was pushed or dropped,
  // or the deadline passes; false then.
  bool drain(uint32_t timeout_ms);

  ClusterStats stats() const;

  // Stops the service and push threads, ends what members hold here, and
  // closes the transport. Idempotent.
  void close();

 private:
  class Impl;
  explicit ClusterNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cascade
