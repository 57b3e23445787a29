#include "serve/pool_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "os/ipc.h"
#include "serve/cluster_node.h"
#include "tiers/pool/pool_channel.h"
#include "tiers/pool/pool_wire.h"
#include "util/errno_status.h"
#include "util/futex.h"
#include "util/thread_name.h"

namespace cascade {

using pool::Channel;
using pool::Op;
using pool::ReplyHeader;
using pool::RequestHeader;

namespace {

// How long a sleeping worker waits for a ring before it scans anyway: a
// bound on the delay a client that scribbles over the doorbell causes.
constexpr int64_t kWorkerCheckUs = 500000;
constexpr int kMaxWorkers = 256;
// A worker's spin after a reserve or a lease (pool::kSpinNs after others).
constexpr int64_t kShortSpinNs = 2000;
constexpr size_t kMaxLeasesPerClient = 1 << 20;
constexpr size_t kMaxReservationsPerClient = 1 << 16;
constexpr int kMaxHandshakes = 64;
// How long the reaper waits for a dead client's process to end before it
// frees the ranges the client had reserved (see reap_loop).
constexpr auto kProcessEndWait = std::chrono::seconds(5);
// A connection younger than this keeps its handshake slot even with no
// hello in yet: its client may be between its connect and its hello.
constexpr auto kHelloGrace = std::chrono::milliseconds(2);

// Whether a whole hello is waiting in sock, unread: its sender is a client
// whose handshake thread has not run yet, not a silent peer.
bool hello_waiting(int sock) {
  return bytes_waiting(sock, sizeof(pool::Hello)) >= sizeof(pool::Hello);
}

uint32_t code_of(const Status& st) { return static_cast<uint32_t>(st.code()); }

}  // namespace

struct PoolClient {
  uint64_t id = 0;
  PeerCredentials cred;
  std::string name_space;
  std::array<uint8_t, 32> digest{};  // of the effective namespace
  int sock = -1;
  // Readable once the client's process ends, even if a process it forked
  // holds on to its socket; -1 where pidfds are not available.
  int pidfd = -1;
  int channel_fd = -1;
  uint8_t* channels = nullptr;
  uint64_t channel_bytes = 0;
  uint32_t nch = 0;
  std::atomic<bool> dead{false};
  std::atomic<bool> watched{false};  // its welcome went out: the monitor watches its socket
  std::atomic<uint64_t> requests{0};

  // The server's own state of each channel (never in the shared file).
  struct ChannelState {
    std::atomic<bool> claimed{false};  // a worker serves the channel now
    std::atomic<uint32_t> last{0};     // the last request number taken (written by the claimer)
  };
  std::unique_ptr<ChannelState[]> states;  // nch of them
  // Workers (and the flusher) serving a request of this client now. The
  // reaper sets `dead`, waits for 0, and only then ends what the client
  // held; a worker adds itself and then checks `dead` (both sequentially
  // consistent), so it either sees `dead` and leaves, or the reaper waits
  // for it.
  std::atomic<int> inside{0};

  ~PoolClient() {
    if (pidfd >= 0) ::close(pidfd);
    // Unmapped only when no worker can hold the client in a table: a worker
    // may still read a dead client's request words while it scans.
    if (channels) ::munmap(channels, channel_bytes);
  }

  // What the client holds, kept per channel so that the channels' workers
  // do not share a lock: a token names the shard that made it (its top 16
  // bits), so a commit or release sent on another channel finds it.
  struct Shard {
    std::mutex mu;  // guards the maps and next
    std::unordered_map<uint64_t, BlockView> leases;
    // Leases a cluster member of this host holds for the client (kLeaseRead).
    std::unordered_map<uint64_t, MappedLease> mapped;
    std::unordered_map<uint64_t, Reservation> reservations;
    uint64_t next = 1;
  };
  std::unique_ptr<Shard[]> shards;  // nch of them
  // Totals over the shards, for the per-client limits.
  std::atomic<size_t> lease_count{0}, reservation_count{0};
  // The client has reserved ranges it fills from GPU memory (kDeviceWrites).
  std::atomic<bool> device_writes{false};

  // The blocks this client committed (or put, finding them present) since
  // its last flush, each once, when the store has a persistent tier: the
  // client's flush writes down these alone, not every block of the pool.
  // Past kMaxUnflushed ids the list is dropped and the next flush writes
  // down the whole pool.
  static constexpr size_t kMaxUnflushed = size_t(1) << 18;
  std::mutex unflushed_mu;
  std::unordered_set<BlockId> unflushed;
  bool flush_everything = false;
  void committed(std::vector<BlockId>&& ids) {
    std::lock_guard<std::mutex> l(unflushed_mu);
    if (flush_everything) return;
    for (const BlockId& id : ids) {
      if (unflushed.size() >= kMaxUnflushed && !unflushed.count(id)) {
        flush_everything = true;
        std::unordered_set<BlockId>().swap(unflushed);
        return;
      }
      unflushed.insert(id);
    }
  }

  static constexpr int kShardShift = 48;
  uint64_t token(uint32_t shard) { return (uint64_t(shard) << kShardShift) | shards[shard].next++; }
  Shard* shard_of(uint64_t token) const {
    const uint64_t i = token >> kShardShift;
    return i < nch ? &shards[i] : nullptr;
  }
  // Calls f(shard, k) for every item k < count whose token is token_of(k),
  // holding each shard's lock once for all its items (shard is null for a
  // token no shard made).
  template <typename TokenOf, typename F>
  void by_shard(uint32_t count, TokenOf&& token_of, F&& f) {
    std::vector<uint32_t> order(count);
    for (uint32_t k = 0; k < count; ++k) order[k] = k;
    auto key = [&](uint32_t k) { return token_of(k) >> kShardShift; };
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return key(a) < key(b); });
    for (size_t b = 0; b < order.size();) {
      size_t e = b;
      while (e < order.size() && key(order[e]) == key(order[b])) ++e;
      Shard* sh = shard_of(token_of(order[b]));
      std::unique_lock<std::mutex> l;
      if (sh) l = std::unique_lock<std::mutex>(sh->mu);
      for (size_t j = b; j < e; ++j) f(sh, order[j]);
      b = e;
    }
  }
  // Sums over the shards (each locked in turn).
  size_t held_leases() {
    size_t n = 0;
    for (uint32_t i = 0; i < nch; ++i) {
      std::lock_guard<std::mutex> l(shards[i].mu);
      n += shards[i].leases.size() + shards[i].mapped.size();
    }
    return n;
  }
  size_t held_reservations() {
    size_t n = 0;
    for (uint32_t i = 0; i < nch; ++i) {
      std::lock_guard<std::mutex> l(shards[i].mu);
      n += shards[i].reservations.size();
    }
    return n;
  }

  BlockId scoped(const uint8_t raw[16]) const {
    uint8_t buf[48];
    std::memcpy(buf, digest.data(), 32);
    std::memcpy(buf + 32, raw, 16);
    auto h = sha256(buf, sizeof buf);
    BlockId id;
    std::memcpy(id.bytes.data(), h.data(), 16);
    return id;
  }
};

// The channels the workers scan: a snapshot, replaced whole when a client
// comes or goes. A worker keeps the snapshot it scans, and with it the
// clients (and their channel mappings) alive.
struct ChannelRef {
  PoolClient* client;
  uint32_t index;
  Channel ch;
  PoolClient::ChannelState* state;
};
struct ChannelTable {
  std::vector<std::shared_ptr<PoolClient>> clients;
  std::vector<ChannelRef> channels;
};

class PoolServer::Impl {
 public:
  PoolServerOptions options;
  std::unique_ptr<CascadeStore> store;
  SharedArena arena;
  bool persistent = false;  // a tier of the store keeps blocks past its close
  // A tier below the arena keeps blocks: a flush writes blocks down to it.
  bool persistent_below = false;
  bool tracks_unflushed = false;  // clients' commits are listed for their flushes
  int listen_fd = -1;
  SocketFile socket_file;      // what listen_fd was bound to, removed at close if still there
  SocketPathLock socket_lock;  // held from start to close
  int wake_fd = -1;            // eventfd: the monitor re-reads its list or stops
  std::atomic<bool> stopping{false};
  std::thread monitor;
  std::thread reaper;
  std::mutex close_mu;
  bool closed = false;
  Status close_status;

