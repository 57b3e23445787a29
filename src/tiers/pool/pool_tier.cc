#include "tiers/pool/pool_tier.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "cuda/device_copy.h"
#include "os/committed_memory.h"
#include "os/ipc.h"
#include "tiers/leased_reads.h"
#include "util/arena_ranges.h"
#include "util/block_checksum.h"
#include "util/copy_bytes.h"
#include "util/errno_status.h"
#include "util/fork_generation.h"
#include "util/sigbus_guard.h"
#include "util/thread_name.h"

namespace cascade {

using pool::Channel;
using pool::ReplyHeader;
using pool::RequestHeader;

namespace {

constexpr int64_t kCheckUs = 10000;              // how often a waiting call checks the server
constexpr int64_t kFlushTimeoutUs = 3600000000;  // a flush writes blocks down: it may take long
constexpr size_t kReleaseBatch = 1024;           // queued releases sent at once
// The least bytes of a sub-batch (16 blocks at most); copying this many
// takes longer than a round trip to the server.
constexpr uint64_t kSubBatchBytes = 1 << 20;
// How often a client waiting for the server's welcome checks whether it
// was asked to give up.
constexpr auto kGreetStep = std::chrono::milliseconds(50);

Status wire_status(uint32_t code, std::string message) {
  if (code == 0) return Status::OK();
  if (code > static_cast<uint32_t>(Code::kNotSupported))
    return Status::Unavailable("the pool server answered an unknown code " + std::to_string(code));
  return Status(static_cast<Code>(code), std::move(message));
}

// Why the server did not reserve room for a block, in the user's terms
// (only the code crosses the wire).
Status reserve_failure(uint32_t code, const BlockId& id) {
  std::string what;
  switch (static_cast<Code>(code)) {
    case Code::kNoSpace:
      what = "the pool has no room for block " + id.hex() + " (every block of its arena is in use)";
      break;
    case Code::kIOError:
      what = "the pool could not make room for block " + id.hex() +
             ": its persistent tier refused to take the blocks that would move out, which are "
             "not written down yet (a read-only, failing or full disk; the server's flush "
             "reports it)";
      break;
    case Code::kInvalidArgument:
      what = "the pool refused block " + id.hex() + " (larger than its arena)";
      break;
    case Code::kBusy:
      what = "the pool could not take block " + id.hex() +
             " now (it is being written, or this client holds as many reservations as a "
             "client may)";
      break;
    default: what = "the pool server could not reserve room for block " + id.hex(); break;
  }
  return wire_status(code, std::move(what));
}

// Why the server did not lease a block, in the user's terms.
Status lease_failure(uint32_t code, const BlockId& id) {
  std::string what;
  switch (static_cast<Code>(code)) {
    case Code::kNotFound: what = "block " + id.hex() + " is not in the pool"; break;
    case Code::kNoSpace:
      what = "block " + id.hex() +
             " is in the pool's lower tiers, but its arena has no room to bring it in (the "
             "blocks there are leased)";
      break;
    case Code::kBusy: what = "block " + id.hex() + " is being written or moved in the pool"; break;
    default: what = "the pool server could not lease block " + id.hex(); break;
  }
  return wire_status(code, std::move(what));
}

}  // namespace

class PoolTier::Held {
 public:
  Held() = default;
  Held(Slot* slot, std::unique_lock<std::mutex> lock) : slot_(slot), lock_(std::move(lock)) {}
  Slot* slot() const { return slot_; }
  void reset() {
    if (lock_.owns_lock()) lock_.unlock();
    slot_ = nullptr;
  }

 private:
  Slot* slot_ = nullptr;
  std::unique_lock<std::mutex> lock_;
};

PoolTier::PoolTier(const CascadeConfig& config, ThreadPool* pool)
    : pool_(pool),
      timeout_us_(int64_t(config.pool_timeout_ms) * 1000),
      parallel_threshold_(config.parallel_copy_threshold),
      generation_(fork_generation()) {}

Result<std::unique_ptr<PoolTier>> PoolTier::Open(const CascadeConfig& config, ThreadPool* pool,
                                                 const std::atomic<bool>* cancel, int loss_fd) {
  std::unique_ptr<PoolTier> tier(new PoolTier(config, pool));
  tier->loss_fd_ = loss_fd;
  CASCADE_RETURN_IF_ERROR(tier->connect(config, cancel));
  if (gpu_usable(config.gpu_device_id)) {
    // As the host tier: loads to the GPU DMA straight from the arena.
    tier->registered_ = register_host_memory(tier->base_, tier->capacity_).ok();
    // The GPU set up now rather than by a first batch (where the process
    // uses it already), unless the store asked for no GPU.
    if (config.use_gpu) prepare_device(config.gpu_device_id);
  }
  tier->releaser_ = std::thread([t = tier.get()] { t->release_loop(); });
  tier->mapper_ = std::thread([t = tier.get()] { t->map_arena(); });
  return tier;
}

// Connects to the server, checks who it is, says hello and takes its
// welcome (with the descriptors that come with it). cut_off: the server
// closed the connection before any welcome.
Status PoolTier::greet(const CascadeConfig& config, const pool::Hello& hello, pool::Welcome* w,
                       std::vector<int>* fds, bool* cut_off, const std::atomic<bool>* cancel,
                       std::optional<ForkFence>* fence) {
  // A connection made again (cancel given) waits no longer for room in a
  // stalled server's listen queue than for its welcome, a step at a time.
  auto sock =
      connect_unix(config.pool_socket, cancel ? std::chrono::milliseconds(kGreetStep).count() : -1);
  if (!sock.ok()) return sock.status();
  sock_ = *sock;
  auto peer = peer_credentials(sock_);
  if (!peer.ok()) return peer.status();
  CASCADE_RETURN_IF_ERROR(check_socket_owner(peer->uid, config.pool_socket));
  Status st = send_message(sock_, &hello, sizeof hello);
  if (st.ok()) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us_);
    // The welcome is waited for in short steps, so that `cancel` ends the
    // wait soon; it is read once all of it is there.
    while (true) {
      const auto step = std::min(deadline, std::chrono::steady_clock::now() + kGreetStep);
      st = wait_readable(sock_, sizeof *w, step);
      if (st.ok()) {
        fence->emplace();
        st = receive_message(sock_, w, sizeof *w, deadline, fds, 3);
        break;
      }
      if (closed_by_peer(st) || std::chrono::steady_clock::now() >= deadline) break;
      if (cancel && cancel->load(std::memory_order_acquire)) {
        st = Status::Unavailable("connecting was given up");
        break;
      }
    }
  }
  if (st.ok()) return st;
  *cut_off = closed_by_peer(st);
  return Status::Unavailable("the pool server at '" + config.pool_socket +
                             "' did not answer: " + st.message());
}

