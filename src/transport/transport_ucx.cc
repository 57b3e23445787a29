// The UCX backend of Transport (UCP API).
//
// One UCP context and one worker per Transport. Every UCP call on them runs
// under the worker's mutex (the worker is created UCS_THREAD_MODE_SERIALIZED
// and we serialize), so any thread may call any method. Progress happens in
// waits: a waiting thread takes the mutex, runs ucp_worker_progress once,
// checks its request, releases the mutex, and spins (yielding the CPU) until
// the request finishes or its deadline passes. The optional progress thread
// does the same with no request of its own.
//
// Idle waits sleep where the worker has an event descriptor (UCX's wakeup
// feature): the progress thread, once a few polls find nothing to do, arms
// the worker and sleeps in poll() until the fabric has an event; a waiter
// that spun for kWaiterSpin without its request finishing (a receive of
// ReceiveWait::kAnyTime: after one look) sleeps until some progress happened
// (Worker::epoch, bumped by every progress call that did work while someone
// sleeps) or kWaiterNap passed, then looks again. So an
// idle member with threads blocked in receive costs no CPU, and a request
// that finishes without an event (local work only) is seen within a nap.
//
// Endpoints use UCP_ERR_HANDLING_MODE_PEER: when UCX notices a peer is gone it
// calls our error handler (inside progress, under the mutex), which marks the
// Peer failed; the requests pending on it complete with an error. Where UCX
// cannot notice (a stopped peer, a fabric without failure detection) the
// deadline does: the waiter marks the Peer failed and closes its endpoint
// with UCP_EP_CLOSE_FLAG_FORCE, which completes every pending request on it
// with UCS_ERR_CANCELED, after which no transfer writes local memory.
//
// With TransportOptions::require_failure_detection off, endpoints use
// UCP_ERR_HANDLING_MODE_NONE (the only mode UCX's shared-memory transports
// serve alone): a forced close is not available there, so a request that
// misses its deadline is left to UCX and the Peer is marked failed.
//
// get is ucp_get_nbx; put is ucp_put_nbx followed by ucp_ep_flush_nbx, whose
// completion means the bytes are at the peer; a batch issues every transfer
// and one flush.
//
// A receive that misses its deadline is cancelled. One that has already
// matched a message whose bytes are still arriving cannot be (they need the
// sender, which may be stopped): after a short grace its request and buffer
// go to the worker's orphans, which keep the buffer until the request ends,
// and the caller returns. The next receive of the tag takes the orphan over
// (the message is not lost); a discard of the tag drops it once it ends.
#include <poll.h>
#include <sched.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/backends.h"
#include "transport/key_format.h"
#include "transport/transport.h"
#include "util/thread_name.h"

namespace cascade {
namespace {

using namespace std::chrono_literals;

// How long a waiter keeps driving the worker after it force-closed an
// endpoint, for the cancelled requests to complete (local work only).
constexpr auto kCancelGrace = 5s;
// How long a receive that missed its deadline drives the worker after
// cancelling: a receive still waiting for a message ends at once, but one
// that has matched a message whose bytes are still arriving ends only when
// they have, which takes the sender. Past this the transport keeps it
// (Worker::orphans) and the caller returns.
constexpr auto kReceiveCancelGrace = 20ms;
// How long closing the transport waits for the flushes of its endpoints
// without failure detection: a live peer answers at once, a dead one never
// does. (Closing one such endpoint alone does not wait: close_locked.)
constexpr auto kFlushCloseGrace = 200ms;
constexpr uint64_t kMaxMessageBytes = 64ull << 20;
// A waiter polls this long before it sleeps (where the worker can wake it).
constexpr auto kWaiterSpin = 50us;
// The longest a sleeping waiter goes without looking at its request.
constexpr auto kWaiterNap = 2ms;
// Polls that found nothing before the progress thread arms and sleeps.
constexpr unsigned kProgressSpins = 64;
// The progress thread's sleep between looks at whether it should stop.
constexpr int kProgressSleepMs = 100;

Status ucx_status(ucs_status_t s, const std::string& what) {
  std::string m = what + ": " + ucs_status_string(s);
  switch (s) {
    case UCS_OK: return Status::OK();
    case UCS_ERR_NO_MEMORY: return Status::NoSpace(m);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR: return Status::InvalidArgument(m);
    case UCS_ERR_UNSUPPORTED: return Status::NotSupported(m);
    default: return Status::Unavailable(m);
  }
}

// Between two polls of a request nobody else is driving: spin a little,
// then give the CPU to whoever does the work (on a small machine, the peer).
void backoff(unsigned idle) {
  if (idle < 32) return;
  sched_yield();
}

struct Worker {
  std::mutex mu;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::atomic<bool> closed{false};
  int efd = -1;  // the worker's event descriptor; -1: none (waits spin)
  // Set while a progress thread drives the worker: only then may waiters
  // sleep (nothing else would progress it).
  std::atomic<bool> driven{false};
  // Waiters asleep until progress happens.
  std::mutex sleep_mu;
  std::condition_variable sleep_cv;
  std::atomic<uint32_t> sleepers{0};
  uint64_t epoch = 0;  // guarded by sleep_mu

