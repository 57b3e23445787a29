// The MPI backend of Transport: inside one MPI job, the endpoints are the
// ranks of a communicator.
//
// Creation is collective. Each Transport duplicates the communicator (its
// messages never match the application's), agrees on a random nonce (rank
// 0 draws it, MPI_Bcast), and creates one dynamic window over the duplicate
// (MPI_Win_create_dynamic), opening a passive-target epoch to every rank at
// once (MPI_Win_lock_all, MPI_MODE_NOCHECK) for the window's whole life. So
// every rank of the communicator creates its Transports together, in the
// same order, one at a time. MPI must provide MPI_THREAD_MULTIPLE; when it
// is not initialised, the first Open initialises it so (and finalises it at
// process exit).
//
// Address: (rank, communicator size, nonce). A process keeps every
// endpoint it created (registry()), so connect() finds the local twin of
// the address's endpoint by its nonce, and the Peer talks through that
// twin's communicator and window, whichever local Transport connected: an
// endpoint reaches the rank's endpoint of the same creation, as any UCX
// worker reaches any address. An address whose nonce is not one of this
// process's endpoints (another job's, a UCX address) is InvalidArgument.
// connect() is local: there is no handshake, and a rank that does not
// answer shows at the deadline of the first transfer or message.
//
// Registration needs no collective: MPI_Win_attach of the region to the
// endpoint's window, and a key of (rank, nonce, region id) beside the
// frame's base (MPI_Get_address) and size. Regions of one endpoint may not
// overlap (MPI forbids it; refused with InvalidArgument). A region serves
// transfers until its owner destroys it; one that starts after that fails
// with InvalidArgument (MPI_ERR_RMA_RANGE), so a job keeps its regions
// until its peers are done with them.
//
// get is MPI_Rget, complete when its request is. put is MPI_Put, complete
// at the target once an MPI_Win_flush of that target issued after it has
// returned. MPI_Win_flush blocks, and on a fabric where the target must
// progress (TCP) it blocks while the target is stopped, so flushes run on a
// thread per target (Flusher), started on the first put there; a waiter
// waits for the flush with its deadline. Transfers move in pieces of at
// most 1 GiB (MPI counts are int).
//
// Messages: every message of an endpoint is MPI_Isend on the duplicate with
// one MPI tag, the 64-bit tag in an 8-byte header before the bytes (MPI
// guarantees tags up to 32767 only). Whoever drives the endpoint (a
// receive, progress(), the progress thread) takes every message that came
// in (MPI_Improbe, MPI_Imrecv into a buffer of the message's size) and,
// once it has arrived, files it under its tag, in order per sender; a
// receive takes the oldest of its tag. A discard drops the next message of
// its tag instead.
//
// Deadlines: waits poll (MPI_Test, the flush's count) until the deadline.
// MPI cannot cancel a one-sided transfer, nor reliably a send, so a missed
// deadline, a Peer::close() or a Transport::close() fails the Peer and the
// wait returns Unavailable at once, while the transfer goes on inside MPI:
// the endpoint keeps its request (lingering) and tests it until it ends.
// The caller's buffer of a get, put or batch that failed so must stay valid
// until MPI has completed it: until the endpoint's window is unlocked, at
// MPI_Finalize at the latest. A send's buffer is the endpoint's own copy.
// A dead rank ends the job with Open MPI's default error handling (the
// runtime aborts every rank), so no surviving process is left with a
// transfer from a dead one; a stopped or overloaded rank shows as missed
// deadlines.
//
// Lifetime: the window and the duplicate communicator can only be freed
// collectively, so close() is local (it fails the Peers and stops the
// threads) and the MPI objects are freed inside MPI_Finalize, by the delete
// callback of an attribute on MPI_COMM_SELF, for every endpoint in creation
// order (the same on every rank). After that every operation fails with
// Unavailable.
//
// Thread-safety: MPI calls need no lock of ours (MPI_THREAD_MULTIPLE); each
// holds the endpoint's lifecycle lock shared (Use), which the finalize
// callback takes exclusively to free the window. The mailbox is guarded by
// Endpoint::mu, a Peer's state by its own mutex.
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/backends.h"
#include "transport/key_format.h"
#include "transport/transport.h"
#include "util/thread_name.h"

namespace cascade {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kMaxMessageBytes = 64ull << 20;
// The MPI tag of every message on an endpoint's communicator.
constexpr int kMessageTag = 1;
constexpr size_t kHeaderBytes = 8;  // a message: u64 tag, then its bytes
// One MPI call moves at most this many bytes (counts are int).
constexpr uint64_t kMaxPiece = 1ull << 30;

// The MPI payloads inside the frames of key_format.h, little-endian:
//   address: u32 "MPA1" | u32 rank | u32 communicator size | u32 zero | u64 nonce
//   key:     u32 "MPK1" | u32 rank | u64 nonce | u64 region id
constexpr uint32_t kMpiAddressMagic = 0x3141504d;  // "MPA1"
constexpr uint32_t kMpiKeyMagic = 0x314b504d;      // "MPK1"
constexpr size_t kMpiAddressBytes = 24;
constexpr size_t kMpiKeyBytes = 24;

// The longest a waiter sleeps between two looks at what it waits for.
constexpr auto kWaiterNapMax = 200us;
// The longest a receive sleeps between two looks at the mailbox; the
// progress thread's longest sleep when idle.
constexpr auto kReceiveNapMax = 1ms;

Status mpi_error(int rc, const std::string& what) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  int cls = rc;
  if (MPI_Error_class(rc, &cls) != MPI_SUCCESS) cls = rc;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  const std::string m =
      what + ": " + (len > 0 ? std::string(text, len) : "MPI error " + std::to_string(rc));
  switch (cls) {
    case MPI_ERR_NO_MEM: return Status::NoSpace(m);
    case MPI_ERR_ARG:
    case MPI_ERR_COUNT:
    case MPI_ERR_RANK:
    case MPI_ERR_DISP:
    case MPI_ERR_SIZE:
    case MPI_ERR_RMA_RANGE:
    case MPI_ERR_RMA_ATTACH:
    case MPI_ERR_BUFFER: return Status::InvalidArgument(m);
    case MPI_ERR_UNSUPPORTED_OPERATION:
    case MPI_ERR_RMA_FLAVOR: return Status::NotSupported(m);
    default: return Status::Unavailable(m);
  }
}