Status PoolTier::connect(const CascadeConfig& config, const std::atomic<bool>* cancel) {
  if (config.pool_namespace.size() > pool::kMaxNamespaceBytes)
    return Status::InvalidArgument("pool_namespace is longer than 256 bytes");
  int channels = config.pool_channels;
  if (channels <= 0) {
    // A batch's I/O threads talk on two channels each (put_stream), the
    // releasing and mapping threads on one; other callers of the store get
    // at least one per core.
    const int io = pool_ ? pool_->size() : 0;
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    channels = std::clamp(std::max(2 * io + 2, cores), 1, static_cast<int>(pool::kMaxChannels));
  }
  pool::Hello hello{};
  hello.magic = pool::kMagic;
  hello.version = pool::kVersion;
  hello.channels = static_cast<uint32_t>(std::min<int>(channels, pool::kMaxChannels));
  hello.namespace_bytes = static_cast<uint32_t>(config.pool_namespace.size());
  std::memcpy(hello.name_space, config.pool_namespace.data(), config.pool_namespace.size());

  pool::Welcome w{};
  std::vector<int> fds;
  // From the receipt of the server's descriptors until they are closed and
  // the mappings made of them marked MADV_DONTFORK: a child forked in
  // between would hold the arena open (and with it the arena's lock).
  std::optional<ForkFence> fence;
  // A server closes a connection before its welcome when it gave the
  // connection's handshake slot to another (no hello had come within a
  // moment: a client descheduled between its connect and its hello), could
  // not start its handshake, or is shutting down: the client connects
  // again, a few times, soon.
  for (int attempt = 0;; ++attempt) {
    bool cut_off = false;
    Status st = greet(config, hello, &w, &fds, &cut_off, cancel, &fence);
    if (st.ok()) break;
    fence.reset();
    if (!cut_off || attempt == kGreetings - 1) return st;
    ::close(sock_);
    sock_ = -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(2 << attempt));
  }
  auto close_fds = [&] {
    for (int fd : fds) ::close(fd);
  };
  if (w.magic != pool::kMagic || w.version != pool::kVersion) {
    close_fds();
    return Status::Unavailable("'" + config.pool_socket +
                               "' is not a pool server of this version (protocol " +
                               std::to_string(pool::kVersion) + ")");
  }
  if (w.code != 0) {
    close_fds();
    std::string msg(w.message, std::min<uint32_t>(w.message_bytes, pool::kMaxMessageBytes));
    return wire_status(w.code, "the pool server refused this client: " + msg);
  }
  if (fds.size() != 3 || w.channels == 0 || w.channels > hello.channels ||
      w.channel_stride != pool::kChannelStride || w.arena_capacity == 0) {
    close_fds();
    return Status::Unavailable("the pool server's welcome is malformed");
  }
  client_id_ = w.client_id;
  capacity_ = w.arena_capacity;
  persistent_ = w.flags & pool::kPersistent;
  kept_since_ = w.kept_since;
  void* d = ::mmap(nullptr, pool::kDoorbellBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[2], 0);
  int err = errno;
  ::close(fds[2]);
  if (d == MAP_FAILED) {
    ::close(fds[0]);
    ::close(fds[1]);
    return errno_status(err, "mmap of the pool's doorbell");
  }
  doorbell_ = static_cast<pool::Doorbell*>(d);
  arena_map_bytes_ = w.arena_file_offset + w.arena_capacity;
  void* a = ::mmap(nullptr, arena_map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  err = errno;
  ::close(fds[0]);
  if (a == MAP_FAILED) {
    ::close(fds[1]);
    return errno_status(err, "mmap of the pool's arena");
  }
  arena_map_ = static_cast<uint8_t*>(a);
  // A forked child maps none of it: the mapping holds the arena's lock (it
  // came as the server's own open file), and a child that outlives this
  // connection would keep a server started again from reattaching the arena.
  (void)::madvise(arena_map_, arena_map_bytes_, MADV_DONTFORK);
  (void)::madvise(doorbell_, pool::kDoorbellBytes, MADV_DONTFORK);
  base_ = arena_map_ + w.arena_file_offset;
  add_arena_range(arena_map_, arena_map_bytes_);  // no read writes into stored blocks
  arena_committed_ = std::min(w.arena_committed, capacity_);
  channel_count_ = w.channels;
  channel_map_bytes_ = uint64_t(w.channels) * pool::kChannelStride;
  void* c = ::mmap(nullptr, channel_map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1], 0);
  err = errno;
  ::close(fds[1]);
  if (c == MAP_FAILED) return errno_status(err, "mmap of the pool's channels");
  channel_map_ = static_cast<uint8_t*>(c);
  (void)::madvise(channel_map_, channel_map_bytes_, MADV_DONTFORK);
  slots_.reset(new Slot[channel_count_]);
  for (uint32_t i = 0; i < channel_count_; ++i) {
    slots_[i].ch = Channel::at(channel_map_, i);
    slots_[i].seq = 0;  // a new channel file: requests are numbered from 1
  }
  return Status::OK();
}

// Maps the arena's backed pages into this process ahead of use, a chunk at
// a time: without it every page this client touches first takes a page
// fault, even when the server backed it long ago. Only an optimization:
// an error just ends it.
// It follows the server's backing as it grows (asking every 100 ms), until
// the whole arena is mapped or the tier closes.
void PoolTier::map_arena() {
  name_this_thread("cascade-map");
  constexpr uint64_t kChunk = 64ULL << 20;
  uint64_t at = 0, backed = arena_committed_;
  while (!stop_mapping_.load() && at < capacity_) {
    if (at < backed) {
      const uint64_t n = std::min(kChunk, backed - at);
      if (populate_pages(base_ + at, n) != 0) return;
      at += n;
      mapped_bytes_.store(at, std::memory_order_relaxed);
      continue;
    }
    std::unique_lock<std::mutex> lock(release_mu_);
    map_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; });
    if (stopping_) return;
    lock.unlock();
    auto s = server_stats();
    if (!s.ok()) return;
    backed = std::min(s->arena_committed, capacity_);
  }
}

PoolTier::~PoolTier() {
  stop_mapping_.store(true);
  {
    std::lock_guard<std::mutex> lock(release_mu_);
    stopping_ = true;
  }
  release_cv_.notify_all();
  map_cv_.notify_all();
  if (mapper_.joinable()) mapper_.join();
  if (releaser_.joinable()) releaser_.join();
  if (registered_) unregister_host_memory(base_);
  if (channel_map_) ::munmap(channel_map_, channel_map_bytes_);
  if (doorbell_) ::munmap(doorbell_, pool::kDoorbellBytes);
  if (arena_map_) {
    remove_arena_range(arena_map_);
    ::munmap(arena_map_, arena_map_bytes_);
  }
  if (sock_ >= 0) {
    // The server ends what this client still held once the connection
    // ends: shut down here, since a child forked meanwhile may hold a copy
    // of the socket. Only in the process that connected it: a shutdown
    // acts on the connection, whichever process's copy it is made on.
    if (::getpid() == opened_by_) ::shutdown(sock_, SHUT_RDWR);
    ::close(sock_);
  }
}