  // ucp_worker_progress, waking the sleeping waiters when it did work.
  // REQUIRES: mu held.
  unsigned progress_locked() {
    const unsigned n = ucp_worker_progress(worker);
    if (n != 0 && sleepers.load(std::memory_order_seq_cst) != 0) {
      {
        std::lock_guard<std::mutex> l(sleep_mu);
        ++epoch;
      }
      sleep_cv.notify_all();
    }
    return n;
  }

  // Sleeps until progress happened after this call began, `req` finished,
  // or `until`. A progress that completes req after the check below finds
  // sleepers set (both are sequentially consistent) and bumps the epoch.
  // True when progress ended the sleep.
  bool sleep_for_progress(void* req, Deadline until) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint64_t seen;
    {
      std::lock_guard<std::mutex> l(sleep_mu);
      seen = epoch;
    }
    bool done;
    {
      std::lock_guard<std::mutex> l(mu);
      done = ucp_request_check_status(req) != UCS_INPROGRESS;
    }
    bool woken = false;
    if (!done) {
      std::unique_lock<std::mutex> l(sleep_mu);
      woken = sleep_cv.wait_until(l, until, [&] { return epoch != seen; });
    }
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    return woken;
  }
  // TransportCounters::slept_at_once and ::woken.
  std::atomic<uint64_t> slept_at_once{0};
  std::atomic<uint64_t> woken{0};
  // Receives nobody waits for now (a receive given up on while its message
  // was arriving; a discard, with no buffer), each with the buffer UCX may
  // still write until it ends. Guarded by mu.
  struct Orphan {
    void* req;
    uint64_t tag;
    std::unique_ptr<uint8_t[]> buf;
    bool drop;  // nobody will take it over: freed, its message dropped, once it ends
  };
  std::list<Orphan> orphans;
  uint64_t dropped = 0;  // messages orphans took, guarded by mu
  // Sends given up on at their deadline to a peer whose transfers cannot be
  // cancelled (no failure detection): UCX may still read their bytes, so
  // each keeps its copy until the request ends. Guarded by mu.
  struct Lingering {
    void* req;
    std::shared_ptr<const std::vector<uint8_t>> bytes;
  };
  std::list<Lingering> lingering;

  ~Worker() {
    if (worker) {
      // Cancelling ends the orphans still waiting for a message; the others
      // end with the worker, after which nothing writes their buffers (nor
      // reads the lingering sends' bytes).
      for (const Orphan& o : orphans) {
        ucp_request_cancel(worker, o.req);
        ucp_request_free(o.req);
      }
      for (const Lingering& l : lingering) ucp_request_free(l.req);
      ucp_worker_destroy(worker);
    }
    orphans.clear();
    lingering.clear();
    if (context) ucp_cleanup(context);
  }
  Worker() = default;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Frees orphan `it` if it has ended, moving `it` to the next one; false
  // when it has not. REQUIRES: mu held.
  bool release_if_ended_locked(std::list<Orphan>::iterator& it) {
    const ucs_status_t s = ucp_request_check_status(it->req);
    if (s == UCS_INPROGRESS) return false;
    if (s != UCS_ERR_CANCELED) ++dropped;
    ucp_request_free(it->req);
    it = orphans.erase(it);
    return true;
  }
  // Frees the orphans to drop that have ended, those cancelled, and the
  // lingering sends that have ended. REQUIRES: mu held.
  void reap_locked() {
    // Orphans to drop once ended, and any cancelled one (it holds no message).
    for (auto it = orphans.begin(); it != orphans.end();) {
      const bool free_when_ended =
          it->drop || ucp_request_check_status(it->req) == UCS_ERR_CANCELED;
      if (!free_when_ended || !release_if_ended_locked(it)) ++it;
    }
    for (auto it = lingering.begin(); it != lingering.end();) {
      if (ucp_request_check_status(it->req) == UCS_INPROGRESS) {
        ++it;
        continue;
      }
      ucp_request_free(it->req);
      it = lingering.erase(it);
    }
  }

