// PoolServer: the node pool, one store shared by every process of a node
// (`cascade serve`).
//
// The server owns a CascadeStore whose top tier is the host tier (a
// shared-memory arena) and whatever tiers its config puts below it. Client
// processes (PoolTier, src/tiers/pool) connect to its Unix socket, map the
// arena and a file of request channels, and write and read block bytes in the
// arena themselves; the server only answers metadata requests: lookup,
// reserve, commit, abort, lease, release, remove, flush (pool_wire.h).
//
// Threads: one monitor thread accepts connections (each handshake on a
// thread of its own, with a deadline) and watches every client's socket; a
// fixed pool of workers answers the requests of every channel of every
// client, a channel served by one worker at a time so that its requests
// stay in order (clients ring a shared doorbell when the workers sleep:
// pool_channel.h); one flusher runs the clients' flushes, which write blocks
// down to files and may take seconds, so that they hold no worker; one
// reaper cleans up after clients that went away. A client is gone when its socket ends (exit,
// SIGKILL, close): its leases end and its reservations are freed, so a
// client killed mid-put leaves neither a visible partial block nor leaked
// space, and one killed mid-read holds nothing.
//
// Namespaces: a client names a namespace at connect; the ids it sends are
// mapped into that namespace (the first 128 bits of SHA-256 over the
// namespace's digest and the id), so no request can name a block of another
// namespace. Unless `share_across_users`, a namespace is also the client's
// uid's own: two users never share blocks through the API.
//
// Access: the socket is created owner-only and then set to socket_mode; a
// peer is let in when its uid is the server's, or allowed_gid is its primary
// gid or one of its supplementary groups. The arena file stays 0600: clients get it as a
// descriptor.
//
// Thread-safety: stats(), clients() and close() may be called from any thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cascade/config.h"
#include "cascade/stats.h"
#include "cascade/store.h"
#include "serve/cluster_node.h"

namespace cascade {

struct PoolServerOptions {
  std::string socket_path;
  uint32_t socket_mode = 0600;  // 0660 lets allowed_gid's members connect
  int64_t allowed_gid = -1;     // -1: only the server's uid
  int max_clients = 256;
  int max_channels_per_client = 64;
  bool share_across_users = false;
  // How long a connecting peer has to send its hello.
  uint32_t handshake_timeout_ms = 2000;
  // Threads that answer requests, shared by all channels of all clients.
  // 0: two per core, at most 16 (a request takes microseconds, so a few
  // workers keep up with many clients; a sleeping worker costs nothing; at
  // most this many requests that wait for a lower tier, such as a reserve
  // that demotes blocks, run at once).
  int workers = 0;
};

class PoolServer {
 public:
  // Opens the store (its pipeline must start with the host tier and dedup
  // must be off) and starts listening. Busy when a server listens on the
  // socket already.
  static Result<std::unique_ptr<PoolServer>> Start(const CascadeConfig& config,
                                                   const PoolServerOptions& options);
  ~PoolServer();  // close()
  PoolServer(const PoolServer&) = delete;
  PoolServer& operator=(const PoolServer&) = delete;

  // Stops accepting, disconnects every client (their leases end), then
  // closes the store (writing blocks down per its durability contract).
  // Returns the store's close status. Idempotent.
  Status close();

  struct Stats {
    uint64_t clients = 0;       // connected now
    uint64_t leases = 0;        // held by connected clients now
    uint64_t reservations = 0;  // open now
    uint64_t connections = 0;   // accepted since start
    uint64_t refused = 0;       // peers refused (credentials, hello, limits)
    uint64_t disconnects = 0;   // clients gone, with their leases and reservations ended
    uint64_t requests = 0;
    uint64_t malformed = 0;  // requests answered InvalidArgument for their form
    // Doorbell counts a client overwrote, set back (PoolServer::Impl::check_doorbell).
    uint64_t doorbell_repairs = 0;
    uint64_t reclaimed_leases = 0;
    uint64_t reclaimed_reservations = 0;
    uint64_t lookups = 0, lookup_hits = 0;
    uint64_t commits = 0, bytes_committed = 0;
    uint64_t leases_granted = 0, bytes_leased = 0;
    double open_seconds = 0;  // opening the store (with a reattach of a kept arena)
    StoreStats store;
  };
  Stats stats() const;

  struct ClientInfo {
    uint64_t id = 0;
    pid_t pid = 0;
    uid_t uid = 0;
    std::string name_space;
    uint32_t channels = 0;
    uint64_t leases = 0;
    uint64_t reservations = 0;
    uint64_t requests = 0;
  };
  std::vector<ClientInfo> clients() const;

  const std::string& socket_path() const;
  CascadeStore* store();

  // Makes this server a member of a cluster of node servers: lookups and
  // leases that miss here ask the blocks' owners, and what clients commit
  // here is pushed to its owners (cluster_node.h). The node lives until the
  // server closes. Busy when started already.
  Result<ClusterNode*> start_cluster(const ClusterNodeOptions& options);
  ClusterNode* cluster();  // null unless started

 private:
  class Impl;
  explicit PoolServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cascade