  mutable std::mutex mu;  // guards clients, handshakes, the reap queue and reaper_stop
  std::map<uint64_t, std::shared_ptr<PoolClient>> clients;
  size_t admitting = 0;        // admitted, not yet in clients
  int handshakes_running = 0;  // detached handshake threads; close() waits for 0
  // Handshakes still waiting for their hello: socket -> when it was
  // accepted. A handshake takes its socket out (under mu) before it closes
  // it, so a socket listed here is open.
  std::map<int, std::chrono::steady_clock::time_point> awaiting_hello;
  int handshakes_ending = 0;  // of handshakes_running: shut down for a slot, not yet gone
  std::condition_variable handshakes_cv;
  std::deque<std::shared_ptr<PoolClient>> reap_queue;
  std::condition_variable reap_cv;
  bool reaper_stop = false;  // close() dropped every client: the reaper ends with its queue
  uint64_t next_client = 1;

  std::atomic<uint64_t> connections{0}, refused{0}, disconnects{0}, requests{0}, malformed{0};
  std::atomic<uint64_t> reclaimed_leases{0}, reclaimed_reservations{0};
  std::atomic<uint64_t> lookups{0}, lookup_hits{0}, commits{0}, bytes_committed{0};
  std::atomic<uint64_t> leases_granted{0}, bytes_leased{0};
  double open_seconds = 0;

  // Set once by start_cluster; closed with the server, after its clients.
  std::mutex cluster_mu;
  std::unique_ptr<ClusterNode> cluster;
  std::atomic<ClusterNode*> cluster_ptr{nullptr};
  ClusterNode* cluster_node() const { return cluster_ptr.load(std::memory_order_acquire); }
  // Brings the ids a lease missed from their owners in the cluster, then
  // leases them here.
  void fetch_missing(ClusterNode* cn, Deadline budget, std::span<const BlockId> ids,
                     std::vector<BlockView>* views, std::vector<Status>* st);
  // The first ids of a lease request that the client has room for (at most
  // kMaxLeasesPerClient held), in its namespace, acquired here; returns how
  // many (the rest are answered Busy).
  uint32_t acquire_for(PoolClient* c, const uint8_t* items, uint32_t count,
                       std::vector<BlockId>* ids, std::vector<BlockView>* views,
                       std::vector<Status>* st) {
    const size_t room =
        kMaxLeasesPerClient -
        std::min(c->lease_count.load(std::memory_order_relaxed), kMaxLeasesPerClient);
    const uint32_t asked = static_cast<uint32_t>(std::min<size_t>(count, room));
    ids->resize(asked);
    for (uint32_t k = 0; k < asked; ++k) (*ids)[k] = c->scoped(items + k * 16);
    store->acquire_batch(*ids, views, st);
    return asked;
  }
  // Whether a view lies in the host arena the clients map.
  bool in_arena(const BlockView& view) const {
    const uint8_t* p = view.data();
    return view.kind() == MemoryKind::kHost && p >= arena.base &&
           p + view.size() <= arena.base + arena.capacity;
  }

  // ---- workers (table_mu and flush_mu are never held with another lock) ----
  int doorbell_fd = -1;
  pool::Doorbell* bell = nullptr;  // shared with every client (they may scribble on it)
  std::vector<std::thread> workers;
  int max_spinners = 1;
  std::atomic<int> spinners{0};  // the server's own count (bell->spinning is the clients')
  std::atomic<int> sleeping{0};  // likewise for bell->sleepers
  // Workers only add to and take from the doorbell's counts, so a client's
  // stray write there would stay for good: a count above the server's own
  // has clients never ring (each request then waits for a worker's
  // kWorkerCheckUs), one below has them ring for nothing. The monitor sets
  // a count back when it differed from the server's own by the same amount
  // at two checks a heartbeat apart (a worker between its two updates
  // makes a difference that does not last). Monitor thread only.
  void check_doorbell();
  std::chrono::steady_clock::time_point next_doorbell_check{};
  int64_t spinning_gap = 0, sleepers_gap = 0;
  std::atomic<uint64_t> doorbell_repairs{0};
  std::mutex table_mu;  // guards table
  std::shared_ptr<const ChannelTable> table = std::make_shared<ChannelTable>();
  std::atomic<uint64_t> table_gen{1};
  // Flushes wait here for the flusher; each holds its channel's claim and
  // its client's `inside`.
  struct FlushJob {
    ChannelRef ref;
    uint32_t seq;
    std::vector<uint8_t> request;
  };
  std::mutex flush_mu;  // guards flush_queue, flusher_stop
  std::condition_variable flush_cv;
  std::deque<FlushJob> flush_queue;
  bool flusher_stop = false;
  std::thread flusher;

  void wake() {
    uint64_t one = 1;
    (void)!::write(wake_fd, &one, sizeof one);
  }

  // ---- connections ---------------------------------------------------------
  void monitor_loop();
  bool handshake_room_locked() const;
  void end_a_silent_handshake_locked();
  void handshake(int sock);
  Status admit(int sock, const PeerCredentials& cred, const pool::Hello& hello,
               std::shared_ptr<PoolClient>* out, std::string* why);
  Status make_client(int sock, const PeerCredentials& cred, const pool::Hello& hello,
                     std::shared_ptr<PoolClient>* out);
  void drop(const std::shared_ptr<PoolClient>& c);
  void reap_loop();
  void cleanup(PoolClient* c);

  // ---- requests ------------------------------------------------------------
  struct Worker {
    std::shared_ptr<const ChannelTable> table;
    uint64_t gen = 0;
    size_t cursor = 0;  // where the next scan starts, so every channel gets its turn
    std::vector<uint8_t> request = std::vector<uint8_t>(pool::kRequestAreaBytes);
  };
  // Adds c to the workers' table, or takes it out.
  void publish(const std::shared_ptr<PoolClient>& c, bool add);
  void worker_loop();
  // Scans the table for a channel with a request no worker serves and
  // claims it; *more says another such channel was seen.
  bool claim(Worker& w, ChannelRef* out, bool* more);
  // Answers the claimed request; how long to spin for the next one after it.
  int64_t serve(Worker& w, const ChannelRef& ref);
  void reply_and_release(const ChannelRef& ref, uint32_t seq, uint32_t bytes);
  void flush_loop();
  // A request that came on channel `channel` of client c.
  uint32_t handle(PoolClient* c, uint32_t channel, const uint8_t* req, uint32_t n, uint8_t* reply);
  uint32_t error_reply(uint8_t* reply, const Status& st);
};

// ---- start and close ---------------------------------------------------------

Result<std::unique_ptr<PoolServer>> PoolServer::Start(const CascadeConfig& config,
                                                      const PoolServerOptions& options) {
  if (options.socket_path.empty()) return Status::InvalidArgument("the socket path is empty");
  if (options.max_clients < 1) return Status::InvalidArgument("max_clients must be at least 1");
  if (options.workers < 0)
    return Status::InvalidArgument("workers must be 0 (two per core) or a positive count");
  if (options.socket_mode & ~0777u)
    return Status::InvalidArgument("socket_mode takes permission bits only (at most 0777)");
  if (config.dedup_enabled)
    return Status::NotSupported(
        "a pool server stores what its clients write into its arena; dedup needs the bytes "
        "before they are placed: set dedup_enabled to false");
  // A live server on the socket owns the arena too: refused before the
  // arena is opened (in a container, a lock on the arena whose holder this
  // pid namespace cannot see looks like a dead one's).
  CASCADE_RETURN_IF_ERROR(refuse_if_listening(options.socket_path));
  // From here to close this server alone may take the path: another
  // starting beside it is refused, not left listening on a socket file this
  // one replaced.
  auto socket_lock = SocketPathLock::Acquire(options.socket_path);
  if (!socket_lock.ok()) return socket_lock.status();
  auto impl = std::make_unique<Impl>();
  impl->socket_lock = std::move(socket_lock.value());
  impl->options = options;
  auto t0 = std::chrono::steady_clock::now();
  auto store = CascadeStore::Open(config);
  if (!store.ok()) return store.status();
  impl->open_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  impl->store = std::move(store.value());
  impl->arena = impl->store->shared_arena();
  const auto tiers = impl->store->stats().tiers;
  for (size_t t = 0; t < tiers.size(); ++t) {
    impl->persistent |= tiers[t].persistent;
    if (t > 0) impl->persistent_below |= tiers[t].persistent;
  }
  // A flush writes a client's blocks down, or (an arena kept across
  // restarts, no tier below) says which of them a restart does not keep.
  impl->tracks_unflushed = impl->persistent_below || config.shm_persist;
  if (impl->arena.fd < 0)
    return Status::InvalidArgument(
        "a pool server's pipeline must start with the host tier (its shared arena is what "
        "clients map): use a pipeline such as \"host\" or \"host|file\"");
  auto fd = listen_unix(options.socket_path, options.socket_mode, 128);
  if (!fd.ok()) return fd.status();
  impl->listen_fd = *fd;
  auto file = socket_file(options.socket_path);
  if (!file.ok()) {
    ::close(impl->listen_fd);
    return file.status();
  }
  impl->socket_file = *file;
  impl->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl->wake_fd < 0) {
    Status st = errno_status(errno, "eventfd");
    ::close(impl->listen_fd);
    remove_socket_file(impl->socket_file);
    return st;
  }
  impl->doorbell_fd = ::memfd_create("cascade-pool-doorbell", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  void* bell = MAP_FAILED;
  if (impl->doorbell_fd >= 0 &&
      ::ftruncate(impl->doorbell_fd, static_cast<off_t>(pool::kDoorbellBytes)) == 0 &&
      seal_size(impl->doorbell_fd).ok())
    bell = ::mmap(nullptr, pool::kDoorbellBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                  impl->doorbell_fd, 0);
  if (bell == MAP_FAILED) {
    Status st = errno_status(errno, "the doorbell file");
    if (impl->doorbell_fd >= 0) ::close(impl->doorbell_fd);
    ::close(impl->wake_fd);
    ::close(impl->listen_fd);
    remove_socket_file(impl->socket_file);
    return st;
  }
  impl->bell = static_cast<pool::Doorbell*>(bell);
  int nworkers = options.workers;
  // Two per core by default: when client threads outnumber the cores, the
  // workers get a share of the cores in proportion to their number, and a
  // sleeping worker costs nothing.
  if (nworkers <= 0)
    nworkers = static_cast<int>(std::clamp(2 * std::thread::hardware_concurrency(), 2u, 16u));
  nworkers = std::min(nworkers, kMaxWorkers);
  // A spinning worker catches the next request without a wake-up; spinners
  // stop once nothing comes, so an idle server burns no core, but under load
  // with many clients several spinners spare most wake-ups.
  impl->max_spinners = nworkers >= 8 ? 4 : 1;
  Impl* p = impl.get();
  for (int i = 0; i < nworkers; ++i) impl->workers.emplace_back([p] { p->worker_loop(); });
  impl->flusher = std::thread([p] { p->flush_loop(); });
  impl->monitor = std::thread([p] { p->monitor_loop(); });
  impl->reaper = std::thread([p] { p->reap_loop(); });
  return std::unique_ptr<PoolServer>(new PoolServer(std::move(impl)));
}