  // Drives the worker until `req` finishes or `deadline` passes; the
  // request's status, or UCS_INPROGRESS at the deadline. Polls for `spin`
  // before it sleeps (where a progress thread drives the worker).
  ucs_status_t drive(void* req, Deadline deadline, Deadline::duration spin = kWaiterSpin) {
    return drive_or(req, deadline, spin, nullptr);
  }
  // As drive, and also ends (UCS_INPROGRESS) once `other`, looked at with mu
  // held after each progress, holds.
  ucs_status_t drive_or(void* req, Deadline deadline, Deadline::duration spin,
                        const std::function<bool()>* other) {
    const Deadline spin_until = TransportClock::now() + spin;
    for (unsigned idle = 0;; ++idle) {
      {
        std::lock_guard<std::mutex> lock(mu);
        progress_locked();
        ucs_status_t s = ucp_request_check_status(req);
        if (s != UCS_INPROGRESS) return s;
        if (other && (*other)()) return UCS_INPROGRESS;
      }
      const Deadline now = TransportClock::now();
      if (now >= deadline) return UCS_INPROGRESS;
      if (efd >= 0 && driven.load(std::memory_order_relaxed) && now >= spin_until) {
        // A wait with no polls asked for, on its first look (a wait that
        // polls may reach its sleep on the first look too, when its thread
        // lost the core for longer than its polls were to last).
        if (spin <= Deadline::duration::zero() && idle == 0)
          slept_at_once.fetch_add(1, std::memory_order_relaxed);
        if (sleep_for_progress(req, std::min(deadline, now + kWaiterNap)))
          woken.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      backoff(idle);
    }
  }
};

struct PeerState {
  std::shared_ptr<Worker> w;
  ucp_ep_h ep = nullptr;   // guarded by w->mu; null once closed
  bool failed = false;     // guarded by w->mu
  bool can_cancel = true;  // set before the Peer is shared: a forced close cancels
  std::string why;         // guarded by w->mu: why it failed

  // REQUIRES: w->mu held.
  void fail_locked(const std::string& reason) {
    if (failed) return;
    failed = true;
    why = reason;
  }
  // Starts closing the endpoint: forced where requests can be cancelled
  // (every pending one completes with UCS_ERR_CANCELED), else with a
  // flush. The close's request, or null when it finished at once.
  // REQUIRES: w->mu held.
  void* start_close_locked() {
    if (ep == nullptr) return nullptr;
    ucp_request_param_t p{};
    if (can_cancel) {
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
    ep = nullptr;
    if (req == nullptr || UCS_PTR_IS_ERR(req)) return nullptr;
    return req;
  }
  // Closes the endpoint, cancelling what is pending on it. A forced close
  // is local work, driven here until it is done. A flush close (no failure
  // detection) needs the peer, which may be stopped or gone: its request is
  // left to UCX (the progress thread drives it, and it is released when it
  // ends), so the worker, which this thread holds, and its other peers
  // never wait on a dead one.
  // REQUIRES: w->mu held.
  void close_locked() {
    void* req = start_close_locked();
    if (req == nullptr) return;
    if (can_cancel) {
      const Deadline until = TransportClock::now() + kCancelGrace;
      while (ucp_request_check_status(req) == UCS_INPROGRESS && TransportClock::now() < until)
        w->progress_locked();
    }
    ucp_request_free(req);  // one still in progress is released when it ends
  }
  // REQUIRES: w->mu held.
  Status usable_locked() const {
    if (w->closed.load()) return Status::Unavailable("transport: closed");
    if (failed) return Status::Unavailable("transport: peer failed: " + why);
    if (ep == nullptr) return Status::Unavailable("transport: peer closed");
    return Status::OK();
  }
};

void on_peer_error(void* arg, ucp_ep_h, ucs_status_t status) {
  // Called inside ucp_worker_progress, with the worker's mutex held.
  static_cast<PeerState*>(arg)->fail_locked(ucs_status_string(status));
}

// Waits for `req` (issued on `peer`); on a missed deadline fails and closes
// the peer and waits for the cancellation. Frees the request. `bytes`: the
// send's own copy of its message, kept until the request ends when it
// cannot be cancelled.
Status finish(PeerState& peer, void* req, Deadline deadline, const char* what,
              std::shared_ptr<const std::vector<uint8_t>> bytes = nullptr) {
  ucs_status_t s = peer.w->drive(req, deadline);
  if (s == UCS_INPROGRESS && !peer.can_cancel) {
    // Nothing can cancel it: UCX keeps the request. A send's copy of its
    // bytes lingers with it until it ends; the buffer of a get or put stays
    // in use until the Transport closes.
    std::lock_guard<std::mutex> lock(peer.w->mu);
    peer.fail_locked(std::string(what) + ": deadline passed");
    if (bytes) peer.w->lingering.push_back(Worker::Lingering{req, std::move(bytes)});
    else ucp_request_free(req);
    return Status::Unavailable(std::string(what) + ": deadline passed");
  }
  if (s == UCS_INPROGRESS) {
    {
      std::lock_guard<std::mutex> lock(peer.w->mu);
      peer.fail_locked(std::string(what) + ": deadline passed");
      peer.close_locked();
    }
    s = peer.w->drive(req, TransportClock::now() + kCancelGrace);
    if (s == UCS_INPROGRESS) {
      // Never seen: the request stays with UCX rather than be freed early.
      return Status::Unavailable(std::string(what) + ": deadline passed, cancel did not finish");
    }
  }
  std::lock_guard<std::mutex> lock(peer.w->mu);
  ucp_request_free(req);
  if (s == UCS_OK) return Status::OK();
  if (peer.failed) return Status::Unavailable(std::string(what) + ": peer failed: " + peer.why);
  return ucx_status(s, what);
}

class UcxCompletion final : public Completion {
 public:
  // req: null when the operation finished at once. region: the remote
  // region the operation uses, whose key (rkey) UCX may still read while
  // the operation runs: kept alive until it has ended, whatever the caller
  // drops first.
  UcxCompletion(std::shared_ptr<PeerState> peer, void* req, const char* what,
                std::shared_ptr<const RemoteRegion> region = nullptr)
      : peer_(std::move(peer)), req_(req), what_(what), region_(std::move(region)) {}
  ~UcxCompletion() override {
    if (req_ != nullptr) (void)wait(TransportClock::now());
  }