bool PoolTier::wait_for_loss(int wake_fd, int timeout_ms) {
  if (lost()) return true;
  struct pollfd fds[2] = {{sock_, POLLRDHUP, 0}, {wake_fd, POLLIN, 0}};
  const int wait_ms = timeout_ms < 0 ? kWatchBeatMs : std::min(timeout_ms, kWatchBeatMs);
  const int r = ::poll(fds, wake_fd >= 0 ? 2 : 1, wait_ms);
  if (r > 0 && (fds[0].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) mark_lost(false);
  const auto now = std::chrono::steady_clock::now();
  const uint64_t beat = doorbell_->heartbeat.load(std::memory_order_relaxed);
  if (beat != watched_beat_ || watched_beat_seen_ == std::chrono::steady_clock::time_point{}) {
    watched_beat_ = beat;
    watched_beat_seen_ = now;
  } else if (now - watched_beat_seen_ > std::chrono::milliseconds(pool::kStillHeartbeatMs)) {
    // Calls waiting for replies look at server_stalled_ and end with it.
    mark_lost(true);
  }
  return lost();
}

bool PoolTier::mark_lost(bool stalled) const {
  std::atomic<bool>& flag = stalled ? server_stalled_ : server_gone_;
  const bool before = flag.exchange(true, std::memory_order_acq_rel);
  if (!before && loss_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(loss_fd_, &one, sizeof one);
  }
  return before;
}

PoolTier::Held PoolTier::hold() const {
  // A thread keeps to one channel while it is free: the channel's cache
  // lines stay where they were, and requests of one thread are answered in
  // order on one channel.
  thread_local const uint64_t mine = std::hash<std::thread::id>{}(std::this_thread::get_id());
  const uint32_t n = channel_count_;
  const uint32_t start = static_cast<uint32_t>(mine % n);
  if (Held h = try_hold(start); h.slot()) return h;
  for (uint32_t k = 0; k < n; ++k) {
    Slot* s = &slots_[(start + k) % n];
    std::unique_lock<std::mutex> lock(s->mu);
    if (!s->broken) return Held(s, std::move(lock));
  }
  return Held();
}

PoolTier::Held PoolTier::try_hold(uint32_t start, const Slot* mine) const {
  const uint32_t n = channel_count_;
  for (uint32_t k = 0; k < n; ++k) {
    Slot* s = &slots_[(start + k) % n];
    if (s == mine) continue;
    std::unique_lock<std::mutex> lock(s->mu, std::try_to_lock);
    if (lock.owns_lock() && !s->broken) return Held(s, std::move(lock));
  }
  return Held();
}

Status PoolTier::post(Slot* slot, Op op, uint32_t count, uint64_t item_bytes,
                      uint32_t flags) const {
  if (!slot) return Status::Unavailable("every channel to the pool server failed");
  if (server_gone_.load(std::memory_order_acquire))
    return Status::Unavailable("the node pool server is gone");
  if (server_stalled_.load(std::memory_order_acquire))
    return Status::Unavailable("the node pool server stopped answering");
  if (slot->broken) return Status::Unavailable("the channel to the pool server failed");
  Channel& ch = slot->ch;
  RequestHeader h{static_cast<uint32_t>(op), count, flags, 0};
  std::memcpy(ch.request, &h, sizeof h);
  ch.control->request_bytes = static_cast<uint32_t>(sizeof h + count * item_bytes);
  slot->op = op;
  slot->count = count;
  slot->flags = flags;
  slot->posted = std::chrono::steady_clock::now();
  pool::post_request(ch.control, ++slot->seq, doorbell_);
  return Status::OK();
}

Status PoolTier::await_reply(Slot* slot, ReplyHeader* reply, int64_t timeout_us) const {
  *reply = ReplyHeader{};
  Channel& ch = slot->ch;
  const uint32_t seq = slot->seq;
  // The deadline counts from the post: a thread waiting for several
  // requests in turn waits for a stalled server once, not once each.
  const auto deadline = slot->posted + std::chrono::microseconds(timeout_us);
  // A request sent ahead has had the time of a copy: when its reply has not
  // come yet, the server's worker is waiting for a core, and a spin here
  // would keep one from it.
  const int64_t spin_ns = (slot->flags & pool::kAhead) ? 0 : pool::kClientSpinNs;
  bool gone = false, stopped = false;
  // The server's heartbeat, looked at on each check while the reply is
  // waited for: one that stands still for kStillHeartbeatMs is a stopped
  // server's, whatever the deadline.
  uint64_t beat = doorbell_->heartbeat.load(std::memory_order_relaxed);
  auto beat_seen = std::chrono::steady_clock::now();
  bool answered = pool::wait_change(
      &ch.control->reply_seq, seq - 1, &ch.control->client_sleeping, kCheckUs,
      [&] {
        if (peer_closed(sock_)) gone = true;
        const auto now = std::chrono::steady_clock::now();
        const uint64_t b = doorbell_->heartbeat.load(std::memory_order_relaxed);
        if (b != beat) {
          beat = b;
          beat_seen = now;
        } else if (now - beat_seen > std::chrono::milliseconds(pool::kStillHeartbeatMs)) {
          stopped = true;
        }
        return gone || stopped || server_stalled_.load(std::memory_order_relaxed) || now > deadline;
      },
      spin_ns);
  if (answered && ch.control->reply_seq.load(std::memory_order_acquire) != seq) answered = false;
  if (!answered) {
    slot->broken = true;  // a late reply would answer the next request
    if (gone) {
      mark_lost(false);
      return Status::Unavailable("the node pool server is gone");
    }
    if (mark_lost(true)) return Status::Unavailable("the node pool server stopped answering");
    if (stopped)
      return Status::Unavailable("the node pool server stopped: its heartbeat stood still for " +
                                 std::to_string(pool::kStillHeartbeatMs / 1000) + " s");
    return Status::Unavailable("the node pool server did not answer within " +
                               std::to_string(timeout_us / 1000) + " ms");
  }
  std::memcpy(reply, ch.reply, sizeof *reply);
  if (reply->code != 0) {
    std::string msg(reinterpret_cast<const char*>(ch.reply + sizeof *reply),
                    std::min<uint32_t>(reply->message_bytes, pool::kMaxMessageBytes));
    reply->count = 0;
    return wire_status(reply->code, "node pool server: " + msg);
  }
  if (reply->count != slot->count && slot->op != Op::kStats)
    return Status::Unavailable("the node pool server answered " + std::to_string(reply->count) +
                               " items for " + std::to_string(slot->count));
  return Status::OK();
}

uint32_t PoolTier::items_to_give_back(const Status& st, const ReplyHeader& reply, size_t asked) {
  // Items past the count asked do not fit the reply area's layout for this
  // request and are not read.
  return st.ok() ? 0 : static_cast<uint32_t>(std::min<size_t>(reply.count, asked));
}

Status PoolTier::take_reply(Slot* slot, const Status& sent, ReplyHeader* reply) const {
  *reply = ReplyHeader{};  // a request that did not go out has no reply: count 0
  return sent.ok() ? await_reply(slot, reply, timeout_us_) : sent;
}

Status PoolTier::call(Slot* slot, Op op, uint32_t count, uint64_t item_bytes, ReplyHeader* reply,
                      int64_t timeout_us, uint32_t flags) const {
  CASCADE_RETURN_IF_ERROR(post(slot, op, count, item_bytes, flags));
  return await_reply(slot, reply, timeout_us);
}

// ---- puts --------------------------------------------------------------------

Status PoolTier::copy_in(uint8_t* dst, const void* src, uint64_t n, const PutOptions& options) {
  if (options.src_kind == MemoryKind::kHost) {
    parallel_memcpy(pool_, dst, src, n, parallel_threshold_);
    return Status::OK();
  }
  return device_copy(dst, MemoryKind::kHost, src, options.src_kind, n, options.cuda_stream);
}

Status PoolTier::put(const BlockId& id, const void* data, uint64_t size,
                     const PutOptions& options) {
  Status st;
  const void* d[1] = {data};
  uint64_t s[1] = {size};
  put_batch(std::span<const BlockId>(&id, 1), d, s, options, std::span<Status>(&st, 1));
  return st;
}

// ---- sharing a batch's copies ------------------------------------------------

namespace {

// A wait for another thread of the batch: a short spin (the other thread is
// usually running and done within microseconds), then the core goes to
// whoever else is runnable (the server's worker, when it runs here), and a
// wait that lasts (the other thread waits for a channel) sleeps.
void wait_a_little(int round) {
  if (round < 256) pool::cpu_relax();
  else if (round < 4096) std::this_thread::yield();
  else std::this_thread::sleep_for(std::chrono::microseconds(50));
}

}  // namespace

// Takes the part's copies in turn with any other thread of the batch until
// none is left.
template <typename Part, typename CopyOne>
void PoolTier::take_copies(Part* p, CopyOne& copy_one) {
  size_t did = 0;
  for (size_t k; (k = p->next.fetch_add(1, std::memory_order_relaxed)) < p->items; ++did)
    copy_one(p, k);
  if (did) p->done.fetch_add(did, std::memory_order_release);
}

// As take_copies, then waits for the copies other threads took: the part's
// owner, before its commit or its releases.
template <typename Part, typename CopyOne>
void PoolTier::copy_own(Part* p, CopyOne& copy_one) {
  take_copies(p, copy_one);
  for (int round = 0; p->done.load(std::memory_order_acquire) != p->items; ++round)
    wait_a_little(round);
}

// Copies of the batch's parts that their owners shared. With `wait`, also
// waits for parts claimed but not shared yet (the owner waits for their
// reserve or lease), until every part's copies are taken; a thread that
// holds a channel must not wait: the owner may be waiting for it.
template <typename Part, typename CopyOne>
void PoolTier::share_copies(Parts<Part>* parts, CopyOne& copy_one, bool wait) {
  for (int round = 0;; ++round) {
    bool open = false;
    for (size_t c = 0; c < parts->count; ++c) {
      Part* p = &parts->at[c];
      if (!p->ready.load(std::memory_order_acquire)) {
        open = true;
        continue;
      }
      if (p->next.load(std::memory_order_relaxed) < p->items) take_copies(p, copy_one);
    }
    if (!open || !wait) return;
    wait_a_little(round);
  }
}

// The sub-batch size that spreads n items over the I/O threads; 0 when the
// batch stays whole (no threads, few items, or blocks large enough that each
// copy is split over the threads).
size_t PoolTier::sub_batch(std::span<const uint64_t> sizes) const {
  const size_t n = sizes.size();
  if (!pool_ || pool_->size() < 2 || n < 32) return 0;
  uint64_t largest = 0;
  for (uint64_t s : sizes) {
    if (s >= parallel_threshold_) return 0;
    largest = std::max(largest, s);
  }
  // Four sub-batches per thread balance the threads' shares; a sub-batch of
  // at least 1 MiB (and 16 small blocks) keeps the round trips to the server
  // a small part of its copies, unless the batch is too small to give every
  // thread one that large: then every thread gets one.
  const size_t threads = size_t(pool_->size());
  size_t least = std::clamp<size_t>(kSubBatchBytes / std::max<uint64_t>(1, largest), 1, 16);
  least = std::min(least, std::max<size_t>(1, n / threads));
  return std::clamp<size_t>(n / (4 * threads), least, pool::kMaxItems);
}

// Calls fn(c) for the parts [c0, c1), on the I/O threads when there are
// several.
void PoolTier::each_part(size_t c0, size_t c1, const std::function<void(size_t)>& fn) const {
  if (pool_ && c1 - c0 > 1) pool_->parallel_for(c1 - c0, [&](size_t k) { fn(c0 + k); });
  else
    for (size_t c = c0; c < c1; ++c) fn(c);
}

// A batch is cut into sub-batches that the I/O threads take in turn, so the
// server's workers reserve and commit in parallel with the copies instead
// of one worker handling the whole batch while the copies wait. Each thread
// pipelines its sub-batches (put_stream).
void PoolTier::put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                         std::span<const uint64_t> sizes, const PutOptions& options,
                         std::span<Status> statuses) {
  const size_t n = ids.size();
  const PutBatch b{ids, data, sizes, options, statuses};
  const size_t sub = sub_batch(sizes);
  if (options.src_kind != MemoryKind::kHost) {
    put_from_devices(b, sub);
    return;
  }
  if (sub) {
    Parts<PutPart> parts(n, sub);
    uint64_t bytes = 0;
    for (uint64_t size : sizes) bytes += size;
    parts.ahead = bytes / parts.count >= kSubBatchBytes;
    pool_->parallel_for(std::min<size_t>(parts.count, pool_->size()),
                        [&](size_t) { put_stream(b, &parts); });
    return;
  }
  for (size_t begin = 0; begin < n; begin += pool::kMaxItems) {
    PutPart part;
    part.begin = begin;
    part.count = std::min<size_t>(pool::kMaxItems, n - begin);
    {
      Held held = hold();
      part.sent = post_reserve(held.slot(), b, part, false);
      take_reserve(held.slot(), b, &part);
    }
    copy_part(b, &part);  // with no channel held
    Held held = hold();
    part.sent = post_commit(held.slot(), b, &part, false);
    take_commit(held.slot(), b, &part);
  }
}

