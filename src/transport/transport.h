// Transport: one-sided transfers between processes, and small control
// messages, behind an interface that names no fabric library.
//
// A Transport is one local endpoint: it has an address (opaque bytes another
// process connects to), registers memory regions whose remote keys (opaque
// bytes) it hands to peers, and connects to peers by their address. A Peer
// reads (get) and writes (put) byte ranges of the peer's registered regions
// into and from local memory (registered or plain), one transfer at a time
// with a Completion handle, or as a batch with one wait; and sends small
// tagged messages that the other side's Transport receives.
//
// Deadlines: every call that waits takes one, and returns Unavailable when it
// passes; no call waits on a dead or silent peer past it. A transfer cannot
// be abandoned while the peer may still write the local buffer, so a missed
// deadline closes the connection: every operation pending on that Peer is
// cancelled and fails, and so does every later one (connect again to retry;
// without failure detection, see TransportOptions, the Peer is failed but the
// transfer cannot be cancelled).
// A peer that dies is noticed by the fabric where it can (a reset connection)
// and by the deadline where it cannot.
//
// Progress: transfers move while some thread drives the endpoint: a thread
// that waits (Completion::wait, run_batch, send, receive, progress) drives it
// while it waits; a process that only exposes memory and never waits asks for
// the background progress thread (TransportOptions::progress_thread). Some
// fabrics move bytes without the target's help (shared memory with
// cross-process reads, RDMA); others need the target to progress.
//
// Thread-safety: every method of Transport, Peer, MemoryRegion and
// RemoteRegion is thread-safe. A Completion is used by one thread at a time.
// Ownership: a Peer, a MemoryRegion and a RemoteRegion keep the endpoint's
// state alive (shared ownership), so they may outlive the Transport object;
// after Transport::close() they fail with Unavailable. The caller owns the
// memory it registers and the local buffers of transfers, which must stay
// valid until the transfer completes or fails.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cascade/status.h"

namespace cascade {

using TransportClock = std::chrono::steady_clock;
using Deadline = TransportClock::time_point;

// A deadline `ms` milliseconds from now.
inline Deadline deadline_in(std::chrono::milliseconds ms) { return TransportClock::now() + ms; }

// The library under a Transport: UCX (the default, for serving: endpoints
// come and go, any process connects to any address), or MPI inside an MPI
// job (the endpoints are the ranks of a communicator, created together).
enum class TransportBackend : uint8_t { kUcx, kMpi };

struct TransportOptions {
  TransportBackend backend = TransportBackend::kUcx;
  // MPI: the communicator whose ranks the Transport reaches, as its Fortran
  // handle (MPI_Comm_c2f; mpi4py's comm.py2f()); kMpiWorld: MPI_COMM_WORLD.
  // Creating an MPI Transport is collective over it (transport_mpi.cc).
  int64_t mpi_communicator = kMpiWorld;
  static constexpr int64_t kMpiWorld = -1;
  // Which fabrics the backend may use, in its own terms (UCX: the UCX_TLS list,
  // e.g. "tcp", "sm", "rc,sm"). Empty: the backend's default (UCX picks among
  // what the machine offers, honouring UCX_TLS in the environment). MPI:
  // must be empty (the MPI library's own settings choose, e.g. OMPI_MCA_btl).
  std::string fabrics;
  // A background thread drives the endpoint when no caller waits. Needed by a
  // process that serves its memory and does nothing else with the Transport.
  // Off by default: waiting callers drive it themselves, with no thread hop.
  bool progress_thread = false;
  // Refuse connections over fabrics that cannot detect a dead peer (UCX's
  // shared-memory transports carry no failure detection of their own). With
  // false they are allowed: waits still end at their deadlines, but a
  // transfer that missed one cannot be cancelled, so its local buffer must
  // stay valid until the Transport is closed, and a dead peer shows only as
  // missed deadlines. On by default: the guarantees above hold only with it.
  bool require_failure_detection = true;
};

// Memory of this process registered for remote access.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;  // unregisters
  virtual uint8_t* data() const = 0;
  virtual uint64_t size() const = 0;
  // The packed remote key: what a peer passes to Peer::import_key to reach
  // this region (it carries the region's address and size).
  virtual const std::vector<uint8_t>& remote_key() const = 0;
};

// A peer's region, imported on one Peer from its packed key.
class RemoteRegion {
 public:
  virtual ~RemoteRegion() = default;
  virtual uint64_t size() const = 0;
};

// One pending transfer or message. wait() returns its outcome once; waiting
// again returns the same outcome. Destroying a handle that is still pending
// fails and closes its Peer (closing is the only way to be sure the buffer is
// no longer touched).
class Completion {
 public:
  virtual ~Completion() = default;
  // Drives the endpoint once; true when the operation has finished (well or not).
  virtual bool test() = 0;
  virtual Status wait(Deadline deadline) = 0;
};

enum class TransferKind : uint8_t { kGet, kPut };

// When a receive expects its message (Transport::receive).
enum class ReceiveWait : uint8_t { kSoon, kAnyTime };

// One transfer of a batch: bytes [offset, offset + size) of `region`, read
// into `local` (kGet) or written from it (kPut).
struct TransferOp {
  TransferKind kind = TransferKind::kGet;
  const RemoteRegion* region = nullptr;
  uint64_t offset = 0;
  void* local = nullptr;
  uint64_t size = 0;
};