  bool test() override {
    if (req_ == nullptr) return true;
    {
      std::lock_guard<std::mutex> lock(peer_->w->mu);
      peer_->w->progress_locked();
      if (ucp_request_check_status(req_) == UCS_INPROGRESS) return false;
    }
    outcome_ = finish(*peer_, req_, TransportClock::now(), what_);
    req_ = nullptr;
    return true;
  }

  Status wait(Deadline deadline) override {
    if (req_ == nullptr) return outcome_;
    outcome_ = finish(*peer_, req_, deadline, what_);
    req_ = nullptr;
    return outcome_;
  }

 private:
  std::shared_ptr<PeerState> peer_;
  void* req_;
  const char* what_;
  Status outcome_;
  std::shared_ptr<const RemoteRegion> region_;  // released after the destructor ended the request
};

class UcxRemoteRegion final : public RemoteRegion,
                              public std::enable_shared_from_this<UcxRemoteRegion> {
 public:
  UcxRemoteRegion(std::shared_ptr<PeerState> peer, ucp_rkey_h rkey, uint64_t base, uint64_t size)
      : peer_(std::move(peer)), rkey_(rkey), base_(base), size_(size) {}
  ~UcxRemoteRegion() override {
    std::lock_guard<std::mutex> lock(peer_->w->mu);
    ucp_rkey_destroy(rkey_);
  }
  uint64_t size() const override { return size_; }

  const PeerState* owner() const { return peer_.get(); }
  ucp_rkey_h rkey() const { return rkey_; }
  uint64_t base() const { return base_; }

 private:
  std::shared_ptr<PeerState> peer_;
  ucp_rkey_h rkey_;
  uint64_t base_, size_;
};

class UcxPeer final : public Peer {
 public:
  explicit UcxPeer(std::shared_ptr<PeerState> state) : s_(std::move(state)) {}
  ~UcxPeer() override { close(); }

  Result<std::shared_ptr<RemoteRegion>> import_key(std::span<const uint8_t> key) override {
    Result<KeyFrame> k = unpack_key(key);
    if (!k.ok()) return k.status();
    std::lock_guard<std::mutex> lock(s_->w->mu);
    CASCADE_RETURN_IF_ERROR(s_->usable_locked());
    ucp_rkey_h rkey = nullptr;
    ucs_status_t st = ucp_ep_rkey_unpack(s_->ep, k->backend_key.data(), &rkey);
    if (st != UCS_OK)
      return Status::InvalidArgument(std::string("remote key: not usable on this peer: ") +
                                     ucs_status_string(st));
    return std::shared_ptr<RemoteRegion>(
        std::make_shared<UcxRemoteRegion>(s_, rkey, k->base, k->size));
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
    for (const TransferOp& op : ops) CASCADE_RETURN_IF_ERROR(check(op).status());
    std::vector<void*> reqs;
    reqs.reserve(ops.size() + 1);
    Status issue_error;
    {
      std::lock_guard<std::mutex> lock(s_->w->mu);
      CASCADE_RETURN_IF_ERROR(s_->usable_locked());
      for (const TransferOp& op : ops) {
        if (op.size == 0) continue;
        ucs_status_ptr_t r = issue_locked(op);
        if (UCS_PTR_IS_ERR(r)) {
          issue_error = ucx_status(UCS_PTR_STATUS(r), "transport batch");
          break;
        }
        if (r != nullptr) reqs.push_back(r);
      }
      ucp_request_param_t p{};
      ucs_status_ptr_t f = s_->ep ? ucp_ep_flush_nbx(s_->ep, &p) : nullptr;
      if (UCS_PTR_IS_ERR(f)) {
        if (issue_error.ok()) issue_error = ucx_status(UCS_PTR_STATUS(f), "transport flush");
      } else if (f != nullptr) {
        reqs.push_back(f);
      }
    }
    // The flush is last: when it finishes every transfer has. Wait for each
    // anyway, to free it and to see a transfer's own error.
    Status result = issue_error;
    for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) {
      Status st = finish(*s_, *it, deadline, "transport batch");
      if (result.ok() && !st.ok()) result = st;
    }
    return result;
  }