// Puts from device memory, a window of sub-batches at a time: the window's
// reserves go out in parallel, every block it reserved is queued for one
// batched GPU copy into the arena (registered with CUDA), and while those
// copies run the next window is reserved; a window's commits go out in
// parallel once its copies are complete.
void PoolTier::put_from_devices(const PutBatch& b, size_t sub) {
  const size_t step = sub ? sub : pool::kMaxItems;
  Parts<PutPart> parts(b.ids.size(), step);
  PipelinePart windows[2];  // declared before the pipeline, which writes their statuses
  DeviceCopyPipeline copies(MemoryKind::kHost, b.options.src_kind, b.options.cuda_stream);
  // A window's reserves, in parallel, and the copies into what they placed.
  auto start = [&](size_t k, size_t c0, size_t c1) {
    PipelinePart& w = windows[k % 2];
    w = PipelinePart{};
    each_part(c0, c1, [&](size_t c) {
      Held held = hold();
      parts.at[c].sent = post_reserve(held.slot(), b, parts.at[c], false);
      take_reserve(held.slot(), b, &parts.at[c]);
    });
    for (size_t c = c0; c < c1; ++c)
      for (const Placed& t : parts.at[c].placed) {
        if (!b.statuses[t.i].ok() || b.sizes[t.i] == 0) continue;
        w.push(t.i, CopyItem{base_ + t.offset, b.data[t.i], b.sizes[t.i]});
      }
    w.queue(copies);
  };
  // Once a window's copies are done: its commits, in parallel (they abort
  // the blocks whose copies failed).
  auto finish = [&](size_t k, size_t c0, size_t c1) {
    windows[k % 2].settle(copies, b.statuses);
    each_part(c0, c1, [&](size_t c) {
      Held held = hold();
      parts.at[c].sent = post_commit(held.slot(), b, &parts.at[c], false);
      take_commit(held.slot(), b, &parts.at[c]);
    });
  };
  // The windows are runs of whole sub-batches; what a window holds on the
  // server (reservations) stays bounded however large the batch is.
  auto size = [&](size_t c) {
    const size_t first = c * step, last = std::min(b.sizes.size(), first + step);
    uint64_t bytes = 0;
    for (size_t i = first; i < last; ++i) bytes += b.sizes[i];
    return std::pair<size_t, uint64_t>(last - first, bytes);
  };
  for_each_part_two_deep(parts.count, size, start, finish);
}

// One I/O thread's share of a batch: it takes sub-batches in turn, and
// while it copies one, the reserve of its next and the commit of its last
// are with the server, on a second channel. Its waits are then for replies
// to requests sent one copy earlier, which have usually come: where the
// cores are all copying, the server's worker gets one only now and then,
// and a thread that waited for each reply would idle (or spin) that long.
// With no second channel free, each request is waited for in turn. A
// thread left without a sub-batch of its own copies blocks of the others'
// (share_copies), so the threads of a batch end together.
void PoolTier::put_stream(const PutBatch& b, Parts<PutPart>* parts) {
  auto copy_one = [&](PutPart* p, size_t k) { copy_placed(b, p->placed[k]); };
  PutPart* cur = parts->claim();
  if (cur) {
    Held x = hold();          // reserves (and commits when there is no y)
    Held y;                   // commits
    PutPart* last = nullptr;  // its commit in flight on y
    cur->sent = post_reserve(x.slot(), b, *cur, false);
    while (true) {
      take_reserve(x.slot(), b, cur);
      cur->share(cur->placed.size());
      PutPart* ahead = parts->claim();
      if (ahead && !y.slot() && x.slot()) y = try_hold(0, x.slot());
      const bool early = ahead && y.slot();
      if (early) ahead->sent = post_reserve(x.slot(), b, *ahead, parts->ahead);
      copy_own(cur, copy_one);
      if (last) {
        take_commit(y.slot(), b, last);
        last = nullptr;
      }
      Slot* on = early ? y.slot() : x.slot();
      cur->sent = post_commit(on, b, cur, early && parts->ahead);
      if (early) {
        last = cur;
      } else if (ahead) {
        take_commit(on, b, cur);
        ahead->sent = post_reserve(x.slot(), b, *ahead, false);
      } else {
        // The last commit: the other threads' copies meanwhile, without
        // waiting for any (this thread holds channels).
        share_copies(parts, copy_one, false);
        take_commit(on, b, cur);
        break;
      }
      cur = ahead;
    }
  }
  share_copies(parts, copy_one, true);
}

Status PoolTier::post_reserve(Slot* slot, const PutBatch& b, const PutPart& part, bool ahead) {
  if (!slot) return Status::Unavailable("every channel to the pool server failed");
  for (size_t k = 0; k < part.count; ++k) {
    const size_t i = part.begin + k;
    pool::ReserveItem item{};
    std::memcpy(item.id, b.ids[i].bytes.data(), 16);
    item.size = b.sizes[i];
    item.flags = b.options.is_prefix ? pool::kPrefix : 0;
    std::memcpy(slot->ch.request + sizeof(RequestHeader) + k * sizeof item, &item, sizeof item);
  }
  const uint32_t device = b.options.src_kind != MemoryKind::kHost ? pool::kDeviceWrites : 0;
  return post(slot, Op::kReserve, static_cast<uint32_t>(part.count), sizeof(pool::ReserveItem),
              (ahead ? pool::kAhead : 0) | device);
}

void PoolTier::take_reserve(Slot* slot, const PutBatch& b, PutPart* part) {
  part->placed.clear();
  ReplyHeader reply;
  const Status st = take_reply(slot, part->sent, &reply);
  const uint32_t stray = items_to_give_back(st, reply, part->count);
  for (size_t k = 0; k < part->count; ++k) {
    const size_t i = part->begin + k;
    pool::ReserveReply r;
    if (!st.ok()) {
      b.statuses[i] = st;
      if (k < stray) {
        // Failed, but placed: post_commit aborts it.
        std::memcpy(&r, slot->ch.reply + sizeof(ReplyHeader) + k * sizeof r, sizeof r);
        if (r.code == 0 && !(r.flags & pool::kPresent))
          part->placed.push_back(Placed{i, r.offset, r.token});
      }
      continue;
    }
    std::memcpy(&r, slot->ch.reply + sizeof(ReplyHeader) + k * sizeof r, sizeof r);
    if (r.code != 0) {
      b.statuses[i] = reserve_failure(r.code, b.ids[i]);
    } else if (r.flags & pool::kPresent) {
      b.statuses[i] = Status::OK();
    } else if (r.offset > capacity_ || b.sizes[i] > capacity_ - r.offset) {
      // Never written; placed, failed, so that post_commit aborts it.
      b.statuses[i] = Status::Unavailable("the pool server reserved a range outside its arena");
      part->placed.push_back(Placed{i, r.offset, r.token});
    } else {
      b.statuses[i] =
          b.sizes[i] && !b.data[i] ? Status::InvalidArgument("data is null") : Status::OK();
      part->placed.push_back(Placed{i, r.offset, r.token});
    }
  }
}

void PoolTier::copy_placed(const PutBatch& b, const Placed& t) {
  if (!b.statuses[t.i].ok() || b.sizes[t.i] == 0) return;
  b.statuses[t.i] = copy_in(base_ + t.offset, b.data[t.i], b.sizes[t.i], b.options);
}

// A whole part's copies, over the I/O threads.
void PoolTier::copy_part(const PutBatch& b, PutPart* part) {
  auto copy = [&](size_t k) { copy_placed(b, part->placed[k]); };
  const size_t m = part->placed.size();
  if (pool_ && m > 1) pool_->parallel_for(m, copy);
  else
    for (size_t k = 0; k < m; ++k) copy(k);
}