PoolServer::PoolServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PoolServer::~PoolServer() { (void)close(); }

Status PoolServer::close() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.close_mu);
  if (s.closed) return s.close_status;
  s.closed = true;
  s.stopping.store(true);
  s.wake();
  if (s.monitor.joinable()) s.monitor.join();
  {
    std::unique_lock<std::mutex> l(s.mu);
    // Handshakes still waiting for a hello end now, not at their deadline.
    for (const auto& [sock, since] : s.awaiting_hello) ::shutdown(sock, SHUT_RDWR);
    s.handshakes_cv.wait(l, [&] { return s.handshakes_running == 0; });
  }
  std::vector<std::shared_ptr<PoolClient>> all;
  {
    std::lock_guard<std::mutex> l(s.mu);
    for (auto& [id, c] : s.clients) all.push_back(c);
  }
  for (auto& c : all) s.drop(c);
  {
    std::lock_guard<std::mutex> l(s.mu);
    s.reaper_stop = true;
    s.reap_cv.notify_all();
  }
  if (s.reaper.joinable()) s.reaper.join();
  // Every client is reaped: the workers and the flusher hold no request.
  s.bell->seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&s.bell->seq);
  for (auto& t : s.workers) t.join();
  s.workers.clear();
  {
    std::lock_guard<std::mutex> l(s.flush_mu);
    s.flusher_stop = true;
  }
  s.flush_cv.notify_all();
  if (s.flusher.joinable()) s.flusher.join();
  {
    std::lock_guard<std::mutex> l(s.table_mu);
    s.table = std::make_shared<ChannelTable>();
  }
  ::munmap(s.bell, pool::kDoorbellBytes);
  ::close(s.doorbell_fd);
  if (s.listen_fd >= 0) {
    ::close(s.listen_fd);
    remove_socket_file(s.socket_file);
  }
  s.socket_lock.release();
  if (s.wake_fd >= 0) ::close(s.wake_fd);
  // Other members' leases and reservations end before the store closes.
  {
    std::lock_guard<std::mutex> l(s.cluster_mu);
    if (s.cluster) s.cluster->close();
  }
  s.store->close();
  s.close_status = s.store->close_status();
  return s.close_status;
}

const std::string& PoolServer::socket_path() const { return impl_->options.socket_path; }
CascadeStore* PoolServer::store() { return impl_->store.get(); }

Result<ClusterNode*> PoolServer::start_cluster(const ClusterNodeOptions& options) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> l(s.cluster_mu);
  if (s.stopping.load()) return Status::Unavailable("the pool server is closed");
  if (s.cluster) return Status::Busy("this server is a cluster member already");
  auto cn = ClusterNode::Start(s.store.get(), s.arena, options);
  if (!cn.ok()) return cn.status();
  s.cluster = std::move(cn.value());
  s.cluster_ptr.store(s.cluster.get(), std::memory_order_release);
  return s.cluster.get();
}

ClusterNode* PoolServer::cluster() { return impl_->cluster_node(); }

// ---- connections ---------------------------------------------------------------

// Whether another handshake may start. REQUIRES: mu held.
bool PoolServer::Impl::handshake_room_locked() const {
  return handshakes_running - handshakes_ending < kMaxHandshakes &&
         handshakes_running < 2 * kMaxHandshakes;
}

// Every slot is taken, some by peers whose hello has not been read yet: the
// one that connected first and has no whole hello waiting gives its slot up
// (its handshake ends at once) once it is older than kHelloGrace. A client
// sends its hello as soon as it connects, so peers that stall on purpose,
// or reconnect before any longer age limit, cannot keep new clients out,
// and a client whose hello waits for its handshake thread (a loaded host)
// keeps its slot. REQUIRES: mu held.
void PoolServer::Impl::end_a_silent_handshake_locked() {
  const auto now = std::chrono::steady_clock::now();
  auto oldest = awaiting_hello.end();
  for (auto it = awaiting_hello.begin(); it != awaiting_hello.end(); ++it)
    if (now - it->second >= kHelloGrace &&
        (oldest == awaiting_hello.end() || it->second < oldest->second) &&
        !hello_waiting(it->first))
      oldest = it;
  if (oldest == awaiting_hello.end()) return;
  ::shutdown(oldest->first, SHUT_RDWR);
  awaiting_hello.erase(oldest);
  ++handshakes_ending;
}

void PoolServer::Impl::check_doorbell() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_doorbell_check) return;
  next_doorbell_check = now + std::chrono::milliseconds(pool::kHeartbeatMs);
  auto check = [&](std::atomic<uint32_t>& count, int own, int64_t* last_gap) {
    const uint32_t seen = count.load(std::memory_order_seq_cst);
    const int64_t gap = int64_t(seen) - int64_t(own);
    if (gap == 0 || gap != *last_gap) {
      *last_gap = gap;
      return;
    }
    *last_gap = 0;
    uint32_t expected = seen;  // unless a worker changed it meanwhile
    if (count.compare_exchange_strong(expected, uint32_t(std::max(own, 0)),
                                      std::memory_order_seq_cst))
      doorbell_repairs.fetch_add(1, std::memory_order_relaxed);
  };
  check(bell->spinning, spinners.load(std::memory_order_seq_cst), &spinning_gap);
  check(bell->sleepers, sleeping.load(std::memory_order_seq_cst), &sleepers_gap);
}