  Status send(uint64_t tag, std::span<const uint8_t> bytes, Deadline deadline) override {
    if (bytes.size() > kMaxMessageBytes)
      return Status::InvalidArgument("transport send: " + std::to_string(bytes.size()) +
                                     " bytes, more than a control message may carry");
    // Where a send cannot be cancelled (no failure detection), it goes from
    // a copy of its own: one that misses its deadline may still be read by
    // UCX after the caller has freed its bytes.
    std::shared_ptr<const std::vector<uint8_t>> copy;
    const uint8_t* data = bytes.data();
    if (!s_->can_cancel) {
      copy = std::make_shared<const std::vector<uint8_t>>(bytes.begin(), bytes.end());
      data = copy->data();
    }
    void* req;
    {
      std::lock_guard<std::mutex> lock(s_->w->mu);
      CASCADE_RETURN_IF_ERROR(s_->usable_locked());
      ucp_request_param_t p{};
      ucs_status_ptr_t r = ucp_tag_send_nbx(s_->ep, data, bytes.size(), tag, &p);
      if (UCS_PTR_IS_ERR(r)) return ucx_status(UCS_PTR_STATUS(r), "transport send");
      if (r == nullptr) return Status::OK();
      req = r;
    }
    return finish(*s_, req, deadline, "transport send", std::move(copy));
  }

  Status health() const override {
    std::lock_guard<std::mutex> lock(s_->w->mu);
    return s_->usable_locked();
  }

  void close() override {
    std::lock_guard<std::mutex> lock(s_->w->mu);
    s_->fail_locked("closed");
    s_->close_locked();
  }

 private:
  // The region of `op`, checked.
  Result<const UcxRemoteRegion*> check(const TransferOp& op) const {
    auto* region = dynamic_cast<const UcxRemoteRegion*>(op.region);
    if (region == nullptr || region->owner() != s_.get())
      return Status::InvalidArgument("transport: the region was not imported on this peer");
    if (!range_within(op.offset, op.size, region->size()))
      return Status::InvalidArgument("transport: bytes [" + std::to_string(op.offset) + ", +" +
                                     std::to_string(op.size) + ") lie outside the region of " +
                                     std::to_string(region->size()) + " bytes");
    if (op.local == nullptr && op.size > 0)
      return Status::InvalidArgument("transport: no local buffer");
    return region;
  }

  // REQUIRES: s_->w->mu held, the peer usable, op checked and non-empty.
  ucs_status_ptr_t issue_locked(const TransferOp& op) {
    auto* region = static_cast<const UcxRemoteRegion*>(op.region);
    ucp_request_param_t p{};
    uint64_t remote = region->base() + op.offset;
    if (op.kind == TransferKind::kGet)
      return ucp_get_nbx(s_->ep, op.local, op.size, remote, region->rkey(), &p);
    return ucp_put_nbx(s_->ep, op.local, op.size, remote, region->rkey(), &p);
  }

  Result<std::unique_ptr<Completion>> start(const TransferOp& op) {
    CASCADE_RETURN_IF_ERROR(check(op).status());
    const char* what = op.kind == TransferKind::kGet ? "transport get" : "transport put";
    std::lock_guard<std::mutex> lock(s_->w->mu);
    CASCADE_RETURN_IF_ERROR(s_->usable_locked());
    if (op.size == 0) return std::unique_ptr<Completion>(new UcxCompletion(s_, nullptr, what));
    ucs_status_ptr_t r = issue_locked(op);
    if (UCS_PTR_IS_ERR(r)) return ucx_status(UCS_PTR_STATUS(r), what);
    if (op.kind == TransferKind::kPut) {
      // The put's own completion only frees the source buffer; the flush
      // completes when the bytes are at the peer.
      if (r != nullptr) ucp_request_free(r);
      ucp_request_param_t p{};
      r = ucp_ep_flush_nbx(s_->ep, &p);
      if (UCS_PTR_IS_ERR(r)) return ucx_status(UCS_PTR_STATUS(r), what);
    }
    std::shared_ptr<const RemoteRegion> keep;
    if (r != nullptr)
      keep = static_cast<const UcxRemoteRegion*>(op.region)->weak_from_this().lock();
    return std::unique_ptr<Completion>(new UcxCompletion(s_, r, what, std::move(keep)));
  }

  std::shared_ptr<PeerState> s_;
};

class UcxRegion final : public MemoryRegion {
 public:
  UcxRegion(std::shared_ptr<Worker> w, ucp_mem_h memh, uint8_t* data, uint64_t size,
            std::vector<uint8_t> key)
      : w_(std::move(w)), memh_(memh), data_(data), size_(size), key_(std::move(key)) {}
  ~UcxRegion() override {
    std::lock_guard<std::mutex> lock(w_->mu);
    ucp_mem_unmap(w_->context, memh_);
  }
  uint8_t* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  const std::vector<uint8_t>& remote_key() const override { return key_; }