// Aborts the reservations whose copies failed (waiting for that reply), then
// sends the commit of the others.
Status PoolTier::post_commit(Slot* slot, const PutBatch& b, PutPart* part, bool ahead) {
  part->committing.clear();
  std::vector<size_t> failed;
  for (size_t k = 0; k < part->placed.size(); ++k)
    (b.statuses[part->placed[k].i].ok() ? part->committing : failed).push_back(k);
  if (!slot) return Status::Unavailable("every channel to the pool server failed");
  if (!failed.empty()) {
    for (size_t j = 0; j < failed.size(); ++j) {
      pool::TokenItem t{part->placed[failed[j]].token};
      std::memcpy(slot->ch.request + sizeof(RequestHeader) + j * sizeof t, &t, sizeof t);
    }
    ReplyHeader reply;
    (void)call(slot, Op::kAbort, static_cast<uint32_t>(failed.size()), sizeof(pool::TokenItem),
               &reply, timeout_us_);
  }
  if (part->committing.empty()) return Status::OK();
  for (size_t j = 0; j < part->committing.size(); ++j) {
    pool::TokenItem t{part->placed[part->committing[j]].token};
    std::memcpy(slot->ch.request + sizeof(RequestHeader) + j * sizeof t, &t, sizeof t);
  }
  return post(slot, Op::kCommit, static_cast<uint32_t>(part->committing.size()),
              sizeof(pool::TokenItem), ahead ? pool::kAhead : 0);
}

void PoolTier::take_commit(Slot* slot, const PutBatch& b, PutPart* part) {
  if (part->committing.empty()) return;
  ReplyHeader reply;
  const Status st = take_reply(slot, part->sent, &reply);
  for (size_t j = 0; j < part->committing.size(); ++j) {
    const size_t i = part->placed[part->committing[j]].i;
    if (!st.ok()) {
      b.statuses[i] = st;
      continue;
    }
    pool::CodeReply r;
    std::memcpy(&r, slot->ch.reply + sizeof(ReplyHeader) + j * sizeof r, sizeof r);
    b.statuses[i] = wire_status(r.code, "the pool could not store block " + b.ids[i].hex());
    if (r.code == 0) counters_.stored(b.options, b.sizes[i]);
  }
}

// ---- reads -------------------------------------------------------------------

Status PoolTier::call_with_ids(Slot* slot, Op op, std::span<const BlockId> ids,
                               ReplyHeader* reply) const {
  *reply = ReplyHeader{};
  if (!slot) return Status::Unavailable("every channel to the pool server failed");
  for (size_t k = 0; k < ids.size(); ++k)
    std::memcpy(slot->ch.request + sizeof(RequestHeader) + k * 16, ids[k].bytes.data(), 16);
  return call(slot, op, static_cast<uint32_t>(ids.size()), sizeof(pool::BlockIdItem), reply,
              timeout_us_);
}

void PoolTier::acquire_batch(std::span<const BlockId> ids, std::span<BlockView> views,
                             std::span<Status> statuses) {
  acquire_views(ids, views, statuses, true);
}

uint64_t PoolTier::releases_sent() const {
  std::lock_guard<std::mutex> lock(release_mu_);
  return releases_sent_;
}

// Items the server could not bring into an arena whose blocks are all
// leased: leases this client ended may still wait in its release queue
// (sent in batches), or have reached the server only after it answered.
// Those in the queue go now, and those on their way are waited for a
// little. False when none were queued, on their way or sent since
// `sent_before`: asking again would find the arena as full.
bool PoolTier::send_releases_before_asking_again(uint64_t sent_before) {
  bool queued;
  {
    std::lock_guard<std::mutex> lock(release_mu_);
    queued = !release_queue_.empty() || !failed_queue_.empty();
    if (!queued && releases_on_the_way_ == 0 && releases_sent_ == sent_before) return false;
  }
  if (queued) release_queued();
  // Those the releasing thread took from the queue and is sending.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
  for (int round = 0; std::chrono::steady_clock::now() < until; ++round) {
    {
      std::lock_guard<std::mutex> lock(release_mu_);
      if (releases_on_the_way_ == 0) break;
    }
    wait_a_little(round);
  }
  return true;
}

namespace {

std::vector<size_t> out_of_room(std::span<const Status> statuses) {
  std::vector<size_t> again;
  for (size_t i = 0; i < statuses.size(); ++i)
    if (statuses[i].is(Code::kNoSpace)) again.push_back(i);
  return again;
}

}  // namespace

void PoolTier::acquire_views(std::span<const BlockId> ids, std::span<BlockView> views,
                             std::span<Status> statuses, bool count) {
  const uint64_t sent_before = releases_sent();
  lease_views(ids, views, statuses, count);
  const std::vector<size_t> again = out_of_room(statuses);
  if (again.empty() || !send_releases_before_asking_again(sent_before)) return;
  std::vector<BlockId> retry_ids;
  for (size_t i : again) retry_ids.push_back(ids[i]);
  std::vector<BlockView> retry_views(again.size());
  std::vector<Status> retry_statuses(again.size());
  lease_views(retry_ids, retry_views, retry_statuses, count);
  for (size_t j = 0; j < again.size(); ++j) {
    views[again[j]] = std::move(retry_views[j]);
    statuses[again[j]] = std::move(retry_statuses[j]);
  }
}

void PoolTier::lease_views(std::span<const BlockId> ids, std::span<BlockView> views,
                           std::span<Status> statuses, bool count) {
  for (size_t begin = 0; begin < ids.size(); begin += pool::kMaxItems) {
    const uint32_t m = static_cast<uint32_t>(std::min<size_t>(pool::kMaxItems, ids.size() - begin));
    // Views the caller passed in end first: ending one may send releases,
    // which takes a channel, and none may be held then.
    for (uint32_t k = 0; k < m; ++k) views[begin + k].reset();
    Held held = hold();
    ReplyHeader reply;
    Status st = call_with_ids(held.slot(), Op::kLease, ids.subspan(begin, m), &reply);
    std::vector<uint64_t> stray;  // leases of a malformed reply, given back
    const uint32_t named = items_to_give_back(st, reply, m);
    for (uint32_t k = 0; k < m; ++k) {
      const size_t i = begin + k;
      pool::LeaseReply r;
      if (!st.ok()) {
        statuses[i] = st;
        if (k < named) {
          std::memcpy(&r, held.slot()->ch.reply + sizeof(ReplyHeader) + k * sizeof r, sizeof r);
          if (r.code == 0) stray.push_back(r.token);
        }
        continue;
      }
      std::memcpy(&r, held.slot()->ch.reply + sizeof(ReplyHeader) + k * sizeof r, sizeof r);
      if (r.code != 0) {
        statuses[i] = lease_failure(r.code, ids[i]);
        if (count && r.code == static_cast<uint32_t>(Code::kNotFound))
          TierCounters::add(counters_.misses);
        continue;
      }
      if (r.offset > capacity_ || r.size > capacity_ - r.offset) {
        stray.push_back(r.token);
        statuses[i] = Status::Unavailable("the pool server leased a range outside its arena");
        continue;
      }
      if (count) TierCounters::add(counters_.hits);
      statuses[i] = Status::OK();
      views_held_.fetch_add(1, std::memory_order_relaxed);
      views[i] = BlockView(this, base_ + r.offset, r.size, MemoryKind::kHost, r.token,
                           (r.flags & pool::kPrefix) != 0);
    }
    held.reset();
    if (!stray.empty()) send_releases(std::move(stray));
  }
}

Result<BlockView> PoolTier::acquire(const BlockId& id) {
  BlockView v;
  Status st;
  acquire_batch(std::span<const BlockId>(&id, 1), std::span<BlockView>(&v, 1),
                std::span<Status>(&st, 1));
  if (!st.ok()) return st;
  return v;
}

void PoolTier::read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                          std::span<ReadResult> results, std::span<Status> statuses) {
  const uint64_t sent_before = releases_sent();
  read_batch_once(ids, reqs, results, statuses);
  // As acquire_batch: items refused for an arena full of leases are asked
  // once more after this client's own ended leases have gone out.
  const std::vector<size_t> again = out_of_room(statuses);
  if (again.empty() || !send_releases_before_asking_again(sent_before)) return;
  std::vector<BlockId> retry_ids;
  std::vector<ReadRequest> retry_reqs;
  for (size_t i : again) {
    retry_ids.push_back(ids[i]);
    retry_reqs.push_back(reqs[i]);
  }
  std::vector<ReadResult> retry_results(again.size());
  std::vector<Status> retry_statuses(again.size());
  read_batch_once(retry_ids, retry_reqs, retry_results, retry_statuses);
  for (size_t j = 0; j < again.size(); ++j) {
    results[again[j]] = retry_results[j];
    statuses[again[j]] = std::move(retry_statuses[j]);
  }
}

