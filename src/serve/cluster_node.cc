#include "serve/cluster_node.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "cascade/store.h"
#include "os/file_mapping.h"
#include "serve/cluster_wire.h"
#include "transport/transport.h"
#include "util/block_checksum.h"
#include "util/copy_bytes.h"
#include "util/sigbus_guard.h"
#include "util/thread_name.h"
#include "util/thread_pool.h"

namespace cascade {

using namespace std::chrono_literals;
using cluster::Op;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kM1 = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kM2 = 0xBF58476D1CE4E5B9ULL;
constexpr auto kServiceWait = 100ms;  // a service thread's receive, between checks for the end
constexpr auto kSweepEvery = 1s;
// How long a member that left the view is still answered (its holdings
// ended, its connection back kept): one stopped or cut off from the
// coordination service past its lease comes back with the same generation
// and goes on over the links it has, which nothing tells it to renew.
constexpr auto kAbsentMemberKept = 10min;
// The longest a member whose address refuses connections is skipped.
constexpr auto kMaxFailedSkip = 30s;

// The ring position of a block id: a mix of all 128 bits (the membership
// service's ring uses the same function).
uint64_t id_position(const BlockId& id) {
  uint64_t lo, hi;
  std::memcpy(&lo, id.bytes.data(), 8);
  std::memcpy(&hi, id.bytes.data() + 8, 8);
  const uint64_t x = (lo ^ (hi * kM1)) * kM2;
  return x ^ (x >> 31);
}

uint32_t code_of(const Status& st) { return static_cast<uint32_t>(st.code()); }

// Calls to different owners (or lanes) of one request overlap on the
// member's call pool (the caller and up to this many threads more) instead
// of paying their round trips one after another.
constexpr int kCallThreads = 7;
// A fetch is split over lanes only in parts of at least this many blocks.
constexpr size_t kMinBlocksPerLane = 8;

Status status_of(uint32_t code, std::string message) {
  if (code > static_cast<uint32_t>(Code::kNotSupported))
    return Status::Unavailable("a member answered with unknown code " + std::to_string(code));
  return Status(static_cast<Code>(code), std::move(message));
}

template <typename T>
void put_item(std::vector<uint8_t>* out, const T& v) {
  const size_t at = out->size();
  out->resize(at + sizeof v);
  std::memcpy(out->data() + at, &v, sizeof v);
}

template <typename T>
T item_at(const uint8_t* items, size_t k) {
  T v;
  std::memcpy(&v, items + k * sizeof(T), sizeof(T));
  return v;
}

std::vector<uint8_t> error_reply(const Status& st) {
  cluster::ReplyHead h{};
  h.code = code_of(st);
  const std::string msg = st.message().substr(0, cluster::kMaxMessageText);
  h.message_bytes = static_cast<uint32_t>(msg.size());
  std::vector<uint8_t> out(sizeof h + msg.size());
  std::memcpy(out.data(), &h, sizeof h);
  std::memcpy(out.data() + sizeof h, msg.data(), msg.size());
  return out;
}

std::vector<uint8_t> ok_reply(uint32_t count, const std::vector<uint8_t>& items) {
  cluster::ReplyHead h{};
  h.count = count;
  std::vector<uint8_t> out(sizeof h + items.size());
  std::memcpy(out.data(), &h, sizeof h);
  if (!items.empty()) std::memcpy(out.data() + sizeof h, items.data(), items.size());
  return out;
}

}  // namespace

// A member as this node reaches it (the requesting side).
struct Link {
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> arena;
  uint64_t arena_bytes = 0;
  size_t lane = 0;  // the local lane the connection belongs to
  // The member's arena mapped read-only, when it is on this host: leased
  // blocks are copied from it instead of over the transport.
  std::shared_ptr<const ReadOnlyMapping> mapped;
};

struct LinkSlot {
  // One connect at a time, held across its network calls (link_to). The
  // fields are guarded by `mu`, which is never held across a network call,
  // so reading them (a mapping's lookup, stats) never waits for a connect.
  std::mutex connect_mu;
  std::mutex mu;  // guards the fields
  // Bumped whenever the slot's links are dropped (the member's record
  // changed, a call failed, the member left the view, the node closed): a
  // connect that began in an earlier epoch changes nothing in the slot.
  uint64_t epoch = 0;
  uint64_t generation = 0;
  std::vector<uint8_t> address;
  std::vector<std::shared_ptr<Link>> links;  // one per local lane
  // The member's lanes' addresses, from its reply to the first Hello.
  std::vector<std::vector<uint8_t>> lane_addresses;
  Clock::time_point skip_until{};
  // Failures in a row: connects refused (nothing listens there) or timed
  // out, hellos that failed, calls that missed their deadline (a member
  // stopped, or cut off from the others while its lease in the view
  // lives). Each doubles the skip, from retry_after_ms up to kMaxFailedSkip,
  // until the member's record changes or it answers a request: a member
  // that never answers costs a deadline ever more rarely, not every
  // retry_after_ms. A hello answered does not count (hellos have threads
  // of their own, which answer while the member's service threads are
  // stuck). Every refused attempt also costs a socket that UCX 1.13 never
  // closes. Written under mu; read without it by answered().
  std::atomic<uint32_t> failures{0};
  // The member's arena file mapped (same host), from its Hello reply; dropped
  // with its connections, so a member that is gone pins no memory here.
  std::shared_ptr<const ReadOnlyMapping> mapped;
  uint32_t mapped_index = 0;  // a number for this mapping, never reused
  MappedArenaFile mapped_file;
  uint32_t lease_expiry_ms = 0;  // the member's (HostArena)
};

// A member that said Hello (the owning side): what it holds here.
struct PeerState {
  std::string node_id;
  uint64_t generation = 0;
  std::shared_ptr<Peer> back;  // replies go here
  std::mutex mu;               // guards the maps
  struct Lease {
    BlockView view;
    Clock::time_point expires;
  };
  struct Held {
    Reservation r;
    Clock::time_point expires;
  };
  std::unordered_map<uint64_t, Lease> leases;
  std::unordered_map<uint64_t, Held> reservations;
  Clock::time_point since = Clock::now();  // its Hello
  // Guarded by peers_mu: seen in a view of this member with this
  // generation; since when it has been out of the view (zero: in it).
  bool was_member = false;
  Clock::time_point absent_since{};
  // Set by end_peer: a request served concurrently must not add to maps
  // nobody will end again.
  bool ended = false;
};

class ClusterNode::Impl {
 public:
  CascadeStore* store = nullptr;
  SharedArena arena;
  ClusterNodeOptions options;
  // Lanes: transport endpoints with the arena registered on each. A
  // transport moves bytes on the thread that drives it, one operation at a
  // time, so copies between two members spread over the lanes: a thread
  // uses the lane its id hashes to, and a lane talks to the same lane
  // (modulo their count) of the other member.
  struct Lane {
    std::unique_ptr<Transport> t;
    std::unique_ptr<MemoryRegion> region;
  };
  std::vector<Lane> lanes;
  size_t my_lane() const {
    thread_local const size_t h = std::hash<std::thread::id>()(std::this_thread::get_id());
    return h % lanes.size();
  }
  std::atomic<bool> stopping{false};
  std::mutex close_mu;
  bool closed = false;

  // The view, and for each point the member of the next distinct point.
  struct Ring {
    ClusterView view;
    std::vector<uint32_t> second;
    int self = -1;
  };
  mutable std::shared_mutex view_mu;
  std::shared_ptr<const Ring> ring;  // guarded by view_mu

  std::mutex links_mu;
  std::map<std::string, std::shared_ptr<LinkSlot>> links;  // guarded by links_mu

  std::mutex peers_mu;
  // By (node id, generation, the lane its Hello came on).
  using PeerKey = std::tuple<std::string, uint64_t, size_t>;
  std::map<PeerKey, std::shared_ptr<PeerState>> peers;

  // This host's boot id and this arena as a file of it (HostArena), for
  // members on the same host.
  std::string host_boot_id;
  OpenFileIdentity arena_file;
  cluster::HostArena host_arena{};

  std::vector<std::thread> service;
  std::thread pusher;
  // Hellos are answered by threads of their own: answering one connects
  // back to its sender, which can take a whole deadline (a sender that
  // stopped, a host that is gone), and a lane's service thread must not
  // hold the lane's other requests that long.
  static constexpr size_t kHelloThreads = 2;
  static constexpr size_t kMaxHellosWaiting = 256;
  std::mutex hello_mu;
  std::condition_variable hello_cv;
  std::deque<std::pair<size_t, std::vector<uint8_t>>> hellos;  // (lane, message), guarded
  std::vector<std::thread> helloers;
  void hello_loop();
  std::unique_ptr<ThreadPool> calls;  // see kCallThreads
  void for_each_call(size_t n, const std::function<void(size_t)>& fn) {
    if (n == 1) return fn(0);
    calls->parallel_for(n, fn, kCallThreads);
  }
  // Local ranges a failed get may still write (see fetch_from).
  std::mutex quarantine_mu;
  std::vector<Reservation> quarantine;  // guarded by quarantine_mu
  // Reservations of members whose state here ended (end_peer): a put of
  // theirs already under way may still land in the range, so each is held
  // until its own expiry, as a live member's would be, then freed by sweep.
  struct Ending {
    Reservation r;
    Clock::time_point expires;
  };
  std::vector<Ending> ending;  // guarded by quarantine_mu
  // Set once close() has closed the transports: nothing lands any more, and
  // what ends from then on is freed at once. Guarded by quarantine_mu.
  bool transports_closed = false;
  // Reservations taken from their members, held in `ending` until their
  // expiry (still counted in peer_reservations until sweep frees them), or
  // freed at once when the transports are closed (`closed`, or once they
  // are): nothing lands in them any more.
  void hold_until_expiry(std::vector<Ending>&& held, bool closed) {
    if (held.empty()) return;
    std::unique_lock<std::mutex> q(quarantine_mu);
    if (closed || transports_closed) {
      q.unlock();
      peer_reservations.fetch_sub(static_cast<int64_t>(held.size()), std::memory_order_relaxed);
      for (const auto& e : held) store->abort(e.r);
      return;
    }
    ending.insert(ending.end(), held.begin(), held.end());
  }
  std::mutex queue_mu;
  std::condition_variable queue_cv, drained_cv;
  std::deque<BlockId> queue;      // guarded by queue_mu
  uint64_t queued = 0, done = 0;  // ids ever queued and ever finished, guarded by queue_mu
  std::atomic<uint64_t> next_tag{1};
  // Tokens of the leases and reservations granted here, unique across every
  // connection: a release or commit a member sends for a connection that
  // ended (its lane said Hello again) matches nothing the new one holds.
  std::atomic<uint64_t> next_token{1};
  std::atomic<int64_t> last_sweep_ns{0};

  std::atomic<uint64_t> pushed{0}, pushed_bytes{0}, push_dropped{0}, fetched{0}, fetched_bytes{0};
  std::atomic<uint64_t> remote_lookups{0}, remote_hits{0}, served_leases{0}, served_lease_bytes{0};
  std::atomic<uint64_t> remote_removes{0}, remote_removed{0}, served_removes{0};
  std::atomic<uint64_t> remove_incomplete{0};  // removes some member of the view missed
  // Ids a push has taken hold of here, or a fetch is bringing here, and
  // not done with: a remove waits for them. Else a push's commit at the
  // owner could land after the remove there, or a fetch's copy here after
  // the remove here, and store the removed bytes again.
  std::mutex in_flight_mu;
  std::condition_variable in_flight_cv;
  std::unordered_multiset<BlockId> in_flight;  // guarded by in_flight_mu
  // Removes of listed ids, numbered: a fetch listed before a remove of its
  // id does not store its copy. Guarded by in_flight_mu.
  uint64_t remove_seq = 0;
  std::unordered_map<BlockId, uint64_t> removed_at;  // listed ids only
  // Lists ids in in_flight for its lifetime.
  class Listed {
   public:
    Listed(Impl* self, std::vector<BlockId> ids) : self_(self), ids_(std::move(ids)) {
      std::lock_guard<std::mutex> l(self_->in_flight_mu);
      for (const BlockId& id : ids_) self_->in_flight.insert(id);
      seq_ = self_->remove_seq;
    }
    ~Listed() {
      {
        std::lock_guard<std::mutex> l(self_->in_flight_mu);
        for (const BlockId& id : ids_) {
          self_->in_flight.erase(self_->in_flight.find(id));
          if (!self_->in_flight.count(id)) self_->removed_at.erase(id);
        }
      }
      self_->in_flight_cv.notify_all();
    }
    // Whether a remove of id came after this listing.
    bool removed_since(const BlockId& id) const {
      std::lock_guard<std::mutex> l(self_->in_flight_mu);
      auto it = self_->removed_at.find(id);
      return it != self_->removed_at.end() && it->second > seq_;
    }
    Listed(const Listed&) = delete;
    Listed& operator=(const Listed&) = delete;