// A transfer MPI refused. MPI_ERR_RMA_RANGE means the target has no region
// attached over the bytes when the transfer starts (Open MPI's osc/rdma
// looks the target's regions up on every transfer, so a region attached
// after the epoch opened is found): the key's region was unregistered
// there, or the key never named a live region.
Status transfer_error(int rc, const std::string& what, int target) {
  Status st = mpi_error(rc, what);
  int cls = rc;
  if (MPI_Error_class(rc, &cls) == MPI_SUCCESS && cls == MPI_ERR_RMA_RANGE)
    st = Status::InvalidArgument(st.message() + " (rank " + std::to_string(target) +
                                 " has no registered region over these bytes: the key's region "
                                 "was unregistered there, or the key names no live region)");
  return st;
}

// Between two polls of something another process finishes: spin a little,
// then yield the CPU, then nap a little longer each time (up to `most`),
// never past `until`.
void pause(unsigned* idle, Deadline until, std::chrono::microseconds most) {
  const unsigned n = (*idle)++;
  if (n < 8) return;
  if (n < 32) {
    sched_yield();
    return;
  }
  const auto nap = std::min<std::chrono::microseconds>(
      most, std::chrono::microseconds(4LL << std::min(n - 32, 10u)));
  std::this_thread::sleep_until(std::min(until, TransportClock::now() + nap));
}

// Puts to one target are complete there once a flush of it, started after
// them, has returned. A thread of its own runs the flushes (they block).
struct Flusher {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t wanted = 0;  // guarded by mu: puts issued and asking for a flush
  uint64_t done = 0;    // guarded by mu: puts known complete at the target
  Status error;         // guarded by mu: the last flush's failure
  bool stop = false;    // guarded by mu
  bool running = true;  // guarded by mu: the thread has not exited

  // A number a later flush will reach: the puts issued before this call are
  // complete at the target once done reaches it.
  uint64_t ask() {
    uint64_t n;
    {
      std::lock_guard<std::mutex> l(mu);
      n = ++wanted;
    }
    cv.notify_all();
    return n;
  }
};

struct Endpoint {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Win win = MPI_WIN_NULL;
  int rank = 0, size = 0;
  uint64_t nonce = 0;
  std::vector<uint8_t> address;

  // Held shared by every MPI call on comm or win, exclusively to free them.
  std::shared_mutex life;
  bool freed = false;  // guarded by life
  std::atomic<bool> closed{false};

  // The mailbox.
  std::mutex mu;
  std::condition_variable delivered;  // a message was filed (or the endpoint closed)
  struct Arriving {
    MPI_Request req = MPI_REQUEST_NULL;
    int source = 0;
    bool done = false;
    std::vector<uint8_t> buf;
  };
  std::list<Arriving> arriving;                                          // guarded by mu
  std::unordered_map<uint64_t, std::deque<std::vector<uint8_t>>> ready;  // guarded by mu
  // Discards waiting for their message: by sequence number (oldest first),
  // and each tag's sequence numbers.
  uint64_t next_discard = 0;                                    // guarded by mu
  std::map<uint64_t, uint64_t> discard_tags;                    // guarded by mu
  std::unordered_map<uint64_t, std::deque<uint64_t>> discards;  // guarded by mu
  uint64_t dropped = 0;                                         // guarded by mu
  uint64_t malformed = 0;                                       // guarded by mu
  // Requests nobody waits for any more (a send, get or put that failed its
  // deadline or its Peer), tested until they end; a send's buffer with it.
  struct Lingering {
    MPI_Request req;
    std::vector<uint8_t> buf;
  };
  std::list<Lingering> lingering;  // guarded by mu

  // Attached regions: start -> end, none overlapping.
  std::mutex regions_mu;
  std::map<uintptr_t, uintptr_t> regions;  // guarded by regions_mu
  std::atomic<uint64_t> next_region{1};

  std::mutex flush_mu;
  std::unordered_map<int, std::shared_ptr<Flusher>> flushers;  // guarded by flush_mu

  std::thread progress;
  std::atomic<bool> stop_progress{false};

  // Takes what came in, files what has arrived, ends lingering requests
  // that have ended; true when it did any of that. REQUIRES: mu held and a
  // Use (shared `life`, not freed).
  bool pump_locked();
  // Files one arrived message. REQUIRES: mu held.
  void file_locked(std::vector<uint8_t>&& buf);
  // Leaves requests to the endpoint, with the buffer they may still use.
  void linger(std::vector<MPI_Request> reqs, std::vector<uint8_t> buf = {}) {
    std::lock_guard<std::mutex> l(mu);
    for (MPI_Request r : reqs)
      if (r != MPI_REQUEST_NULL) lingering.push_back(Lingering{r, std::move(buf)});
  }
  std::shared_ptr<Flusher> flusher(const std::shared_ptr<Endpoint>& self, int target);
  // Local: fails nothing by itself (the Transport fails its Peers), stops
  // the progress thread and the flushers.
  void close();
  // Frees the MPI objects. Collective: inside MPI_Finalize, on every rank.
  void free_mpi_objects();
};