void PoolTier::read_batch_once(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                               std::span<ReadResult> results, std::span<Status> statuses) {
  const size_t n = ids.size();
  std::vector<uint64_t> sizes(n, 0);  // what the sub-batch choice needs: the requests' sizes
  for (size_t i = 0; i < n; ++i) sizes[i] = reqs[i].capacity;
  const size_t sub = sub_batch(sizes);
  if (any_device_out(reqs)) {
    read_to_devices(ids, reqs, results, statuses, sub);
    return;
  }
  if (sub) {
    // As put_batch: the I/O threads take sub-batches in turn, each thread
    // leasing its next while it copies one (read_stream).
    const ReadBatch b{ids, reqs, results, statuses};
    Parts<ReadPart> parts(n, sub);
    uint64_t bytes = 0;
    for (uint64_t size : sizes) bytes += size;
    parts.ahead = bytes / parts.count >= kSubBatchBytes;
    pool_->parallel_for(std::min<size_t>(parts.count, pool_->size()),
                        [&](size_t) { read_stream(b, &parts); });
    return;
  }
  read_chunk(ids, reqs, results, statuses);
}

// Reads with a destination in device memory, a part at a time
// (read_leased_in_parts): a part's leases go out in sub-batches in parallel
// (several server workers answer them), its blocks are copied in one
// batched GPU operation straight from the mapped arena (registered with
// CUDA) while the next part is leased, and its views are released once the
// copies are complete. What a client holds on the server stays within two
// parts however large the batch.
void PoolTier::read_to_devices(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                               std::span<ReadResult> results, std::span<Status> statuses,
                               size_t sub) {
  const size_t step = sub ? sub : pool::kMaxItems;
  std::vector<BlockView> views(ids.size());
  auto lease = [&](size_t begin, size_t end, std::span<LeasedBytes> blocks) {
    each_part(0, (end - begin + step - 1) / step, [&](size_t c) {
      const size_t b = begin + c * step, m = std::min(step, end - b);
      acquire_batch(ids.subspan(b, m), std::span<BlockView>(views).subspan(b, m),
                    statuses.subspan(b, m));
    });
    for (size_t i = begin; i < end; ++i) {
      if (!statuses[i].ok()) continue;
      blocks[i] = LeasedBytes{views[i].data(), views[i].size()};
      results[i].is_prefix = views[i].is_prefix();
    }
  };
  auto release = [&](size_t begin, size_t end) {
    // The part's leases given back at once: a view's own reset() would take
    // the queue's lock, and perhaps wake the releasing thread, per block.
    // A full batch of them is sent from here, as release_leases does.
    std::vector<uint64_t> tokens;
    tokens.reserve(end - begin);
    for (size_t i = begin; i < end; ++i) {
      if (!views[i]) continue;
      tokens.push_back(views[i].token());
      views[i].detach();
    }
    views_held_.fetch_sub(tokens.size(), std::memory_order_relaxed);
    release_leases(tokens);
  };
  TierCounters::add(counters_.bytes_read, read_leased_in_parts(MemoryKind::kHost, reqs, results,
                                                               statuses, lease, release));
}

// Leases every item (one request per kMaxItems), copies the hits out over
// the I/O threads, and queues the releases. REQUIRES: every request's
// destination is host memory.
void PoolTier::read_chunk(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                          std::span<ReadResult> results, std::span<Status> statuses) {
  const ReadBatch b{ids, reqs, results, statuses};
  for (size_t begin = 0; begin < ids.size(); begin += pool::kMaxItems) {
    ReadPart part;
    part.begin = begin;
    part.count = std::min<size_t>(pool::kMaxItems, ids.size() - begin);
    {
      Held held = hold();
      part.sent = post_lease_read(held.slot(), b, part, false);
      take_lease_read(held.slot(), b, &part);
    }
    if (part.members) map_members(b, &part);
    auto copy = [&](size_t k) { copy_leased(b, &part, k); };
    if (pool_ && part.count > 1) pool_->parallel_for(part.count, copy);
    else
      for (size_t k = 0; k < part.count; ++k) copy(k);
    release_failed(&part);
    release_leases(part.tokens);
  }
}

// One I/O thread's share of a read batch: while it copies one sub-batch,
// the lease of its next is with the server. Releases are queued for the
// releasing thread (this one holds a channel, and must not wait for another).
// As in put_stream, a thread left without a sub-batch copies blocks of the
// others'.
void PoolTier::read_stream(const ReadBatch& b, Parts<ReadPart>* parts) {
  auto copy_one = [&](ReadPart* p, size_t k) { copy_leased(b, p, k); };
  ReadPart* cur = parts->claim();
  if (cur) {
    Held x = hold();
    cur->sent = post_lease_read(x.slot(), b, *cur, false);
    while (true) {
      take_lease_read(x.slot(), b, cur);
      if (cur->members) {
        // Mapping a member's arena asks the server on a channel of its own.
        x.reset();
        map_members(b, cur);
        x = hold();
      }
      cur->share(cur->count);
      ReadPart* ahead = parts->claim();
      if (ahead) ahead->sent = post_lease_read(x.slot(), b, *ahead, parts->ahead);
      copy_own(cur, copy_one);
      release_failed(cur);
      queue_releases(cur->tokens);
      if (!ahead) break;
      cur = ahead;
    }
  }
  share_copies(parts, copy_one, true);
}

Status PoolTier::post_lease_read(Slot* slot, const ReadBatch& b, const ReadPart& part, bool ahead) {
  if (!slot) return Status::Unavailable("every channel to the pool server failed");
  for (size_t k = 0; k < part.count; ++k)
    std::memcpy(slot->ch.request + sizeof(RequestHeader) + k * 16,
                b.ids[part.begin + k].bytes.data(), 16);
  return post(slot, Op::kLeaseRead, static_cast<uint32_t>(part.count), sizeof(pool::BlockIdItem),
              ahead ? pool::kAhead : 0);
}

void PoolTier::take_lease_read(Slot* slot, const ReadBatch& b, ReadPart* part) {
  part->got.clear();
  part->got.resize(part->count);
  part->tokens.clear();
  part->members = false;
  ReplyHeader reply;
  const Status st = take_reply(slot, part->sent, &reply);
  const uint32_t named = items_to_give_back(st, reply, part->count);
  for (size_t k = 0; k < part->count; ++k) {
    const size_t i = part->begin + k;
    b.results[i] = ReadResult{};
    pool::LeaseReadReply r;
    if (!st.ok()) {
      b.statuses[i] = st;
      if (k < named) {  // given back with the part's other leases
        std::memcpy(&r, slot->ch.reply + sizeof(ReplyHeader) + k * sizeof r, sizeof r);
        if (r.code == 0) part->tokens.push_back(r.token);
      }
      continue;
    }
    std::memcpy(&r, slot->ch.reply + sizeof(ReplyHeader) + k * sizeof r, sizeof r);
    if (r.code != 0) {
      b.statuses[i] = lease_failure(r.code, b.ids[i]);
      if (r.code == static_cast<uint32_t>(Code::kNotFound)) TierCounters::add(counters_.misses);
      continue;
    }
    part->tokens.push_back(r.token);
    b.results[i].is_prefix = (r.flags & pool::kPrefix) != 0;
    Leased& g = part->got[k];
    g.lease = r;
    if (r.arena == 0 && (r.offset > capacity_ || r.size > capacity_ - r.offset)) {
      b.statuses[i] = Status::Unavailable("the pool server leased a range outside its arena");
      continue;
    }
    if (r.arena == 0) g.data = base_ + r.offset;  // a member's: placed by map_members
    else part->members = true;
    b.statuses[i] = Status::OK();
  }
}

// Blocks in a member's arena: its mapping, made outside the channels. A
// block whose member's arena this process cannot map is read through the
// server, which brings it into its own arena (from its own mapping of the
// member's arena, or over the transport) and leases it there.
void PoolTier::map_members(const ReadBatch& b, ReadPart* part) {
  std::vector<size_t> unmapped;  // items of the part
  for (size_t k = 0; k < part->count; ++k) {
    const size_t i = part->begin + k;
    Leased& g = part->got[k];
    if (!b.statuses[i].ok() || g.lease.arena == 0) continue;
    auto member = member_arena(g.lease.arena);
    if (!member.ok()) {
      unmapped.push_back(k);
      continue;
    }
    if (g.lease.offset > (*member)->size() || g.lease.size > (*member)->size() - g.lease.offset) {
      b.statuses[i] = Status::NotFound("block " + b.ids[i].hex() +
                                       ": its lease lies outside the arena of the member "
                                       "holding it");
      TierCounters::add(counters_.misses);
      continue;
    }
    g.member = std::move(member.value());
    g.data = g.member->data() + g.lease.offset;
  }
  if (unmapped.empty()) return;
  std::vector<BlockId> ids;
  for (size_t k : unmapped) ids.push_back(b.ids[part->begin + k]);
  std::vector<BlockView> views(ids.size());
  std::vector<Status> statuses(ids.size());
  // The member's leases are released with the part's others. The views'
  // hits and misses are counted once, as the part's reads (copy_leased).
  acquire_views(ids, views, statuses, false);
  for (size_t j = 0; j < unmapped.size(); ++j) {
    const size_t i = part->begin + unmapped[j];
    Leased& g = part->got[unmapped[j]];
    b.statuses[i] = statuses[j];
    if (statuses[j].is(Code::kNotFound)) TierCounters::add(counters_.misses);
    if (!statuses[j].ok()) continue;
    g.through_server = std::move(views[j]);
    g.lease.arena = 0;
    g.lease.size = g.through_server.size();
    g.lease.checksum = 0;
    g.data = g.through_server.data();
    b.results[i].is_prefix = g.through_server.is_prefix();
  }
}