   private:
    Impl* self_;
    std::vector<BlockId> ids_;
    uint64_t seq_ = 0;
  };
  std::atomic<uint64_t> served_commits{0}, served_commit_bytes{0}, checksum_failures{0},
      timeouts{0}, budget_cuts{0};
  std::atomic<uint64_t> expired{0}, bad_messages{0};
  std::atomic<uint64_t> fetched_mapped{0}, map_failures{0}, lease_hashes{0};
  std::atomic<uint64_t> mapped_leases{0};
  std::atomic<uint32_t> next_mapping{1};
  std::atomic<int64_t> peer_leases{0}, peer_reservations{0};

  Deadline deadline() const {
    return deadline_in(std::chrono::milliseconds(options.request_timeout_ms));
  }
  // Whether a get that failed (missed its deadline) may still write its
  // local buffer: MPI never cancels a one-sided transfer, and a fabric
  // without failure detection does not cancel one to a peer that stopped.
  bool failed_gets_may_land() const {
    return options.transport == TransportBackend::kMpi || options.allow_undetected_failures;
  }
  Deadline request_deadline() const {
    const uint32_t ms =
        options.request_budget_ms != 0 ? options.request_budget_ms : 2 * options.request_timeout_ms;
    return deadline_in(std::chrono::milliseconds(ms));
  }
  // No call starts once its request's budget is spent. A call under way
  // keeps its own deadline: cutting it short would leave what the member
  // granted (leases) held there until their expiry, and would not tell a
  // dead member from a slow one. `calls`: how many calls the caller then
  // does not make (counted in budget_cuts).
  bool budget_spent(Deadline budget, uint64_t calls = 1) {
    if (TransportClock::now() < budget) return false;
    budget_cuts.fetch_add(calls, std::memory_order_relaxed);
    return true;
  }
  // Calls of up to kMaxItems ids that `left` ids take.
  static uint64_t calls_for(size_t left) {
    return (left + cluster::kMaxItems - 1) / cluster::kMaxItems;
  }
  std::shared_ptr<const Ring> current() const {
    std::shared_lock<std::shared_mutex> l(view_mu);
    return ring;
  }
  uint64_t checksum(const void* p, uint64_t n) const {
    return options.verify ? block_checksum(p, n) : 0;
  }

  // Checksums of blocks held here, remembered from the first lease that
  // computed them over the bytes held, or from a member's commit whose bytes
  // are the ones the store holds (when another put of the id won, the bytes
  // held are that put's), so a block read by many members is hashed at most
  // once. Each is remembered with where the bytes lie and is used only for a
  // block at that place; an id stored here again (committed by a client,
  // fetched) is forgotten, since its bytes may differ.
  static constexpr size_t kMaxSums = size_t(1) << 20;
  struct Sum {
    const uint8_t* data;
    uint64_t size;
    uint64_t sum;
  };
  std::mutex sums_mu;
  std::unordered_map<BlockId, Sum> sums;  // guarded by sums_mu
  void remember(const BlockId& id, const uint8_t* data, uint64_t size, uint64_t sum) {
    if (sum == 0) return;
    std::lock_guard<std::mutex> l(sums_mu);
    if (sums.size() >= kMaxSums) sums.clear();
    sums[id] = Sum{data, size, sum};
  }
  void forget(std::span<const BlockId> ids) {
    std::lock_guard<std::mutex> l(sums_mu);
    if (sums.empty()) return;
    for (const BlockId& id : ids) sums.erase(id);
  }
  uint64_t sum_of(const BlockId& id, const uint8_t* p, uint64_t n) {
    if (!options.verify) return 0;
    {
      std::lock_guard<std::mutex> l(sums_mu);
      auto it = sums.find(id);
      if (it != sums.end() && it->second.data == p && it->second.size == n) return it->second.sum;
    }
    const uint64_t sum = block_checksum(p, n);
    lease_hashes.fetch_add(1, std::memory_order_relaxed);
    remember(id, p, n, sum);
    return sum;
  }

  // ---- placement --------------------------------------------------------------
  // The members holding id, best first, this member excluded.
  void owners_of(const Ring& r, const BlockId& id, uint32_t out[2], int* n) const {
    *n = 0;
    const auto& pos = r.view.positions;
    if (pos.empty()) return;
    size_t i = std::lower_bound(pos.begin(), pos.end(), id_position(id)) - pos.begin();
    if (i == pos.size()) i = 0;
    const uint32_t first = r.view.owners[i];
    if (static_cast<int>(first) != r.self) out[(*n)++] = first;
    if (r.view.replicas >= 2) {
      const uint32_t second = r.second[i];
      if (second != first && static_cast<int>(second) != r.self) out[(*n)++] = second;
    }
  }

