#include "tiers/remote/rank_fabric.h"

#include <sys/mman.h>
#include <sys/prctl.h>

#include <algorithm>
#include <numeric>
#include <string>

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include "tiers/remote/mpi_status.h"
#include "util/thread_name.h"

namespace cascade::remote {
namespace {

constexpr uint64_t kSegmentAlign = 2ULL << 20;  // huge-page aligned arena
constexpr uint64_t kMaxTransfer = 1ULL << 30;   // MPI counts are int: move at most 1 GiB per call
constexpr uint64_t kMapStep = 64ULL << 20;      // = LocalShare::kCommitStep

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Every rank learns whether every rank succeeded; the failing rank keeps
// its own message.
Status agree_all(MPI_Comm comm, Status local) {
  int mine = local.ok() ? 1 : 0, all = 0;
  int rc = MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, comm);
  if (rc != MPI_SUCCESS) return mpi_status(rc, "MPI_Allreduce");
  if (!local.ok()) return local;
  if (!all)
    return Status::Unavailable("another rank could not open its part of the distributed store");
  return Status::OK();
}

int delete_fabric_attribute(MPI_Comm, int, void* value, void*) {
  auto* holder = static_cast<std::shared_ptr<RankFabric>*>(value);
  (*holder)->shutdown();
  delete holder;
  return MPI_SUCCESS;
}

std::optional<Message> gone_reply(const Message& request) {
  switch (request.kind) {
    case MessageKind::kPutBegin:
    case MessageKind::kPutCommit:
    case MessageKind::kLookup:
    case MessageKind::kContains:
    case MessageKind::kRemove: {
      Message r;
      r.kind = MessageKind::kReply;
      r.call_id = request.call_id;
      r.items = request.items;
      for (Item& it : r.items) it.outcome = Outcome::kGone;
      return r;
    }
    default: return std::nullopt;
  }
}

}  // namespace

Status RankFabric::finalized_status() {
  return Status::Unavailable("MPI has been finalized: the distributed store's remote tier is gone");
}