void PoolTier::copy_leased(const ReadBatch& b, ReadPart* part, size_t k) {
  const size_t i = part->begin + k;
  if (!b.statuses[i].ok()) return;
  const Leased& g = part->got[k];
  const ReadRequest& req = b.reqs[i];
  b.results[i].found = true;
  b.results[i].block_size = g.lease.size;
  uint64_t from = 0, count = 0;
  Status st = req.span(g.lease.size, &from, &count);
  // Host destinations only (device ones take read_to_devices).
  if (st.ok() && g.lease.arena == 0 && count)
    parallel_memcpy(pool_, req.out, g.data + from, count, parallel_threshold_);
  if (st.ok() && g.lease.arena != 0) {
    auto* out = static_cast<uint8_t*>(req.out);
    // A member's block: its checksum computed over the bytes copied (the
    // whole block, whatever range is asked), and the lease still held at
    // the end. For part of a block the whole block is copied aside and
    // checked, and the part handed out from that copy: bytes read from
    // the arena twice might differ between the reads.
    // The member's file cut short under the mapping (by its owner's user,
    // or root) faults the copy, not this process.
    uint64_t sum = 0;
    bool whole = true;
    if (g.lease.checksum == 0) {
      if (count) whole = copy_out_of_mapping(out, g.data + from, count);
    } else if (from == 0 && count == g.lease.size) {
      whole = copy_out_of_mapping_with_checksum(out, g.data, g.lease.size, &sum, pool_,
                                                parallel_threshold_);
    } else {
      std::unique_ptr<uint8_t[]> block(new uint8_t[g.lease.size]);
      whole = copy_out_of_mapping_with_checksum(block.get(), g.data, g.lease.size, &sum, pool_,
                                                parallel_threshold_);
      if (whole && count) copy_bytes(out, block.get() + from, count);
    }
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    if (!whole) {
      st = Status::NotFound("block " + b.ids[i].hex() +
                            ": the arena file of the member holding it was cut short under its "
                            "mapping");
      TierCounters::add(counters_.misses);
      // Later reads of that member's blocks go through the server.
      std::lock_guard<std::mutex> l(members_mu_);
      member_arenas_.erase(g.lease.arena);
      unmappable_arenas_.emplace(g.lease.arena, st);
    } else if (sum != g.lease.checksum) {
      st = Status::NotFound("block " + b.ids[i].hex() + " failed its checksum in a member's arena");
      TierCounters::add(counters_.misses);
      TierCounters::add(corrupt_);
      part->got[k].failed = true;
    } else if (now > g.lease.valid_until_ns) {
      st = Status::NotFound("block " + b.ids[i].hex() + ": its lease ended before its copy did");
      TierCounters::add(counters_.misses);
    }
  }
  if (st.ok()) {
    b.results[i].copied = count;
    TierCounters::add(counters_.hits);
    TierCounters::add(counters_.bytes_read, count);
  }
  b.statuses[i] = st;
}

Result<std::shared_ptr<const ReadOnlyMapping>> PoolTier::member_arena(uint32_t index) {
  {
    std::lock_guard<std::mutex> l(members_mu_);
    auto it = member_arenas_.find(index);
    if (it != member_arenas_.end()) return it->second;
    auto failed = unmappable_arenas_.find(index);
    if (failed != unmappable_arenas_.end()) return failed->second;
  }
  pool::ArenaReply r{};
  {
    Held held = hold();
    if (!held.slot()) return Status::Unavailable("every channel to the pool server failed");
    pool::ArenaItem item{index, 0};
    std::memcpy(held.slot()->ch.request + sizeof(RequestHeader), &item, sizeof item);
    ReplyHeader reply;
    CASCADE_RETURN_IF_ERROR(
        call(held.slot(), Op::kArena, 1, sizeof(pool::ArenaItem), &reply, timeout_us_));
    std::memcpy(&r, held.slot()->ch.reply + sizeof(ReplyHeader), sizeof r);
  }
  if (r.code != 0) return wire_status(r.code, "member arena " + std::to_string(index));
  if (r.path_bytes == 0 || r.path_bytes > pool::kMaxPathBytes)
    return Status::Unavailable("the pool server described a member arena without a path");
  auto m = map_file_read_only(std::string(r.path, r.path_bytes), r.device, r.inode, r.file_offset,
                              r.bytes);
  std::lock_guard<std::mutex> l(members_mu_);
  if (!m.ok()) {
    unmappable_arenas_.emplace(index, m.status());
    return m.status();
  }
  auto [it, fresh] = member_arenas_.emplace(index, std::move(m.value()));
  return it->second;
}

void PoolTier::forget_gone_arenas() {
  std::vector<uint32_t> known;
  {
    std::lock_guard<std::mutex> l(members_mu_);
    for (auto& [index, m] : member_arenas_) known.push_back(index);
    for (auto& [index, why] : unmappable_arenas_) known.push_back(index);
  }
  // A server that is gone (or every channel to it) leases nothing more:
  // every mapping goes, the memory with the last copy under way.
  auto forget_all = [&] {
    std::lock_guard<std::mutex> l(members_mu_);
    member_arenas_.clear();
    unmappable_arenas_.clear();
  };
  for (uint32_t index : known) {
    pool::ArenaReply r{};
    {
      Held held = hold();
      if (!held.slot()) return forget_all();
      pool::ArenaItem item{index, 0};
      std::memcpy(held.slot()->ch.request + sizeof(RequestHeader), &item, sizeof item);
      ReplyHeader reply;
      if (!call(held.slot(), Op::kArena, 1, sizeof(pool::ArenaItem), &reply, timeout_us_).ok()) {
        if (server_gone_.load(std::memory_order_acquire)) forget_all();
        return;
      }
      std::memcpy(&r, held.slot()->ch.reply + sizeof(ReplyHeader), sizeof r);
    }
    if (r.code != static_cast<uint32_t>(Code::kNotFound)) continue;
    // Copies under way keep their own reference; the memory goes with the last.
    std::lock_guard<std::mutex> l(members_mu_);
    member_arenas_.erase(index);
    unmappable_arenas_.erase(index);
  }
}

Status PoolTier::read(const BlockId& id, const ReadRequest& req, ReadResult* result) {
  Status st;
  read_batch(std::span<const BlockId>(&id, 1), std::span<const ReadRequest>(&req, 1),
             std::span<ReadResult>(result, 1), std::span<Status>(&st, 1));
  return st;
}

void PoolTier::lookup_batch(std::span<const BlockId> ids, std::span<uint64_t> sizes,
                            std::span<Status> statuses) const {
  for (size_t begin = 0; begin < ids.size(); begin += pool::kMaxItems) {
    const uint32_t m = static_cast<uint32_t>(std::min<size_t>(pool::kMaxItems, ids.size() - begin));
    Held held = hold();
    ReplyHeader reply;
    Status st = call_with_ids(held.slot(), Op::kLookup, ids.subspan(begin, m), &reply);
    for (uint32_t k = 0; k < m; ++k) {
      const size_t i = begin + k;
      sizes[i] = 0;
      if (!st.ok()) {
        statuses[i] = st;
        continue;
      }
      pool::LookupReply r;
      std::memcpy(&r, held.slot()->ch.reply + sizeof(ReplyHeader) + k * sizeof r, sizeof r);
      statuses[i] = wire_status(r.code, "block " + ids[i].hex() + " is not in the pool");
      if (r.code == 0) sizes[i] = r.size;
    }
  }
}

bool PoolTier::contains(const BlockId& id) const {
  uint64_t size = 0;
  Status st;
  lookup_batch(std::span<const BlockId>(&id, 1), std::span<uint64_t>(&size, 1),
               std::span<Status>(&st, 1));
  return st.ok();
}

void PoolTier::contains_batch(std::span<const BlockId> ids, std::span<uint8_t> found) const {
  std::vector<uint64_t> sizes(ids.size());
  std::vector<Status> st(ids.size());
  lookup_batch(ids, sizes, st);
  for (size_t i = 0; i < ids.size(); ++i) found[i] = st[i].ok();
}