  // The ids not yet done, grouped by the member to ask in this round: round
  // 0 asks each id's first owner, round 1 its second (replicas 2).
  using Groups = std::vector<std::pair<uint32_t, std::vector<size_t>>>;
  template <typename Done>
  Groups owners_in_round(const Ring& r, std::span<const BlockId> ids, int round,
                         Done&& done) const {
    std::map<uint32_t, std::vector<size_t>> by_member;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (done(i)) continue;
      uint32_t o[2];
      int n;
      owners_of(r, ids[i], o, &n);
      if (round < n) by_member[o[round]].push_back(i);
    }
    return Groups(std::make_move_iterator(by_member.begin()),
                  std::make_move_iterator(by_member.end()));
  }

  // ---- the requesting side ------------------------------------------------------
  std::shared_ptr<LinkSlot> slot_of(const ClusterMember& m) {
    std::shared_ptr<LinkSlot> s;
    {
      // links_mu is not held while waiting for the slot: a connect to one
      // member (which holds its slot) does not stall calls to the others.
      std::lock_guard<std::mutex> l(links_mu);
      auto& slot = links[m.node_id];
      if (!slot) slot = std::make_shared<LinkSlot>();
      s = slot;
    }
    std::vector<std::shared_ptr<Peer>> closing;
    {
      std::lock_guard<std::mutex> sl(s->mu);
      if (s->links.size() != lanes.size()) s->links.resize(lanes.size());
      if (s->generation != m.generation || s->address != m.address) {
        closing = drop_links(*s);
        s->generation = m.generation;
        s->address = m.address;
        s->skip_until = {};
        s->failures = 0;
      }
    }
    for (auto& p : closing) p->close();  // outside mu: a close may drive the transport a while
    return s;
  }

  // Drops every link of the slot and its mapping, and starts a new epoch;
  // the peers to close (after mu is let go). REQUIRES: s.mu held.
  static std::vector<std::shared_ptr<Peer>> drop_links(LinkSlot& s) {
    std::vector<std::shared_ptr<Peer>> peers;
    for (auto& link : s.links) {
      if (link) peers.push_back(link->peer);
      link.reset();
    }
    s.lane_addresses.clear();
    s.mapped.reset();
    ++s.epoch;
    return peers;
  }

  // One more failure in a row for the slot: skipped twice as long as after
  // the last. REQUIRES: s.mu held.
  void back_off(LinkSlot& s) const {
    const uint32_t failures = std::min<uint32_t>(s.failures.load() + 1, 16);
    s.failures.store(failures);
    const auto skip = std::min<Clock::duration>(
        std::chrono::milliseconds(options.retry_after_ms) * (uint64_t{1} << (failures - 1)),
        kMaxFailedSkip);
    // At least a deadline: a member that just cost one is not asked again
    // sooner (the requests of one client batch would each wait for it).
    s.skip_until =
        Clock::now() +
        std::max<Clock::duration>(skip, std::chrono::milliseconds(std::max(
                                            options.retry_after_ms, options.request_timeout_ms)));
  }

  // A call the member answered: its failures in a row end.
  static void answered(LinkSlot& s) {
    if (s.failures.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> l(s.mu);
      s.failures.store(0);
    }
  }

  // A failed call on `link`: every lane's connection to the member is
  // dropped (the member is likely gone), and it is skipped for a while.
  void fail(const std::shared_ptr<LinkSlot>& s, const std::shared_ptr<Link>& link) {
    timeouts.fetch_add(1, std::memory_order_relaxed);
    std::vector<std::shared_ptr<Peer>> closing;
    {
      std::lock_guard<std::mutex> l(s->mu);
      if (link && link->lane < s->links.size() && s->links[link->lane] == link) {
        closing = drop_links(*s);
        back_off(*s);
      }
    }
    for (auto& p : closing) p->close();
  }

  std::vector<uint8_t> request(Op op, uint32_t count, uint64_t reply_tag, size_t lane) const {
    cluster::RequestHead h{};
    h.magic = cluster::kMagic;
    h.version = cluster::kVersion;
    h.op = static_cast<uint32_t>(op);
    h.count = count;
    h.reply_tag = reply_tag;
    h.generation = options.generation;
    h.node_id_bytes = static_cast<uint32_t>(options.node_id.size());
    h.lane = static_cast<uint32_t>(lane);
    std::memcpy(h.node_id, options.node_id.data(), options.node_id.size());
    std::vector<uint8_t> out(sizeof h);
    std::memcpy(out.data(), &h, sizeof h);
    return out;
  }

  // Sends op with `items` and returns the reply's items (count of them, as
  // the op's reply type), or the error the owner answered.
  Result<std::vector<uint8_t>> call(const Link& link, Op op, uint32_t count,
                                    const std::vector<uint8_t>& items, Deadline until) {
    return call(link.lane, *link.peer, op, count, items, until);
  }
  Result<std::vector<uint8_t>> call(size_t lane, Peer& peer, Op op, uint32_t count,
                                    const std::vector<uint8_t>& items, Deadline until) {
    const bool wants_reply = op != Op::kRelease && op != Op::kAbort;
    const uint64_t tag =
        wants_reply ? (cluster::kReplyTagBit | next_tag.fetch_add(1, std::memory_order_relaxed))
                    : 0;
    std::vector<uint8_t> msg = request(op, count, tag, lane);
    msg.insert(msg.end(), items.begin(), items.end());
    Status st = peer.send(cluster::kRequestTag, msg, until);
    if (!st.ok()) {
      // A send that missed its deadline may still reach the member, which
      // then answers: its reply is dropped when it comes.
      if (wants_reply && st.is(Code::kUnavailable)) lanes[lane].t->discard(tag);
      return st;
    }
    if (!wants_reply) return std::vector<uint8_t>{};
    auto got = lanes[lane].t->receive(tag, cluster::kMaxReplyBytes, until);
    if (!got.ok()) {
      // The member may still answer: its reply is taken and dropped when it
      // comes instead of waiting in the transport for good.
      if (got.status().is(Code::kUnavailable)) lanes[lane].t->discard(tag);
      return got.status();
    }
    const std::vector<uint8_t>& r = *got;
    cluster::ReplyHead h{};
    if (r.size() < sizeof h) {
      bad_messages.fetch_add(1, std::memory_order_relaxed);
      return Status::Unavailable("a member sent a reply shorter than its header");
    }
    std::memcpy(&h, r.data(), sizeof h);
    if (h.code != 0) {
      const size_t n = std::min<size_t>(h.message_bytes, r.size() - sizeof h);
      return status_of(h.code, std::string(reinterpret_cast<const char*>(r.data()) + sizeof h, n));
    }
    const uint64_t want = op == Op::kHello ? 0 : reply_item_bytes(op) * uint64_t(count);
    if (h.count != (op == Op::kHello ? h.count : count) || r.size() < sizeof h + want) {
      bad_messages.fetch_add(1, std::memory_order_relaxed);
      return Status::Unavailable("a member sent a reply of the wrong length");
    }
    return std::vector<uint8_t>(r.begin() + sizeof h, r.end());
  }

  // The connection to member m on this thread's lane, made (with its
  // Hello) when there is none. Connecting, with the one or two Hellos it
  // takes, ends by `until`: the deadline of the call the link is for.
  // A member that failed recently is skipped (Unavailable at once) unless
  // `even_if_failed` (a remove, which must reach every copy it can).
  Result<std::shared_ptr<Link>> link_to(const std::shared_ptr<LinkSlot>& s, const ClusterMember& m,
                                        Deadline until, bool even_if_failed = false) {
    return link_to(s, m, my_lane(), until, even_if_failed);
  }
  Result<std::shared_ptr<Link>> link_to(const std::shared_ptr<LinkSlot>& s, const ClusterMember& m,
                                        size_t lane, Deadline until, bool even_if_failed = false) {
    std::lock_guard<std::mutex> c(s->connect_mu);
    std::vector<uint8_t> address;
    std::shared_ptr<Peer> stale;
    uint64_t epoch;
    {
      std::lock_guard<std::mutex> l(s->mu);
      if (s->links[lane] && s->links[lane]->peer->health().ok()) return s->links[lane];
      if (s->links[lane]) {
        stale = s->links[lane]->peer;
        s->links[lane].reset();
      }
      epoch = s->epoch;
      if (!s->lane_addresses.empty()) address = s->lane_addresses[lane % s->lane_addresses.size()];
    }
    if (stale) stale->close();
    {
      std::lock_guard<std::mutex> l(s->mu);
      if (!even_if_failed && Clock::now() < s->skip_until)
        return Status::Unavailable("member " + m.node_id + " failed recently; skipped for now");
    }
    if (m.address.empty())
      return Status::Unavailable("member " + m.node_id + " publishes no transport address");
    if (!address.empty()) return connect_lane(s, m, lane, address, epoch, until);
    // The member's lane addresses come with the reply to a Hello on its
    // published address (its lane 0).
    auto first = connect_lane(s, m, lane, m.address, epoch, until);
    if (!first.ok()) return first.status();
    {
      std::lock_guard<std::mutex> l(s->mu);
      if (s->links[lane] == first.value()) return first;
      if (s->epoch != epoch || s->lane_addresses.empty()) address.clear();
      else address = s->lane_addresses[lane % s->lane_addresses.size()];
    }
    // The connection served to learn the member's lanes; this lane talks to
    // another of them.
    first.value()->peer->close();
    if (address.empty())
      return Status::Unavailable("member " + m.node_id + " changed while connecting");
    return connect_lane(s, m, lane, address, epoch, until);
  }

  // Connects local lane `lane` to `address` (one of m's lanes) and says
  // Hello, by `until`. The link is installed in s when it is the one this
  // lane uses (the lane it talks to is `address`) and s is still in
  // `epoch`; otherwise it is returned uninstalled (or closed, when the
  // epoch ended). Nothing in s changes once its epoch has ended.
  // REQUIRES: s->connect_mu held, s->mu not.
  Result<std::shared_ptr<Link>> connect_lane(const std::shared_ptr<LinkSlot>& s,
                                             const ClusterMember& m, size_t lane,
                                             const std::vector<uint8_t>& address, uint64_t epoch,
                                             Deadline until) {
    auto fail_now = [&](const Status& st) -> Status {
      timeouts.fetch_add(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> l(s->mu);
      if (s->epoch == epoch) back_off(*s);
      return st;
    };
    Transport& t = *lanes[lane].t;
    auto peer = t.connect(address, until);
    if (!peer.ok()) return fail_now(peer.status());
    const std::vector<uint8_t>& mine = t.address();
    auto reply = call(lane, **peer, Op::kHello, static_cast<uint32_t>(mine.size()), mine, until);
    if (!reply.ok()) {
      (*peer)->close();
      return fail_now(reply.status());
    }
    auto bad = [&](const std::string& why) -> Status {
      (*peer)->close();
      bad_messages.fetch_add(1, std::memory_order_relaxed);
      return fail_now(Status::Unavailable("member " + m.node_id + " " + why));
    };
    cluster::HelloReply hr{};
    if (reply->size() < sizeof hr) return bad("sent a short hello reply");
    std::memcpy(&hr, reply->data(), sizeof hr);
    if (hr.generation != m.generation) {
      (*peer)->close();
      return fail_now(Status::Unavailable("member " + m.node_id +
                                          " answered with another generation than its record's"));
    }
    if (hr.key_bytes > reply->size() - sizeof hr || hr.lanes == 0 || hr.lanes > cluster::kMaxLanes)
      return bad("sent a malformed hello reply");
    // The member's lanes: u32 length and the address bytes, each.
    std::vector<std::vector<uint8_t>> addresses;
    size_t at = sizeof hr + hr.key_bytes;
    for (uint32_t k = 0; k < hr.lanes; ++k) {
      uint32_t n;
      if (reply->size() - at < sizeof n) return bad("sent a truncated lane list");
      std::memcpy(&n, reply->data() + at, sizeof n);
      at += sizeof n;
      if (n == 0 || n > cluster::kMaxAddressBytes || reply->size() - at < n)
        return bad("sent a truncated lane list");
      addresses.emplace_back(reply->data() + at, reply->data() + at + n);
      at += n;
    }
    // Where its arena is as a file of its host.
    cluster::HostArena ha{};
    if (reply->size() - at < sizeof ha) return bad("sent no arena file description");
    std::memcpy(&ha, reply->data() + at, sizeof ha);
    at += sizeof ha;
    if (ha.path_bytes > cluster::kMaxPathBytes || reply->size() - at < ha.path_bytes)
      return bad("sent a truncated arena path");
    const std::string arena_path(reinterpret_cast<const char*>(reply->data()) + at, ha.path_bytes);
    auto key =
        (*peer)->import_key(std::span<const uint8_t>(reply->data() + sizeof hr, hr.key_bytes));
    if (!key.ok()) {
      (*peer)->close();
      return fail_now(key.status());
    }
    bool want_mapping;
    {
      std::lock_guard<std::mutex> l(s->mu);
      want_mapping = !s->mapped;
    }
    std::shared_ptr<const ReadOnlyMapping> mapping;
    if (want_mapping && options.map_same_host && !host_boot_id.empty() && !arena_path.empty() &&
        std::string(ha.boot_id, strnlen(ha.boot_id, sizeof ha.boot_id)) == host_boot_id) {
      // On this host: map its arena, or go on over the transport when that
      // fails (another mount namespace, another user, a file replaced).
      auto mapped =
          map_file_read_only(arena_path, ha.device, ha.inode, ha.file_offset, hr.arena_bytes);
      if (mapped.ok()) mapping = std::move(mapped.value());
      else map_failures.fetch_add(1, std::memory_order_relaxed);
    }
    auto link = std::make_shared<Link>();
    link->peer = std::move(peer.value());
    link->arena = std::move(key.value());
    link->arena_bytes = hr.arena_bytes;
    link->lane = lane;
    std::unique_lock<std::mutex> l(s->mu);
    if (s->epoch != epoch) {
      // The slot's links were dropped while this connect went on (the
      // member's record changed, a call failed, it left the view).
      l.unlock();
      link->peer->close();
      return Status::Unavailable("member " + m.node_id + " changed while connecting");
    }
    if (s->lane_addresses.empty()) s->lane_addresses = std::move(addresses);
    if (!s->mapped && mapping) {
      s->mapped = std::move(mapping);
      s->mapped_index = next_mapping.fetch_add(1, std::memory_order_relaxed);
      s->mapped_file =
          MappedArenaFile{arena_path, ha.device, ha.inode, ha.file_offset, hr.arena_bytes};
      s->lease_expiry_ms = ha.lease_expiry_ms;
    }
    link->mapped = s->mapped;
    const size_t want = lane % s->lane_addresses.size();
    if (want == 0 || s->lane_addresses[want] == address) s->links[lane] = link;
    return link;
  }

  // `budget`: the end of the request's budget for member calls.
  void lookup(std::span<const BlockId> ids, std::span<uint8_t> found, std::span<uint64_t> sizes,
              Deadline budget);
  void fetch(std::span<const BlockId> ids, std::span<uint8_t> got, Deadline budget);
  Status remove(std::span<const BlockId> ids, std::span<uint8_t> removed, Deadline budget);
  // The owner's side of a remove: reservations members hold for the ids
  // (pushes under way) end, so their commits store nothing; commits under
  // way end (within `until`); then the store's copies go. removed[i] set
  // where one did.
  void remove_here(std::span<const BlockId> ids, std::span<uint8_t> removed, Deadline until);
  // Calls `m` with `op` for ids[which[j]], j in order, in batches of up to
  // kMaxItems ids, each batch only while the request's `budget` lasts; the
  // connect and the first batch share one deadline. `ready` runs once the
  // link is up (false: no call is made). `take(link, b, e, reply, sent)`
  // reads the reply to the batch of which[b..e), sent at `sent`. A call that
  // fails ends the batches (the member is then skipped). `asked` counts the
  // ids sent. True when every batch was answered. `even_if_failed`: a
  // member in its skip period after a failure is called too.
  using LinkReady = std::function<bool(LinkSlot&, const Link&)>;
  using TakeReply = std::function<void(const Link&, size_t, size_t, const std::vector<uint8_t>&,
                                       Clock::time_point)>;
  bool call_in_batches(const ClusterMember& m, Op op, std::span<const BlockId> ids,
                       std::span<const size_t> which, Deadline budget, std::atomic<uint64_t>* asked,
                       const LinkReady& ready, const TakeReply& take, bool even_if_failed = false);
  // Waits (until `until`) for the ids in in_flight; true when there were.
  bool wait_not_in_flight(std::span<const BlockId> ids, Deadline until);
  void lease_mapped(std::span<const BlockId> ids, std::span<MappedLease> out, Deadline budget);
  void release_mapped(std::span<const MappedLease> leases);
  // The slot whose current mapping has this index, or null.
  std::shared_ptr<LinkSlot> slot_of_mapping(uint32_t index) {
    std::vector<std::shared_ptr<LinkSlot>> all;
    {
      std::lock_guard<std::mutex> l(links_mu);
      for (auto& [id, slot] : links) all.push_back(slot);
    }
    for (auto& slot : all) {
      std::lock_guard<std::mutex> sl(slot->mu);
      if (slot->mapped && slot->mapped_index == index) return slot;
    }
    return nullptr;
  }
  void fetch_from(const ClusterMember& m, size_t lane, std::span<const BlockId> ids,
                  const std::vector<size_t>& which, std::span<uint8_t> got, Deadline budget);
  void push_loop();
  void push_to(const ClusterMember& m, size_t lane, const std::vector<BlockId>& ids);

  // ---- the owning side -------------------------------------------------------
  void service_loop(size_t index);
  void serve(size_t lane, std::vector<uint8_t>&& msg);
  std::vector<uint8_t> serve_hello(size_t lane, const cluster::RequestHead& h,
                                   const std::string& node_id, std::span<const uint8_t> address,
                                   std::shared_ptr<Peer>* back);
  std::vector<uint8_t> serve_items(PeerState& p, Op op, uint32_t count, const uint8_t* items);
  void end_peer(PeerState& p, bool closed = false) { end_holdings(p, closed, /*for_good=*/true); }
  // Ends the leases and reservations a member holds here; for good: its
  // state too (requests that were under way add nothing) and its
  // connection back.
  void end_holdings(PeerState& p, bool closed, bool for_good);
  // A member that left the view: what it holds ends, and it is still
  // answered over its connection for kAbsentMemberKept. REQUIRES: peers_mu.
  void mark_absent(PeerState& p, Clock::time_point now,
                   std::vector<std::shared_ptr<PeerState>>* to_end,
                   const std::shared_ptr<PeerState>& ref) {
    if (p.absent_since != Clock::time_point{}) return;
    p.absent_since = now;
    to_end->push_back(ref);
  }
  void sweep();
};

// ---- lookups and fetches -----------------------------------------------------

bool ClusterNode::Impl::call_in_batches(const ClusterMember& m, Op op, std::span<const BlockId> ids,
                                        std::span<const size_t> which, Deadline budget,
                                        std::atomic<uint64_t>* asked, const LinkReady& ready,
                                        const TakeReply& take, bool even_if_failed) {
  if (budget_spent(budget, calls_for(which.size()))) return false;
  // A connect and the first batch share one deadline, which runs while
  // another thread holds the slot too.
  const Deadline first = deadline();
  auto s = slot_of(m);
  auto link = link_to(s, m, first, even_if_failed);
  if (!link.ok() || (ready && !ready(*s, **link))) return false;
  for (size_t b = 0; b < which.size(); b += cluster::kMaxItems) {
    // Also after the connect, which may have waited for another's.
    if (budget_spent(budget, calls_for(which.size() - b))) return false;
    const size_t e = std::min(which.size(), b + cluster::kMaxItems);
    std::vector<uint8_t> items;
    items.reserve((e - b) * 16);
    for (size_t j = b; j < e; ++j) put_item(&items, ids[which[j]].bytes);
    if (asked) asked->fetch_add(e - b, std::memory_order_relaxed);
    const Clock::time_point sent = Clock::now();
    auto reply = call(**link, op, static_cast<uint32_t>(e - b), items, b == 0 ? first : deadline());
    if (!reply.ok()) {
      fail(s, *link);
      return false;
    }
    answered(*s);
    take(**link, b, e, *reply, sent);
  }
  return true;
}