 private:
  std::shared_ptr<Worker> w_;
  ucp_mem_h memh_;
  uint8_t* data_;
  uint64_t size_;
  std::vector<uint8_t> key_;
};

class UcxTransport final : public Transport {
 public:
  using Transport::receive;  // the overload that expects its message soon
  explicit UcxTransport(std::shared_ptr<Worker> w) : w_(std::move(w)) {}
  ~UcxTransport() override { close(); }

  Status init(const TransportOptions& options) {
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    ucs_status_t s = ucp_worker_get_address(w_->worker, &addr, &len);
    if (s != UCS_OK) return ucx_status(s, "transport: worker address");
    address_ = pack_address(std::span(reinterpret_cast<const uint8_t*>(addr), len));
    ucp_worker_release_address(w_->worker, addr);
    require_failure_detection_ = options.require_failure_detection;
    if (options.progress_thread) {
      w_->driven.store(true);
      progress_ = std::thread([this] { run_progress(); });
    }
    return Status::OK();
  }

  std::string backend() const override { return "ucx"; }
  const std::vector<uint8_t>& address() const override { return address_; }

  Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, uint64_t n) override {
    if (data == nullptr || n == 0)
      return Status::InvalidArgument("transport: register_memory needs a non-empty region");
    std::lock_guard<std::mutex> lock(w_->mu);
    if (w_->closed.load()) return Status::Unavailable("transport: closed");
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = data;
    mp.length = n;
    ucp_mem_h memh = nullptr;
    ucs_status_t s = ucp_mem_map(w_->context, &mp, &memh);
    if (s != UCS_OK) return ucx_status(s, "transport: register " + std::to_string(n) + " bytes");
    void* packed = nullptr;
    size_t packed_len = 0;
    s = ucp_rkey_pack(w_->context, memh, &packed, &packed_len);
    if (s != UCS_OK) {
      ucp_mem_unmap(w_->context, memh);
      return ucx_status(s, "transport: pack remote key");
    }
    std::vector<uint8_t> key = pack_key(reinterpret_cast<uint64_t>(data), n,
                                        std::span(static_cast<const uint8_t*>(packed), packed_len));
    ucp_rkey_buffer_release(packed);
    return std::unique_ptr<MemoryRegion>(
        new UcxRegion(w_, memh, static_cast<uint8_t*>(data), n, std::move(key)));
  }