Result<std::shared_ptr<RankFabric>> RankFabric::Open(MPI_Comm comm, uint64_t segment_bytes,
                                                     bool node_local_loads) {
  int provided = MPI_THREAD_SINGLE;
  if (int rc = MPI_Query_thread(&provided); rc != MPI_SUCCESS)
    return mpi_status(rc, "MPI_Query_thread");
  if (provided < MPI_THREAD_MULTIPLE)
    return Status::Unavailable(
        "the distributed store needs MPI initialized with MPI_THREAD_MULTIPLE (a progress thread "
        "serves peers while the application calls MPI); call MPI_Init_thread with it, or import "
        "mpi4py with its default settings");

  std::shared_ptr<RankFabric> f(new RankFabric());
  if (int rc = MPI_Comm_dup(comm, &f->comm_); rc != MPI_SUCCESS)
    return mpi_status(rc, "MPI_Comm_dup");
  MPI_Comm_set_errhandler(f->comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(f->comm_, &f->rank_);
  MPI_Comm_size(f->comm_, &f->size_);
  f->live_ = LiveRanks(f->size_);
  f->segment_bytes_ = segment_bytes;

  auto fail = [&](Status st) -> Result<std::shared_ptr<RankFabric>> {
    f->free_mpi_objects();  // every rank fails at the same step (agree), so frees match
    return st;
  };

  int rc =
      MPI_Comm_split_type(f->comm_, MPI_COMM_TYPE_SHARED, f->rank_, MPI_INFO_NULL, &f->node_comm_);
  if (Status st = agree_all(f->comm_, mpi_status(rc, "MPI_Comm_split_type")); !st.ok())
    return fail(st);
  int node_rank = 0, node_size = 1;
  MPI_Comm_rank(f->node_comm_, &node_rank);
  MPI_Comm_size(f->node_comm_, &node_size);
  int first = node_rank == 0 ? 1 : 0;
  MPI_Allreduce(&first, &f->nodes_, 1, MPI_INT, MPI_SUM, f->comm_);

  // This rank's segment of the node's shared window, with room to align it.
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* raw = nullptr;
  rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(segment_bytes + kSegmentAlign), 1, info,
                               f->node_comm_, &raw, &f->shared_win_);
  MPI_Info_free(&info);
  if (Status st = agree_all(f->comm_, mpi_status(rc, "MPI_Win_allocate_shared")); !st.ok())
    return fail(st);
  MPI_Win_set_errhandler(f->shared_win_, MPI_ERRORS_RETURN);
  uintptr_t aligned = (reinterpret_cast<uintptr_t>(raw) + kSegmentAlign - 1) & ~(kSegmentAlign - 1);
  uint64_t delta = aligned - reinterpret_cast<uintptr_t>(raw);
  f->local_base_ = reinterpret_cast<uint8_t*>(aligned);

  // The other processes map the window elsewhere; each rank's alignment
  // offset inside its segment is the same everywhere.
  std::vector<uint64_t> deltas(f->size_);
  rc = MPI_Allgather(&delta, 1, MPI_UINT64_T, deltas.data(), 1, MPI_UINT64_T, f->comm_);
  if (rc != MPI_SUCCESS) return fail(mpi_status(rc, "MPI_Allgather"));
  f->peer_bytes_.resize(f->size_);
  f->unanswered_ = std::make_unique<Unanswered[]>(f->size_);
  rc = MPI_Allgather(&segment_bytes, 1, MPI_UINT64_T, f->peer_bytes_.data(), 1, MPI_UINT64_T,
                     f->comm_);
  if (rc != MPI_SUCCESS) return fail(mpi_status(rc, "MPI_Allgather"));
  f->peer_base_.assign(f->size_, nullptr);
  f->peer_mapped_.resize(f->size_);
  if (node_local_loads) {
    MPI_Group world_group, node_group;
    MPI_Comm_group(f->comm_, &world_group);
    MPI_Comm_group(f->node_comm_, &node_group);
    std::vector<int> node_ranks(node_size), world_ranks(node_size);
    std::iota(node_ranks.begin(), node_ranks.end(), 0);
    MPI_Group_translate_ranks(node_group, node_size, node_ranks.data(), world_group,
                              world_ranks.data());
    MPI_Group_free(&world_group);
    MPI_Group_free(&node_group);
    for (int nr = 0; nr < node_size; ++nr) {
      MPI_Aint bytes = 0;
      int unit = 1;
      void* base = nullptr;
      rc = MPI_Win_shared_query(f->shared_win_, nr, &bytes, &unit, &base);
      if (rc != MPI_SUCCESS) return fail(mpi_status(rc, "MPI_Win_shared_query"));
      int w = world_ranks[nr];
      f->peer_base_[w] = static_cast<uint8_t*>(base) + deltas[w];
      size_t steps = (f->peer_bytes_[w] + kMapStep - 1) / kMapStep;
      f->peer_mapped_[w].reset(new std::atomic<uint8_t>[steps]);
      for (size_t i = 0; i < steps; ++i)
        f->peer_mapped_[w][i].store(w == f->rank_, std::memory_order_relaxed);
    }
  }

  // Ranks on other nodes (or every peer, without node-local loads) are
  // reached through one-sided operations on a window over the same memory.
  // Its creation is collective, so the ranks decide together: a rank whose
  // node_local_loads differs then opens on, to the check of the options
  // every rank must share, instead of waiting for the others for ever.
  int need_rma = (node_size < f->size_ || !node_local_loads) ? 1 : 0;
  int any_rma = need_rma;
  MPI_Allreduce(&need_rma, &any_rma, 1, MPI_INT, MPI_MAX, f->comm_);
  if (any_rma) {
    rc = MPI_Win_create(f->local_base_, static_cast<MPI_Aint>(segment_bytes), 1, MPI_INFO_NULL,
                        f->comm_, &f->rma_win_);
    Status st = mpi_status(rc, "MPI_Win_create");
    if (!st.ok())
      st = Status::Unavailable(st.message() +
                               " (this MPI cannot expose memory for one-sided access under "
                               "MPI_THREAD_MULTIPLE here; with Open MPI single-node runs need the "
                               "vader BTL's single-copy mechanism, e.g. CMA)");
    if (st = agree_all(f->comm_, st); !st.ok()) return fail(st);
    MPI_Win_set_errhandler(f->rma_win_, MPI_ERRORS_RETURN);
    rc = MPI_Win_lock_all(MPI_MODE_NOCHECK, f->rma_win_);
    if (Status st2 = agree_all(f->comm_, mpi_status(rc, "MPI_Win_lock_all")); !st2.ok())
      return fail(st2);
  }

#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  f->cuda_aware_ = MPIX_Query_cuda_support() == 1;
#endif

  if (Status st = agree_all(f->comm_, f->install_finalize_hook(f)); !st.ok()) return fail(st);
  MPI_Barrier(f->comm_);
  f->progress_ = std::thread([p = f.get()] { p->run(); });
  return f;
}