// Holds an endpoint's MPI objects for the duration of an MPI call.
class Use {
 public:
  explicit Use(Endpoint& e) : lock_(e.life), ok_(!e.freed) {}
  bool ok() const { return ok_; }

 private:
  std::shared_lock<std::shared_mutex> lock_;
  bool ok_;
};

Status finalized() { return Status::Unavailable("transport: MPI has been finalized"); }

bool Endpoint::pump_locked() {
  bool did = false;
  for (;;) {
    int flag = 0;
    MPI_Message m;
    MPI_Status st;
    if (MPI_Improbe(MPI_ANY_SOURCE, kMessageTag, comm, &flag, &m, &st) != MPI_SUCCESS || !flag)
      break;
    int count = 0;
    MPI_Get_count(&st, MPI_BYTE, &count);
    Arriving a;
    a.source = st.MPI_SOURCE;
    a.buf.resize(count > 0 ? static_cast<size_t>(count) : 0);
    if (MPI_Imrecv(a.buf.data(), static_cast<int>(a.buf.size()), MPI_BYTE, &m, &a.req) !=
        MPI_SUCCESS) {
      ++malformed;
      continue;
    }
    arriving.push_back(std::move(a));
    did = true;
  }
  if (!arriving.empty()) {
    for (Arriving& a : arriving) {
      if (a.done) continue;
      int done = 0;
      MPI_Test(&a.req, &done, MPI_STATUS_IGNORE);
      a.done = done != 0;
    }
    // In order per sender: a message is filed once every earlier one from
    // its sender has been.
    std::vector<int> blocked;
    for (auto it = arriving.begin(); it != arriving.end();) {
      const bool waits = std::find(blocked.begin(), blocked.end(), it->source) != blocked.end();
      if (!it->done || waits) {
        if (!waits) blocked.push_back(it->source);
        ++it;
        continue;
      }
      file_locked(std::move(it->buf));
      it = arriving.erase(it);
      did = true;
    }
  }
  for (auto it = lingering.begin(); it != lingering.end();) {
    int done = 0;
    MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
    if (done) {
      it = lingering.erase(it);
      did = true;
    } else {
      ++it;
    }
  }
  if (did) delivered.notify_all();
  return did;
}

void Endpoint::file_locked(std::vector<uint8_t>&& buf) {
  if (buf.size() < kHeaderBytes) {
    ++malformed;
    return;
  }
  const uint64_t tag = get_le<uint64_t>(buf.data());
  auto d = discards.find(tag);
  if (d != discards.end()) {
    discard_tags.erase(d->second.front());
    d->second.pop_front();
    if (d->second.empty()) discards.erase(d);
    ++dropped;
    return;
  }
  buf.erase(buf.begin(), buf.begin() + kHeaderBytes);
  ready[tag].push_back(std::move(buf));
}

std::shared_ptr<Flusher> Endpoint::flusher(const std::shared_ptr<Endpoint>& self, int target) {
  std::lock_guard<std::mutex> l(flush_mu);
  std::shared_ptr<Flusher>& f = flushers[target];
  if (f) return f;
  f = std::make_shared<Flusher>();
  // Detached: a flush of a target that stopped answering may never return,
  // and nothing may wait for it (close() only asks it to stop).
  std::thread([e = self, f, target] {
    name_this_thread("cascade-rma");
    std::unique_lock<std::mutex> l(f->mu);
    for (;;) {
      f->cv.wait(l, [&] { return f->stop || f->wanted > f->done; });
      if (f->stop) break;
      const uint64_t upto = f->wanted;
      l.unlock();
      int rc = MPI_SUCCESS;
      bool gone = false;
      {
        Use u(*e);
        if (u.ok()) rc = MPI_Win_flush(target, e->win);
        else gone = true;
      }
      l.lock();
      if (gone) {
        f->error = finalized();
      } else if (rc != MPI_SUCCESS) {
        f->error = mpi_error(rc, "transport put: MPI_Win_flush");
      }
      f->done = upto;
      f->cv.notify_all();
    }
    f->running = false;
    f->cv.notify_all();
  }).detach();
  return f;
}

void Endpoint::close() {
  if (closed.exchange(true)) return;
  stop_progress.store(true);
  if (progress.joinable() && progress.get_id() != std::this_thread::get_id()) progress.join();
  {
    std::lock_guard<std::mutex> l(mu);
    delivered.notify_all();
  }
  std::lock_guard<std::mutex> l(flush_mu);
  for (auto& [target, f] : flushers) {
    {
      std::lock_guard<std::mutex> fl(f->mu);
      f->stop = true;
    }
    f->cv.notify_all();
  }
}

void Endpoint::free_mpi_objects() {
  close();
  // The flushers leave once their flush returns (MPI_Win_unlock_all below
  // would wait for the same transfers anyway).
  std::vector<std::shared_ptr<Flusher>> fs;
  {
    std::lock_guard<std::mutex> l(flush_mu);
    for (auto& [target, f] : flushers) fs.push_back(f);
  }
  for (auto& f : fs) {
    std::unique_lock<std::mutex> l(f->mu);
    f->cv.wait_for(l, 10s, [&] { return !f->running; });
  }
  std::unique_lock<std::shared_mutex> l(life);
  if (freed) return;
  if (win != MPI_WIN_NULL) {
    MPI_Win_unlock_all(win);
    MPI_Win_free(&win);
  }
  if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  freed = true;
}

// Every endpoint this process created, in creation order; never destroyed
// (the finalize callback may run after static destructors).
struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<Endpoint>> all;  // guarded by mu
  bool hooked = false;                         // guarded by mu
};
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