void PoolTier::sizes_batch(std::span<const BlockId> ids, std::span<uint8_t> found,
                           std::span<uint64_t> sizes) {
  std::vector<Status> st(ids.size());
  lookup_batch(ids, sizes, st);
  for (size_t i = 0; i < ids.size(); ++i) found[i] = st[i].ok();
}

Result<uint64_t> PoolTier::size_of(const BlockId& id) {
  uint64_t size = 0;
  Status st;
  lookup_batch(std::span<const BlockId>(&id, 1), std::span<uint64_t>(&size, 1),
               std::span<Status>(&st, 1));
  if (st.is(Code::kNotFound)) TierCounters::add(counters_.misses);
  if (!st.ok()) return st;
  return size;
}

Status PoolTier::remove(const BlockId& id) {
  Held held = hold();
  if (!held.slot()) return Status::Unavailable("every channel to the pool server failed");
  std::memcpy(held.slot()->ch.request + sizeof(RequestHeader), id.bytes.data(), 16);
  ReplyHeader reply;
  CASCADE_RETURN_IF_ERROR(
      call(held.slot(), Op::kRemove, 1, sizeof(pool::BlockIdItem), &reply, timeout_us_));
  pool::CodeReply r;
  std::memcpy(&r, held.slot()->ch.reply + sizeof(ReplyHeader), sizeof r);
  std::string what;
  switch (static_cast<Code>(r.code)) {
    case Code::kNotFound: what = "block " + id.hex() + " is not in the pool"; break;
    case Code::kUnavailable:
      // A pool server in a cluster that could not reach every member.
      what = "block " + id.hex() +
             " was removed from the pool server, but not every member of its cluster could be "
             "reached (one did not answer in time, or the server is cut off from the "
             "coordination service): one may still hold the block and serve it; remove it again "
             "later";
      break;
    default: what = "the pool server could not remove block " + id.hex(); break;
  }
  return wire_status(r.code, std::move(what));
}

Status PoolTier::flush(bool everything) {
  release_queued();
  Held held = hold();
  if (!held.slot()) return Status::Unavailable("every channel to the pool server failed");
  // A flush writes blocks down and may take long: its deadline is long, and
  // a stopped server is told by its heartbeat (await_reply).
  ReplyHeader reply;
  return call(held.slot(), Op::kFlush, 0, 0, &reply, kFlushTimeoutUs,
              everything ? pool::kFlushEverything : 0);
}

Result<pool::ServerStatsReply> PoolTier::server_stats() const {
  Held held = hold();
  if (!held.slot()) return Status::Unavailable("every channel to the pool server failed");
  ReplyHeader reply;
  CASCADE_RETURN_IF_ERROR(call(held.slot(), Op::kStats, 0, 0, &reply, timeout_us_));
  pool::ServerStatsReply s;
  std::memcpy(&s, held.slot()->ch.reply + sizeof(ReplyHeader), sizeof s);
  return s;
}

TierStats PoolTier::stats() const {
  TierStats s;
  s.name = name();
  s.capacity_bytes = capacity_;
  s.committed_bytes = mapped_bytes_.load(std::memory_order_relaxed);  // mapped in ahead of use
  s.leased_blocks = views_held_.load(std::memory_order_relaxed);
  s.corrupt_blocks = corrupt_.load(std::memory_order_relaxed);
  counters_.fill(&s);
  return s;
}

// ---- lease releases ----------------------------------------------------------

// The release of a view acquire handed out (BlockView's release).
void PoolTier::release_lease(uint64_t token) {
  // In a forked child the lease is the parent's, and the channels are not
  // mapped here: nothing to send.
  if (fork_generation() == generation_) release_leases({&token, 1});
  // Last: once no view is held, whoever closes the tier may do so at once
  // (this thread touches the tier no more).
  views_held_.fetch_sub(1, std::memory_order_release);
}

void PoolTier::release_leases(std::span<const uint64_t> tokens) {
  if (tokens.empty()) return;
  std::vector<uint64_t> now;
  bool first;
  {
    std::lock_guard<std::mutex> lock(release_mu_);
    first = release_queue_.empty();
    release_queue_.insert(release_queue_.end(), tokens.begin(), tokens.end());
    if (release_queue_.size() >= kReleaseBatch) {
      now.swap(release_queue_);
      ++releases_on_the_way_;
    }
  }
  if (!now.empty()) {
    send_releases(std::move(now));
    sent_releases();
  } else if (first) {
    release_cv_.notify_one();
  }
}

void PoolTier::sent_releases() {
  std::lock_guard<std::mutex> lock(release_mu_);
  --releases_on_the_way_;
  ++releases_sent_;
}

void PoolTier::queue_releases(std::span<const uint64_t> tokens) {
  if (tokens.empty()) return;
  bool wake;
  {
    std::lock_guard<std::mutex> lock(release_mu_);
    const size_t before = release_queue_.size();
    release_queue_.insert(release_queue_.end(), tokens.begin(), tokens.end());
    // The releasing thread waits for a first release, then for a full batch.
    wake = before == 0 || (before < kReleaseBatch && release_queue_.size() >= kReleaseBatch);
  }
  if (wake) release_cv_.notify_one();
}

void PoolTier::release_queued() {
  std::vector<uint64_t> now, failed;
  {
    std::lock_guard<std::mutex> lock(release_mu_);
    now.swap(release_queue_);
    failed.swap(failed_queue_);
    ++releases_on_the_way_;
  }
  if (!now.empty()) send_releases(std::move(now));
  if (!failed.empty()) send_releases(std::move(failed), pool::kChecksumFailed);
  sent_releases();
}

void PoolTier::release_failed(ReadPart* part) {
  std::vector<uint64_t> failed;
  for (const Leased& g : part->got)
    if (g.failed) failed.push_back(g.lease.token);
  if (failed.empty()) return;
  std::erase_if(part->tokens, [&](uint64_t t) {
    return std::find(failed.begin(), failed.end(), t) != failed.end();
  });
  {
    std::lock_guard<std::mutex> lock(release_mu_);
    failed_queue_.insert(failed_queue_.end(), failed.begin(), failed.end());
  }
  release_cv_.notify_one();
}

void PoolTier::send_releases(std::vector<uint64_t> tokens, uint32_t flags) {
  for (size_t begin = 0; begin < tokens.size(); begin += pool::kMaxItems) {
    const uint32_t m =
        static_cast<uint32_t>(std::min<size_t>(pool::kMaxItems, tokens.size() - begin));
    Held held = hold();
    if (!held.slot()) return;  // the server ends this client's leases when it goes
    std::memcpy(held.slot()->ch.request + sizeof(RequestHeader), tokens.data() + begin,
                m * sizeof(uint64_t));
    ReplyHeader reply;
    if (!call(held.slot(), Op::kRelease, m, sizeof(pool::TokenItem), &reply, timeout_us_,
              pool::kAhead | flags)
             .ok())
      return;
  }
}

void PoolTier::release_loop() {
  name_this_thread("cascade-release");
  std::unique_lock<std::mutex> lock(release_mu_);
  auto last_check = std::chrono::steady_clock::now();
  while (true) {
    // Every second or so: drop mappings of member arenas the server dropped.
    release_cv_.wait_for(lock, std::chrono::seconds(1), [&] {
      return stopping_ || !release_queue_.empty() || !failed_queue_.empty();
    });
    if (!stopping_ && std::chrono::steady_clock::now() - last_check >= std::chrono::seconds(1)) {
      last_check = std::chrono::steady_clock::now();
      bool any;
      {
        std::lock_guard<std::mutex> l(members_mu_);
        any = !member_arenas_.empty() || !unmappable_arenas_.empty();
      }
      if (any) {
        lock.unlock();
        forget_gone_arenas();
        lock.lock();
      }
    }
    if (!stopping_ && release_queue_.empty() && failed_queue_.empty()) continue;
    if (!stopping_) {
      // Gather what a burst of reads releases into one request.
      release_cv_.wait_for(lock, std::chrono::microseconds(500),
                           [&] { return stopping_ || release_queue_.size() >= kReleaseBatch; });
    }
    std::vector<uint64_t> now, failed;
    now.swap(release_queue_);
    failed.swap(failed_queue_);
    bool stop = stopping_;
    ++releases_on_the_way_;
    lock.unlock();
    if (!now.empty()) send_releases(std::move(now));
    if (!failed.empty()) send_releases(std::move(failed), pool::kChecksumFailed);
    lock.lock();
    --releases_on_the_way_;
    ++releases_sent_;
    if (stop && release_queue_.empty() && failed_queue_.empty()) return;
  }
}

}  // namespace cascade