void ClusterNode::Impl::lookup(std::span<const BlockId> ids, std::span<uint8_t> found,
                               std::span<uint64_t> sizes, Deadline budget) {
  auto r = current();
  if (!r || r->view.members.empty()) return;
  // Round 0 asks the first owner, round 1 the second of what is still missing.
  for (int round = 0; round < 2; ++round) {
    const Groups groups = owners_in_round(*r, ids, round, [&](size_t i) { return found[i] != 0; });
    if (groups.empty()) return;
    for_each_call(groups.size(), [&](size_t g) {
      const auto& [mi, which] = groups[g];
      call_in_batches(r->view.members[mi], Op::kLookup, ids, which, budget, &remote_lookups,
                      nullptr,
                      [&](const Link&, size_t b, size_t e, const std::vector<uint8_t>& reply,
                          Clock::time_point) {
                        for (size_t j = b; j < e; ++j) {
                          auto lr = item_at<cluster::LookupReply>(reply.data(), j - b);
                          if (lr.code != 0) continue;
                          found[which[j]] = 1;
                          sizes[which[j]] = lr.size;
                          remote_hits.fetch_add(1, std::memory_order_relaxed);
                        }
                      });
    });
  }
}

Status ClusterNode::Impl::remove(std::span<const BlockId> ids, std::span<uint8_t> removed,
                                 Deadline budget) {
  auto r = current();
  if (!r || ids.empty()) return Status::OK();
  // This member's pushes of the ids that took hold of the bytes before the
  // caller removed them here, its fetches of them and commits of members'
  // pushes of them end first (within the budget), and what they stored
  // here goes; so do reservations members hold here for them.
  remove_here(ids, removed, std::min(budget, deadline()));
  // Every member but this one: a copy may be at an owner, at the second
  // owner, or at any member that fetched the block for its clients.
  std::vector<size_t> others;
  for (size_t mi = 0; mi < r->view.members.size(); ++mi)
    if (static_cast<int>(mi) != r->self) others.push_back(mi);
  const Status partial = Status::Unavailable(
      "removed here, but this server's view of the cluster is partial (cut off "
      "from the coordination service, or not registered yet): members it "
      "cannot see may keep a copy and serve it; remove again later");
  if (others.empty()) return r->view.partial ? partial : Status::OK();
  std::vector<size_t> every(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) every[i] = i;
  std::vector<std::vector<uint8_t>> held(others.size(), std::vector<uint8_t>(ids.size()));
  std::vector<uint8_t> reached(others.size());
  for_each_call(others.size(), [&](size_t g) {
    reached[g] = call_in_batches(
        r->view.members[others[g]], Op::kRemove, ids, every, budget, &remote_removes, nullptr,
        [&](const Link&, size_t b, size_t e, const std::vector<uint8_t>& reply, Clock::time_point) {
          for (size_t j = b; j < e; ++j)
            held[g][j] = item_at<cluster::CodeReply>(reply.data(), j - b).code == 0;
        },
        /*even_if_failed=*/true);
  });
  for (const auto& h : held)
    for (size_t i = 0; i < ids.size(); ++i)
      if (h[i]) {
        removed[i] = 1;
        remote_removed.fetch_add(1, std::memory_order_relaxed);
      }
  std::string missed;
  size_t n_missed = 0;
  for (size_t g = 0; g < others.size(); ++g) {
    if (reached[g]) continue;
    if (n_missed++ < 4) missed += (missed.empty() ? "" : ", ") + r->view.members[others[g]].node_id;
  }
  if (n_missed == 0) return r->view.partial ? partial : Status::OK();
  remove_incomplete.fetch_add(1, std::memory_order_relaxed);
  return Status::Unavailable(
      "removed here and at the members that answered, but " + std::to_string(n_missed) + " of " +
      std::to_string(others.size()) + " other members did not answer in time (" + missed +
      (n_missed > 4 ? ", ..." : "") + "): they may keep a copy and serve it; remove again later");
}

bool ClusterNode::Impl::wait_not_in_flight(std::span<const BlockId> ids, Deadline until) {
  std::unique_lock<std::mutex> l(in_flight_mu);
  ++remove_seq;
  for (const BlockId& id : ids)
    if (in_flight.count(id)) removed_at[id] = remove_seq;
  bool waited = false;
  (void)in_flight_cv.wait_until(l, until, [&] {
    for (const BlockId& id : ids)
      if (in_flight.count(id)) {
        waited = true;
        return false;
      }
    return true;
  });
  return waited;
}

void ClusterNode::Impl::remove_here(std::span<const BlockId> ids, std::span<uint8_t> removed,
                                    Deadline until) {
  const std::unordered_set<BlockId> gone(ids.begin(), ids.end());
  std::vector<std::shared_ptr<PeerState>> all;
  {
    std::lock_guard<std::mutex> l(peers_mu);
    for (const auto& [key, p] : peers) all.push_back(p);
  }
  std::vector<Ending> cancelled;
  for (auto& p : all) {
    std::lock_guard<std::mutex> l(p->mu);
    for (auto it = p->reservations.begin(); it != p->reservations.end();) {
      if (gone.count(it->second.r.id)) {
        // The member may still be writing the range: held until its expiry.
        cancelled.push_back(Ending{it->second.r, it->second.expires});
        it = p->reservations.erase(it);
      } else {
        ++it;
      }
    }
  }
  hold_until_expiry(std::move(cancelled), /*closed=*/false);
  (void)wait_not_in_flight(ids, until);
  for (size_t i = 0; i < ids.size(); ++i)
    if (store->remove(ids[i]).ok()) removed[i] = 1;
}

void ClusterNode::Impl::fetch(std::span<const BlockId> ids, std::span<uint8_t> got,
                              Deadline budget) {
  auto r = current();
  if (!r || r->view.members.empty()) return;
  for (int round = 0; round < 2; ++round) {
    const Groups by_member = owners_in_round(*r, ids, round, [&](size_t i) { return got[i] != 0; });
    if (by_member.empty()) return;
    // Each owner's ids in parts, the parts on different lanes at once: one
    // lane moves bytes on one thread, so a large fetch spreads over them.
    struct Part {
      uint32_t member;
      size_t lane;
      std::vector<size_t> which;
    };
    std::vector<Part> parts;
    const size_t first_lane = my_lane();
    for (auto& [mi, which] : by_member) {
      const size_t n = which.size();
      // A member whose arena is mapped here needs no lanes: one lease call
      // per request's worth of ids, the copies spread over the call pool.
      bool mapped;
      {
        auto s = slot_of(r->view.members[mi]);
        std::lock_guard<std::mutex> l(s->mu);
        mapped = s->mapped != nullptr;
      }
      const size_t pieces = std::max((n + cluster::kMaxItems - 1) / cluster::kMaxItems,
                                     mapped ? 1 : std::min(lanes.size(), n / kMinBlocksPerLane));
      const size_t step = (n + std::max<size_t>(pieces, 1) - 1) / std::max<size_t>(pieces, 1);
      for (size_t b = 0, k = 0; b < n; b += step, ++k)
        parts.push_back(
            Part{mi, (first_lane + k) % lanes.size(),
                 std::vector<size_t>(which.begin() + b, which.begin() + std::min(n, b + step))});
    }
    for_each_call(parts.size(), [&](size_t k) {
      fetch_from(r->view.members[parts[k].member], parts[k].lane, ids, parts[k].which, got, budget);
    });
  }
}

void ClusterNode::Impl::fetch_from(const ClusterMember& m, size_t lane,
                                   std::span<const BlockId> ids, const std::vector<size_t>& which,
                                   std::span<uint8_t> got, Deadline budget) {
  if (budget_spent(budget)) return;
  // Listed from before the owner is asked until the copies are committed
  // here (or given up): a remove of an id meanwhile waits for it, and its
  // copy is not committed.
  std::vector<BlockId> fetching;
  fetching.reserve(which.size());
  for (size_t i : which) fetching.push_back(ids[i]);
  const Listed listed(this, std::move(fetching));
  const Deadline until = deadline();  // the connect's and the lease's
  auto s = slot_of(m);
  auto link = link_to(s, m, lane, until);
  if (!link.ok() || budget_spent(budget)) return;
  Peer& peer = *(*link)->peer;
  const Link& ln = **link;
  std::vector<uint8_t> items;
  items.reserve(which.size() * 16);
  for (size_t i : which) put_item(&items, ids[i].bytes);
  // The owner grants the leases after this, and keeps them at least three
  // deadlines (lease_expiry_ms): a copy from its mapped arena that ends by
  // this call's deadline read ranges that were leased all along.
  const Deadline leased_until = until;
  auto reply = call(ln, Op::kLease, static_cast<uint32_t>(which.size()), items, leased_until);
  if (!reply.ok()) {
    fail(s, *link);
    return;
  }
  answered(*s);
  // What the owner leased us: reserve room here for it.
  std::vector<size_t> leased;     // positions in `which`
  std::vector<uint64_t> refused;  // tokens of leases outside the owner's arena
  std::vector<cluster::LeaseReply> lr(which.size());
  for (size_t j = 0; j < which.size(); ++j) {
    lr[j] = item_at<cluster::LeaseReply>(reply->data(), j);
    if (lr[j].code != 0) continue;
    if (lr[j].size > (*link)->arena_bytes || lr[j].offset > (*link)->arena_bytes - lr[j].size) {
      bad_messages.fetch_add(1, std::memory_order_relaxed);
      refused.push_back(lr[j].token);
      continue;
    }
    leased.push_back(j);
  }
  std::vector<uint8_t> releases;
  auto release_all = [&] {
    releases.clear();
    for (size_t j : leased) put_item(&releases, cluster::TokenItem{lr[j].token});
    for (uint64_t t : refused) put_item(&releases, cluster::TokenItem{t});
    const size_t n = leased.size() + refused.size();
    if (n > 0) (void)call(ln, Op::kRelease, static_cast<uint32_t>(n), releases, deadline());
  };
  if (leased.empty()) {
    release_all();
    return;
  }
  std::vector<BlockId> want;
  std::vector<uint64_t> sizes;
  for (size_t j : leased) {
    want.push_back(ids[which[j]]);
    sizes.push_back(lr[j].size);
  }
  // Prefix and ordinary blocks are reserved in separate calls (the flag
  // is an option of a batch).
  std::vector<Reservation> res(leased.size());
  std::vector<Status> rst(leased.size(), Status::Unavailable("not reserved"));
  for (int prefix = 0; prefix < 2; ++prefix) {
    std::vector<size_t> ks;
    for (size_t k = 0; k < leased.size(); ++k)
      if (((lr[leased[k]].flags & pool::kPrefix) != 0) == (prefix == 1)) ks.push_back(k);
    if (ks.empty()) continue;
    std::vector<BlockId> some_ids;
    std::vector<uint64_t> some_sizes;
    for (size_t k : ks) {
      some_ids.push_back(want[k]);
      some_sizes.push_back(sizes[k]);
    }
    PutOptions o;
    o.origin = PutOrigin::kPromotion;
    o.is_prefix = prefix == 1;
    std::vector<Reservation> r;
    std::vector<Status> st;
    store->reserve_batch(some_ids, some_sizes, o, &r, &st);
    for (size_t j = 0; j < ks.size(); ++j) {
      res[ks[j]] = r[j];
      rst[ks[j]] = st[j];
    }
  }
  std::vector<TransferOp> ops;
  std::vector<size_t> moving;  // positions in `leased`
  for (size_t k = 0; k < leased.size(); ++k) {
    if (!rst[k].ok()) continue;
    if (res[k].present) {
      got[which[leased[k]]] = 1;
      continue;
    }
    const cluster::LeaseReply& l = lr[leased[k]];
    ops.push_back(TransferOp{TransferKind::kGet, (*link)->arena.get(), l.offset,
                             arena.base + res[k].offset, l.size});
    moving.push_back(k);
  }
  // Checksums of the bytes as copied (mapped arena), by position in `leased`.
  std::vector<uint64_t> sums;
  Status st = Status::OK();
  if (ln.mapped && !moving.empty()) {
    // Same host: one pass from the owner's arena into the reserved ranges,
    // the checksum computed on the way.
    sums.assign(leased.size(), 0);
    // The member's file cut short under the mapping (by its owner's user,
    // or root) faults the copy, not this process.
    std::atomic<bool> cut_short{false};
    auto copy_one = [&](size_t j) {
      const size_t k = moving[j];
      const cluster::LeaseReply& l = lr[leased[k]];
      const uint8_t* from = ln.mapped->data() + l.offset;
      uint8_t* to = arena.base + res[k].offset;
      const bool whole = options.verify
                             ? copy_out_of_mapping_with_checksum(to, from, l.size, &sums[k])
                             : copy_out_of_mapping(to, from, l.size);
      if (!whole) cut_short.store(true, std::memory_order_relaxed);
    };
    // Over the call pool (parallel_for may run inside one of its jobs).
    calls->parallel_for(moving.size(), copy_one, kCallThreads);
    if (cut_short.load()) {
      // Its mapping goes with the member's links: the next connect maps
      // the file again only if it is whole, else goes over the transport.
      map_failures.fetch_add(1, std::memory_order_relaxed);
      for (size_t k : moving) store->abort(res[k]);
      release_all();
      fail(s, *link);
      return;
    }
    if (Clock::now() > leased_until)
      st = Status::Unavailable("a copy from a member's mapped arena outlasted its deadline");
    if (st.ok()) fetched_mapped.fetch_add(moving.size(), std::memory_order_relaxed);
  } else if (!ops.empty()) {
    st = peer.run_batch(ops, deadline());
  }
  if (!st.ok() && ln.mapped) {
    // Nothing writes the ranges any more: they are free at once.
    for (size_t k : moving) store->abort(res[k]);
    release_all();
    return;
  }
  if (!st.ok()) {
    // On a fabric without failure detection, and over MPI (which cannot
    // cancel a one-sided transfer), a get that missed its deadline may
    // still write its range: the ranges are held until the transports
    // close, never handed to another block.
    if (failed_gets_may_land()) {
      std::lock_guard<std::mutex> q(quarantine_mu);
      for (size_t k : moving) quarantine.push_back(res[k]);
    } else {
      for (size_t k : moving) store->abort(res[k]);
    }
    fail(s, *link);
    return;
  }
  std::vector<Reservation> good;
  std::vector<size_t> good_k;
  for (size_t k : moving) {
    const cluster::LeaseReply& l = lr[leased[k]];
    const uint64_t sum = !options.verify ? 0
                         : sums.empty()  ? block_checksum(arena.base + res[k].offset, l.size)
                                         : sums[k];
    if (options.verify && (l.checksum == 0 || sum != l.checksum)) {
      checksum_failures.fetch_add(1, std::memory_order_relaxed);
      store->abort(res[k]);
      continue;
    }
    if (listed.removed_since(res[k].id)) {  // removed here while it travelled
      store->abort(res[k]);
      continue;
    }
    good.push_back(res[k]);
    good_k.push_back(k);
  }
  release_all();
  if (good.empty()) return;
  PutOptions o;
  o.origin = PutOrigin::kPromotion;
  std::vector<BlockId> good_ids;
  for (const auto& r : good) good_ids.push_back(r.id);
  forget(good_ids);
  std::vector<Status> cst;
  store->commit_batch(good, o, &cst);
  for (size_t j = 0; j < good.size(); ++j) {
    if (!cst[j].ok()) continue;
    got[which[leased[good_k[j]]]] = 1;
    fetched.fetch_add(1, std::memory_order_relaxed);
    fetched_bytes.fetch_add(good[j].size, std::memory_order_relaxed);
  }
}