int free_endpoints_at_finalize(MPI_Comm, int, void*, void*) {
  std::vector<std::shared_ptr<Endpoint>> all;
  {
    std::lock_guard<std::mutex> l(registry().mu);
    all = registry().all;
  }
  for (auto& e : all) e->free_mpi_objects();
  return MPI_SUCCESS;
}

// REQUIRES: registry().mu held.
Status hook_finalize_locked() {
  if (registry().hooked) return Status::OK();
  int key = MPI_KEYVAL_INVALID;
  int rc = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_endpoints_at_finalize, &key, nullptr);
  if (rc != MPI_SUCCESS) return mpi_error(rc, "transport: MPI_Comm_create_keyval");
  rc = MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr);
  MPI_Comm_free_keyval(&key);
  if (rc != MPI_SUCCESS) return mpi_error(rc, "transport: MPI_Comm_set_attr");
  registry().hooked = true;
  return Status::OK();
}

std::shared_ptr<Endpoint> find_endpoint(uint64_t nonce) {
  std::lock_guard<std::mutex> l(registry().mu);
  for (auto& e : registry().all)
    if (e->nonce == nonce) return e;
  return nullptr;
}

struct PeerState {
  std::shared_ptr<Endpoint> e;  // the endpoint the address names (its twin here)
  int rank = 0;
  mutable std::mutex mu;
  bool failed = false;  // guarded by mu
  std::string why;      // guarded by mu

  void fail(const std::string& reason) {
    std::lock_guard<std::mutex> l(mu);
    if (failed) return;
    failed = true;
    why = reason;
  }
  Status usable() const {
    if (e->closed.load()) return Status::Unavailable("transport: closed");
    std::lock_guard<std::mutex> l(mu);
    if (failed) return Status::Unavailable("transport: peer failed: " + why);
    return Status::OK();
  }
};

// Waits until `reqs` have ended and, with `flush`, until the flush numbered
// `upto` has returned; on a missed deadline, or the Peer failing meanwhile,
// fails the Peer and leaves what is pending to the endpoint.
Status wait_for(PeerState& p, std::vector<MPI_Request>& reqs, Flusher* flush, uint64_t upto,
                Deadline deadline, const char* what) {
  Endpoint& e = *p.e;
  unsigned idle = 0;
  for (;;) {
    bool finished = true;
    {
      Use u(e);
      if (!u.ok()) return finalized();
      for (MPI_Request& r : reqs) {
        if (r == MPI_REQUEST_NULL) continue;
        int done = 0;
        MPI_Status st;
        const int rc = MPI_Test(&r, &done, &st);
        if (rc != MPI_SUCCESS) {
          // The request is freed by a failed test.
          p.fail(std::string(what) + ": MPI_Test failed");
          std::erase(reqs, MPI_REQUEST_NULL);
          e.linger(std::move(reqs));
          reqs.clear();
          return mpi_error(rc, what);
        }
        if (!done) finished = false;
      }
    }
    Status flushed;
    if (finished && flush != nullptr) {
      std::lock_guard<std::mutex> l(flush->mu);
      if (flush->done < upto) finished = false;
      flushed = flush->error;
    }
    if (finished) {
      reqs.clear();
      if (!flushed.ok()) {
        p.fail(flushed.message());
        return flushed;
      }
      return Status::OK();
    }
    Status st = p.usable();
    if (st.ok() && TransportClock::now() >= deadline) {
      p.fail(std::string(what) + ": deadline passed");
      st = Status::Unavailable(std::string(what) + ": deadline passed");
    }
    if (!st.ok()) {
      e.linger(std::move(reqs));
      reqs.clear();
      return st;
    }
    if (flush != nullptr && reqs.empty()) {
      // Only the flush is left: sleep until it returns.
      std::unique_lock<std::mutex> l(flush->mu);
      flush->cv.wait_until(l, std::min(deadline, TransportClock::now() + 10ms),
                           [&] { return flush->done >= upto; });
      continue;
    }
    pause(&idle, deadline, kWaiterNapMax);
  }
}

class MpiRemoteRegion final : public RemoteRegion {
 public:
  MpiRemoteRegion(std::shared_ptr<PeerState> peer, MPI_Aint base, uint64_t size)
      : peer_(std::move(peer)), base_(base), size_(size) {}
  uint64_t size() const override { return size_; }
  const PeerState* owner() const { return peer_.get(); }
  MPI_Aint base() const { return base_; }

 private:
  std::shared_ptr<PeerState> peer_;
  MPI_Aint base_;
  uint64_t size_;
};

// Transfers started on one Peer, and what completes them.
struct Issued {
  std::vector<MPI_Request> gets;
  std::shared_ptr<Flusher> flush;  // set when puts were issued
  uint64_t upto = 0;
};

class MpiCompletion final : public Completion {
 public:
  MpiCompletion(std::shared_ptr<PeerState> peer, Issued issued, const char* what)
      : peer_(std::move(peer)), issued_(std::move(issued)), what_(what) {
    pending_ = !issued_.gets.empty() || issued_.flush != nullptr;
  }
  ~MpiCompletion() override {
    if (pending_) (void)wait(TransportClock::now());
  }