  Result<std::shared_ptr<Peer>> connect(std::span<const uint8_t> address,
                                        Deadline deadline) override {
    Result<std::span<const uint8_t>> raw = unpack_address(address);
    if (!raw.ok()) return raw.status();
    auto state = std::make_shared<PeerState>();
    state->w = w_;
    void* req;
    {
      std::lock_guard<std::mutex> lock(w_->mu);
      if (w_->closed.load()) return Status::Unavailable("transport: closed");
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(raw->data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = on_peer_error;
      ep.err_handler.arg = state.get();
      if (!require_failure_detection_) {
        ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        state->can_cancel = false;
      }
      ucs_status_t s = ucp_ep_create(w_->worker, &ep, &state->ep);
      if (s == UCS_ERR_UNREACHABLE && require_failure_detection_)
        return Status::Unavailable(
            "transport: connect: the peer cannot be reached: it is gone (nothing listens at its "
            "address any more), or no fabric allowed here reaches it with failure detection "
            "(UCX's posix and sysv shared-memory transports have none: allow tcp beside them, "
            "e.g. \"sm,tcp\", or turn require_failure_detection off)");
      if (s != UCS_OK) return ucx_status(s, "transport: connect");
      std::erase_if(peers_, [](const std::weak_ptr<PeerState>& p) { return p.expired(); });
      peers_.push_back(state);
      // The flush finishes once the connection is set up, or fails with it.
      ucp_request_param_t p{};
      ucs_status_ptr_t r = ucp_ep_flush_nbx(state->ep, &p);
      if (UCS_PTR_IS_ERR(r)) {
        state->close_locked();
        return ucx_status(UCS_PTR_STATUS(r), "transport: connect");
      }
      req = r;
    }
    auto peer = std::make_shared<UcxPeer>(state);
    if (req != nullptr) CASCADE_RETURN_IF_ERROR(finish(*state, req, deadline, "transport connect"));
    return std::shared_ptr<Peer>(std::move(peer));
  }

  Result<std::vector<uint8_t>> receive(uint64_t tag, uint64_t max_bytes, Deadline deadline,
                                       ReceiveWait wait) override {
    if (max_bytes > kMaxMessageBytes)
      return Status::InvalidArgument("transport receive: max_bytes above the message limit");
    const Deadline::duration spin = wait == ReceiveWait::kAnyTime ? Deadline::duration::zero()
                                                                  : Deadline::duration(kWaiterSpin);
    // An earlier receive's message of this tag that has arrived since (an
    // orphan that ended) is this receive's. One still arriving stays where
    // it is: this receive is posted anew and takes the next message, so a
    // sender that stopped in the middle of one holds up no other sender's
    // messages of the tag; it ends this receive's wait if it arrives first.
    auto arrived = [&](const Worker::Orphan& o) {
      return o.tag == tag && !o.drop && ucp_request_check_status(o.req) != UCS_INPROGRESS;
    };
    auto arriving = [&](const Worker::Orphan& o) { return o.tag == tag && !o.drop; };
    const std::function<bool()> orphan_arrived = [&] {
      return std::any_of(w_->orphans.begin(), w_->orphans.end(), arrived);
    };
    void* req;
    std::unique_ptr<uint8_t[]> buf;
    ucs_status_t st;
    while (true) {
      // Not zeroed, and made before the worker's lock: a receive may allow
      // for a large message, and only the bytes that arrive are read.
      std::unique_ptr<uint8_t[]> fresh(new uint8_t[std::max<uint64_t>(max_bytes, 1)]);
      bool watch_orphans;
      {
        std::lock_guard<std::mutex> lock(w_->mu);
        if (w_->closed.load()) return Status::Unavailable("transport: closed");
        w_->reap_locked();
        auto it = std::find_if(w_->orphans.begin(), w_->orphans.end(), arrived);
        if (it != w_->orphans.end()) {
          req = it->req;
          buf = std::move(it->buf);
          w_->orphans.erase(it);
          st = ucp_request_check_status(req);
          break;
        }
        ucp_request_param_t p{};
        p.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        ucs_status_ptr_t r =
            ucp_tag_recv_nbx(w_->worker, fresh.get(), max_bytes, tag, ~ucp_tag_t{0}, &p);
        if (UCS_PTR_IS_ERR(r)) return ucx_status(UCS_PTR_STATUS(r), "transport receive");
        req = r;
        buf = std::move(fresh);
        watch_orphans = std::any_of(w_->orphans.begin(), w_->orphans.end(), arriving);
      }
      st = w_->drive_or(req, deadline, spin, watch_orphans ? &orphan_arrived : nullptr);
      if (st != UCS_INPROGRESS || TransportClock::now() >= deadline) break;
      // An orphan's message arrived first: this receive gives its request
      // up (kept as an orphan when a message matched it meanwhile) and
      // takes that one, or waits again if another receive took it.
      {
        std::lock_guard<std::mutex> lock(w_->mu);
        ucp_request_cancel(w_->worker, req);
      }
      (void)w_->drive(req, TransportClock::now() + kReceiveCancelGrace);
      std::lock_guard<std::mutex> lock(w_->mu);
      if (ucp_request_check_status(req) == UCS_ERR_CANCELED) ucp_request_free(req);
      else w_->orphans.push_back(Worker::Orphan{req, tag, std::move(buf), false});
    }
    if (st == UCS_INPROGRESS) {
      // The deadline passed.
      {
        std::lock_guard<std::mutex> lock(w_->mu);
        ucp_request_cancel(w_->worker, req);
      }
      (void)w_->drive(req, TransportClock::now() + kReceiveCancelGrace);
    }
    std::lock_guard<std::mutex> lock(w_->mu);
    if (ucp_request_check_status(req) == UCS_INPROGRESS) {
      // Its message is still arriving: the buffer stays with the transport
      // until it has, for the next receive of the tag.
      w_->orphans.push_back(Worker::Orphan{req, tag, std::move(buf), false});
      return Status::Unavailable("transport receive: no message before the deadline");
    }
    ucp_tag_recv_info_t info{};
    const ucs_status_t s = ucp_tag_recv_request_test(req, &info);
    ucp_request_free(req);
    if (s == UCS_ERR_CANCELED)
      return Status::Unavailable("transport receive: no message before the deadline");
    if (s == UCS_ERR_MESSAGE_TRUNCATED || (s == UCS_OK && info.length > max_bytes))
      return Status::InvalidArgument("transport receive: message longer than " +
                                     std::to_string(max_bytes) + " bytes");
    if (s != UCS_OK) return ucx_status(s, "transport receive");
    return std::vector<uint8_t>(buf.get(), buf.get() + info.length);
  }

  void discard(uint64_t tag) override {
    std::lock_guard<std::mutex> lock(w_->mu);
    if (w_->closed.load()) return;
    w_->reap_locked();
    // A receive of `tag` given up on while its message arrived: its message
    // is dropped once it ends.
    for (Worker::Orphan& o : w_->orphans) {
      if (o.tag != tag) continue;
      o.drop = true;
      return;
    }
    // Over the bound, the oldest are cancelled: one still waiting for its
    // message ends at once (one whose message is arriving ends by itself).
    for (auto it = w_->orphans.begin();
         w_->orphans.size() >= kMaxDiscards && it != w_->orphans.end();) {
      ucp_request_cancel(w_->worker, it->req);
      if (!w_->release_if_ended_locked(it)) ++it;
    }
    // No buffer: the message is taken as truncated, which ends it for the
    // sender too.
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    ucs_status_ptr_t r = ucp_tag_recv_nbx(w_->worker, nullptr, 0, tag, ~ucp_tag_t{0}, &p);
    if (UCS_PTR_IS_ERR(r)) return;
    w_->orphans.push_back(Worker::Orphan{r, tag, nullptr, true});
  }

  bool progress() override {
    std::lock_guard<std::mutex> lock(w_->mu);
    return w_->progress_locked() != 0;
  }

  TransportCounters counters() const override {
    std::lock_guard<std::mutex> lock(w_->mu);
    w_->reap_locked();
    return TransportCounters{w_->orphans.size(), w_->dropped,
                             w_->slept_at_once.load(std::memory_order_relaxed),
                             w_->woken.load(std::memory_order_relaxed)};
  }

  void close() override {
    if (w_->closed.exchange(true)) return;
    stop_.store(true);
    if (progress_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(w_->mu);
        if (w_->efd >= 0) ucp_worker_signal(w_->worker);  // out of its poll()
      }
      progress_.join();
      w_->driven.store(false);
    }
    std::lock_guard<std::mutex> lock(w_->mu);
    // Every endpoint's close started at once, then driven together: live
    // peers answer their flushes within a grace, however many are dead.
    std::vector<std::pair<void*, Deadline>> closing;
    const auto now = TransportClock::now();
    for (auto& weak : peers_) {
      if (auto p = weak.lock()) {
        p->fail_locked("transport closed");
        if (void* req = p->start_close_locked())
          closing.emplace_back(req, now + (p->can_cancel ? Deadline::duration(kCancelGrace)
                                                         : Deadline::duration(kFlushCloseGrace)));
      }
    }
    peers_.clear();
    for (bool open = !closing.empty(); open;) {
      open = false;
      for (const auto& [req, until] : closing)
        open |= ucp_request_check_status(req) == UCS_INPROGRESS && TransportClock::now() < until;
      if (open) w_->progress_locked();
    }
    for (const auto& [req, until] : closing) ucp_request_free(req);
  }