// ---- leases on mapped arenas -------------------------------------------------------

void ClusterNode::Impl::lease_mapped(std::span<const BlockId> ids, std::span<MappedLease> out,
                                     Deadline budget) {
  auto r = current();
  if (!r || r->view.members.empty()) return;
  for (int round = 0; round < 2; ++round) {
    const Groups groups =
        owners_in_round(*r, ids, round, [&](size_t i) { return out[i].arena != 0; });
    if (groups.empty()) return;
    for_each_call(groups.size(), [&](size_t g) {
      const auto& [mi, which] = groups[g];
      uint32_t index = 0, expiry_ms = 0;
      auto ready = [&](LinkSlot& s, const Link& ln) {
        if (!ln.mapped) return false;
        std::lock_guard<std::mutex> l(s.mu);
        if (s.mapped != ln.mapped) return false;
        index = s.mapped_index;
        expiry_ms = s.lease_expiry_ms;
        return true;
      };
      // The owner grants after `sent`: its leases last at least its expiry
      // from then.
      auto take = [&](const Link& ln, size_t b, size_t e, const std::vector<uint8_t>& reply,
                      Clock::time_point sent) {
        const int64_t valid_until =
            std::chrono::duration_cast<std::chrono::nanoseconds>(
                (sent + std::chrono::milliseconds(expiry_ms)).time_since_epoch())
                .count();
        std::vector<uint8_t> refused;
        uint32_t refused_count = 0;
        for (size_t j = b; j < e; ++j) {
          auto l = item_at<cluster::LeaseReply>(reply.data(), j - b);
          if (l.code != 0) continue;
          if (l.size > ln.arena_bytes || l.offset > ln.arena_bytes - l.size ||
              (options.verify && l.checksum == 0)) {
            bad_messages.fetch_add(1, std::memory_order_relaxed);
            put_item(&refused, cluster::TokenItem{l.token});
            ++refused_count;
            continue;
          }
          MappedLease& o = out[which[j]];
          o.arena = index;
          o.lane = static_cast<uint32_t>(ln.lane);
          o.flags = l.flags;
          o.offset = l.offset;
          o.size = l.size;
          o.token = l.token;
          o.checksum = options.verify ? l.checksum : 0;
          o.valid_until_ns = valid_until;
          mapped_leases.fetch_add(1, std::memory_order_relaxed);
        }
        if (refused_count > 0) (void)call(ln, Op::kRelease, refused_count, refused, deadline());
      };
      call_in_batches(r->view.members[mi], Op::kLease, ids, which, budget, nullptr, ready, take);
    });
  }
}

void ClusterNode::Impl::release_mapped(std::span<const MappedLease> leases) {
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> by_link;
  for (const MappedLease& l : leases)
    if (l.arena != 0) put_item(&by_link[{l.arena, l.lane}], cluster::TokenItem{l.token});
  for (auto& [key, tokens] : by_link) {
    auto s = slot_of_mapping(key.first);
    if (!s) continue;  // gone: the owner ends them at expiry, or ended them already
    std::shared_ptr<Link> link;
    {
      std::lock_guard<std::mutex> l(s->mu);
      if (key.second < s->links.size()) link = s->links[key.second];
    }
    if (!link) continue;
    const size_t item = sizeof(cluster::TokenItem);
    const size_t n = tokens.size() / item;
    for (size_t b = 0; b < n; b += cluster::kMaxItems) {
      const size_t m = std::min<size_t>(n - b, cluster::kMaxItems);
      std::vector<uint8_t> part(tokens.begin() + b * item, tokens.begin() + (b + m) * item);
      (void)call(*link, Op::kRelease, static_cast<uint32_t>(m), part, deadline());
    }
  }
}

// ---- pushes ---------------------------------------------------------------------

void ClusterNode::Impl::push_loop() {
  name_this_thread("cascade-push");
  while (true) {
    std::vector<BlockId> batch;
    {
      std::unique_lock<std::mutex> l(queue_mu);
      queue_cv.wait(l, [&] { return stopping.load() || !queue.empty(); });
      if (stopping.load()) return;
      const size_t n = std::min<size_t>(queue.size(), cluster::kMaxItems);
      batch.assign(queue.begin(), queue.begin() + n);
      queue.erase(queue.begin(), queue.begin() + n);
    }
    auto r = current();
    if (r && !r->view.members.empty()) {
      std::map<uint32_t, std::vector<BlockId>> by_member;
      for (const BlockId& id : batch) {
        uint32_t o[2];
        int n;
        owners_of(*r, id, o, &n);
        for (int k = 0; k < n; ++k) by_member[o[k]].push_back(id);
      }
      // Each owner's ids in parts on different lanes at once, as fetches.
      std::vector<std::pair<uint32_t, std::vector<BlockId>>> parts;
      std::vector<size_t> part_lane;
      for (auto& [mi, ids] : by_member) {
        const size_t n = ids.size();
        const size_t pieces = std::max<size_t>(1, std::min(lanes.size(), n / kMinBlocksPerLane));
        const size_t step = (n + pieces - 1) / pieces;
        for (size_t b = 0, k = 0; b < n; b += step, ++k) {
          parts.emplace_back(
              mi, std::vector<BlockId>(ids.begin() + b, ids.begin() + std::min(n, b + step)));
          part_lane.push_back(k % lanes.size());
        }
      }
      for_each_call(parts.size(), [&](size_t k) {
        push_to(r->view.members[parts[k].first], part_lane[k], parts[k].second);
      });
    }
    {
      std::lock_guard<std::mutex> l(queue_mu);
      done += batch.size();
    }
    drained_cv.notify_all();
  }
}