  bool test() override {
    if (!pending_) return true;
    {
      Use u(*peer_->e);
      if (u.ok()) {
        for (MPI_Request& r : issued_.gets) {
          if (r == MPI_REQUEST_NULL) continue;
          int done = 0;
          if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) break;
        }
      }
    }
    std::erase(issued_.gets, MPI_REQUEST_NULL);
    bool finished = issued_.gets.empty();
    if (finished && issued_.flush) {
      std::lock_guard<std::mutex> l(issued_.flush->mu);
      finished = issued_.flush->done >= issued_.upto;
    }
    if (!finished && peer_->usable().ok()) return false;
    (void)wait(TransportClock::now());
    return true;
  }

  Status wait(Deadline deadline) override {
    if (!pending_) return outcome_;
    outcome_ = wait_for(*peer_, issued_.gets, issued_.flush.get(), issued_.upto, deadline, what_);
    pending_ = false;
    return outcome_;
  }

 private:
  std::shared_ptr<PeerState> peer_;
  Issued issued_;
  const char* what_;
  bool pending_ = false;
  Status outcome_;
};

class MpiPeer final : public Peer {
 public:
  explicit MpiPeer(std::shared_ptr<PeerState> state) : s_(std::move(state)) {}
  ~MpiPeer() override { close(); }

  Result<std::shared_ptr<RemoteRegion>> import_key(std::span<const uint8_t> key) override {
    Result<KeyFrame> k = unpack_key(key);
    if (!k.ok()) return k.status();
    const std::span<const uint8_t> b = k->backend_key;
    if (b.size() != kMpiKeyBytes || get_le<uint32_t>(b.data()) != kMpiKeyMagic)
      return Status::InvalidArgument("remote key: not a key of an MPI transport");
    const uint32_t rank = get_le<uint32_t>(b.data() + 4);
    const uint64_t nonce = get_le<uint64_t>(b.data() + 8);
    if (nonce != s_->e->nonce || rank != static_cast<uint32_t>(s_->rank))
      return Status::InvalidArgument(
          "remote key: a region of another endpoint than this peer's (rank " +
          std::to_string(rank) + ", peer rank " + std::to_string(s_->rank) + ")");
    if (k->base > static_cast<uint64_t>(std::numeric_limits<MPI_Aint>::max()) ||
        k->size > static_cast<uint64_t>(std::numeric_limits<MPI_Aint>::max()) - k->base)
      return Status::InvalidArgument("remote key: region bounds beyond MPI's address range");
    CASCADE_RETURN_IF_ERROR(s_->usable());
    return std::shared_ptr<RemoteRegion>(
        std::make_shared<MpiRemoteRegion>(s_, static_cast<MPI_Aint>(k->base), k->size));
  }

  Result<std::unique_ptr<Completion>> get(const RemoteRegion& region, uint64_t offset, void* dst,
                                          uint64_t n) override {
    return start(TransferOp{TransferKind::kGet, &region, offset, dst, n});
  }
  Result<std::unique_ptr<Completion>> put(const RemoteRegion& region, uint64_t offset,
                                          const void* src, uint64_t n) override {
    return start(TransferOp{TransferKind::kPut, &region, offset, const_cast<void*>(src), n});
  }

  Status run_batch(std::span<const TransferOp> ops, Deadline deadline) override {
    for (const TransferOp& op : ops) CASCADE_RETURN_IF_ERROR(check(op));
    CASCADE_RETURN_IF_ERROR(s_->usable());
    Issued issued;
    const Status st = issue(ops, &issued);
    Status waited =
        wait_for(*s_, issued.gets, issued.flush.get(), issued.upto, deadline, "transport batch");
    return st.ok() ? waited : st;
  }