Status RankFabric::install_finalize_hook(const std::shared_ptr<RankFabric>& self) {
  int key = MPI_KEYVAL_INVALID;
  int rc = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, delete_fabric_attribute, &key, nullptr);
  if (rc != MPI_SUCCESS) return mpi_status(rc, "MPI_Comm_create_keyval");
  auto* holder = new std::shared_ptr<RankFabric>(self);
  rc = MPI_Comm_set_attr(MPI_COMM_SELF, key, holder);
  MPI_Comm_free_keyval(&key);  // the attribute keeps it alive until MPI_Finalize
  if (rc != MPI_SUCCESS) {
    delete holder;
    return mpi_status(rc, "MPI_Comm_set_attr");
  }
  return Status::OK();
}

RankFabric::~RankFabric() {
  // Reached without shutdown() only when the finalize hook was never
  // installed (a failed open) or the process never finalizes MPI: stop the
  // thread, leave the MPI objects to the process's end.
  stop_.store(true, std::memory_order_release);
  if (progress_.joinable()) progress_.join();
}

void RankFabric::free_mpi_objects() {
  if (rma_win_ != MPI_WIN_NULL) {
    MPI_Win_unlock_all(rma_win_);
    MPI_Win_free(&rma_win_);
  }
  if (shared_win_ != MPI_WIN_NULL) MPI_Win_free(&shared_win_);
  if (node_comm_ != MPI_COMM_NULL) MPI_Comm_free(&node_comm_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  local_base_ = nullptr;
}

Status RankFabric::agree(const Status& local) { return agree_all(comm_, local); }

Result<bool> RankFabric::all_equal(uint64_t value) {
  uint64_t lo = 0, hi = 0;
  int rc = MPI_Allreduce(&value, &lo, 1, MPI_UINT64_T, MPI_MIN, comm_);
  if (rc == MPI_SUCCESS) rc = MPI_Allreduce(&value, &hi, 1, MPI_UINT64_T, MPI_MAX, comm_);
  if (rc != MPI_SUCCESS) return mpi_status(rc, "MPI_Allreduce");
  return lo == hi;
}

// ---- transfers -----------------------------------------------------------------

void RankFabric::map_peer_range(int peer, uint64_t offset, uint64_t n) {
  if (n == 0) return;
  const uint64_t bytes = peer_bytes_[peer];
  for (uint64_t step = offset / kMapStep; step * kMapStep < std::min(bytes, offset + n); ++step) {
    std::atomic<uint8_t>& mapped = peer_mapped_[peer][step];
    uint8_t expected = 0;
    // One thread maps a step; others copy meanwhile (taking page faults).
    if (mapped.load(std::memory_order_acquire) || !mapped.compare_exchange_strong(expected, 1))
      continue;
    uint64_t start = step * kMapStep;
    // Best effort: a failure only leaves the page faults to the copy.
    ::madvise(peer_base_[peer] + start, std::min(kMapStep, bytes - start), MADV_POPULATE_WRITE);
  }
}

Status RankFabric::rma_get(int peer, uint64_t offset, void* dst, uint64_t n) {
  if (rma_win_ == MPI_WIN_NULL)
    return Status::Unavailable("no RMA window to reach rank " + std::to_string(peer));
  auto* d = static_cast<uint8_t*>(dst);
  std::vector<MPI_Request> reqs;
  Status st;
  for (uint64_t off = 0; off < n; off += kMaxTransfer) {
    int len = static_cast<int>(std::min(kMaxTransfer, n - off));
    MPI_Request r;
    int rc = MPI_Rget(d + off, len, MPI_BYTE, peer, static_cast<MPI_Aint>(offset + off), len,
                      MPI_BYTE, rma_win_, &r);
    if (rc != MPI_SUCCESS) {
      st = mpi_status(rc, "MPI_Rget");
      break;
    }
    reqs.push_back(r);
  }
  if (!reqs.empty()) {
    int rc = MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    if (st.ok()) st = mpi_status(rc, "MPI_Rget completion");
  }
  return st;
}

Status RankFabric::rma_put(int peer, uint64_t offset, const void* src, uint64_t n) {
  if (rma_win_ == MPI_WIN_NULL)
    return Status::Unavailable("no RMA window to reach rank " + std::to_string(peer));
  const auto* s = static_cast<const uint8_t*>(src);
  Status st;
  for (uint64_t off = 0; off < n; off += kMaxTransfer) {
    int len = static_cast<int>(std::min(kMaxTransfer, n - off));
    int rc = MPI_Put(s + off, len, MPI_BYTE, peer, static_cast<MPI_Aint>(offset + off), len,
                     MPI_BYTE, rma_win_);
    if (rc != MPI_SUCCESS) {
      st = mpi_status(rc, "MPI_Put");
      break;
    }
  }
  // Remote completion: the bytes are in the owner's memory before the
  // commit that publishes them is sent.
  int rc = MPI_Win_flush(peer, rma_win_);
  if (st.ok()) st = mpi_status(rc, "MPI_Win_flush");
  return st;
}

// ---- messages -----------------------------------------------------------------------

Status RankFabric::post(int peer, int tag, const Message& m) {
  auto send = std::make_unique<PendingSend>();
  send->bytes = encode_message(m);
  int rc = MPI_Isend(send->bytes.data(), static_cast<int>(send->bytes.size()), MPI_BYTE, peer, tag,
                     comm_, &send->request);
  if (rc != MPI_SUCCESS) return mpi_status(rc, "MPI_Isend");
  std::lock_guard<std::mutex> lock(sends_mu_);
  new_sends_.push_back(std::move(send));
  return Status::OK();
}

void RankFabric::note_unanswered(int peer, std::chrono::milliseconds base) {
  Unanswered& u = unanswered_[peer];
  u.base_ns.store(std::chrono::nanoseconds(base).count());
  const uint32_t streak = std::min<uint32_t>(u.streak.fetch_add(1) + 1, 16);
  const auto skip = std::min<std::chrono::nanoseconds>(base * (int64_t{1} << (streak - 1)),
                                                       std::chrono::seconds(30));
  u.skip_until_ns.store((Clock::now() + skip).time_since_epoch().count());
}

bool RankFabric::skipped(int peer) const {
  return Clock::now().time_since_epoch().count() <
         unanswered_[peer].skip_until_ns.load(std::memory_order_relaxed);
}

Result<std::shared_ptr<PendingCalls::Call>> RankFabric::start_call(int peer, Message request) {
  if (!live_.present(peer))
    return Status::Unavailable("rank " + std::to_string(peer) + " has left the group");
  if (skipped(peer))
    return Status::Unavailable("rank " + std::to_string(peer) +
                               " left a request unanswered recently; skipped for now");
  auto c = calls_.open(peer);
  request.call_id = c->id;
  if (Status st = post(peer, kRequestTag, request); !st.ok()) {
    calls_.cancel(c);
    return st;
  }
  return c;
}

Result<Message> RankFabric::call(int peer, Message request, Clock::time_point deadline) {
  auto c = start_call(peer, std::move(request));
  if (!c.ok()) return c.status();
  return calls_.wait(*c, deadline, [this] { return try_poll(); });
}

void RankFabric::attach(RequestHandler* handler) {
  std::lock_guard<std::mutex> lock(handler_mu_);
  handler_ = handler;
  silent_ = false;
}

void RankFabric::detach(bool silent) {
  std::lock_guard<std::mutex> lock(handler_mu_);
  handler_ = nullptr;
  silent_ = silent;
}

void RankFabric::announce_leave() {
  Message leave;
  leave.kind = MessageKind::kLeave;
  for (int p = 0; p < size_; ++p)
    if (p != rank_ && live_.present(p)) (void)post(p, kRequestTag, leave);
}

// ---- progress thread ---------------------------------------------------------------

void RankFabric::dispatch(int source, int tag, std::span<const uint8_t> bytes) {
  auto m = decode_message(bytes);
  if (!m.ok() || source < 0 || source >= size_) {
    bad_messages_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (tag == kReplyTag) {
    Unanswered& u = unanswered_[source];
    if (calls_.deliver(source, std::move(*m))) {
      // It answers in time: the run of unanswered calls ends.
      u.streak.store(0, std::memory_order_relaxed);
      u.skip_until_ns.store(0, std::memory_order_relaxed);
      return;
    }
    // A late reply (its call gave up): it runs again, so it is skipped at
    // most one deadline more, not the rest of a doubled window (a rank
    // stopped for a while answers these first when it goes on). The run
    // goes on: a rank that always answers late is still skipped most of
    // the time rather than costing every call its deadline.
    const int64_t soon =
        (Clock::now() + std::chrono::nanoseconds(u.base_ns.load())).time_since_epoch().count();
    int64_t until = u.skip_until_ns.load(std::memory_order_relaxed);
    while (until > soon && !u.skip_until_ns.compare_exchange_weak(until, soon)) {
    }
    std::lock_guard<std::mutex> lock(handler_mu_);
    if (handler_) handler_->on_stale_reply(source, *m);
    return;
  }
  if (m->kind == MessageKind::kLeave) {
    live_.mark_gone(source);
    calls_.fail_peer(source,
                     Status::Unavailable("rank " + std::to_string(source) + " left the group"));
    std::lock_guard<std::mutex> lock(handler_mu_);
    if (handler_) handler_->on_peer_left(source);
    return;
  }
  std::optional<Message> reply;
  {
    std::lock_guard<std::mutex> lock(handler_mu_);
    if (handler_) reply = handler_->serve(source, std::move(*m));
    else if (!silent_) reply = gone_reply(*m);
  }
  if (reply) (void)post(source, kReplyTag, *reply);
}

void RankFabric::reap_sends(bool all) {
  {
    std::lock_guard<std::mutex> lock(sends_mu_);
    for (auto& s : new_sends_) sends_.push_back(std::move(s));
    new_sends_.clear();
  }
  auto done = [](std::unique_ptr<PendingSend>& s) {
    int flag = 0;
    MPI_Test(&s->request, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  };
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(), done), sends_.end());
  if (all) {
    // Shutting down: a send a departed peer never received is cancelled.
    for (auto& s : sends_) {
      MPI_Cancel(&s->request);
      MPI_Request_free(&s->request);
    }
    sends_.clear();
  }
}

bool RankFabric::poll_once() {
  bool did = false;
  for (int burst = 0; burst < 64; ++burst) {
    int flag = 0;
    MPI_Message msg;
    MPI_Status st;
    if (MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, &msg, &st) != MPI_SUCCESS || !flag)
      break;
    int count = 0;
    MPI_Get_count(&st, MPI_BYTE, &count);
    recv_buf_.resize(static_cast<size_t>(std::max(count, 0)));
    if (MPI_Mrecv(recv_buf_.data(), count, MPI_BYTE, &msg, &st) != MPI_SUCCESS) {
      bad_messages_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    dispatch(st.MPI_SOURCE, st.MPI_TAG, recv_buf_);
    did = true;
  }
  if (did)
    last_message_ns_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  return did;
}

bool RankFabric::try_poll() {
  std::unique_lock<std::mutex> lock(recv_mu_, std::try_to_lock);
  if (!lock.owns_lock() || stop_.load(std::memory_order_acquire)) return false;
  return poll_once();
}

void RankFabric::run() {
  name_this_thread("cascade-rank");
  // Short sleeps should be short: the kernel's default timer slack (50 µs)
  // would dominate the idle-to-busy latency.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  auto last_tick = Clock::now();
  int idle_sleep_us = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    bool did = false;
    {
      std::lock_guard<std::mutex> lock(recv_mu_);
      did = poll_once();
    }
    reap_sends(false);
    auto now = Clock::now();
    if (now - last_tick > std::chrono::milliseconds(5)) {
      last_tick = now;
      std::lock_guard<std::mutex> lock(recv_mu_);  // handlers run one at a time
      std::lock_guard<std::mutex> hlock(handler_mu_);
      if (handler_) handler_->on_tick();
    }
    if (did) {
      idle_sleep_us = 0;
      continue;
    }
    // Right after a message (received by this thread or by a caller
    // waiting for a reply) the next one is likely close: spin, yielding the
    // core to anyone runnable, for 50 µs. Then sleep in short steps while
    // the group was busy lately (a sleeping thread wakes soon on a core
    // with room), and back off to ~1 ms once idle, so an idle group costs
    // no CPU.
    auto quiet =
        now - Clock::time_point(Clock::duration(last_message_ns_.load(std::memory_order_relaxed)));
    if (quiet < std::chrono::microseconds(50)) {
      std::this_thread::yield();
      continue;
    }
    if (quiet < std::chrono::milliseconds(20)) {
      idle_sleep_us = 0;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      continue;
    }
    idle_sleep_us = std::min(1000, idle_sleep_us ? idle_sleep_us * 2 : 20);
    std::this_thread::sleep_for(std::chrono::microseconds(idle_sleep_us));
  }
}

void RankFabric::shutdown() {
  if (down_.load(std::memory_order_acquire)) return;
  calls_.fail_all(Status::Unavailable("MPI is being finalized"));
  {
    std::lock_guard<std::mutex> lock(handler_mu_);
    if (handler_ != nullptr) {
      // The store is still open: leave the group now.
      announce_leave();
      handler_ = nullptr;
    }
  }
  {
    std::unique_lock<std::shared_mutex> lock(lifecycle_);
    down_.store(true, std::memory_order_release);
  }
  stop_.store(true, std::memory_order_release);
  if (progress_.joinable()) progress_.join();
  // Let the last sends (Leave, replies) complete; cancel what a departed
  // peer will never receive.
  for (int i = 0; i < 100; ++i) {
    reap_sends(false);
    if (sends_.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  reap_sends(true);
  free_mpi_objects();
}

}  // namespace cascade::remote