void ClusterNode::Impl::push_to(const ClusterMember& m, size_t lane,
                                const std::vector<BlockId>& ids) {
  const Deadline until = deadline();  // the connect's and the reserve's
  auto s = slot_of(m);
  auto link = link_to(s, m, lane, until);
  if (!link.ok()) {
    push_dropped.fetch_add(ids.size(), std::memory_order_relaxed);
    return;
  }
  Peer& peer = *(*link)->peer;
  const Link& ln = **link;
  // Listed before the bytes are taken hold of (a remove that misses the
  // list removed them first, and the acquire finds nothing) and until the
  // push has ended, committed or not.
  const Listed listed(this, ids);
  // The bytes stay leased here while they travel.
  std::vector<BlockView> views;
  std::vector<Status> vst;
  store->acquire_batch(ids, &views, &vst);
  std::vector<size_t> have;
  std::vector<uint8_t> items;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!vst[i].ok() || views[i].kind() != MemoryKind::kHost) continue;
    pool::ReserveItem it{};
    std::memcpy(it.id, ids[i].bytes.data(), 16);
    it.size = views[i].size();
    it.flags = views[i].is_prefix() ? pool::kPrefix : 0;
    put_item(&items, it);
    have.push_back(i);
  }
  push_dropped.fetch_add(ids.size() - have.size(), std::memory_order_relaxed);
  if (have.empty()) return;
  auto reply = call(ln, Op::kReserve, static_cast<uint32_t>(have.size()), items, until);
  if (!reply.ok()) {
    push_dropped.fetch_add(have.size(), std::memory_order_relaxed);
    fail(s, *link);
    return;
  }
  answered(*s);
  std::vector<TransferOp> ops;
  std::vector<cluster::CommitItem> commits;
  std::vector<BlockId> committing;
  std::vector<uint64_t> bytes;
  std::vector<uint8_t> unused;  // tokens of reservations granted and not used: aborted
  uint32_t unused_count = 0;
  for (size_t j = 0; j < have.size(); ++j) {
    auto rr = item_at<cluster::ReserveReply>(reply->data(), j);
    if (rr.code != 0) {  // refused: the owner will not hold it
      push_dropped.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    if (rr.flags & pool::kPresent) continue;
    const BlockView& v = views[have[j]];
    if (v.size() > (*link)->arena_bytes || rr.offset > (*link)->arena_bytes - v.size()) {
      bad_messages.fetch_add(1, std::memory_order_relaxed);
      push_dropped.fetch_add(1, std::memory_order_relaxed);
      put_item(&unused, cluster::TokenItem{rr.token});
      ++unused_count;
      continue;
    }
    ops.push_back(TransferOp{TransferKind::kPut, (*link)->arena.get(), rr.offset,
                             const_cast<uint8_t*>(v.data()), v.size()});
    commits.push_back(cluster::CommitItem{rr.token, checksum(v.data(), v.size())});
    committing.push_back(ids[have[j]]);
    bytes.push_back(v.size());
  }
  // The owner keeps a granted reservation until it expires unless told:
  // sent without waiting for a reply, as releases are.
  if (unused_count) (void)call(ln, Op::kAbort, unused_count, unused, deadline());
  if (ops.empty()) return;
  Status st = peer.run_batch(ops, deadline());
  if (!st.ok()) {
    // Not aborted: a transfer that missed its deadline may still land, and
    // the owner must not hand the range to another writer before the
    // reservation expires.
    push_dropped.fetch_add(ops.size(), std::memory_order_relaxed);
    fail(s, *link);
    return;
  }
  // Ids removed here while their bytes travelled (a remove another member
  // sent reached this one): their reservations are aborted, not committed.
  // The owner may have served the same remove before this push's reserve
  // reached it, and would store the removed bytes again.
  {
    std::vector<uint8_t> dropped;
    uint32_t dropped_count = 0;
    size_t kept = 0;
    for (size_t j = 0; j < commits.size(); ++j) {
      if (listed.removed_since(committing[j])) {
        put_item(&dropped, cluster::TokenItem{commits[j].token});
        ++dropped_count;
        continue;
      }
      commits[kept] = commits[j];
      bytes[kept] = bytes[j];
      ++kept;
    }
    commits.resize(kept);
    bytes.resize(kept);
    if (dropped_count) {
      push_dropped.fetch_add(dropped_count, std::memory_order_relaxed);
      (void)call(ln, Op::kAbort, dropped_count, dropped, deadline());
    }
    if (commits.empty()) return;
  }
  items.clear();
  for (const auto& c : commits) put_item(&items, c);
  auto done_reply = call(ln, Op::kCommit, static_cast<uint32_t>(commits.size()), items, deadline());
  if (!done_reply.ok()) {
    // The bytes have arrived (the transfer completed), so the reservations
    // go back before the link is dropped: an owner that is alive frees the
    // space now, and one that committed them already finds none.
    push_dropped.fetch_add(commits.size(), std::memory_order_relaxed);
    items.clear();
    for (const auto& c : commits) put_item(&items, cluster::TokenItem{c.token});
    (void)call(ln, Op::kAbort, static_cast<uint32_t>(commits.size()), items, deadline());
    fail(s, *link);
    return;
  }
  for (size_t j = 0; j < commits.size(); ++j) {
    auto cr = item_at<cluster::CodeReply>(done_reply->data(), j);
    if (cr.code != 0) {
      push_dropped.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    pushed.fetch_add(1, std::memory_order_relaxed);
    pushed_bytes.fetch_add(bytes[j], std::memory_order_relaxed);
  }
}

// ---- the owning side ---------------------------------------------------------------

void ClusterNode::Impl::service_loop(size_t index) {
  name_this_thread("cascade-member");
  const size_t lane = index % lanes.size();
  while (!stopping.load()) {
    // Requests come at any time: the thread sleeps until the lane's progress
    // thread has one in, rather than poll beside it.
    auto msg = lanes[lane].t->receive(
        cluster::kRequestTag, cluster::kMaxRequestBytes,
        deadline_in(std::chrono::duration_cast<std::chrono::milliseconds>(kServiceWait)),
        ReceiveWait::kAnyTime);
    if (msg.ok()) {
      serve(lane, std::move(msg.value()));
    } else if (msg.status().is(Code::kInvalidArgument)) {
      bad_messages.fetch_add(1, std::memory_order_relaxed);
    }
    if (index == 0) {
      const int64_t now = Clock::now().time_since_epoch().count();
      if (now - last_sweep_ns.load() >
          std::chrono::duration_cast<Clock::duration>(kSweepEvery).count()) {
        last_sweep_ns.store(now);
        sweep();
      }
    }
  }
}

void ClusterNode::Impl::hello_loop() {
  name_this_thread("cascade-greeter");
  while (true) {
    std::pair<size_t, std::vector<uint8_t>> next;
    {
      std::unique_lock<std::mutex> l(hello_mu);
      hello_cv.wait(l, [&] { return stopping.load() || !hellos.empty(); });
      if (stopping.load()) return;
      next = std::move(hellos.front());
      hellos.pop_front();
    }
    // Checked by serve() before it was queued.
    const auto& [lane, msg] = next;
    cluster::RequestHead h{};
    std::memcpy(&h, msg.data(), sizeof h);
    const std::string node_id(h.node_id, h.node_id_bytes);
    std::shared_ptr<Peer> back;
    std::vector<uint8_t> reply =
        serve_hello(lane, h, node_id, {msg.data() + sizeof h, h.count}, &back);
    if (back) (void)back->send(h.reply_tag, reply, deadline());
  }
}

void ClusterNode::Impl::serve(size_t lane, std::vector<uint8_t>&& msg) {
  cluster::RequestHead h{};
  if (msg.size() < sizeof h) {
    bad_messages.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::memcpy(&h, msg.data(), sizeof h);
  if (h.magic != cluster::kMagic || h.version != cluster::kVersion || h.node_id_bytes == 0 ||
      h.node_id_bytes > cluster::kMaxNodeIdBytes || h.op < static_cast<uint32_t>(Op::kHello) ||
      h.op > static_cast<uint32_t>(Op::kRemove) || h.lane >= cluster::kMaxLanes) {
    bad_messages.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const Op op = static_cast<Op>(h.op);
  const std::string node_id(h.node_id, h.node_id_bytes);
  const uint8_t* body = msg.data() + sizeof h;
  const uint64_t body_bytes = msg.size() - sizeof h;
  if (op == Op::kHello) {
    if (h.count == 0 || h.count > cluster::kMaxAddressBytes || body_bytes != h.count ||
        h.reply_tag == 0) {
      bad_messages.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    {
      std::lock_guard<std::mutex> l(hello_mu);
      if (hellos.size() >= kMaxHellosWaiting) {
        // A flood of hellos: this one goes unanswered; its sender retries.
        bad_messages.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      hellos.emplace_back(lane, std::move(msg));
    }
    hello_cv.notify_one();
    return;
  }
  std::shared_ptr<PeerState> p;
  {
    std::lock_guard<std::mutex> l(peers_mu);
    auto it = peers.find({node_id, h.generation, h.lane});
    if (it != peers.end()) p = it->second;
  }
  // A sender that did not say Hello cannot be answered: its call ends at its
  // deadline, and it says Hello on its next connection.
  if (!p) {
    bad_messages.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const bool wants_reply = op != Op::kRelease && op != Op::kAbort;
  if (wants_reply != (h.reply_tag != 0) ||
      (h.reply_tag != 0 && !(h.reply_tag & cluster::kReplyTagBit))) {
    bad_messages.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::vector<uint8_t> reply;
  const uint64_t item = cluster::request_item_bytes(op);
  if (h.count > cluster::kMaxItems || body_bytes != uint64_t(h.count) * item) {
    bad_messages.fetch_add(1, std::memory_order_relaxed);
    reply = error_reply(Status::InvalidArgument("a request of " + std::to_string(body_bytes) +
                                                " bytes for " + std::to_string(h.count) +
                                                " items of op " + std::to_string(h.op)));
  } else {
    reply = serve_items(*p, op, h.count, body);
  }
  if (!wants_reply) return;
  if (p->back->send(h.reply_tag, reply, deadline()).ok()) return;
  // The member never learns what this reply granted: take it back now
  // rather than at expiry.
  if ((op != Op::kLease && op != Op::kReserve) || reply.size() < sizeof(cluster::ReplyHead)) return;
  cluster::ReplyHead rh;
  std::memcpy(&rh, reply.data(), sizeof rh);
  const uint64_t reply_item = cluster::reply_item_bytes(op);
  if (rh.code != 0 || reply.size() < sizeof rh + uint64_t(rh.count) * reply_item) return;
  const uint8_t* items = reply.data() + sizeof rh;
  std::vector<BlockView> ended;
  std::vector<Reservation> freed;
  {
    std::lock_guard<std::mutex> l(p->mu);
    for (uint32_t k = 0; k < rh.count; ++k) {
      if (op == Op::kLease) {
        auto r = item_at<cluster::LeaseReply>(items, k);
        auto it = r.code == 0 ? p->leases.find(r.token) : p->leases.end();
        if (it == p->leases.end()) continue;
        ended.push_back(std::move(it->second.view));
        p->leases.erase(it);
      } else {
        auto r = item_at<cluster::ReserveReply>(items, k);
        auto it = r.code == 0 ? p->reservations.find(r.token) : p->reservations.end();
        if (it == p->reservations.end()) continue;
        freed.push_back(it->second.r);
        p->reservations.erase(it);
      }
    }
  }
  peer_leases.fetch_sub(static_cast<int64_t>(ended.size()), std::memory_order_relaxed);
  peer_reservations.fetch_sub(static_cast<int64_t>(freed.size()), std::memory_order_relaxed);
  for (const auto& r : freed) store->abort(r);
}

std::vector<uint8_t> ClusterNode::Impl::serve_hello(size_t lane, const cluster::RequestHead& h,
                                                    const std::string& node_id,
                                                    std::span<const uint8_t> address,
                                                    std::shared_ptr<Peer>* back) {
  auto peer = lanes[lane].t->connect(address, deadline());
  if (!peer.ok()) {
    timeouts.fetch_add(1, std::memory_order_relaxed);
    return {};
  }
  auto state = std::make_shared<PeerState>();
  state->node_id = node_id;
  state->generation = h.generation;
  state->back = peer.value();
  *back = peer.value();
  std::shared_ptr<PeerState> old;
  {
    std::lock_guard<std::mutex> l(peers_mu);
    // A member this owner kept while it is out of the view (or that was in
    // it) stays so on a new connection of any of its lanes.
    for (const auto& [key, p] : peers)
      if (std::get<0>(key) == node_id && std::get<1>(key) == h.generation && p->was_member) {
        state->was_member = true;
        state->absent_since = p->absent_since;
        break;
      }
    auto& slot = peers[{node_id, h.generation, h.lane}];
    old = std::exchange(slot, state);
    // An older generation of the same member is gone for good.
    for (auto it = peers.begin(); it != peers.end();) {
      if (std::get<0>(it->first) == node_id && std::get<1>(it->first) < h.generation) {
        end_peer(*it->second);
        it = peers.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (old) end_peer(*old);
  cluster::HelloReply hr{};
  hr.generation = options.generation;
  hr.arena_bytes = arena.capacity;
  const std::vector<uint8_t>& key = lanes[lane].region->remote_key();
  hr.key_bytes = static_cast<uint32_t>(key.size());
  hr.lanes = static_cast<uint32_t>(lanes.size());
  std::vector<uint8_t> items;
  put_item(&items, hr);
  items.insert(items.end(), key.begin(), key.end());
  for (const Lane& l : lanes) {
    const std::vector<uint8_t>& a = l.t->address();
    put_item(&items, static_cast<uint32_t>(a.size()));
    items.insert(items.end(), a.begin(), a.end());
  }
  put_item(&items, host_arena);
  items.insert(items.end(), arena_file.path.begin(), arena_file.path.end());
  return ok_reply(1, items);
}

std::vector<uint8_t> ClusterNode::Impl::serve_items(PeerState& p, Op op, uint32_t count,
                                                    const uint8_t* items) {
  std::vector<uint8_t> out;
  const auto expires = Clock::now() + std::chrono::milliseconds(options.lease_expiry_ms);
  auto id_of = [&](uint32_t k) {
    BlockId id;
    std::memcpy(id.bytes.data(), items + k * 16, 16);
    return id;
  };
  switch (op) {
    case Op::kLookup: {
      for (uint32_t k = 0; k < count; ++k) {
        cluster::LookupReply r{};
        auto size = store->size_of(id_of(k));
        r.code = code_of(size.status());
        if (size.ok()) r.size = *size;
        put_item(&out, r);
      }
      return ok_reply(count, out);
    }
    case Op::kRemove: {
      // Within half a deadline: the remover's call waits one.
      std::vector<BlockId> ids(count);
      for (uint32_t k = 0; k < count; ++k) ids[k] = id_of(k);
      std::vector<uint8_t> removed(count);
      remove_here(ids, removed,
                  Clock::now() + std::chrono::milliseconds(options.request_timeout_ms / 2));
      for (uint32_t k = 0; k < count; ++k) {
        if (removed[k]) served_removes.fetch_add(1, std::memory_order_relaxed);
        put_item(&out,
                 cluster::CodeReply{code_of(removed[k] ? Status::OK() : Status::NotFound(""))});
      }
      return ok_reply(count, out);
    }
    case Op::kLease: {
      std::vector<BlockId> ids(count);
      for (uint32_t k = 0; k < count; ++k) ids[k] = id_of(k);
      std::vector<BlockView> views;
      std::vector<Status> st;
      store->acquire_batch(ids, &views, &st);
      std::vector<cluster::LeaseReply> replies(count);
      // Checksums are taken outside the member's lock (the views keep the
      // bytes in place), then the leases are recorded under it.
      for (uint32_t k = 0; k < count; ++k) {
        cluster::LeaseReply& r = replies[k];
        r.code = code_of(st[k]);
        if (!st[k].ok()) continue;
        const uint8_t* d = views[k].data();
        if (views[k].kind() != MemoryKind::kHost || d < arena.base ||
            d + views[k].size() > arena.base + arena.capacity) {
          r.code = static_cast<uint32_t>(Code::kUnavailable);
          continue;
        }
        r.offset = static_cast<uint64_t>(d - arena.base);
        r.size = views[k].size();
        r.flags = views[k].is_prefix() ? pool::kPrefix : 0;
        r.checksum = sum_of(ids[k], d, r.size);
      }
      uint64_t granted = 0;
      {
        std::lock_guard<std::mutex> l(p.mu);
        for (uint32_t k = 0; k < count; ++k) {
          cluster::LeaseReply& r = replies[k];
          if (r.code != 0) continue;
          if (p.ended) {  // the member's state ended meanwhile: grant nothing
            r = cluster::LeaseReply{};
            r.code = static_cast<uint32_t>(Code::kUnavailable);
            continue;
          }
          r.token = next_token.fetch_add(1, std::memory_order_relaxed);
          served_lease_bytes.fetch_add(r.size, std::memory_order_relaxed);
          p.leases.emplace(r.token, PeerState::Lease{std::move(views[k]), expires});
          ++granted;
        }
      }
      served_leases.fetch_add(granted, std::memory_order_relaxed);
      peer_leases.fetch_add(static_cast<int64_t>(granted), std::memory_order_relaxed);
      for (const auto& r : replies) put_item(&out, r);
      return ok_reply(count, out);
    }
    case Op::kRelease: {
      std::vector<BlockView> ended;
      {
        std::lock_guard<std::mutex> l(p.mu);
        for (uint32_t k = 0; k < count; ++k) {
          auto it = p.leases.find(item_at<cluster::TokenItem>(items, k).token);
          if (it == p.leases.end()) continue;
          ended.push_back(std::move(it->second.view));
          p.leases.erase(it);
        }
      }
      peer_leases.fetch_sub(static_cast<int64_t>(ended.size()), std::memory_order_relaxed);
      return {};
    }
    case Op::kReserve: {
      std::vector<cluster::ReserveReply> replies(count);
      for (int prefix = 0; prefix < 2; ++prefix) {
        std::vector<uint32_t> ks;
        std::vector<BlockId> ids;
        std::vector<uint64_t> sizes;
        for (uint32_t k = 0; k < count; ++k) {
          auto it = item_at<pool::ReserveItem>(items, k);
          if (((it.flags & pool::kPrefix) != 0) != (prefix == 1)) continue;
          BlockId id;
          std::memcpy(id.bytes.data(), it.id, 16);
          ks.push_back(k);
          ids.push_back(id);
          sizes.push_back(it.size);
        }
        if (ks.empty()) continue;
        PutOptions o;
        o.is_prefix = prefix == 1;
        std::vector<Reservation> res;
        std::vector<Status> st;
        store->reserve_batch(ids, sizes, o, &res, &st);
        std::lock_guard<std::mutex> l(p.mu);
        for (size_t j = 0; j < ks.size(); ++j) {
          cluster::ReserveReply& r = replies[ks[j]];
          r.code = code_of(st[j]);
          if (!st[j].ok()) continue;
          if (res[j].present) {
            r.flags = pool::kPresent;
            continue;
          }
          if (p.ended) {  // the member's state ended meanwhile: keep nothing for it
            r.code = static_cast<uint32_t>(Code::kUnavailable);
            store->abort(res[j]);
            continue;
          }
          r.offset = res[j].offset;
          r.token = next_token.fetch_add(1, std::memory_order_relaxed);
          p.reservations.emplace(r.token, PeerState::Held{res[j], expires});
          peer_reservations.fetch_add(1, std::memory_order_relaxed);
        }
      }
      for (const auto& r : replies) put_item(&out, r);
      return ok_reply(count, out);
    }
    case Op::kCommit:
    case Op::kAbort: {
      std::vector<std::optional<Reservation>> taken(count);
      // A commit's ids are listed (in_flight) from when its reservations
      // are taken, under the member's lock a remove cancels them under,
      // until the commit ended: a remove of one either cancels its
      // reservation first or waits for the commit and removes what it
      // stored.
      std::optional<Listed> committing;
      {
        std::lock_guard<std::mutex> l(p.mu);
        std::vector<BlockId> ids;
        for (uint32_t k = 0; k < count; ++k) {
          const uint64_t token = op == Op::kCommit ? item_at<cluster::CommitItem>(items, k).token
                                                   : item_at<cluster::TokenItem>(items, k).token;
          auto it = p.reservations.find(token);
          if (it == p.reservations.end()) continue;
          taken[k] = it->second.r;
          ids.push_back(it->second.r.id);
          p.reservations.erase(it);
          peer_reservations.fetch_sub(1, std::memory_order_relaxed);
        }
        if (op == Op::kCommit && !ids.empty()) committing.emplace(this, std::move(ids));
      }
      if (op == Op::kAbort) {
        for (auto& t : taken)
          if (t) store->abort(*t);
        return {};
      }
      std::vector<cluster::CodeReply> replies(
          count, cluster::CodeReply{code_of(Status::InvalidArgument("no such reservation"))});
      std::vector<Reservation> batch;
      std::vector<uint32_t> ks;
      for (uint32_t k = 0; k < count; ++k) {
        if (!taken[k]) continue;
        const uint64_t want = item_at<cluster::CommitItem>(items, k).checksum;
        if (options.verify &&
            (want == 0 || block_checksum(arena.base + taken[k]->offset, taken[k]->size) != want)) {
          checksum_failures.fetch_add(1, std::memory_order_relaxed);
          store->abort(*taken[k]);
          replies[k].code = static_cast<uint32_t>(Code::kCorruption);
          continue;
        }
        batch.push_back(*taken[k]);
        ks.push_back(k);
      }
      if (!batch.empty()) {
        std::vector<Status> st;
        store->commit_batch(batch, PutOptions{}, &st);
        std::vector<BlockId> stored;
        std::vector<size_t> stored_j;
        for (size_t j = 0; j < batch.size(); ++j) {
          replies[ks[j]].code = code_of(st[j]);
          if (!st[j].ok()) continue;
          served_commits.fetch_add(1, std::memory_order_relaxed);
          served_commit_bytes.fetch_add(batch[j].size, std::memory_order_relaxed);
          stored.push_back(batch[j].id);
          stored_j.push_back(j);
        }
        // The checksum just verified is the block's wherever this commit is
        // the one the store holds (its bytes at the reserved range): kept,
        // so the first member to lease the block does not wait for it to
        // be hashed again.
        if (options.verify && !stored.empty()) {
          std::vector<BlockView> views;
          std::vector<Status> vst;
          store->acquire_batch(stored, &views, &vst);
          for (size_t i = 0; i < stored.size(); ++i) {
            const Reservation& r = batch[stored_j[i]];
            if (vst[i].ok() && views[i].kind() == MemoryKind::kHost &&
                views[i].data() == arena.base + r.offset && views[i].size() == r.size)
              remember(r.id, views[i].data(), r.size,
                       item_at<cluster::CommitItem>(items, ks[stored_j[i]]).checksum);
          }
        }
      }
      for (const auto& r : replies) put_item(&out, r);
      return ok_reply(count, out);
    }
    default: return error_reply(Status::InvalidArgument("op not served"));
  }
}

// Ends what p holds here: its leases end at once; its reservations are
// held until their expiry (a put of p's may still be landing in them: the
// member's own connection, which carries its puts, is not this one), then
// freed by sweep. With the transports closed (`closed`), nothing lands any
// more and they are freed at once.
// REQUIRES: p is no longer reachable from `peers`, or peers_mu is held.
void ClusterNode::Impl::end_holdings(PeerState& p, bool closed, bool for_good) {
  std::vector<BlockView> ended;
  std::vector<Ending> held_back;
  {
    std::lock_guard<std::mutex> l(p.mu);
    if (for_good) p.ended = true;
    for (auto& [t, lease] : p.leases) ended.push_back(std::move(lease.view));
    for (auto& [t, held] : p.reservations) held_back.push_back(Ending{held.r, held.expires});
    p.leases.clear();
    p.reservations.clear();
  }
  peer_leases.fetch_sub(static_cast<int64_t>(ended.size()), std::memory_order_relaxed);
  hold_until_expiry(std::move(held_back), closed);
  if (for_good && p.back) p.back->close();
}

// Ends leases and reservations past their expiry: a member that leased a
// block and never released it does not pin it for ever. A sender that is
// not in the view loses all it holds here once a deadline has passed since
// its Hello (time for a member that just joined to appear in this member's
// view): one never seen in the view is forgotten with its connection back,
// one that was a member is still answered for kAbsentMemberKept (it may be
// stopped, or cut off from the coordination service, and come back with
// the same generation), and one whose node is in the view with a newer
// generation is forgotten at once.
void ClusterNode::Impl::sweep() {
  std::vector<std::shared_ptr<PeerState>> all, strays, absent;
  const auto now = Clock::now();
  {
    const auto r = current();
    const auto grace = std::chrono::milliseconds(options.request_timeout_ms);
    std::lock_guard<std::mutex> l(peers_mu);
    for (auto it = peers.begin(); it != peers.end();) {
      PeerState& p = *it->second;
      bool in_view = false, newer = false;
      if (r)
        for (const auto& m : r->view.members) {
          in_view |= m.node_id == p.node_id && m.generation <= p.generation;
          newer |= m.node_id == p.node_id && m.generation > p.generation;
        }
      if (in_view) {
        p.was_member = true;
        p.absent_since = {};
      } else if (now - p.since >= grace) {
        if (p.was_member && !newer) mark_absent(p, now, &absent, it->second);
        if (!p.was_member || newer || now - p.absent_since >= kAbsentMemberKept) {
          strays.push_back(it->second);
          it = peers.erase(it);
          continue;
        }
      }
      all.push_back(it->second);
      ++it;
    }
  }
  for (auto& p : absent) end_holdings(*p, /*closed=*/false, /*for_good=*/false);
  for (auto& p : strays) end_peer(*p);
  for (auto& p : all) {
    std::vector<BlockView> ended;
    std::vector<Reservation> freed;
    {
      std::lock_guard<std::mutex> l(p->mu);
      for (auto it = p->leases.begin(); it != p->leases.end();) {
        if (it->second.expires <= now) {
          ended.push_back(std::move(it->second.view));
          it = p->leases.erase(it);
        } else {
          ++it;
        }
      }
      for (auto it = p->reservations.begin(); it != p->reservations.end();) {
        if (it->second.expires <= now) {
          freed.push_back(it->second.r);
          it = p->reservations.erase(it);
        } else {
          ++it;
        }
      }
    }
    expired.fetch_add(ended.size() + freed.size(), std::memory_order_relaxed);
    peer_leases.fetch_sub(static_cast<int64_t>(ended.size()), std::memory_order_relaxed);
    peer_reservations.fetch_sub(static_cast<int64_t>(freed.size()), std::memory_order_relaxed);
    for (const auto& r : freed) store->abort(r);
  }
  // Reservations of ended members, once past their expiry.
  std::vector<Reservation> due;
  {
    std::lock_guard<std::mutex> q(quarantine_mu);
    for (auto it = ending.begin(); it != ending.end();) {
      if (it->expires <= now) {
        due.push_back(it->r);
        it = ending.erase(it);
      } else {
        ++it;
      }
    }
  }
  expired.fetch_add(due.size(), std::memory_order_relaxed);
  peer_reservations.fetch_sub(static_cast<int64_t>(due.size()), std::memory_order_relaxed);
  for (const auto& r : due) store->abort(r);
}

// ---- the public face ------------------------------------------------------------

Result<std::unique_ptr<ClusterNode>> ClusterNode::Start(CascadeStore* store, SharedArena arena,
                                                        const ClusterNodeOptions& options) {
  if (options.node_id.empty() || options.node_id.size() > cluster::kMaxNodeIdBytes)
    return Status::InvalidArgument("cluster node id: 1 to 128 bytes");
  if (arena.base == nullptr || arena.capacity == 0)
    return Status::InvalidArgument("a cluster member needs the store's shared host arena");
  // A push holds a reservation across three calls (reserve, put, commit),
  // each with its own deadline, and the sweep runs once a second: an
  // expiry below that could free a range a put still writes.
  if (options.request_timeout_ms == 0 ||
      uint64_t(options.lease_expiry_ms) < 3ULL * options.request_timeout_ms + 2000)
    return Status::InvalidArgument(
        "cluster timeouts: request_timeout_ms above 0, lease_expiry_ms at least 3 x "
        "request_timeout_ms + 2000");
  if (options.request_budget_ms != 0 && (options.request_budget_ms < options.request_timeout_ms ||
                                         options.request_budget_ms > 3600 * 1000))
    return Status::InvalidArgument(
        "cluster request_budget_ms: 0 (two request timeouts) or from request_timeout_ms to "
        "3,600,000");
  if (options.service_threads == 0 || options.service_threads > 64)
    return Status::InvalidArgument("cluster service threads: 1 to 64");
  if (options.lanes == 0 || options.lanes > cluster::kMaxLanes)
    return Status::InvalidArgument("cluster lanes: 1 to " + std::to_string(cluster::kMaxLanes));
  TransportOptions to;
  to.backend = options.transport;
  to.mpi_communicator = options.mpi_communicator;
  to.fabrics = options.fabrics;
  to.progress_thread = true;
  to.require_failure_detection = !options.allow_undetected_failures;
  auto impl = std::make_unique<Impl>();
  impl->store = store;
  impl->arena = arena;
  impl->options = options;
  impl->host_boot_id = boot_id();
  if (arena.fd >= 0) {
    auto file = describe_open_file(arena.fd);
    if (file.ok() && file->path.size() <= cluster::kMaxPathBytes) impl->arena_file = *file;
  }
  {
    cluster::HostArena& ha = impl->host_arena;
    std::memcpy(ha.boot_id, impl->host_boot_id.data(),
                std::min(impl->host_boot_id.size(), sizeof ha.boot_id - 1));
    ha.device = impl->arena_file.device;
    ha.inode = impl->arena_file.inode;
    ha.file_offset = arena.file_offset;
    ha.path_bytes = static_cast<uint32_t>(impl->arena_file.path.size());
    ha.lease_expiry_ms = options.lease_expiry_ms;
  }
  for (uint32_t i = 0; i < options.lanes; ++i) {
    auto t = Transport::Open(to);
    if (!t.ok()) return t.status();
    auto region = (*t)->register_memory(arena.base, arena.capacity);
    if (!region.ok()) return region.status();
    impl->lanes.push_back(Impl::Lane{std::move(t.value()), std::move(region.value())});
  }
  auto calls = ThreadPool::Create(kCallThreads, "cascade-call");
  if (!calls.ok()) return calls.status();
  impl->calls = std::move(calls.value());
  Impl* p = impl.get();
  const uint32_t threads = std::max(options.service_threads, options.lanes);
  for (uint32_t i = 0; i < threads; ++i) impl->service.emplace_back([p, i] { p->service_loop(i); });
  for (size_t i = 0; i < Impl::kHelloThreads; ++i)
    impl->helloers.emplace_back([p] { p->hello_loop(); });
  impl->pusher = std::thread([p] { p->push_loop(); });
  return std::unique_ptr<ClusterNode>(new ClusterNode(std::move(impl)));
}

ClusterNode::ClusterNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ClusterNode::~ClusterNode() { close(); }

const std::vector<uint8_t>& ClusterNode::address() const { return impl_->lanes[0].t->address(); }
std::string ClusterNode::backend() const { return impl_->lanes[0].t->backend(); }

Status ClusterNode::set_view(ClusterView view) {
  const size_t m = view.members.size();
  if (view.positions.size() != view.owners.size())
    return Status::InvalidArgument("cluster view: positions and owners differ in length");
  if (m > 0 && view.positions.empty())
    return Status::InvalidArgument("cluster view: members without points");
  if (view.replicas < 1 || view.replicas > 2)
    return Status::InvalidArgument("cluster view: 1 or 2 replicas");
  for (size_t i = 0; i < view.owners.size(); ++i) {
    if (view.owners[i] >= m) return Status::InvalidArgument("cluster view: owner out of range");
    if (i > 0 && view.positions[i] < view.positions[i - 1])
      return Status::InvalidArgument("cluster view: positions not in ascending order");
  }
  auto ring = std::make_shared<Impl::Ring>();
  for (size_t i = 0; i < m; ++i)
    if (view.members[i].node_id == impl_->options.node_id) ring->self = static_cast<int>(i);
  // For each point, the member of the next point that is not its own.
  const size_t n = view.owners.size();
  ring->second.assign(view.owners.begin(), view.owners.end());
  int64_t nearest = -1;
  for (size_t k = 2 * n; k-- > 0;) {
    const size_t i = k % n;
    const uint32_t next = view.owners[(i + 1) % n];
    if (next != view.owners[i]) nearest = next;
    if (k < n && nearest >= 0) ring->second[i] = static_cast<uint32_t>(nearest);
  }
  // Members that were in the old view and are not in the new one (or are
  // there with a new generation) lose what they held here.
  std::map<std::string, uint64_t> now;
  for (const auto& mem : view.members) now[mem.node_id] = mem.generation;
  std::shared_ptr<const Impl::Ring> old;
  ring->view = std::move(view);
  {
    std::unique_lock<std::shared_mutex> l(impl_->view_mu);
    old = std::exchange(impl_->ring, ring);
  }
  std::vector<std::shared_ptr<PeerState>> gone, absent;
  if (old) {
    const auto at = Clock::now();
    std::lock_guard<std::mutex> l(impl_->peers_mu);
    for (auto it = impl_->peers.begin(); it != impl_->peers.end();) {
      const auto& [id, gen, lane] = it->first;
      auto seen = now.find(id);
      bool was = false;
      for (const auto& mem : old->view.members) was |= mem.node_id == id && mem.generation <= gen;
      if (seen != now.end() && seen->second > gen) {  // a new process of the member
        gone.push_back(it->second);
        it = impl_->peers.erase(it);
        continue;
      }
      if (seen == now.end() && was) {  // it left: it may come back (see sweep)
        it->second->was_member = true;
        impl_->mark_absent(*it->second, at, &absent, it->second);
      } else if (seen != now.end()) {  // in the view: what it holds from now on ends if it leaves
        it->second->was_member = true;
        it->second->absent_since = {};
      }
      ++it;
    }
  }
  for (auto& p : gone) impl_->end_peer(*p);
  for (auto& p : absent) impl_->end_holdings(*p, /*closed=*/false, /*for_good=*/false);
  // Connections to members no longer in the view end, and so do mappings
  // of their arenas: a member that is gone pins no memory here. (A call
  // under way keeps its own Link until it returns.)
  std::vector<std::shared_ptr<LinkSlot>> dropped;
  {
    std::lock_guard<std::mutex> l(impl_->links_mu);
    for (auto it = impl_->links.begin(); it != impl_->links.end();) {
      if (now.count(it->first)) {
        ++it;
      } else {
        dropped.push_back(std::move(it->second));
        it = impl_->links.erase(it);
      }
    }
  }
  for (auto& slot : dropped) {
    std::vector<std::shared_ptr<Peer>> closing;
    {
      std::lock_guard<std::mutex> sl(slot->mu);
      closing = Impl::drop_links(*slot);
    }
    for (auto& p : closing) p->close();
  }
  return Status::OK();
}

Deadline ClusterNode::request_deadline() const { return impl_->request_deadline(); }

void ClusterNode::lookup(std::span<const BlockId> ids, std::span<uint8_t> found,
                         std::span<uint64_t> sizes, Deadline budget) {
  if (impl_->stopping.load()) return;
  impl_->lookup(ids, found, sizes, budget == kOwnBudget ? request_deadline() : budget);
}

Status ClusterNode::remove(std::span<const BlockId> ids, std::span<uint8_t> removed,
                           Deadline budget) {
  if (impl_->stopping.load())
    return Status::Unavailable(
        "removed here; this server is leaving the cluster, so other "
        "members were not asked: remove again through another server");
  return impl_->remove(ids, removed, budget == kOwnBudget ? request_deadline() : budget);
}

void ClusterNode::fetch(std::span<const BlockId> ids, std::span<uint8_t> fetched, Deadline budget) {
  if (impl_->stopping.load()) return;
  impl_->fetch(ids, fetched, budget == kOwnBudget ? request_deadline() : budget);
}

void ClusterNode::lease_mapped(std::span<const BlockId> ids, std::span<MappedLease> out,
                               Deadline budget) {
  if (impl_->stopping.load() || !impl_->options.map_same_host) return;
  impl_->lease_mapped(ids, out, budget == kOwnBudget ? request_deadline() : budget);
}

void ClusterNode::count_checksum_failures(uint64_t n) {
  impl_->checksum_failures.fetch_add(n, std::memory_order_relaxed);
}

void ClusterNode::release_mapped(std::span<const MappedLease> leases) {
  if (impl_->stopping.load()) return;
  impl_->release_mapped(leases);
}

Result<MappedArenaFile> ClusterNode::mapped_arena(uint32_t index) const {
  auto s = impl_->slot_of_mapping(index);
  if (!s) return Status::NotFound("no member's arena is mapped as " + std::to_string(index));
  std::lock_guard<std::mutex> l(s->mu);
  if (!s->mapped || s->mapped_index != index)
    return Status::NotFound("no member's arena is mapped as " + std::to_string(index));
  return s->mapped_file;
}

void ClusterNode::publish(std::span<const BlockId> ids) {
  if (ids.empty()) return;
  impl_->forget(ids);  // stored again here: perhaps with other bytes
  if (impl_->stopping.load()) return;
  {
    std::lock_guard<std::mutex> l(impl_->queue_mu);
    const size_t room = impl_->options.publish_queue -
                        std::min<size_t>(impl_->queue.size(), impl_->options.publish_queue);
    const size_t take = std::min(room, ids.size());
    impl_->queue.insert(impl_->queue.end(), ids.begin(), ids.begin() + take);
    impl_->queued += take;
    impl_->push_dropped.fetch_add(ids.size() - take, std::memory_order_relaxed);
  }
  impl_->queue_cv.notify_one();
}

bool ClusterNode::drain(uint32_t timeout_ms) {
  std::unique_lock<std::mutex> l(impl_->queue_mu);
  const uint64_t target = impl_->queued;
  return impl_->drained_cv.wait_for(l, std::chrono::milliseconds(timeout_ms), [&] {
    return impl_->done >= target || impl_->stopping.load();
  });
}

ClusterStats ClusterNode::stats() const {
  const Impl& i = *impl_;
  ClusterStats s;
  if (auto r = i.current()) {
    s.members = r->view.members.size();
    s.view_version = r->view.version;
  }
  {
    std::vector<std::shared_ptr<LinkSlot>> slots;
    {
      std::lock_guard<std::mutex> l(const_cast<Impl&>(i).links_mu);
      for (auto& [id, slot] : i.links) slots.push_back(slot);
    }
    for (auto& slot : slots) {
      std::lock_guard<std::mutex> sl(slot->mu);
      s.connected += std::any_of(slot->links.begin(), slot->links.end(),
                                 [](const auto& l) { return l != nullptr; });
      s.mapped += slot->mapped != nullptr;
    }
  }
  auto get = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  s.pushed = get(i.pushed);
  s.pushed_bytes = get(i.pushed_bytes);
  s.push_dropped = get(i.push_dropped);
  s.fetched = get(i.fetched);
  s.fetched_bytes = get(i.fetched_bytes);
  s.remote_lookups = get(i.remote_lookups);
  s.remote_hits = get(i.remote_hits);
  s.remote_removes = get(i.remote_removes);
  s.remote_removed = get(i.remote_removed);
  s.served_removes = get(i.served_removes);
  s.remove_incomplete = get(i.remove_incomplete);
  s.served_leases = get(i.served_leases);
  s.served_lease_bytes = get(i.served_lease_bytes);
  s.served_commits = get(i.served_commits);
  s.served_commit_bytes = get(i.served_commit_bytes);
  s.checksum_failures = get(i.checksum_failures);
  s.timeouts = get(i.timeouts);
  s.budget_cuts = get(i.budget_cuts);
  s.expired = get(i.expired);
  s.bad_messages = get(i.bad_messages);
  s.fetched_mapped = get(i.fetched_mapped);
  s.map_failures = get(i.map_failures);
  s.lease_hashes = get(i.lease_hashes);
  s.mapped_leases = get(i.mapped_leases);
  for (const auto& lane : i.lanes) s.late_replies += lane.t->counters().dropped;
  s.peer_leases = static_cast<uint64_t>(std::max<int64_t>(0, i.peer_leases.load()));
  s.peer_reservations = static_cast<uint64_t>(std::max<int64_t>(0, i.peer_reservations.load()));
  {
    std::lock_guard<std::mutex> q(const_cast<Impl&>(i).quarantine_mu);
    s.quarantined = i.quarantine.size();
    for (const auto& r : i.quarantine) s.quarantined_bytes += r.size;
  }
  return s;
}

void ClusterNode::close() {
  Impl& i = *impl_;
  std::lock_guard<std::mutex> l(i.close_mu);
  if (i.closed) return;
  i.closed = true;
  {
    std::lock_guard<std::mutex> q(i.queue_mu);
    i.stopping.store(true);
  }
  i.queue_cv.notify_all();
  i.drained_cv.notify_all();
  {
    std::lock_guard<std::mutex> h(i.hello_mu);  // a helloer checks stopping under it
  }
  i.hello_cv.notify_all();
  for (auto& t : i.helloers) t.join();
  for (auto& t : i.service) t.join();
  if (i.pusher.joinable()) i.pusher.join();
  std::map<Impl::PeerKey, std::shared_ptr<PeerState>> peers;
  {
    std::lock_guard<std::mutex> pl(i.peers_mu);
    peers.swap(i.peers);
  }
  // The transport closes first: once it is closed no transfer of a peer
  // touches the arena, so the ranges can be reused.
  {
    std::lock_guard<std::mutex> ll(i.links_mu);
    for (auto& [id, slot] : i.links) {
      std::lock_guard<std::mutex> sl(slot->mu);
      (void)Impl::drop_links(*slot);  // a closed member pins no other member's memory
    }
  }
  for (auto& lane : i.lanes) lane.t->close();
  {
    std::lock_guard<std::mutex> q(i.quarantine_mu);
    for (const auto& r : i.quarantine) i.store->abort(r);
    i.quarantine.clear();
    for (const auto& e : i.ending) i.store->abort(e.r);
    i.peer_reservations.fetch_sub(static_cast<int64_t>(i.ending.size()), std::memory_order_relaxed);
    i.ending.clear();
    i.transports_closed = true;
  }
  for (auto& [k, p] : peers) i.end_peer(*p, /*closed=*/true);
  for (auto& lane : i.lanes) lane.region.reset();
}

}  // namespace cascade