  Status send(uint64_t tag, std::span<const uint8_t> bytes, Deadline deadline) override {
    if (bytes.size() > kMaxMessageBytes)
      return Status::InvalidArgument("transport send: " + std::to_string(bytes.size()) +
                                     " bytes, more than a control message may carry");
    CASCADE_RETURN_IF_ERROR(s_->usable());
    std::vector<uint8_t> buf;
    buf.reserve(kHeaderBytes + bytes.size());
    put_le<uint64_t>(buf, tag);
    buf.insert(buf.end(), bytes.begin(), bytes.end());
    Endpoint& e = *s_->e;
    std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
    {
      Use u(e);
      if (!u.ok()) return finalized();
      const int rc = MPI_Isend(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, s_->rank,
                               kMessageTag, e.comm, req.data());
      if (rc != MPI_SUCCESS) return mpi_error(rc, "transport send: MPI_Isend");
    }
    unsigned idle = 0;
    for (;;) {
      {
        Use u(e);
        if (!u.ok()) return finalized();
        int done = 0;
        const int rc = MPI_Test(req.data(), &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_error(rc, "transport send");
        if (done) return Status::OK();
      }
      Status st = s_->usable();
      if (st.ok() && TransportClock::now() >= deadline) {
        s_->fail("transport send: deadline passed");
        st = Status::Unavailable("transport send: deadline passed");
      }
      if (!st.ok()) {
        e.linger(std::move(req), std::move(buf));
        return st;
      }
      pause(&idle, deadline, kWaiterNapMax);
    }
  }

  Status health() const override { return s_->usable(); }

  void close() override { s_->fail("closed"); }

 private:
  Status check(const TransferOp& op) const {
    auto* region = dynamic_cast<const MpiRemoteRegion*>(op.region);
    if (region == nullptr || region->owner() != s_.get())
      return Status::InvalidArgument("transport: the region was not imported on this peer");
    if (!range_within(op.offset, op.size, region->size()))
      return Status::InvalidArgument("transport: bytes [" + std::to_string(op.offset) + ", +" +
                                     std::to_string(op.size) + ") lie outside the region of " +
                                     std::to_string(region->size()) + " bytes");
    if (op.local == nullptr && op.size > 0)
      return Status::InvalidArgument("transport: no local buffer");
    return Status::OK();
  }

  // Starts every op (checked). On an error, what was started is in
  // *issued all the same, to be waited for.
  Status issue(std::span<const TransferOp> ops, Issued* issued) {
    Endpoint& e = *s_->e;
    bool puts = false;
    Status st;
    {
      Use u(e);
      if (!u.ok()) return finalized();
      for (const TransferOp& op : ops) {
        const auto* region = static_cast<const MpiRemoteRegion*>(op.region);
        auto* local = static_cast<uint8_t*>(op.local);
        for (uint64_t at = 0; at < op.size && st.ok(); at += kMaxPiece) {
          const int n = static_cast<int>(std::min(kMaxPiece, op.size - at));
          const MPI_Aint disp = MPI_Aint_add(region->base(), static_cast<MPI_Aint>(op.offset + at));
          if (op.kind == TransferKind::kGet) {
            MPI_Request r = MPI_REQUEST_NULL;
            const int rc =
                MPI_Rget(local + at, n, MPI_BYTE, s_->rank, disp, n, MPI_BYTE, e.win, &r);
            if (rc != MPI_SUCCESS) st = transfer_error(rc, "transport get: MPI_Rget", s_->rank);
            else issued->gets.push_back(r);
          } else {
            const int rc = MPI_Put(local + at, n, MPI_BYTE, s_->rank, disp, n, MPI_BYTE, e.win);
            if (rc != MPI_SUCCESS) st = transfer_error(rc, "transport put: MPI_Put", s_->rank);
            else puts = true;
          }
        }
        if (!st.ok()) break;
      }
    }
    if (puts) {
      issued->flush = e.flusher(s_->e, s_->rank);
      issued->upto = issued->flush->ask();
    }
    return st;
  }

  Result<std::unique_ptr<Completion>> start(const TransferOp& op) {
    CASCADE_RETURN_IF_ERROR(check(op));
    CASCADE_RETURN_IF_ERROR(s_->usable());
    const char* what = op.kind == TransferKind::kGet ? "transport get" : "transport put";
    Issued issued;
    if (op.size > 0) {
      const Status st = issue(std::span(&op, 1), &issued);
      if (!st.ok()) {
        // Whatever was started goes on without a waiter.
        (void)wait_for(*s_, issued.gets, issued.flush.get(), issued.upto, TransportClock::now(),
                       what);
        return st;
      }
    }
    return std::unique_ptr<Completion>(new MpiCompletion(s_, std::move(issued), what));
  }

  std::shared_ptr<PeerState> s_;
};

class MpiRegion final : public MemoryRegion {
 public:
  MpiRegion(std::shared_ptr<Endpoint> e, uint8_t* data, uint64_t size, std::vector<uint8_t> key)
      : e_(std::move(e)), data_(data), size_(size), key_(std::move(key)) {}
  ~MpiRegion() override {
    {
      Use u(*e_);
      if (u.ok()) MPI_Win_detach(e_->win, data_);
    }
    std::lock_guard<std::mutex> l(e_->regions_mu);
    e_->regions.erase(reinterpret_cast<uintptr_t>(data_));
  }
  uint8_t* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  const std::vector<uint8_t>& remote_key() const override { return key_; }

 private:
  std::shared_ptr<Endpoint> e_;
  uint8_t* data_;
  uint64_t size_;
  std::vector<uint8_t> key_;
};

class MpiTransport final : public Transport {
 public:
  using Transport::receive;  // the overload that expects its message soon
  explicit MpiTransport(std::shared_ptr<Endpoint> e) : e_(std::move(e)) {}
  ~MpiTransport() override { close(); }

  void start_progress() {
    Endpoint* e = e_.get();
    e_->progress = std::thread([e] {
      name_this_thread("cascade-mpi");
      unsigned idle = 0;
      while (!e->stop_progress.load(std::memory_order_relaxed)) {
        bool did = false;
        {
          Use u(*e);
          if (!u.ok()) return;
          std::lock_guard<std::mutex> l(e->mu);
          did = e->pump_locked();
        }
        if (did) {
          idle = 0;
          continue;
        }
        pause(&idle, Deadline::max(),
              std::chrono::duration_cast<std::chrono::microseconds>(
                  Deadline::duration(kReceiveNapMax)));
      }
    });
  }

  std::string backend() const override { return "mpi"; }
  const std::vector<uint8_t>& address() const override { return e_->address; }

  Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, uint64_t n) override {
    if (data == nullptr || n == 0)
      return Status::InvalidArgument("transport: register_memory needs a non-empty region");
    if (e_->closed.load()) return Status::Unavailable("transport: closed");
    const auto start = reinterpret_cast<uintptr_t>(data);
    if (n > std::numeric_limits<uintptr_t>::max() - start ||
        n > static_cast<uint64_t>(std::numeric_limits<MPI_Aint>::max()))
      return Status::InvalidArgument("transport: register_memory: region beyond the address space");
    {
      std::lock_guard<std::mutex> l(e_->regions_mu);
      auto next = e_->regions.lower_bound(start);
      const bool overlaps = (next != e_->regions.end() && next->first < start + n) ||
                            (next != e_->regions.begin() && std::prev(next)->second > start);
      if (overlaps)
        return Status::InvalidArgument(
            "transport: register_memory: the region overlaps one already registered on this "
            "transport (an MPI window cannot attach overlapping memory)");
      e_->regions.emplace(start, start + n);
    }
    MPI_Aint base = 0;
    int rc;
    {
      Use u(*e_);
      if (!u.ok()) {
        std::lock_guard<std::mutex> l(e_->regions_mu);
        e_->regions.erase(start);
        return finalized();
      }
      rc = MPI_Win_attach(e_->win, data, static_cast<MPI_Aint>(n));
      if (rc == MPI_SUCCESS) MPI_Get_address(data, &base);
    }
    if (rc != MPI_SUCCESS) {
      std::lock_guard<std::mutex> l(e_->regions_mu);
      e_->regions.erase(start);
      return mpi_error(rc, "transport: register " + std::to_string(n) + " bytes: MPI_Win_attach");
    }
    std::vector<uint8_t> payload;
    put_le<uint32_t>(payload, kMpiKeyMagic);
    put_le<uint32_t>(payload, static_cast<uint32_t>(e_->rank));
    put_le<uint64_t>(payload, e_->nonce);
    put_le<uint64_t>(payload, e_->next_region.fetch_add(1));
    std::vector<uint8_t> key = pack_key(static_cast<uint64_t>(base), n, payload);
    return std::unique_ptr<MemoryRegion>(
        new MpiRegion(e_, static_cast<uint8_t*>(data), n, std::move(key)));
  }