 private:
  void run_progress() {
    name_this_thread("cascade-ucx");
    unsigned idle = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      bool worked;
      {
        std::lock_guard<std::mutex> lock(w_->mu);
        worked = w_->progress_locked() != 0;
      }
      idle = worked ? 0 : idle + 1;
      if (w_->efd >= 0) {
        if (idle < kProgressSpins) continue;
        // Nothing to do: sleep until the fabric has an event for the worker
        // (arm says BUSY when events came in meanwhile: progress them).
        ucs_status_t armed;
        {
          std::lock_guard<std::mutex> lock(w_->mu);
          armed = ucp_worker_arm(w_->worker);
        }
        if (armed == UCS_OK) {
          pollfd pfd{w_->efd, POLLIN, 0};
          (void)::poll(&pfd, 1, kProgressSleepMs);
        }
        idle = 0;
        continue;
      }
      // Without an event descriptor: spin while traffic is recent, yield
      // for a while, then sleep briefly.
      if (idle > 20000) {
        std::this_thread::sleep_for(20us);
      } else if (idle > 64) {
        sched_yield();
      }
    }
  }

  std::shared_ptr<Worker> w_;
  std::vector<uint8_t> address_;
  std::vector<std::weak_ptr<PeerState>> peers_;  // guarded by w_->mu
  bool require_failure_detection_ = true;
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace

bool ucx_transport_available() { return true; }

Result<std::unique_ptr<Transport>> open_ucx_transport(const TransportOptions& options) {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return ucx_status(s, "transport: read UCX configuration");
  if (!options.fabrics.empty()) {
    s = ucp_config_modify(config, "TLS", options.fabrics.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return Status::InvalidArgument("transport: fabrics \"" + options.fabrics +
                                     "\": " + ucs_status_string(s));
    }
  }
  auto w = std::make_shared<Worker>();
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  // With wakeup, idle waits sleep (see the top of this file); a UCX that
  // cannot offer it on these fabrics is used without.
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  s = ucp_init(&params, config, &w->context);
  bool wakeup = s == UCS_OK;
  if (!wakeup) {
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG;
    s = ucp_init(&params, config, &w->context);
  }
  ucp_config_release(config);
  if (s != UCS_OK) {
    w->context = nullptr;
    return ucx_status(s, "transport: UCX init (fabrics \"" + options.fabrics + "\")");
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  s = ucp_worker_create(w->context, &wp, &w->worker);
  if (s != UCS_OK) {
    w->worker = nullptr;
    return ucx_status(s, "transport: UCX worker");
  }
  if (wakeup && ucp_worker_get_efd(w->worker, &w->efd) != UCS_OK) w->efd = -1;
  auto t = std::make_unique<UcxTransport>(std::move(w));
  CASCADE_RETURN_IF_ERROR(t->init(options));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace cascade