// A connection to another endpoint.
class Peer {
 public:
  virtual ~Peer() = default;  // closes (pending operations fail)

  // A region of the peer from its packed key. InvalidArgument when the bytes
  // are not a key of this backend.
  virtual Result<std::shared_ptr<RemoteRegion>> import_key(std::span<const uint8_t> key) = 0;

  // Starts reading n bytes at `offset` of `region` into dst (get), or
  // writing n bytes from src there (put). The put is complete at the peer
  // when its Completion is. InvalidArgument for a range outside the region
  // or a region imported on another Peer; Unavailable once the Peer failed.
  // REQUIRES: region was imported on this Peer; dst/src stay valid until the
  // Completion finishes.
  virtual Result<std::unique_ptr<Completion>> get(const RemoteRegion& region, uint64_t offset,
                                                  void* dst, uint64_t n) = 0;
  virtual Result<std::unique_ptr<Completion>> put(const RemoteRegion& region, uint64_t offset,
                                                  const void* src, uint64_t n) = 0;

  // Starts every transfer, then waits once for all of them. Checks every op
  // before starting any (InvalidArgument, nothing moved).
  virtual Status run_batch(std::span<const TransferOp> ops, Deadline deadline) = 0;

  // Sends a message the peer receives with Transport::receive(tag, ...).
  virtual Status send(uint64_t tag, std::span<const uint8_t> bytes, Deadline deadline) = 0;

  // OK while usable; otherwise why not (Unavailable).
  virtual Status health() const = 0;
  // Cancels what is pending (it fails with Unavailable) and closes. Idempotent.
  virtual void close() = 0;
};

// Receives a Transport keeps for nobody now: a receive that missed its
// deadline after it had matched a message still arriving (its buffer stays
// with the transport), and discards (Transport::discard).
//
// And how waits slept, where a backend's waits sleep until progress (UCX
// with its wakeup feature and a progress thread; 0 elsewhere): waits that
// went to sleep after their first look (receives of ReceiveWait::kAnyTime),
// and sleeps that progress ended (the others end at a short nap, then look
// again), ever.
struct TransportCounters {
  uint64_t held = 0;     // such receives now
  uint64_t dropped = 0;  // messages they took and dropped, ever
  uint64_t slept_at_once = 0;
  uint64_t woken = 0;
};

class Transport {
 public:
  // Opens a local endpoint with options.backend: Unavailable when this build
  // lacks it (no UCX), NotSupported for MPI in a build without MPI.
  static Result<std::unique_ptr<Transport>> Open(const TransportOptions& options);
  // Whether this build has the backend.
  static bool available(TransportBackend backend = TransportBackend::kUcx);

  virtual ~Transport() = default;  // close()

  // "ucx" or "mpi", for reports.
  virtual std::string backend() const = 0;
  // The address peers connect to.
  virtual const std::vector<uint8_t>& address() const = 0;

  // Registers [data, data + n) (n > 0) for remote access until the region is
  // destroyed. REQUIRES: the memory outlives the region.
  virtual Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, uint64_t n) = 0;

  // Connects to the endpoint at `address`, ready for transfers when it
  // returns. InvalidArgument for bytes that are not an address; Unavailable
  // when the peer does not answer before the deadline.
  virtual Result<std::shared_ptr<Peer>> connect(std::span<const uint8_t> address,
                                                Deadline deadline) = 0;

  // Receives one message sent with `tag` (from any peer), at most max_bytes
  // (a longer one fails with InvalidArgument). Unavailable at the deadline:
  // it returns by then and a few milliseconds more, even when a message had
  // begun to arrive. Such a message is kept for the next receive of its tag
  // (or dropped, after discard(tag)), its buffer held until then (counters()).
  //
  // `wait` says when the message is expected. kSoon (a reply to a request
  // just sent): the receiving thread polls the endpoint for a short while
  // before it sleeps, so a quick reply costs no wake-up. kAnyTime (a server
  // waiting for requests): it sleeps at once where a progress thread drives
  // the endpoint (TransportOptions::progress_thread) and the fabric can wake
  // it (UCX's wakeup feature), and the progress thread wakes it when the
  // message is in; elsewhere it polls as for kSoon, since nothing else would
  // take the message in. Idle waiters that poll take cores from the
  // threads doing work when a host runs many of them.
  virtual Result<std::vector<uint8_t>> receive(uint64_t tag, uint64_t max_bytes, Deadline deadline,
                                               ReceiveWait wait) = 0;
  Result<std::vector<uint8_t>> receive(uint64_t tag, uint64_t max_bytes, Deadline deadline) {
    return receive(tag, max_bytes, deadline, ReceiveWait::kSoon);
  }

  // Takes the next message sent with `tag` (from any peer) when it comes,
  // and drops it, rather than keeping it for a receive that never comes:
  // for the reply to a request whose receive gave up (one that had begun to
  // arrive then is dropped once it has). Waits for it until the Transport
  // closes, or until kMaxDiscards receives are held after it (the oldest are
  // given up first). REQUIRES: nobody receives `tag` afterwards.
  virtual void discard(uint64_t tag) = 0;
  static constexpr uint64_t kMaxDiscards = 4096;

  // Drives the endpoint once; true when it did work.
  virtual bool progress() = 0;

  // Frees what has ended first.
  virtual TransportCounters counters() const = 0;

  // Closes every Peer, stops the progress thread; every later operation fails
  // with Unavailable. Idempotent.
  virtual void close() = 0;
};

}  // namespace cascade