  Result<std::shared_ptr<Peer>> connect(std::span<const uint8_t> address, Deadline) override {
    Result<std::span<const uint8_t>> raw = unpack_address(address);
    if (!raw.ok()) return raw.status();
    const std::span<const uint8_t> a = *raw;
    if (a.size() != kMpiAddressBytes || get_le<uint32_t>(a.data()) != kMpiAddressMagic)
      return Status::InvalidArgument("transport address: not an address of an MPI transport");
    const uint32_t rank = get_le<uint32_t>(a.data() + 4);
    const uint32_t size = get_le<uint32_t>(a.data() + 8);
    const uint64_t nonce = get_le<uint64_t>(a.data() + 16);
    if (e_->closed.load()) return Status::Unavailable("transport: closed");
    std::shared_ptr<Endpoint> target = find_endpoint(nonce);
    if (!target)
      return Status::InvalidArgument(
          "transport address: not an endpoint of this MPI job (another job's address, or one "
          "whose endpoint this process did not create)");
    if (size != static_cast<uint32_t>(target->size) || rank >= size)
      return Status::InvalidArgument("transport address: rank " + std::to_string(rank) + " of " +
                                     std::to_string(size) + " does not fit its communicator of " +
                                     std::to_string(target->size));
    if (target->closed.load())
      return Status::Unavailable("transport connect: the endpoint of that address is closed here");
    auto state = std::make_shared<PeerState>();
    state->e = std::move(target);
    state->rank = static_cast<int>(rank);
    {
      std::lock_guard<std::mutex> l(peers_mu_);
      std::erase_if(peers_, [](const std::weak_ptr<PeerState>& p) { return p.expired(); });
      peers_.push_back(state);
    }
    // A close() between the check above and the list: fail it here.
    if (e_->closed.load()) state->fail("transport closed");
    return std::shared_ptr<Peer>(std::make_shared<MpiPeer>(std::move(state)));
  }

  // Every receive sleeps between its looks at the mailbox, whatever `wait`
  // says.
  Result<std::vector<uint8_t>> receive(uint64_t tag, uint64_t max_bytes, Deadline deadline,
                                       ReceiveWait /*wait*/) override {
    if (max_bytes > kMaxMessageBytes)
      return Status::InvalidArgument("transport receive: max_bytes above the message limit");
    unsigned idle = 0;
    for (;;) {
      if (e_->closed.load()) return Status::Unavailable("transport: closed");
      Use u(*e_);
      if (!u.ok()) return finalized();
      std::unique_lock<std::mutex> l(e_->mu);
      e_->pump_locked();
      auto q = e_->ready.find(tag);
      if (q != e_->ready.end()) {
        std::vector<uint8_t> m = std::move(q->second.front());
        q->second.pop_front();
        if (q->second.empty()) e_->ready.erase(q);
        l.unlock();
        if (m.size() > max_bytes)
          return Status::InvalidArgument("transport receive: message longer than " +
                                         std::to_string(max_bytes) + " bytes");
        return m;
      }
      const Deadline now = TransportClock::now();
      if (now >= deadline)
        return Status::Unavailable("transport receive: no message before the deadline");
      // Sleep until something is filed (by another thread that pumps) or a
      // nap passed, a longer one the longer nothing came.
      const auto nap = std::min<std::chrono::microseconds>(
          std::chrono::duration_cast<std::chrono::microseconds>(Deadline::duration(kReceiveNapMax)),
          std::chrono::microseconds(10LL << std::min(idle++, 7u)));
      e_->delivered.wait_until(l, std::min(deadline, now + nap));
    }
  }

  void discard(uint64_t tag) override {
    std::lock_guard<std::mutex> l(e_->mu);
    if (e_->closed.load()) return;
    // Already here (it came after its receive gave up): dropped now.
    auto q = e_->ready.find(tag);
    if (q != e_->ready.end()) {
      q->second.pop_front();
      if (q->second.empty()) e_->ready.erase(q);
      ++e_->dropped;
      return;
    }
    // Over the bound, the oldest are given up.
    while (e_->discard_tags.size() >= kMaxDiscards) {
      auto oldest = e_->discard_tags.begin();
      auto d = e_->discards.find(oldest->second);
      d->second.pop_front();
      if (d->second.empty()) e_->discards.erase(d);
      e_->discard_tags.erase(oldest);
    }
    const uint64_t seq = e_->next_discard++;
    e_->discard_tags.emplace(seq, tag);
    e_->discards[tag].push_back(seq);
  }

  bool progress() override {
    Use u(*e_);
    if (!u.ok() || e_->closed.load()) return false;
    std::lock_guard<std::mutex> l(e_->mu);
    return e_->pump_locked();
  }

  TransportCounters counters() const override {
    Use u(*e_);
    std::lock_guard<std::mutex> l(e_->mu);
    if (u.ok() && !e_->closed.load()) e_->pump_locked();
    return TransportCounters{e_->discard_tags.size() + e_->arriving.size(), e_->dropped};
  }