void PoolServer::Impl::monitor_loop() {
  name_this_thread("cascade-monitor");
  std::vector<struct pollfd> fds;
  std::vector<std::shared_ptr<PoolClient>> watched;
  // A connection waits in the listen queue while every handshake slot is
  // taken (its client's hello waits with it), rather than being closed: the
  // queue is looked at again every millisecond, and when a handshake ends.
  bool queue_waits = false;
  // After an accept that failed for want of descriptors or memory, the
  // queue is left alone a while: it stays readable, and the loop would spin.
  std::chrono::steady_clock::time_point accept_paused_until{};
  // Non-blocking: a connection seen in the queue may be gone by the accept.
  // (The accepted sockets block, as every socket does unless asked.)
  if (const int flags = ::fcntl(listen_fd, F_GETFL); flags >= 0)
    (void)::fcntl(listen_fd, F_SETFL, flags | O_NONBLOCK);
  while (!stopping.load()) {
    fds.clear();
    watched.clear();
    const bool paused = std::chrono::steady_clock::now() < accept_paused_until;
    fds.push_back({queue_waits || paused ? -1 : listen_fd, POLLIN, 0});
    fds.push_back({wake_fd, POLLIN, 0});
    {
      std::lock_guard<std::mutex> l(mu);
      for (auto& [id, c] : clients) {
        if (!c->watched.load()) continue;
        fds.push_back({c->sock, POLLIN | POLLRDHUP, 0});
        watched.push_back(c);
        if (c->pidfd >= 0) {
          fds.push_back({c->pidfd, POLLIN, 0});
          watched.push_back(c);
        }
      }
    }
    int r = ::poll(fds.data(), fds.size(), queue_waits ? 1 : paused ? 10 : pool::kHeartbeatMs);
    bell->heartbeat.fetch_add(1, std::memory_order_relaxed);
    check_doorbell();
    if (r < 0) continue;
    if (fds[1].revents) {
      uint64_t v;
      (void)!::read(wake_fd, &v, sizeof v);
    }
    for (size_t i = 0; i < watched.size(); ++i) {
      // After the handshake a client sends nothing: any event is its end or
      // a breach of the protocol, and either way it goes. So does a client
      // whose process ended while a child it forked keeps its socket open
      // (the child cannot use the store; what the client held is freed).
      if (fds[i + 2].revents) drop(watched[i]);
    }
    if (paused || (!queue_waits && !(fds[0].revents & POLLIN))) continue;
    {
      std::lock_guard<std::mutex> l(mu);
      if (!handshake_room_locked() && !awaiting_hello.empty()) end_a_silent_handshake_locked();
      queue_waits = !handshake_room_locked();
      if (queue_waits) continue;
    }
    int sock = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (sock < 0) {
      // EAGAIN: its client gave up meanwhile.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        accept_paused_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
      continue;
    }
    // Out-of-band bytes stay in the stream, where the hello is read: none
    // can sit beside it, counted as waiting but never read.
    const int one = 1;
    (void)::setsockopt(sock, SOL_SOCKET, SO_OOBINLINE, &one, sizeof one);
    std::lock_guard<std::mutex> l(mu);
    ++handshakes_running;
    awaiting_hello[sock] = std::chrono::steady_clock::now();
    try {
      std::thread([this, sock] { handshake(sock); }).detach();
    } catch (const std::system_error&) {
      // No thread to be had (a process or memory limit): this connection
      // is refused, and the queue left alone a while.
      --handshakes_running;
      awaiting_hello.erase(sock);
      refused.fetch_add(1);
      ::close(sock);
      accept_paused_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
    }
  }
}

