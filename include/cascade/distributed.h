// Distributed store: one CascadeStore per MPI rank whose host-memory level
// spans the arenas of every rank (the remote tier).
//
// Each block id has an owner rank, chosen by consistent hashing over the
// ranks still in the group. A put stores the block once, in its owner's
// arena: a copy into shared memory when the owner runs on the same node,
// MPI one-sided writes when it does not. Every rank then reads the block
// from there: a load from a shared-memory window on the same node, MPI_Get
// across nodes. The owner keeps the index and serves lookups, reservations
// and commits from a progress thread. docs/design.md ("Distributed tier")
// describes the protocol and its guarantees.
//
// This header includes no MPI header: the communicator crosses as its
// Fortran handle (MPI_Comm_c2f(comm) in C, comm.py2f() in mpi4py), or
// MpiCommunicator::World().
//
// Thread-safety: OpenDistributed is collective over the communicator: every
// rank calls it, once, from one thread. MPI must be initialized with
// MPI_THREAD_MULTIPLE (mpi4py does so by default); when MPI is not
// initialized at all, OpenDistributed initializes it that way and finalizes
// it at process exit. The store it returns is thread-safe like any
// CascadeStore.
// Ownership: the caller owns the store. Closing it is local (no collective
// call): the rank leaves the group and its blocks become misses for the
// others. Its memory windows are freed collectively inside MPI_Finalize; a
// store still open then leaves the group at that point, and later calls on
// it fail with Unavailable.
#pragma once

#include <cstdint>
#include <memory>

#include "cascade/block_id.h"
#include "cascade/config.h"
#include "cascade/status.h"
#include "cascade/store.h"

namespace cascade {

// Which reads of another rank's block verify the block's checksum.
enum class RemoteChecksum : uint8_t {
  kOff,        // none; writers compute no checksum
  kCrossNode,  // reads that crossed the network (MPI_Get); shared-memory reads trust the protocol
  kAlways,     // every read of another rank's block, shared memory included
};

struct DistributedOptions {
  // How long a rank waits for an owner's answer. Past it, a read is a miss,
  // a put fails with Unavailable, and the owner is treated as gone from the
  // group (its ids move to the next rank on the ring). 10 s rides out a busy
  // node; tests use 1-2 s.
  uint32_t request_timeout_ms = 10000;
  // Points per rank on the hash ring. More points even out the share of
  // ids each rank owns (spread ~1/sqrt(points)); 128 keeps the largest share
  // within ~25% of the mean at 64 ranks while the ring stays in L2.
  int ring_points_per_rank = 128;
  // Reach ranks of the same node through the shared-memory window with
  // plain loads and stores (true). false sends every transfer through MPI
  // RMA as if the peer were on another node: the way to exercise the
  // cross-node path on one machine.
  bool node_local_loads = true;
  RemoteChecksum checksum = RemoteChecksum::kCrossNode;
  // On close, tell the other ranks this one is leaving, so they treat its
  // blocks as misses at once. false leaves silently: the others find out
  // through request_timeout_ms. For testing failure handling.
  bool announce_departure = true;
  // Give each rank's file tier its own directory, <file_path>/rank-<r>
  // (a file tier directory belongs to one open store). The same rank of a
  // restarted job reopens the same directory.
  bool file_dir_per_rank = true;

  Status validate() const;
};

// A communicator, as its Fortran handle.
struct MpiCommunicator {
  int64_t fortran_handle = kWorldHandle;
  static constexpr int64_t kWorldHandle = -1;  // stands for MPI_COMM_WORLD
  static MpiCommunicator World() { return MpiCommunicator{}; }
  static MpiCommunicator FromFortran(int64_t handle) { return MpiCommunicator{handle}; }
};

// Opens this rank's part of a distributed store. Collective over `comm`.
// The pipeline is config.pipeline with "host" read as "remote" (the remote
// tier holds this rank's arena); an empty pipeline means "gpu|remote|file"
// resolved as for CascadeStore::Open. shm_capacity_bytes is this rank's
// share. Unavailable when the build has no MPI, MPI lacks
// MPI_THREAD_MULTIPLE, or a peer cannot be reached; every rank gets the same
// outcome.
Result<std::unique_ptr<CascadeStore>> OpenDistributed(
    const CascadeConfig& config, const DistributedOptions& options,
    MpiCommunicator comm = MpiCommunicator::World());

// True when this build has MPI (the remote tier can be opened).
bool distributed_available();

// The rank that owns `id` in a group of `ranks` ranks, all present, with
// `points_per_rank` ring points each: the same answer every rank computes.
// For benchmarks and tools that want to know which reads are local.
int ring_owner(const BlockId& id, int ranks,
               int points_per_rank = DistributedOptions{}.ring_points_per_rank);

}  // namespace cascade