  void close() override {
    e_->close();
    std::vector<std::shared_ptr<PeerState>> peers;
    {
      std::lock_guard<std::mutex> l(peers_mu_);
      for (auto& weak : peers_)
        if (auto p = weak.lock()) peers.push_back(std::move(p));
      peers_.clear();
    }
    for (auto& p : peers) p->fail("transport closed");
  }

 private:
  std::shared_ptr<Endpoint> e_;
  std::mutex peers_mu_;
  std::vector<std::weak_ptr<PeerState>> peers_;  // guarded by peers_mu_
};

void finalize_mpi_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// MPI initialised with MPI_THREAD_MULTIPLE (here, when nobody had).
Status ensure_mpi(int64_t communicator) {
  int done = 0;
  MPI_Finalized(&done);
  if (done) return Status::Unavailable("transport: MPI has been finalized in this process");
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (!initialized) {
    if (communicator != TransportOptions::kMpiWorld)
      return Status::InvalidArgument(
          "transport: a communicator was given but MPI is not initialized");
    if (int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
        rc != MPI_SUCCESS)
      return mpi_error(rc, "transport: MPI_Init_thread");
    std::atexit(finalize_mpi_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE)
    return Status::NotSupported(
        "transport: the MPI backend needs MPI_THREAD_MULTIPLE; MPI was initialized with level " +
        std::to_string(provided) + " (initialize it with MPI_Init_thread(MPI_THREAD_MULTIPLE))");
  return Status::OK();
}

}  // namespace

bool mpi_transport_available() { return true; }

Result<std::unique_ptr<Transport>> open_mpi_transport(const TransportOptions& options) {
  if (!options.fabrics.empty())
    return Status::InvalidArgument(
        "transport: the MPI backend takes no fabric list (the MPI library's settings choose)");
  // One creation at a time in this process: the collectives of two would
  // interleave.
  static std::mutex open_mu;
  std::lock_guard<std::mutex> open_lock(open_mu);
  CASCADE_RETURN_IF_ERROR(ensure_mpi(options.mpi_communicator));
  MPI_Comm parent = MPI_COMM_WORLD;
  if (options.mpi_communicator != TransportOptions::kMpiWorld) {
    parent = MPI_Comm_f2c(static_cast<MPI_Fint>(options.mpi_communicator));
    if (parent == MPI_COMM_NULL)
      return Status::InvalidArgument("transport: the communicator handle is MPI_COMM_NULL");
  }
  {
    // Before any collective: every rank that gets past here frees its
    // endpoints inside MPI_Finalize.
    std::lock_guard<std::mutex> l(registry().mu);
    CASCADE_RETURN_IF_ERROR(hook_finalize_locked());
  }
  // The collectives run in the same order on every rank whatever fails
  // locally; the ranks agree on the outcome at the end.
  auto e = std::make_shared<Endpoint>();
  if (int rc = MPI_Comm_dup(parent, &e->comm); rc != MPI_SUCCESS)
    return mpi_error(rc, "transport: MPI_Comm_dup");
  MPI_Comm_set_errhandler(e->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(e->comm, &e->rank);
  MPI_Comm_size(e->comm, &e->size);
  uint64_t nonce = 0;
  if (e->rank == 0) {
    std::random_device rd;
    while (nonce == 0) nonce = (uint64_t(rd()) << 32) ^ rd();
  }
  int rc = MPI_Bcast(&nonce, 1, MPI_UINT64_T, 0, e->comm);
  Status local = rc == MPI_SUCCESS ? Status::OK() : mpi_error(rc, "transport: MPI_Bcast");
  e->nonce = nonce;
  if (local.ok() && find_endpoint(nonce) != nullptr)
    local = Status::Unavailable("transport: an endpoint nonce was drawn twice");
  rc = MPI_Win_create_dynamic(MPI_INFO_NULL, e->comm, &e->win);
  if (rc != MPI_SUCCESS) {
    e->win = MPI_WIN_NULL;
    if (local.ok())
      local = Status::Unavailable(
          mpi_error(rc, "transport: MPI_Win_create_dynamic").message() +
          " (this MPI cannot expose memory for one-sided access under MPI_THREAD_MULTIPLE here)");
  } else {
    MPI_Win_set_errhandler(e->win, MPI_ERRORS_RETURN);
    rc = MPI_Win_lock_all(MPI_MODE_NOCHECK, e->win);
    if (rc != MPI_SUCCESS && local.ok()) local = mpi_error(rc, "transport: MPI_Win_lock_all");
  }
  // Every rank has its endpoint, or none keeps one. A failed creation's MPI
  // objects stay until the process ends (freeing them is collective).
  int mine = local.ok() ? 1 : 0, all = 0;
  rc = MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, e->comm);
  if (!local.ok()) return local;
  if (rc != MPI_SUCCESS) return mpi_error(rc, "transport: MPI_Allreduce");
  if (all == 0)
    return Status::Unavailable("transport: another rank could not create its MPI endpoint");
  {
    std::lock_guard<std::mutex> l(registry().mu);
    registry().all.push_back(e);
  }
  std::vector<uint8_t> payload;
  put_le<uint32_t>(payload, kMpiAddressMagic);
  put_le<uint32_t>(payload, static_cast<uint32_t>(e->rank));
  put_le<uint32_t>(payload, static_cast<uint32_t>(e->size));
  put_le<uint32_t>(payload, 0);
  put_le<uint64_t>(payload, e->nonce);
  e->address = pack_address(payload);
  auto t = std::make_unique<MpiTransport>(e);
  if (options.progress_thread) t->start_progress();
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace cascade