void PoolServer::Impl::handshake(int sock) {
  name_this_thread("cascade-hello");
  pool::Welcome w{};
  w.magic = pool::kMagic;
  w.version = pool::kVersion;
  std::shared_ptr<PoolClient> client;
  std::string why;
  Status st;
  auto cred = peer_credentials(sock);
  pool::Hello hello{};
  std::chrono::steady_clock::time_point deadline;
  if (!cred.ok()) {
    st = cred.status();
  } else {
    deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(options.handshake_timeout_ms);
    // The whole hello is left in the socket until this connection is out
    // of awaiting_hello: while it waits there the monitor never takes this
    // slot (it looks under mu).
    st = wait_readable(sock, sizeof hello, deadline);
  }
  // A peer that closed before sending a byte (a check that a server
  // listens here, a client that gave up) was refused nothing.
  char byte;
  const bool said_nothing = !st.ok() && ::recv(sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
  bool evicted;  // its slot went to a new connection before its hello came
  {
    std::lock_guard<std::mutex> l(mu);
    evicted = awaiting_hello.erase(sock) == 0;
  }
  if (st.ok() && evicted) st = Status::Unavailable("its handshake slot went to a new connection");
  if (st.ok()) st = receive_message(sock, &hello, sizeof hello, deadline);
  if (cred.ok()) {
    if (st.ok()) st = admit(sock, *cred, hello, &client, &why);
  }
  if (st.ok()) {
    w.code = 0;
    w.client_id = client->id;
    w.channels = client->nch;
    w.arena_capacity = arena.capacity;
    w.arena_file_offset = arena.file_offset;
    w.channel_stride = pool::kChannelStride;
    w.arena_committed = store->shared_arena().committed;
    w.kept_since = arena.kept_since;
    w.flags = persistent ? pool::kPersistent : 0;
    // The client is listed, and its channels are in the workers' table,
    // before it has its welcome: its first request finds them, and what it
    // holds counts at once. Its socket is watched only after the welcome
    // went out: the monitor may hand a watched client to the reaper, which
    // closes the socket.
    {
      std::lock_guard<std::mutex> l(mu);
      clients[client->id] = client;
      --admitting;  // counted in clients from now on
    }
    publish(client, true);
    st = send_message(sock, &w, sizeof w, {arena.fd, client->channel_fd, doorbell_fd});
    if (st.ok()) {
      client->watched.store(true);
      connections.fetch_add(1);
      wake();
    } else {
      client->dead.store(true);
      publish(client, false);
      {
        std::lock_guard<std::mutex> l(mu);
        clients.erase(client->id);
      }
      cleanup(client.get());
    }
  } else {
    if (!said_nothing) refused.fetch_add(1);
    if (why.empty()) why = st.message();
    w.code = code_of(st);
    w.message_bytes = static_cast<uint32_t>(std::min<size_t>(why.size(), pool::kMaxMessageBytes));
    std::memcpy(w.message, why.data(), w.message_bytes);
    (void)send_message(sock, &w, sizeof w);
    ::close(sock);
  }
  std::lock_guard<std::mutex> l(mu);
  // A connection may wait in the listen queue for this slot. Woken before
  // the count drops: close() waits for it, then closes wake_fd, and this
  // thread must not touch the server after that.
  wake();
  --handshakes_running;
  if (evicted) --handshakes_ending;
  handshakes_cv.notify_all();
}

Status PoolServer::Impl::admit(int sock, const PeerCredentials& cred, const pool::Hello& hello,
                               std::shared_ptr<PoolClient>* out, std::string* why) {
  if (cred.uid != ::geteuid() &&
      !(options.allowed_gid >= 0 && cred.in_group(static_cast<gid_t>(options.allowed_gid)))) {
    *why = "uid " + std::to_string(cred.uid) + " may not use this pool";
    return Status::InvalidArgument(*why);
  }
  if (hello.magic != pool::kMagic || hello.version != pool::kVersion) {
    *why = "not a hello of pool protocol " + std::to_string(pool::kVersion);
    return Status::InvalidArgument(*why);
  }
  if (hello.channels == 0 || hello.channels > pool::kMaxChannels ||
      hello.namespace_bytes > pool::kMaxNamespaceBytes) {
    *why = "the hello asks for " + std::to_string(hello.channels) +
           " channels and a namespace of " + std::to_string(hello.namespace_bytes) + " bytes";
    return Status::InvalidArgument(*why);
  }
  {
    // Clients between this check and their listing count too: hellos that
    // arrive together are admitted one limit's worth, not each alone.
    std::lock_guard<std::mutex> l(mu);
    if (clients.size() + admitting >= static_cast<size_t>(options.max_clients)) {
      *why =
          "the pool serves " + std::to_string(clients.size() + admitting) + " clients, its limit";
      return Status::Busy(*why);
    }
    ++admitting;
  }
  Status st = make_client(sock, cred, hello, out);
  if (!st.ok()) {
    std::lock_guard<std::mutex> l(mu);
    --admitting;
  }
  return st;
}

// A client's state, channels and id (admit's part that cannot be refused
// by a limit).
Status PoolServer::Impl::make_client(int sock, const PeerCredentials& cred,
                                     const pool::Hello& hello, std::shared_ptr<PoolClient>* out) {
  auto c = std::make_shared<PoolClient>();
  c->cred = cred;
  c->pidfd = watch_process(cred.pid);
  c->sock = sock;
  c->name_space.assign(hello.name_space, hello.namespace_bytes);
  std::string effective = options.share_across_users
                              ? "shared\n" + c->name_space
                              : "uid " + std::to_string(cred.uid) + "\n" + c->name_space;
  c->digest = sha256(effective.data(), effective.size());
  c->nch =
      std::min<uint32_t>(hello.channels, static_cast<uint32_t>(options.max_channels_per_client));
  c->shards.reset(new PoolClient::Shard[c->nch]);
  c->states.reset(new PoolClient::ChannelState[c->nch]);
  c->channel_bytes = uint64_t(c->nch) * pool::kChannelStride;
  c->channel_fd = ::memfd_create("cascade-pool-channels", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (c->channel_fd < 0) return errno_status(errno, "memfd_create");
  if (::ftruncate(c->channel_fd, static_cast<off_t>(c->channel_bytes)) != 0) {
    Status st = errno_status(errno, "ftruncate of the channel file");
    ::close(c->channel_fd);
    return st;
  }
  // The client cannot shrink it under the server's mapping.
  if (Status st = seal_size(c->channel_fd); !st.ok()) {
    ::close(c->channel_fd);
    return st;
  }
  void* m = ::mmap(nullptr, c->channel_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->channel_fd, 0);
  if (m == MAP_FAILED) {
    Status st = errno_status(errno, "mmap of the channel file");
    ::close(c->channel_fd);
    return st;
  }
  c->channels = static_cast<uint8_t*>(m);
  {
    std::lock_guard<std::mutex> l(mu);
    c->id = next_client++;
  }
  *out = std::move(c);
  return Status::OK();
}

// Marks a client gone and hands it to the reaper (once).
void PoolServer::Impl::drop(const std::shared_ptr<PoolClient>& c) {
  if (c->dead.exchange(true)) return;
  publish(c, false);
  std::lock_guard<std::mutex> l(mu);
  clients.erase(c->id);
  reap_queue.push_back(c);
  reap_cv.notify_all();
}

// Ends dead clients as soon as no worker serves a request of theirs. A
// client whose request is still under way (a long flush, a call to a
// cluster member) waits in `busy` and is looked at again every millisecond,
// while the clients that died after it are ended at once.
//
// A client that fills reserved ranges from GPU memory (kDeviceWrites) and
// held reservations when its connection ended also waits for its process
// to end (its pidfd), for at most kProcessEndWait: a copy from GPU memory
// into a reserved range may still be under way until the process's GPU
// context is gone, which the kernel tears down after the socket may
// already have closed. Its ranges are freed only then.
void PoolServer::Impl::reap_loop() {
  name_this_thread("cascade-reaper");
  struct Dying {
    std::shared_ptr<PoolClient> c;
    std::chrono::steady_clock::time_point since;
  };
  std::vector<Dying> busy;
  std::unique_lock<std::mutex> l(mu);
  while (true) {
    const auto ready = [&] { return !reap_queue.empty() || (reaper_stop && busy.empty()); };
    if (busy.empty()) reap_cv.wait(l, ready);
    else reap_cv.wait_for(l, std::chrono::milliseconds(1), ready);
    if (reap_queue.empty() && busy.empty()) return;  // reaper_stop
    const auto now = std::chrono::steady_clock::now();
    while (!reap_queue.empty()) {
      busy.push_back(Dying{std::move(reap_queue.front()), now});
      reap_queue.pop_front();
    }
    const bool stopping_now = reaper_stop;
    l.unlock();
    for (auto it = busy.begin(); it != busy.end();) {
      PoolClient* c = it->c.get();
      // `dead` is set (drop): a worker that enters from now on leaves.
      const bool waiting_for_process =
          !stopping_now && c->device_writes.load(std::memory_order_relaxed) &&
          c->reservation_count.load(std::memory_order_relaxed) > 0 && c->pidfd >= 0 &&
          !process_ended(c->pidfd) && now - it->since < kProcessEndWait;
      if (c->inside.load() != 0 || waiting_for_process) {
        ++it;
        continue;
      }
      cleanup(c);
      disconnects.fetch_add(1);  // counted once everything it held is given back
      it = busy.erase(it);
    }
    l.lock();
  }
}

// Ends what a dead client held, once no worker serves a request of its:
// its leases and its reservations (a put it never committed stays
// invisible and its range is free again). Its channels stay mapped until
// no worker's table holds the client.
void PoolServer::Impl::cleanup(PoolClient* c) {
  c->dead.store(true);
  while (c->inside.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  size_t leases = 0, reservations = 0;
  std::vector<MappedLease> mapped;
  for (uint32_t i = 0; i < c->nch && c->shards; ++i) {
    PoolClient::Shard& sh = c->shards[i];
    std::unordered_map<uint64_t, Reservation> open;
    {
      std::lock_guard<std::mutex> l(sh.mu);
      leases += sh.leases.size() + sh.mapped.size();
      reservations += sh.reservations.size();
      sh.leases.clear();
      for (auto& [token, m] : sh.mapped) mapped.push_back(m);
      sh.mapped.clear();
      open.swap(sh.reservations);
    }
    for (auto& [token, r] : open) store->abort(r);
  }
  if (!mapped.empty())
    if (ClusterNode* cn = cluster_node()) cn->release_mapped(mapped);
  reclaimed_leases.fetch_add(leases);
  reclaimed_reservations.fetch_add(reservations);
  if (c->channel_fd >= 0) ::close(c->channel_fd);
  c->channel_fd = -1;
  if (c->sock >= 0) ::close(c->sock);
  c->sock = -1;
  if (c->pidfd >= 0) ::close(c->pidfd);
  c->pidfd = -1;
}

// ---- requests ------------------------------------------------------------------

void PoolServer::Impl::publish(const std::shared_ptr<PoolClient>& c, bool add) {
  std::lock_guard<std::mutex> l(table_mu);
  auto next = std::make_shared<ChannelTable>();
  for (const auto& other : table->clients)
    if (other != c) next->clients.push_back(other);
  if (add) next->clients.push_back(c);
  for (const auto& cl : next->clients)
    for (uint32_t i = 0; i < cl->nch; ++i)
      next->channels.push_back(
          ChannelRef{cl.get(), i, Channel::at(cl->channels, i), &cl->states[i]});
  table = std::move(next);
  table_gen.fetch_add(1, std::memory_order_seq_cst);
}

bool PoolServer::Impl::claim(Worker& w, ChannelRef* out, bool* more) {
  // Sequentially consistent loads throughout: a scan is the "check" of the
  // doorbell's announce-then-check (pool_channel.h), and it must also see a
  // client added to the table before the client's first request.
  if (!w.table || table_gen.load(std::memory_order_seq_cst) != w.gen) {
    std::lock_guard<std::mutex> l(table_mu);
    w.table = table;
    w.gen = table_gen.load(std::memory_order_seq_cst);
  }
  const std::vector<ChannelRef>& chs = w.table->channels;
  const size_t n = chs.size();
  bool found = false;
  *more = false;
  for (size_t k = 0; k < n; ++k) {
    const size_t at = (w.cursor + k) % n;
    const ChannelRef& r = chs[at];
    if (r.client->dead.load(std::memory_order_relaxed)) continue;
    if (r.ch.control->request_seq.load(std::memory_order_seq_cst) ==
            r.state->last.load(std::memory_order_relaxed) ||
        r.state->claimed.load(std::memory_order_seq_cst))
      continue;
    if (found) {
      *more = true;
      break;
    }
    bool expected = false;
    if (!r.state->claimed.compare_exchange_strong(expected, true, std::memory_order_seq_cst))
      continue;
    // Another worker may have served the request between the look and the
    // claim. Whoever releases a claim scans again (or rings) afterwards, so
    // a request posted meanwhile is not left behind.
    if (r.ch.control->request_seq.load(std::memory_order_seq_cst) ==
        r.state->last.load(std::memory_order_relaxed)) {
      r.state->claimed.store(false, std::memory_order_seq_cst);
      continue;
    }
    r.client->inside.fetch_add(1, std::memory_order_seq_cst);
    if (r.client->dead.load(std::memory_order_seq_cst)) {
      r.state->claimed.store(false, std::memory_order_seq_cst);
      r.client->inside.fetch_sub(1, std::memory_order_seq_cst);
      continue;
    }
    found = true;
    *out = r;
    w.cursor = (at + 1) % n;
  }
  return found;
}

int64_t PoolServer::Impl::serve(Worker& w, const ChannelRef& ref) {
  pool::ChannelControl* control = ref.ch.control;
  const uint32_t seq = control->request_seq.load(std::memory_order_acquire);
  // The request is copied out of the shared page before it is read: the
  // client cannot change what is checked after the check.
  const uint32_t n =
      std::min<uint32_t>(control->request_bytes, static_cast<uint32_t>(pool::kRequestAreaBytes));
  std::memcpy(w.request.data(), ref.ch.request, n);
  ref.state->last.store(seq, std::memory_order_relaxed);
  RequestHeader head{};
  if (n >= sizeof head) std::memcpy(&head, w.request.data(), sizeof head);
  const uint32_t op_word = head.op;
  if (op_word == static_cast<uint32_t>(Op::kFlush)) {
    {
      std::lock_guard<std::mutex> l(flush_mu);
      flush_queue.push_back(
          FlushJob{ref, seq, std::vector<uint8_t>(w.request.begin(), w.request.begin() + n)});
    }
    flush_cv.notify_one();
    return 0;
  }
  const uint32_t bytes = handle(ref.client, ref.index, w.request.data(), n, ref.ch.reply);
  reply_and_release(ref, seq, bytes);
  // A request sent ahead is followed by the client's copies, not by its
  // next request: a spin would only take a core from them. After a reserve
  // or a lease the client copies block bytes too: a long spin would only
  // take a core from the copies, and a short one still catches the commit
  // of a small block without a wake-up.
  if (head.flags & pool::kAhead) return 0;
  return op_word == static_cast<uint32_t>(Op::kReserve) ||
                 op_word == static_cast<uint32_t>(Op::kLease) ||
                 op_word == static_cast<uint32_t>(Op::kLeaseRead)
             ? kShortSpinNs
             : pool::kSpinNs;
}

void PoolServer::Impl::reply_and_release(const ChannelRef& ref, uint32_t seq, uint32_t bytes) {
  ref.ch.control->reply_bytes = bytes;
  pool::post(&ref.ch.control->reply_seq, seq, &ref.ch.control->client_sleeping);
  ref.state->claimed.store(false, std::memory_order_seq_cst);
  // The last touch of the client: the reaper may end it once this is 0.
  ref.client->inside.fetch_sub(1, std::memory_order_seq_cst);
}

// A worker: serves what it finds; when nothing is pending it spins a while
// after the request it answered (unless enough workers spin already), then
// sleeps on the doorbell.
void PoolServer::Impl::worker_loop() {
  name_this_thread("cascade-worker");
  Worker w;
  int64_t spin_ns = 0;  // after the request just answered
  ChannelRef ref{};
  bool more = false;
  auto take = [&] {
    // A burst spreads over the workers: the next one is woken for the rest.
    if (more) pool::ring_if_needed(bell);
    spin_ns = serve(w, ref);
  };
  while (!stopping.load(std::memory_order_relaxed)) {
    if (claim(w, &ref, &more)) {
      take();
      continue;
    }
    if (const int64_t ns = std::exchange(spin_ns, 0); ns > 0) {
      int s = spinners.load(std::memory_order_relaxed);
      while (s < max_spinners && !spinners.compare_exchange_weak(s, s + 1)) {
      }
      if (s < max_spinners) {
        bell->spinning.fetch_add(1, std::memory_order_seq_cst);
        const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
        bool got = false;
        while (!(got = claim(w, &ref, &more)) && std::chrono::steady_clock::now() < end)
          pool::cpu_relax();
        // Out of `spinning` before anything else: a client that saw this
        // worker spin did not ring, and the scan that follows (here or at
        // the top of the loop) finds its request.
        bell->spinning.fetch_sub(1, std::memory_order_seq_cst);
        spinners.fetch_sub(1, std::memory_order_relaxed);
        if (got) take();
        continue;
      }
    }
    // The eventcount: key, announce, scan again, then wait for the key to
    // change (pool_channel.h says why no ring is lost).
    const uint32_t key = bell->seq.load(std::memory_order_seq_cst);
    sleeping.fetch_add(1, std::memory_order_seq_cst);
    bell->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (claim(w, &ref, &more)) {
      bell->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      sleeping.fetch_sub(1, std::memory_order_seq_cst);
      take();
      continue;
    }
    w.table.reset();  // a sleeping worker keeps no client mapped
    if (!stopping.load(std::memory_order_seq_cst)) futex_wait(&bell->seq, key, kWorkerCheckUs);
    bell->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    sleeping.fetch_sub(1, std::memory_order_seq_cst);
  }
}

// Flushes write blocks down to files and may take seconds: they run here,
// one at a time, holding no worker.
void PoolServer::Impl::flush_loop() {
  name_this_thread("cascade-flush");
  std::unique_lock<std::mutex> l(flush_mu);
  while (true) {
    flush_cv.wait(l, [&] { return flusher_stop || !flush_queue.empty(); });
    if (flush_queue.empty()) return;
    FlushJob job = std::move(flush_queue.front());
    flush_queue.pop_front();
    l.unlock();
    const uint32_t bytes = handle(job.ref.client, job.ref.index, job.request.data(),
                                  static_cast<uint32_t>(job.request.size()), job.ref.ch.reply);
    // The claim is released here, not by a worker that scans next: a worker
    // that skipped the channel while it was claimed may sleep, so ring.
    PoolClient* c = job.ref.client;
    job.ref.ch.control->reply_bytes = bytes;
    pool::post(&job.ref.ch.control->reply_seq, job.seq, &job.ref.ch.control->client_sleeping);
    job.ref.state->claimed.store(false, std::memory_order_seq_cst);
    pool::ring_if_needed(bell);
    c->inside.fetch_sub(1, std::memory_order_seq_cst);
    l.lock();
  }
}

void PoolServer::Impl::fetch_missing(ClusterNode* cn, Deadline budget, std::span<const BlockId> ids,
                                     std::vector<BlockView>* views, std::vector<Status>* st) {
  std::vector<BlockId> missed;
  std::vector<size_t> where;
  for (size_t k = 0; k < ids.size(); ++k) {
    if (!(*st)[k].is(Code::kNotFound)) continue;
    missed.push_back(ids[k]);
    where.push_back(k);
  }
  if (missed.empty()) return;
  std::vector<uint8_t> got(missed.size(), 0);
  cn->fetch(missed, got, budget);
  for (size_t j = 0; j < missed.size(); ++j) {
    if (!got[j]) continue;
    auto v = store->acquire(missed[j]);
    (*st)[where[j]] = v.status();
    if (v.ok()) (*views)[where[j]] = std::move(v.value());
  }
}

uint32_t PoolServer::Impl::error_reply(uint8_t* reply, const Status& st) {
  ReplyHeader h{};
  h.code = code_of(st);
  std::string msg = st.message().substr(0, pool::kMaxMessageBytes);
  h.message_bytes = static_cast<uint32_t>(msg.size());
  std::memcpy(reply, &h, sizeof h);
  std::memcpy(reply + sizeof h, msg.data(), msg.size());
  return static_cast<uint32_t>(sizeof h + msg.size());
}

uint32_t PoolServer::Impl::handle(PoolClient* c, uint32_t channel, const uint8_t* req, uint32_t n,
                                  uint8_t* reply) {
  requests.fetch_add(1, std::memory_order_relaxed);
  c->requests.fetch_add(1, std::memory_order_relaxed);
  RequestHeader h{};
  if (n < sizeof h) {
    malformed.fetch_add(1);
    return error_reply(reply, Status::InvalidArgument("a request shorter than its header"));
  }
  std::memcpy(&h, req, sizeof h);
  const Op op = static_cast<Op>(h.op);
  if (h.op < static_cast<uint32_t>(Op::kLookup) || h.op > static_cast<uint32_t>(Op::kArena)) {
    malformed.fetch_add(1);
    return error_reply(reply, Status::InvalidArgument("unknown op " + std::to_string(h.op)));
  }
  const uint64_t item = pool::request_item_bytes(op);
  if (h.count > pool::kMaxItems || (item == 0 && h.count != 0) ||
      n != sizeof h + uint64_t(h.count) * item) {
    malformed.fetch_add(1);
    return error_reply(reply, Status::InvalidArgument("a request of " + std::to_string(n) +
                                                      " bytes for " + std::to_string(h.count) +
                                                      " items of op " + std::to_string(h.op)));
  }
  const uint8_t* items = req + sizeof h;
  uint8_t* out = reply + sizeof(ReplyHeader);
  const uint32_t count = h.count;
  auto put_out = [&](uint32_t k, const auto& value) {
    std::memcpy(out + k * sizeof value, &value, sizeof value);
  };
  auto take_token = [&](uint32_t k) {
    uint64_t t;
    std::memcpy(&t, items + k * sizeof t, sizeof t);
    return t;
  };
  uint32_t reply_count = count;
  switch (op) {
    case Op::kLookup: {
      lookups.fetch_add(count, std::memory_order_relaxed);
      std::vector<BlockId> missed;
      std::vector<uint32_t> missed_k;
      for (uint32_t k = 0; k < count; ++k) {
        pool::LookupReply r{};
        const BlockId id = c->scoped(items + k * 16);
        auto size = store->size_of(id);
        r.code = code_of(size.status());
        if (size.ok()) {
          r.size = *size;
          lookup_hits.fetch_add(1, std::memory_order_relaxed);
        } else if (cluster_node() && size.status().is(Code::kNotFound)) {
          missed.push_back(id);
          missed_k.push_back(k);
        }
        put_out(k, r);
      }
      // What this node lacks, its owner in the cluster may hold.
      if (!missed.empty()) {
        std::vector<uint8_t> found(missed.size(), 0);
        std::vector<uint64_t> sizes(missed.size(), 0);
        cluster_node()->lookup(missed, found, sizes);
        for (size_t j = 0; j < missed.size(); ++j) {
          if (!found[j]) continue;
          pool::LookupReply r{};
          r.size = sizes[j];
          lookup_hits.fetch_add(1, std::memory_order_relaxed);
          put_out(missed_k[j], r);
        }
      }
      break;
    }
    case Op::kReserve: {
      // The client's lock is taken twice per batch, not per item: once for
      // the room left, once to record the reservations made; the store
      // places the batch in one call.
      if (h.flags & pool::kDeviceWrites) c->device_writes.store(true, std::memory_order_relaxed);
      const size_t room =
          kMaxReservationsPerClient -
          std::min(c->reservation_count.load(std::memory_order_relaxed), kMaxReservationsPerClient);
      const uint32_t asked = static_cast<uint32_t>(std::min<size_t>(count, room));
      std::vector<BlockId> ids(asked);
      std::vector<uint64_t> sizes(asked);
      // One call per kind of put: the prefix flag is an option of the batch.
      std::vector<uint32_t> order[2];
      for (uint32_t k = 0; k < asked; ++k) {
        pool::ReserveItem it;
        std::memcpy(&it, items + k * sizeof it, sizeof it);
        ids[k] = c->scoped(it.id);
        sizes[k] = it.size;
        order[(it.flags & pool::kPrefix) ? 1 : 0].push_back(k);
      }
      for (uint32_t k = asked; k < count; ++k) {
        pool::ReserveReply r{};
        r.code = static_cast<uint32_t>(Code::kBusy);
        put_out(k, r);
      }
      std::vector<std::pair<uint32_t, Reservation>> made;
      made.reserve(asked);
      // Ids the store holds already are this client's to flush too: its
      // put succeeded, and another client may never flush them.
      std::vector<BlockId> present;
      for (int prefix = 0; prefix < 2; ++prefix) {
        const std::vector<uint32_t>& ks = order[prefix];
        if (ks.empty()) continue;
        std::vector<BlockId> some_ids(ks.size());
        std::vector<uint64_t> some_sizes(ks.size());
        for (size_t j = 0; j < ks.size(); ++j) {
          some_ids[j] = ids[ks[j]];
          some_sizes[j] = sizes[ks[j]];
        }
        PutOptions o;
        o.is_prefix = prefix == 1;
        std::vector<Reservation> res;
        std::vector<Status> st;
        store->reserve_batch(some_ids, some_sizes, o, &res, &st);
        for (size_t j = 0; j < ks.size(); ++j) {
          pool::ReserveReply r{};
          r.code = code_of(st[j]);
          if (st[j].ok() && res[j].present) {
            r.flags = pool::kPresent;
            if (tracks_unflushed) present.push_back(some_ids[j]);
          } else if (st[j].ok()) {
            made.emplace_back(ks[j], res[j]);
          }
          put_out(ks[j], r);
        }
      }
      if (!present.empty()) c->committed(std::move(present));
      if (!made.empty()) {
        PoolClient::Shard& sh = c->shards[channel];
        std::lock_guard<std::mutex> l(sh.mu);
        for (auto& [k, res] : made) {
          pool::ReserveReply r{};
          r.token = c->token(channel);
          r.offset = res.offset;
          sh.reservations.emplace(r.token, res);
          put_out(k, r);
        }
        c->reservation_count.fetch_add(made.size(), std::memory_order_relaxed);
      }
      break;
    }
    case Op::kCommit:
    case Op::kAbort: {
      std::vector<std::optional<Reservation>> taken(count);
      size_t found = 0;
      c->by_shard(count, take_token, [&](PoolClient::Shard* sh, uint32_t k) {
        if (!sh) return;
        auto it = sh->reservations.find(take_token(k));
        if (it == sh->reservations.end()) return;
        taken[k] = it->second;
        sh->reservations.erase(it);
        ++found;
      });
      c->reservation_count.fetch_sub(found, std::memory_order_relaxed);
      std::vector<uint32_t> held;
      std::vector<Reservation> batch;
      for (uint32_t k = 0; k < count; ++k) {
        if (!taken[k]) {
          put_out(k, pool::CodeReply{static_cast<uint32_t>(Code::kInvalidArgument)});
        } else if (op == Op::kAbort) {
          store->abort(*taken[k]);
          put_out(k, pool::CodeReply{});
        } else {
          held.push_back(k);
          batch.push_back(*taken[k]);
        }
      }
      if (batch.empty()) break;
      std::vector<Status> st;
      store->commit_batch(batch, PutOptions{}, &st);
      uint64_t ok = 0, bytes = 0;
      std::vector<BlockId> stored, flushable;  // new to the store; this client's to flush
      ClusterNode* cn = cluster_node();
      for (size_t j = 0; j < held.size(); ++j) {
        put_out(held[j], pool::CodeReply{code_of(st[j])});
        if (!st[j].ok()) continue;
        ++ok;
        bytes += batch[j].size;
        if (cn && !batch[j].present) stored.push_back(batch[j].id);
        if (tracks_unflushed) flushable.push_back(batch[j].id);
      }
      if (cn) cn->publish(stored);
      if (!flushable.empty()) c->committed(std::move(flushable));
      commits.fetch_add(ok, std::memory_order_relaxed);
      bytes_committed.fetch_add(bytes, std::memory_order_relaxed);
      break;
    }
    case Op::kLease: {
      std::vector<BlockId> ids;
      std::vector<BlockView> views;
      std::vector<Status> st;
      const uint32_t asked = acquire_for(c, items, count, &ids, &views, &st);
      if (ClusterNode* cn = cluster_node())
        fetch_missing(cn, cn->request_deadline(), ids, &views, &st);
      std::vector<std::pair<uint32_t, BlockView>> granted;
      granted.reserve(asked);
      uint64_t leased = 0;
      for (uint32_t k = 0; k < count; ++k) {
        pool::LeaseReply r{};
        if (k >= asked) {
          r.code = static_cast<uint32_t>(Code::kBusy);
          put_out(k, r);
          continue;
        }
        r.code = code_of(st[k]);
        if (st[k].ok()) {
          const BlockView& view = views[k];
          if (!in_arena(view)) {
            r.code = static_cast<uint32_t>(Code::kUnavailable);
          } else {
            r.offset = static_cast<uint64_t>(view.data() - arena.base);
            r.size = view.size();
            r.flags = view.is_prefix() ? pool::kPrefix : 0;
            leased += r.size;
            granted.emplace_back(k, std::move(views[k]));
          }
        }
        put_out(k, r);
      }
      leases_granted.fetch_add(granted.size(), std::memory_order_relaxed);
      bytes_leased.fetch_add(leased, std::memory_order_relaxed);
      if (!granted.empty()) {
        PoolClient::Shard& sh = c->shards[channel];
        std::lock_guard<std::mutex> l(sh.mu);
        for (auto& [k, view] : granted) {
          pool::LeaseReply r;
          std::memcpy(&r, out + k * sizeof r, sizeof r);
          r.token = c->token(channel);
          sh.leases.emplace(r.token, std::move(view));
          put_out(k, r);
        }
        c->lease_count.fetch_add(granted.size(), std::memory_order_relaxed);
      }
      break;
    }
    case Op::kRelease: {
      std::vector<BlockView> ended;  // leases end outside the client's lock
      std::vector<MappedLease> ended_mapped;
      ended.reserve(count);
      c->by_shard(count, take_token, [&](PoolClient::Shard* sh, uint32_t k) {
        pool::CodeReply r{static_cast<uint32_t>(Code::kInvalidArgument)};
        if (sh) {
          auto it = sh->leases.find(take_token(k));
          if (it != sh->leases.end()) {
            ended.push_back(std::move(it->second));
            sh->leases.erase(it);
            r.code = 0;
          } else if (auto m = sh->mapped.find(take_token(k)); m != sh->mapped.end()) {
            ended_mapped.push_back(m->second);
            sh->mapped.erase(m);
            r.code = 0;
          }
        }
        put_out(k, r);
      });
      c->lease_count.fetch_sub(ended.size() + ended_mapped.size(), std::memory_order_relaxed);
      if (!ended_mapped.empty())
        if (ClusterNode* cn = cluster_node()) {
          // The client's copies from the owners' arenas failed their checksums.
          if (h.flags & pool::kChecksumFailed) cn->count_checksum_failures(ended_mapped.size());
          cn->release_mapped(ended_mapped);
        }
      break;
    }
    case Op::kLeaseRead: {
      std::vector<BlockId> ids;
      std::vector<BlockView> views;
      std::vector<Status> st;
      const uint32_t asked = acquire_for(c, items, count, &ids, &views, &st);
      // What this server lacks: first from the arenas of members of this
      // host that hold it (the client copies from there), then fetched.
      std::vector<MappedLease> mapped(asked);
      if (ClusterNode* cn = cluster_node()) {
        std::vector<BlockId> missed;
        std::vector<uint32_t> where;
        for (uint32_t k = 0; k < asked; ++k)
          if (st[k].is(Code::kNotFound)) {
            missed.push_back(ids[k]);
            where.push_back(k);
          }
        if (!missed.empty()) {
          // One budget for both: no member call of this request starts
          // after it (calls under way keep their own deadlines).
          const Deadline budget = cn->request_deadline();
          std::vector<MappedLease> got(missed.size());
          cn->lease_mapped(missed, got, budget);
          for (size_t j = 0; j < missed.size(); ++j) {
            if (got[j].arena == 0) continue;
            mapped[where[j]] = got[j];
            st[where[j]] = Status::OK();
          }
          fetch_missing(cn, budget, ids, &views, &st);
        }
      }
      uint32_t granted = 0;
      uint64_t leased = 0;
      std::vector<pool::LeaseReadReply> replies(count);
      {
        PoolClient::Shard& sh = c->shards[channel];
        std::lock_guard<std::mutex> l(sh.mu);
        for (uint32_t k = 0; k < count; ++k) {
          pool::LeaseReadReply& r = replies[k];
          if (k >= asked) {
            r.code = static_cast<uint32_t>(Code::kBusy);
            continue;
          }
          r.code = code_of(st[k]);
          if (!st[k].ok()) continue;
          if (mapped[k].arena != 0) {
            const MappedLease& m = mapped[k];
            r.arena = m.arena;
            r.flags = m.flags;
            r.offset = m.offset;
            r.size = m.size;
            r.checksum = m.checksum;
            r.valid_until_ns = m.valid_until_ns;
            r.token = c->token(channel);
            sh.mapped.emplace(r.token, m);
          } else {
            if (!in_arena(views[k])) {
              r.code = static_cast<uint32_t>(Code::kUnavailable);
              continue;
            }
            r.offset = static_cast<uint64_t>(views[k].data() - arena.base);
            r.size = views[k].size();
            r.flags = views[k].is_prefix() ? pool::kPrefix : 0;
            r.token = c->token(channel);
            sh.leases.emplace(r.token, std::move(views[k]));
          }
          leased += r.size;
          ++granted;
        }
      }
      c->lease_count.fetch_add(granted, std::memory_order_relaxed);
      leases_granted.fetch_add(granted, std::memory_order_relaxed);
      bytes_leased.fetch_add(leased, std::memory_order_relaxed);
      for (uint32_t k = 0; k < count; ++k) put_out(k, replies[k]);
      break;
    }
    case Op::kArena: {
      if (count != 1) return error_reply(reply, Status::InvalidArgument("kArena takes one item"));
      pool::ArenaItem item;
      std::memcpy(&item, items, sizeof item);
      pool::ArenaReply r{};
      ClusterNode* cn = cluster_node();
      Result<MappedArenaFile> f = cn ? cn->mapped_arena(item.index)
                                     : Result<MappedArenaFile>(Status::NotFound("no cluster"));
      r.code = code_of(f.status());
      if (f.ok() && f->path.size() <= pool::kMaxPathBytes) {
        r.path_bytes = static_cast<uint32_t>(f->path.size());
        r.device = f->device;
        r.inode = f->inode;
        r.file_offset = f->file_offset;
        r.bytes = f->bytes;
        std::memcpy(r.path, f->path.data(), f->path.size());
      } else if (f.ok()) {
        r.code = static_cast<uint32_t>(Code::kNotFound);
      }
      std::memcpy(out, &r, sizeof r);
      break;
    }
    case Op::kRemove: {
      std::vector<BlockId> ids(count);
      std::vector<Status> st(count);
      for (uint32_t k = 0; k < count; ++k) {
        ids[k] = c->scoped(items + k * 16);
        st[k] = store->remove(ids[k]);
      }
      // In a cluster the owners, and members that fetched an id, hold
      // copies of their own: they go too, or they would go on serving the
      // bytes the client removed.
      if (ClusterNode* cn = cluster_node()) {
        std::vector<uint8_t> removed(count);
        const Status whole = cn->remove(ids, removed);
        for (uint32_t k = 0; k < count; ++k) {
          if (removed[k] && st[k].is(Code::kNotFound)) st[k] = Status::OK();
          // A member not reached may still serve the id: the client is told.
          if (!whole.ok() && (st[k].ok() || st[k].is(Code::kNotFound))) st[k] = whole;
        }
      }
      for (uint32_t k = 0; k < count; ++k) put_out(k, pool::CodeReply{code_of(st[k])});
      break;
    }
    case Op::kFlush: {
      // What this client committed since its last flush (or every block,
      // when the client asks: it lost a connection whose list went with
      // it); a failed flush keeps it for the next.
      std::vector<BlockId> ids;
      bool everything;
      {
        std::lock_guard<std::mutex> l(c->unflushed_mu);
        ids.assign(c->unflushed.begin(), c->unflushed.end());
        std::unordered_set<BlockId>().swap(c->unflushed);
        everything =
            std::exchange(c->flush_everything, false) || (h.flags & pool::kFlushEverything) != 0;
      }
      Status st = everything ? store->flush() : store->flush(ids);
      if (!st.ok()) {
        if (everything) {
          std::lock_guard<std::mutex> l(c->unflushed_mu);
          c->flush_everything = true;
          std::unordered_set<BlockId>().swap(c->unflushed);
        } else {
          c->committed(std::move(ids));
        }
        return error_reply(reply, st);
      }
      // Blocks of this client's that a restart does not keep: said once (a
      // flush again cannot keep them).
      if (const uint64_t n = everything ? 0 : store->unkept(ids))
        return error_reply(
            reply, Status::NoSpace(std::to_string(n) +
                                   " of the blocks this client stored since "
                                   "its last flush have no slot in the arena's block table "
                                   "(empty, or stored while it was full: shm_table_slots): a "
                                   "restart does not keep them"));
      break;
    }
    case Op::kStats: {
      pool::ServerStatsReply r{};
      {
        std::lock_guard<std::mutex> l(mu);
        r.clients = clients.size();
        for (auto& [id, cl] : clients) {
          r.leases += cl->held_leases();
          r.reservations += cl->held_reservations();
        }
      }
      r.requests = requests.load();
      r.arena_committed = store->shared_arena().committed;
      put_out(0, r);
      reply_count = 1;
      break;
    }
    case Op::kPing: break;
  }
  ReplyHeader rh{};
  rh.count = reply_count;
  std::memcpy(reply, &rh, sizeof rh);
  return static_cast<uint32_t>(sizeof rh + reply_count * pool::reply_item_bytes(op));
}

// ---- observation ---------------------------------------------------------------

PoolServer::Stats PoolServer::stats() const {
  const Impl& s = *impl_;
  Stats out;
  {
    std::lock_guard<std::mutex> l(s.mu);
    out.clients = s.clients.size();
    for (auto& [id, c] : s.clients) {
      out.leases += c->held_leases();
      out.reservations += c->held_reservations();
    }
  }
  out.connections = s.connections.load();
  out.refused = s.refused.load();
  out.disconnects = s.disconnects.load();
  out.requests = s.requests.load();
  out.malformed = s.malformed.load();
  out.doorbell_repairs = s.doorbell_repairs.load();
  out.reclaimed_leases = s.reclaimed_leases.load();
  out.reclaimed_reservations = s.reclaimed_reservations.load();
  out.lookups = s.lookups.load();
  out.lookup_hits = s.lookup_hits.load();
  out.commits = s.commits.load();
  out.bytes_committed = s.bytes_committed.load();
  out.leases_granted = s.leases_granted.load();
  out.bytes_leased = s.bytes_leased.load();
  out.open_seconds = s.open_seconds;
  out.store = s.store->stats();
  return out;
}

std::vector<PoolServer::ClientInfo> PoolServer::clients() const {
  const Impl& s = *impl_;
  std::vector<ClientInfo> out;
  std::lock_guard<std::mutex> l(s.mu);
  for (auto& [id, c] : s.clients) {
    ClientInfo i;
    i.id = c->id;
    i.pid = c->cred.pid;
    i.uid = c->cred.uid;
    i.name_space = c->name_space;
    i.channels = c->nch;
    i.requests = c->requests.load();
    i.leases = c->held_leases();
    i.reservations = c->held_reservations();
    out.push_back(std::move(i));
  }
  return out;
}

}  // namespace cascade
