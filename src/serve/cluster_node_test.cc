// Cluster members in one process: two PoolServers whose ClusterNodes talk
// over the transport (TCP), client stores on each, and a raw endpoint that
// speaks the members' protocol (cluster_wire.h) by hand.
#include "serve/cluster_node.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "cascade/store.h"
#include "serve/cluster_wire.h"
#include "serve/pool_raw_client_testing.h"
#include "serve/pool_server.h"
#include "transport/forked_peer.h"
#include "transport/transport.h"
#include "util/block_checksum.h"

namespace cascade {
namespace {

using namespace std::chrono_literals;

std::string unique(const std::string& what) {
  static std::atomic<int> n{0};
  return what + std::to_string(getpid()) + "-" + std::to_string(n++);
}

std::vector<uint8_t> bytes_of(int i, size_t n) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(i);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Polls `done` every `step` until it holds or `limit` has passed.
void poll_until(const std::function<bool()>& done, std::chrono::milliseconds limit,
                std::chrono::milliseconds step = 10ms) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(step);
}

struct Member {
  std::string socket = "/tmp/" + unique("cascade-cluster-test-") + ".sock";
  std::unique_ptr<PoolServer> server;
  ClusterNode* node = nullptr;

  std::string shm_path;

  // map_same_host off by default: these tests are about the transport; the
  // ones about mapped arenas turn it on.
  Member(const std::string& id, uint32_t expiry_ms = 60000, uint32_t lanes = 4,
         uint32_t timeout_ms = 500, bool map_same_host = false, uint32_t budget_ms = 0) {
    CascadeConfig c;
    c.pipeline = "host";
    c.shm_capacity_bytes = 64 << 20;
    c.shm_path = "/dev/shm/" + unique("cascade-cluster-test-");
    shm_path = c.shm_path;
    c.num_io_threads = 2;
    c.index_shards = 16;
    PoolServerOptions o;
    o.socket_path = socket;
    auto s = PoolServer::Start(c, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return;
    server = std::move(s.value());
    ClusterNodeOptions co;
    co.node_id = id;
    co.generation = 7;
    co.fabrics = "tcp";
    co.request_timeout_ms = timeout_ms;
    co.request_budget_ms = budget_ms;
    co.lease_expiry_ms = expiry_ms;
    co.retry_after_ms = 100;
    co.lanes = lanes;
    co.map_same_host = map_same_host;
    auto n = server->start_cluster(co);
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    if (n.ok()) node = *n;
  }
  ~Member() {
    if (server) (void)server->close();
  }
  std::unique_ptr<CascadeStore> client(uint32_t threads = 2) {
    CascadeConfig c;
    c.pipeline = "pool";
    c.pool_socket = socket;
    c.pool_namespace = "ns";
    c.pool_channels = threads;
    c.num_io_threads = threads;
    c.use_gpu = false;
    auto s = CascadeStore::Open(c);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s.value()) : nullptr;
  }
};

// A view of the given members, each with a few points spread over the ring.
ClusterView view_of(const std::vector<std::pair<std::string, std::vector<uint8_t>>>& members,
                    uint64_t version = 1) {
  ClusterView v;
  v.version = version;
  std::vector<std::pair<uint64_t, uint32_t>> points;
  for (uint32_t m = 0; m < members.size(); ++m) {
    v.members.push_back(ClusterMember{members[m].first, 7, members[m].second});
    std::mt19937_64 rng(m + 1);
    for (int p = 0; p < 32; ++p) points.emplace_back(rng(), m);
  }
  std::sort(points.begin(), points.end());
  for (auto& [pos, m] : points) {
    v.positions.push_back(pos);
    v.owners.push_back(m);
  }
  return v;
}

// An endpoint that speaks the protocol by hand.
struct RawMember {
  std::unique_ptr<Transport> t;
  std::shared_ptr<Peer> peer;
  std::string id = "raw";
  uint64_t next_tag = 1;

  explicit RawMember(const std::vector<uint8_t>& address) {
    TransportOptions o;
    o.fabrics = "tcp";
    o.progress_thread = true;
    auto tr = Transport::Open(o);
    EXPECT_TRUE(tr.ok()) << tr.status().ToString();
    t = std::move(tr.value());
    auto p = t->connect(address, deadline_in(2000ms));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    peer = std::move(p.value());
  }
  std::vector<uint8_t> head(cluster::Op op, uint32_t count, uint64_t tag) {
    cluster::RequestHead h{};
    h.magic = cluster::kMagic;
    h.version = cluster::kVersion;
    h.op = static_cast<uint32_t>(op);
    h.count = count;
    h.reply_tag = tag;
    h.generation = 7;
    h.node_id_bytes = static_cast<uint32_t>(id.size());
    std::memcpy(h.node_id, id.data(), id.size());
    std::vector<uint8_t> out(sizeof h);
    std::memcpy(out.data(), &h, sizeof h);
    return out;
  }
  // Sends op and returns the reply (empty when none came).
  std::vector<uint8_t> call(cluster::Op op, uint32_t count, const std::vector<uint8_t>& body) {
    const uint64_t tag = cluster::kReplyTagBit | next_tag++;
    std::vector<uint8_t> m = head(op, count, tag);
    m.insert(m.end(), body.begin(), body.end());
    EXPECT_TRUE(peer->send(cluster::kRequestTag, m, deadline_in(1000ms)).ok());
    auto r = t->receive(tag, cluster::kMaxReplyBytes, deadline_in(1000ms));
    return r.ok() ? *r : std::vector<uint8_t>{};
  }
  void send_raw(const std::vector<uint8_t>& m) {
    EXPECT_TRUE(peer->send(cluster::kRequestTag, m, deadline_in(1000ms)).ok());
  }
  // Says hello and imports the owner's arena key: null on failure.
  std::shared_ptr<RemoteRegion> hello_with_key() {
    auto hello =
        call(cluster::Op::kHello, static_cast<uint32_t>(t->address().size()), t->address());
    if (hello.size() < sizeof(cluster::ReplyHead) + sizeof(cluster::HelloReply)) return nullptr;
    cluster::HelloReply hr;
    std::memcpy(&hr, hello.data() + sizeof(cluster::ReplyHead), sizeof hr);
    const size_t key_at = sizeof(cluster::ReplyHead) + sizeof hr;
    if (key_at + hr.key_bytes > hello.size()) return nullptr;
    auto region = peer->import_key(std::span<const uint8_t>(hello.data() + key_at, hr.key_bytes));
    EXPECT_TRUE(region.ok()) << region.status().ToString();
    return region.ok() ? std::move(region.value()) : nullptr;
  }
  // Reserves room for one block at the owner; code != 0 when refused.
  cluster::ReserveReply reserve(const BlockId& id, uint64_t size) {
    pool::ReserveItem ri{};
    std::memcpy(ri.id, id.bytes.data(), 16);
    ri.size = size;
    std::vector<uint8_t> body(sizeof ri);
    std::memcpy(body.data(), &ri, sizeof ri);
    auto rr = call(cluster::Op::kReserve, 1, body);
    cluster::ReserveReply granted{};
    granted.code = UINT32_MAX;
    if (rr.size() == sizeof(cluster::ReplyHead) + sizeof granted)
      std::memcpy(&granted, rr.data() + sizeof(cluster::ReplyHead), sizeof granted);
    return granted;
  }
};

// A view of member "a" and the hand-made member "raw".
ClusterView view_with_raw(const Member& a, const RawMember& raw) {
  return view_of({{"a", a.node->address()}, {"raw", raw.t->address()}});
}

// An owner that speaks the protocol by hand: it answers hellos (after
// hello_delay) with a small registered arena of its own, and every other
// request with what `answer` returns (nothing: no reply), after reply_delay.
// Its hello reply lists its own address as lane 0 and, with silent_lane, a
// second lane whose endpoint never answers.
constexpr uint64_t kRawArena = 1 << 20;

struct RawOwner {
  using Answer = std::function<std::optional<std::vector<uint8_t>>(cluster::Op op, uint32_t count,
                                                                   const uint8_t* items)>;
  std::unique_ptr<Transport> t, silent;
  std::vector<uint8_t> memory = std::vector<uint8_t>(kRawArena);
  std::unique_ptr<MemoryRegion> region;
  Answer answer;
  std::chrono::milliseconds hello_delay{0}, reply_delay{0};
  std::atomic<int> replies_sent{0};

  std::mutex mu;
  std::condition_variable cv;
  struct Due {
    std::shared_ptr<Peer> to;
    uint64_t tag;
    std::vector<uint8_t> bytes;
  };
  std::multimap<std::chrono::steady_clock::time_point, Due> due;  // guarded by mu
  std::vector<uint64_t> released;                                 // tokens, guarded by mu
  std::vector<uint64_t> aborted;                                  // tokens, guarded by mu
  bool stop = false;                                              // guarded by mu
  std::thread server, sender;

  // An answer to `op` alone, one reply per item: reply(k) for item k.
  template <class Make>
  static Answer each_item(cluster::Op op, Make reply) {
    return [op, reply](cluster::Op got, uint32_t count, const uint8_t*) {
      std::optional<std::vector<uint8_t>> out;
      if (got != op) return out;
      out.emplace();
      for (uint32_t k = 0; k < count; ++k) {
        const auto r = reply(k);
        const auto* b = reinterpret_cast<const uint8_t*>(&r);
        out->insert(out->end(), b, b + sizeof r);
      }
      return out;
    };
  }

  // Lookups answered alone: every id held with `size` bytes, or (size 0)
  // every id a miss.
  static Answer lookups(uint64_t size) {
    return each_item(cluster::Op::kLookup, [size](uint32_t) {
      cluster::LookupReply l{};
      if (size) l.size = size;
      else l.code = static_cast<uint32_t>(Code::kNotFound);
      return l;
    });
  }

  explicit RawOwner(Answer a, bool silent_lane = false) : answer(std::move(a)) {
    TransportOptions o;
    o.fabrics = "tcp";
    o.progress_thread = true;
    auto tr = Transport::Open(o);
    EXPECT_TRUE(tr.ok()) << tr.status().ToString();
    t = std::move(tr.value());
    auto r = t->register_memory(memory.data(), memory.size());
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    region = std::move(r.value());
    if (silent_lane) {
      auto s = Transport::Open(o);
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      silent = std::move(s.value());
    }
  }
  ~RawOwner() {
    {
      std::lock_guard<std::mutex> l(mu);
      stop = true;
    }
    cv.notify_all();
    if (server.joinable()) server.join();
    if (sender.joinable()) sender.join();
    // Nothing reaches the memory once the transports are closed.
    if (t) t->close();
    if (silent) silent->close();
  }
  void start() {
    server = std::thread([this] { serve(); });
    sender = std::thread([this] { send_due(); });
  }
  bool stopping() {
    std::lock_guard<std::mutex> l(mu);
    return stop;
  }
  void later(std::chrono::milliseconds delay, std::shared_ptr<Peer> to, uint64_t tag,
             std::vector<uint8_t> bytes) {
    {
      std::lock_guard<std::mutex> l(mu);
      due.emplace(std::chrono::steady_clock::now() + delay,
                  Due{std::move(to), tag, std::move(bytes)});
    }
    cv.notify_all();
  }
  static std::vector<uint8_t> ok(uint32_t count, const std::vector<uint8_t>& items) {
    cluster::ReplyHead h{};
    h.count = count;
    std::vector<uint8_t> out(sizeof h);
    std::memcpy(out.data(), &h, sizeof h);
    out.insert(out.end(), items.begin(), items.end());
    return out;
  }
  void serve() {
    std::map<uint32_t, std::shared_ptr<Peer>> back;  // by the sender's lane
    while (!stopping()) {
      auto m = t->receive(cluster::kRequestTag, cluster::kMaxRequestBytes, deadline_in(50ms));
      if (!m.ok() || m->size() < sizeof(cluster::RequestHead)) continue;
      cluster::RequestHead h;
      std::memcpy(&h, m->data(), sizeof h);
      const uint8_t* body = m->data() + sizeof h;
      const auto op = static_cast<cluster::Op>(h.op);
      if (op == cluster::Op::kHello) {
        auto p = t->connect(std::vector<uint8_t>(body, body + h.count), deadline_in(2000ms));
        if (!p.ok()) continue;
        back[h.lane] = *p;
        cluster::HelloReply hr{};
        hr.generation = 7;
        hr.arena_bytes = memory.size();
        hr.key_bytes = static_cast<uint32_t>(region->remote_key().size());
        hr.lanes = silent ? 2 : 1;
        std::vector<uint8_t> items(sizeof hr);
        std::memcpy(items.data(), &hr, sizeof hr);
        items.insert(items.end(), region->remote_key().begin(), region->remote_key().end());
        for (Transport* lane : {t.get(), silent.get()}) {
          if (lane == nullptr) continue;
          const uint32_t n = static_cast<uint32_t>(lane->address().size());
          items.insert(items.end(), reinterpret_cast<const uint8_t*>(&n),
                       reinterpret_cast<const uint8_t*>(&n) + sizeof n);
          items.insert(items.end(), lane->address().begin(), lane->address().end());
        }
        cluster::HostArena none{};  // no arena file to map: everything over the transport
        items.insert(items.end(), reinterpret_cast<const uint8_t*>(&none),
                     reinterpret_cast<const uint8_t*>(&none) + sizeof none);
        later(hello_delay, *p, h.reply_tag, ok(1, items));
        continue;
      }
      if (op == cluster::Op::kRelease || op == cluster::Op::kAbort) {
        std::lock_guard<std::mutex> l(mu);
        for (uint32_t k = 0; k < h.count; ++k) {
          uint64_t token;
          std::memcpy(&token, body + k * sizeof token, sizeof token);
          (op == cluster::Op::kRelease ? released : aborted).push_back(token);
        }
      }
      auto it = back.find(h.lane);
      if (h.reply_tag == 0 || it == back.end()) continue;
      auto reply = answer(op, h.count, body);
      if (reply) later(reply_delay, it->second, h.reply_tag, ok(h.count, *reply));
    }
  }
  void send_due() {
    std::unique_lock<std::mutex> l(mu);
    while (!stop) {
      if (due.empty()) {
        cv.wait(l);
        continue;
      }
      auto first = due.begin();
      if (cv.wait_until(l, first->first) == std::cv_status::no_timeout) continue;
      Due d = std::move(first->second);
      due.erase(first);
      l.unlock();
      if (d.to->send(d.tag, d.bytes, deadline_in(2000ms)).ok()) ++replies_sent;
      l.lock();
    }
  }
  std::vector<uint64_t> released_tokens() {
    std::lock_guard<std::mutex> l(mu);
    return released;
  }
  std::vector<uint64_t> aborted_tokens() {
    std::lock_guard<std::mutex> l(mu);
    return aborted;
  }
  // The aborted tokens, sorted, once `count` have come (aborts are sent
  // without waiting for a reply) or after 3 s.
  std::vector<uint64_t> aborted_once(size_t count) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<uint64_t> got = aborted_tokens();
    while (got.size() < count && std::chrono::steady_clock::now() - t0 < 3s) {
      std::this_thread::sleep_for(10ms);
      got = aborted_tokens();
    }
    std::sort(got.begin(), got.end());
    return got;
  }
};

// A view of member `self` and an owner that holds every point.
ClusterView view_owned_by(const std::string& self, const std::vector<uint8_t>& self_address,
                          const std::vector<uint8_t>& owner_address) {
  ClusterView v;
  v.version = 1;
  v.members.push_back(ClusterMember{self, 7, self_address});
  v.members.push_back(ClusterMember{"raw", 7, owner_address});
  for (uint64_t k = 0; k < 4; ++k) {
    v.positions.push_back(k << 62);
    v.owners.push_back(1);
  }
  return v;
}

BlockId id_of(uint64_t v) { return compute_block_id(&v, sizeof v); }

// One id looked up through a member: whether an owner holds it, and its size.
std::pair<bool, uint64_t> lookup_one(ClusterNode* node, const BlockId& id) {
  uint8_t found = 0;
  uint64_t size = 0;
  node->lookup({&id, 1}, {&found, 1}, {&size, 1});
  return {found != 0, size};
}

// Reads id through `store` and checks it holds `want`.
void expect_block(CascadeStore* store, const BlockId& id, const std::vector<uint8_t>& want) {
  std::vector<uint8_t> out(want.size() + 4096);
  GetResult r;
  ASSERT_TRUE(store->get(id, out.data(), out.size(), &r).ok());
  ASSERT_TRUE(r.found);
  ASSERT_EQ(r.size, want.size());
  ASSERT_EQ(0, std::memcmp(out.data(), want.data(), want.size()));
}

// Appends a reply item's bytes.
template <class T>
void append_item(std::vector<uint8_t>* out, const T& item) {
  const auto* b = reinterpret_cast<const uint8_t*>(&item);
  out->insert(out->end(), b, b + sizeof item);
}

// Installs the view of members a and b in both.
bool share_view(Member& a, Member& b) {
  auto v = view_of({{"a", a.node->address()}, {"b", b.node->address()}});
  return a.node->set_view(v).ok() && b.node->set_view(v).ok();
}

// Stores n blocks of 4 KiB straight into store (ids id_of(first + i)) and
// returns their ids as the bytes of a lease request.
std::vector<uint8_t> put_blocks(CascadeStore* store, uint64_t first, int n) {
  std::vector<uint8_t> ids;
  for (int i = 0; i < n; ++i) {
    auto data = bytes_of(i, 4096);
    BlockId id = id_of(first + i);
    EXPECT_TRUE(store->put(id, data.data(), data.size()).ok());
    ids.insert(ids.end(), id.bytes.begin(), id.bytes.end());
  }
  return ids;
}

// Starts `owner` as the owner of every id in member a's view, writes n
// blocks (ids first, first + 1, ...) through a client of a, and returns once
// a's pushes of them to the owner are over.
void push_to_raw_owner(Member& a, RawOwner& owner, uint64_t first, int n) {
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  auto ca = a.client();
  ASSERT_TRUE(ca);
  put_blocks(ca.get(), first, n);
  ASSERT_TRUE(a.node->drain(5000));
}

#define SKIP_WITHOUT_TRANSPORT() \
  if (!Transport::available()) GTEST_SKIP() << "built without a transport"

TEST(ClusterNode, BlocksCommittedOnOneMemberAreFetchedThroughAnother) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a"), b("b");
  ASSERT_TRUE(a.node && b.node);
  ASSERT_TRUE(share_view(a, b));
  auto ca = a.client();
  auto cb = b.client();
  ASSERT_TRUE(ca && cb);
  constexpr int kBlocks = 64;
  for (int i = 0; i < kBlocks; ++i) {
    auto data = bytes_of(i, 4096 * (1 + i % 16));
    ASSERT_TRUE(ca->put(id_of(i), data.data(), data.size()).ok());
  }
  ASSERT_TRUE(a.node->drain(5000));
  EXPECT_GT(a.node->stats().pushed, 0u);
  EXPECT_EQ(a.node->stats().push_dropped, 0u);
  for (int i = 0; i < kBlocks; ++i)
    expect_block(cb.get(), id_of(i), bytes_of(i, 4096 * (1 + i % 16)));
  const ClusterStats sb = b.node->stats();
  EXPECT_GT(sb.fetched, 0u);
  EXPECT_GT(sb.served_commits, 0u);
  EXPECT_EQ(sb.checksum_failures, 0u);
  // Every fetch released its leases (releases are sent without waiting).
  poll_until([&] { return a.node->stats().peer_leases == 0; }, 2000ms);
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
}

TEST(ClusterNode, ARemoveReachesTheOwnersAndTheMembersThatFetchedTheBlock) {
  // Before, a remove went to the client's own server only: the owner, and
  // members that had fetched the block, went on serving it, and a put of
  // other bytes under the id after the remove found the owner's old copy
  // present, so readers through other servers got the old bytes.
  SKIP_WITHOUT_TRANSPORT();
  Member a("a"), b("b"), c("c");
  ASSERT_TRUE(a.node && b.node && c.node);
  auto v = view_of({{"a", a.node->address()}, {"b", b.node->address()}, {"c", c.node->address()}});
  for (Member* m : {&a, &b, &c}) ASSERT_TRUE(m->node->set_view(v).ok());
  auto ca = a.client();
  auto cb = b.client();
  auto cc = c.client();
  ASSERT_TRUE(ca && cb && cc);
  constexpr int kBlocks = 32;
  auto first = [](int i) { return bytes_of(i, 4096); };
  auto second = [](int i) { return bytes_of(1000 + i, 4096); };
  for (int i = 0; i < kBlocks; ++i) ASSERT_TRUE(ca->put(id_of(i), first(i).data(), 4096).ok());
  ASSERT_TRUE(a.node->drain(5000));
  for (int i = 0; i < kBlocks; ++i) {  // b and c fetch them into their stores
    expect_block(cb.get(), id_of(i), first(i));
    expect_block(cc.get(), id_of(i), first(i));
  }
  for (int i = 0; i < kBlocks; ++i) ASSERT_TRUE(ca->remove(id_of(i)).ok()) << i;
  EXPECT_EQ(a.node->stats().remote_removes, 2u * kBlocks);  // every id to b and c, once
  EXPECT_GE(a.node->stats().remote_removed, 2u * kBlocks);  // b's and c's copies at least
  for (int i = 0; i < kBlocks; ++i) {
    EXPECT_FALSE(cb->contains(id_of(i))) << i;
    EXPECT_FALSE(cc->contains(id_of(i))) << i;
  }
  // Stored again with other bytes: every server serves the new ones.
  for (int i = 0; i < kBlocks; ++i) ASSERT_TRUE(ca->put(id_of(i), second(i).data(), 4096).ok());
  ASSERT_TRUE(a.node->drain(5000));
  for (int i = 0; i < kBlocks; ++i) {
    expect_block(cb.get(), id_of(i), second(i));
    expect_block(cc.get(), id_of(i), second(i));
  }
}

// A prefix block (PutOptions::is_prefix) stays one wherever it is leased
// or fetched: through its writer's server, and through another member that
// fetches it from its owner, so that either keeps it longer than ordinary
// blocks.
TEST(ClusterNode, APrefixBlockStaysOneThroughLeasesAndFetches) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a"), b("b");
  ASSERT_TRUE(a.node && b.node);
  ASSERT_TRUE(share_view(a, b));
  auto ca = a.client();
  auto cb = b.client();
  ASSERT_TRUE(ca && cb);
  constexpr int kBlocks = 32;
  for (int i = 0; i < kBlocks; ++i) {
    PutOptions o;
    o.is_prefix = i % 2 == 0;
    auto data = bytes_of(7000 + i, 8192);
    ASSERT_TRUE(ca->put(id_of(7000 + i), data.data(), data.size(), o).ok());
  }
  ASSERT_TRUE(a.node->drain(5000));
  ASSERT_EQ(a.node->stats().push_dropped, 0u);
  for (CascadeStore* c : {ca.get(), cb.get()}) {
    for (int i = 0; i < kBlocks; ++i) {
      auto v = c->acquire(id_of(7000 + i));
      ASSERT_TRUE(v.ok()) << v.status().ToString();
      EXPECT_EQ(v->is_prefix(), i % 2 == 0) << i << (c == ca.get() ? " writer" : " other");
      const auto want = bytes_of(7000 + i, 8192);
      ASSERT_EQ(v->size(), want.size());
      EXPECT_EQ(0, std::memcmp(v->data(), want.data(), want.size())) << i;
    }
  }
  EXPECT_GT(b.node->stats().fetched, 0u);
}

TEST(ClusterNode, MembersWithDifferentLaneCountsMoveBlocksOnEveryLane) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, /*lanes=*/3), b("b", 60000, /*lanes=*/5);
  ASSERT_TRUE(a.node && b.node);
  ASSERT_TRUE(share_view(a, b));
  // Clients with many threads: the servers' workers call on many lanes.
  auto ca = a.client(8);
  auto cb = b.client(8);
  constexpr int kBlocks = 400;
  std::vector<BlockId> ids;
  std::vector<std::vector<uint8_t>> data;
  std::vector<ConstBuffer> bufs;
  for (int i = 0; i < kBlocks; ++i) {
    ids.push_back(id_of(7000 + i));
    data.push_back(bytes_of(7000 + i, 8192 + 64 * (i % 7)));
  }
  for (const auto& d : data) bufs.push_back(ConstBuffer{d.data(), d.size()});
  std::vector<Status> st;
  ASSERT_EQ(ca->put_batch(ids, bufs, &st), size_t(kBlocks));
  ASSERT_TRUE(a.node->drain(5000));
  std::vector<std::vector<uint8_t>> out(kBlocks, std::vector<uint8_t>(8192 + 64 * 7));
  std::vector<MutableBuffer> outs;
  for (auto& o : out) outs.push_back(MutableBuffer{o.data(), o.size()});
  std::vector<GetResult> results;
  cb->get_batch(ids, outs, &results, &st);
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE(st[i].ok() && results[i].found) << i << ": " << st[i].ToString();
    ASSERT_EQ(results[i].size, data[i].size());
    ASSERT_EQ(0, std::memcmp(out[i].data(), data[i].data(), data[i].size())) << i;
  }
  EXPECT_GT(b.node->stats().fetched, 0u);
  EXPECT_EQ(b.node->stats().checksum_failures, 0u);
  EXPECT_EQ(a.node->stats().push_dropped, 0u);
}

TEST(ClusterNode, MalformedMessagesAreIgnoredAndTheMemberGoesOn) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a"), b("b");
  ASSERT_TRUE(a.node && b.node);
  ASSERT_TRUE(share_view(a, b));
  RawMember raw(a.node->address());
  // In a's view, with no points: a keeps what it knows of it.
  ClusterView with_raw = view_of({{"a", a.node->address()}, {"b", b.node->address()}});
  with_raw.members.push_back(ClusterMember{"raw", 7, raw.t->address()});
  ASSERT_TRUE(a.node->set_view(with_raw).ok());
  std::mt19937_64 rng(99);
  // Random bytes, truncated heads, wrong magic, unknown ops, counts that do
  // not match the body, requests from a sender that never said Hello.
  for (int i = 0; i < 300; ++i) {
    std::vector<uint8_t> m;
    switch (i % 6) {
      case 0: m.resize(rng() % 400); break;
      case 1:
        m = raw.head(cluster::Op::kLookup, 1, cluster::kReplyTagBit | 5);
        m.resize(rng() % m.size());
        break;
      case 2:
        m = raw.head(cluster::Op::kLookup, 1, cluster::kReplyTagBit | 5);
        m[0] ^= 1;
        break;
      case 3:
        m = raw.head(static_cast<cluster::Op>(50 + rng() % 100), 0, cluster::kReplyTagBit | 5);
        break;
      case 4:
        m = raw.head(cluster::Op::kLease, 3, cluster::kReplyTagBit | 5);
        m.resize(m.size() + 17);
        break;
      case 5:
        m = raw.head(cluster::Op::kHello, 4000, cluster::kReplyTagBit | 5);
        m.resize(m.size() + 12);
        break;
    }
    for (size_t k = m.empty() ? 0 : (i % 6 == 0 ? 0 : m.size()); k < m.size(); ++k)
      m[k] = static_cast<uint8_t>(rng());
    raw.send_raw(m);
  }
  // A Hello, then requests whose counts disagree with their bodies: error
  // replies, the sender stays known.
  auto hello = raw.call(cluster::Op::kHello, static_cast<uint32_t>(raw.t->address().size()),
                        raw.t->address());
  ASSERT_GE(hello.size(), sizeof(cluster::ReplyHead) + sizeof(cluster::HelloReply));
  auto bad = raw.call(cluster::Op::kLookup, 5, std::vector<uint8_t>(16));
  ASSERT_GE(bad.size(), sizeof(cluster::ReplyHead));
  cluster::ReplyHead h;
  std::memcpy(&h, bad.data(), sizeof h);
  EXPECT_EQ(h.code, static_cast<uint32_t>(Code::kInvalidArgument));
  // Commits and releases of tokens never granted change nothing.
  std::vector<uint8_t> commit(sizeof(cluster::CommitItem) * 4);
  for (auto& c : commit) c = static_cast<uint8_t>(rng());
  auto cr = raw.call(cluster::Op::kCommit, 4, commit);
  ASSERT_GE(cr.size(), sizeof(cluster::ReplyHead) + 4 * sizeof(cluster::CodeReply));
  std::memcpy(&h, cr.data(), sizeof h);
  EXPECT_EQ(h.code, 0u);
  for (int k = 0; k < 4; ++k) {
    cluster::CodeReply c;
    std::memcpy(&c, cr.data() + sizeof h + k * sizeof c, sizeof c);
    EXPECT_EQ(c.code, static_cast<uint32_t>(Code::kInvalidArgument));
  }
  EXPECT_GT(a.node->stats().bad_messages, 250u);

  // A verifying owner refuses a commit that carries no checksum: bytes it
  // cannot check are never published.
  pool::ReserveItem ri{};
  const BlockId unchecked = id_of(4242);
  std::memcpy(ri.id, unchecked.bytes.data(), 16);
  ri.size = 4096;
  std::vector<uint8_t> rbody(sizeof ri);
  std::memcpy(rbody.data(), &ri, sizeof ri);
  auto rr = raw.call(cluster::Op::kReserve, 1, rbody);
  ASSERT_EQ(rr.size(), sizeof(cluster::ReplyHead) + sizeof(cluster::ReserveReply));
  cluster::ReserveReply granted;
  std::memcpy(&granted, rr.data() + sizeof(cluster::ReplyHead), sizeof granted);
  ASSERT_EQ(granted.code, 0u);
  cluster::CommitItem ci{granted.token, 0};
  std::vector<uint8_t> cbody(sizeof ci);
  std::memcpy(cbody.data(), &ci, sizeof ci);
  auto cz = raw.call(cluster::Op::kCommit, 1, cbody);
  ASSERT_EQ(cz.size(), sizeof(cluster::ReplyHead) + sizeof(cluster::CodeReply));
  cluster::CodeReply zc;
  std::memcpy(&zc, cz.data() + sizeof(cluster::ReplyHead), sizeof zc);
  EXPECT_EQ(zc.code, static_cast<uint32_t>(Code::kCorruption));
  EXPECT_FALSE(a.server->store()->contains(unchecked));
  EXPECT_EQ(a.node->stats().peer_reservations, 0u);

  // The member still serves the others.
  auto ca = a.client();
  auto cb = b.client();
  std::vector<BlockId> ids;
  for (int i = 0; i < 40; ++i) {
    auto data = bytes_of(i, 8192);
    ids.push_back(id_of(1000 + i));
    ASSERT_TRUE(ca->put(ids.back(), data.data(), data.size()).ok());
  }
  ASSERT_TRUE(a.node->drain(5000));
  for (int i = 0; i < 40; ++i) expect_block(cb.get(), ids[i], bytes_of(i, 8192));
}

TEST(ClusterNode, LeasesOfAMemberThatNeverReleasesExpireAndALeavingMemberLosesThem) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", /*expiry_ms=*/3500);
  ASSERT_TRUE(a.node);
  std::vector<uint8_t> ids = put_blocks(a.server->store(), 2000, 8);
  RawMember raw(a.node->address());
  ASSERT_TRUE(a.node->set_view(view_with_raw(a, raw)).ok());
  ASSERT_FALSE(raw.call(cluster::Op::kHello, static_cast<uint32_t>(raw.t->address().size()),
                        raw.t->address())
                   .empty());
  auto lease = raw.call(cluster::Op::kLease, 8, ids);
  ASSERT_EQ(lease.size(), sizeof(cluster::ReplyHead) + 8 * sizeof(cluster::LeaseReply));
  for (int k = 0; k < 8; ++k) {
    cluster::LeaseReply l;
    std::memcpy(&l, lease.data() + sizeof(cluster::ReplyHead) + k * sizeof l, sizeof l);
    ASSERT_EQ(l.code, 0u);
    EXPECT_EQ(l.size, 4096u);
    EXPECT_NE(l.checksum, 0u);
  }
  EXPECT_EQ(a.node->stats().peer_leases, 8u);
  poll_until([&] { return a.node->stats().peer_leases == 0; }, 8000ms, 50ms);
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
  EXPECT_GE(a.node->stats().expired, 8u);

  // Leased again, then the member leaves the view: its leases end at once.
  lease = raw.call(cluster::Op::kLease, 8, ids);
  ASSERT_FALSE(lease.empty());
  EXPECT_EQ(a.node->stats().peer_leases, 8u);
  ASSERT_TRUE(a.node->set_view(view_of({{"a", a.node->address()}}, 2)).ok());
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
}

TEST(ClusterNode, AMemberLeavingTheViewKeepsItsReservationsUntilTheyExpire) {
  SKIP_WITHOUT_TRANSPORT();
  // A member's put into a range it reserved may still be landing when the
  // owner's view drops it (its connection, which carries the put, is its
  // own): the range goes to no other block before the reservation expires.
  Member a("a", /*expiry_ms=*/6000);
  ASSERT_TRUE(a.node);
  RawMember raw(a.node->address());
  ASSERT_TRUE(a.node->set_view(view_with_raw(a, raw)).ok());
  // Blocks of a word pattern: made fast enough under the sanitizers that
  // the test ends well within the reservation's expiry.
  auto block = [](uint64_t i, size_t n) {
    std::vector<uint8_t> v(n);
    for (size_t w = 0; w + 8 <= n; w += 8) {
      uint64_t x = (i << 32 | w) * 0x9e3779b97f4a7c15ULL;
      x ^= x >> 29;
      std::memcpy(v.data() + w, &x, 8);
    }
    return v;
  };
  auto region = raw.hello_with_key();
  ASSERT_TRUE(region);

  constexpr uint64_t kBlock = 1 << 20;
  const BlockId pushed = id_of(9100);
  const cluster::ReserveReply granted = raw.reserve(pushed, kBlock);
  ASSERT_EQ(granted.code, 0u);
  EXPECT_EQ(a.node->stats().peer_reservations, 1u);

  // The view drops the member; the arena then fills with local blocks of
  // the same size, several times over (the oldest evicted).
  ASSERT_TRUE(a.node->set_view(view_of({{"a", a.node->address()}}, 2)).ok());
  const auto dropped = std::chrono::steady_clock::now();
  CascadeStore* store = a.server->store();
  std::vector<BlockId> ids;
  for (int i = 0; i < 160; ++i) {
    ids.push_back(id_of(9200 + i));
    auto data = block(9200 + i, kBlock);
    ASSERT_TRUE(store->put(ids.back(), data.data(), data.size()).ok());
  }
  // The member's put lands now, into the range it reserved.
  std::vector<uint8_t> late(kBlock, 0xAB);
  auto put = raw.peer->put(*region, granted.offset, late.data(), kBlock);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  ASSERT_TRUE((*put)->wait(deadline_in(2000ms)).ok());
  int present = 0;
  for (int i = 0; i < 160; ++i) {
    if (!store->contains(ids[i])) continue;
    ++present;
    ASSERT_NO_FATAL_FAILURE(expect_block(store, ids[i], block(9200 + i, kBlock)));
  }
  EXPECT_GT(present, 30);
  EXPECT_FALSE(store->contains(pushed));
  const auto held = a.node->stats().peer_reservations;  // held in the member's name
  EXPECT_TRUE(held == 1u || std::chrono::steady_clock::now() - dropped >= 6000ms)
      << "freed before its expiry";

  // After its expiry the range is free.
  poll_until([&] { return a.node->stats().peer_reservations == 0; }, 8000ms, 50ms);
  EXPECT_EQ(a.node->stats().peer_reservations, 0u);
  EXPECT_GE(a.node->stats().expired, 1u);
}

TEST(ClusterNode, AReservationForAnIdRemovedAtItsOwnerCommitsNothing) {
  SKIP_WITHOUT_TRANSPORT();
  // A member's push of X is under way (reserved at the owner, bytes on
  // their way) when a client removes X at the owner. Before, the push's
  // commit then stored the removed bytes at the owner, which kept them
  // against every later put of X.
  Member a("a", /*expiry_ms=*/6000);
  ASSERT_TRUE(a.node);
  RawMember raw(a.node->address());
  ASSERT_TRUE(a.node->set_view(view_with_raw(a, raw)).ok());
  auto region = raw.hello_with_key();
  ASSERT_TRUE(region);
  const BlockId x = id_of(8500);
  const auto old_bytes = bytes_of(5, 8192);
  const cluster::ReserveReply granted = raw.reserve(x, old_bytes.size());
  ASSERT_EQ(granted.code, 0u);
  // The push's bytes land; then a client removes X at the owner.
  auto put = raw.peer->put(*region, granted.offset, old_bytes.data(), old_bytes.size());
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  ASSERT_TRUE((*put)->wait(deadline_in(2000ms)).ok());
  // What the server does for a client's remove: its store's copy, then the
  // cluster's.
  (void)a.server->store()->remove(x);
  std::vector<uint8_t> removed(1);
  (void)a.node->remove({&x, 1}, removed);
  cluster::CommitItem ci{granted.token, block_checksum(old_bytes.data(), old_bytes.size())};
  std::vector<uint8_t> cbody(sizeof ci);
  std::memcpy(cbody.data(), &ci, sizeof ci);
  auto cr = raw.call(cluster::Op::kCommit, 1, cbody);
  ASSERT_EQ(cr.size(), sizeof(cluster::ReplyHead) + sizeof(cluster::CodeReply));
  cluster::CodeReply code;
  std::memcpy(&code, cr.data() + sizeof(cluster::ReplyHead), sizeof code);
  EXPECT_NE(code.code, 0u) << "a reservation of a removed id was committed";
  EXPECT_FALSE(a.server->store()->contains(x));
}

TEST(ClusterNode, WhatAMemberThatIsNotInTheViewHoldsEndsAfterADeadline) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");  // leases expire after a minute: the test must not wait for that
  ASSERT_TRUE(a.node);
  std::vector<uint8_t> ids = put_blocks(a.server->store(), 8000, 8);
  RawMember stray(a.node->address());  // "raw": never in the view
  RawMember known(a.node->address());
  known.id = "known";
  ASSERT_TRUE(
      a.node->set_view(view_of({{"a", a.node->address()}, {"known", known.t->address()}})).ok());
  for (RawMember* r : {&stray, &known}) {
    ASSERT_FALSE(
        r->call(cluster::Op::kHello, static_cast<uint32_t>(r->t->address().size()), r->t->address())
            .empty());
    auto lease = r->call(cluster::Op::kLease, 8, ids);
    ASSERT_EQ(lease.size(), sizeof(cluster::ReplyHead) + 8 * sizeof(cluster::LeaseReply));
  }
  EXPECT_EQ(a.node->stats().peer_leases, 16u);
  poll_until([&] { return a.node->stats().peer_leases <= 8; }, 5000ms, 20ms);
  EXPECT_EQ(a.node->stats().peer_leases, 8u);  // the member in the view keeps its leases
  EXPECT_EQ(a.node->stats().expired, 0u);      // ended, not expired
  // The stray member is forgotten (its requests are dropped until it says
  // hello again); the one in the view is still served.
  const std::vector<uint8_t> one(ids.begin(), ids.begin() + 16);
  EXPECT_TRUE(stray.call(cluster::Op::kLookup, 1, one).empty());
  EXPECT_FALSE(known.call(cluster::Op::kLookup, 1, one).empty());
}

TEST(ClusterNode, AMemberThatLeftTheViewAndCameBackIsAnsweredWithoutANewHello) {
  SKIP_WITHOUT_TRANSPORT();
  // A member stopped (or cut off from the coordination service) past its
  // lease drops out of the others' views and comes back with the same
  // generation; its own view never changed, so nothing makes it say Hello
  // again. Before, the owner forgot it when it left, and every request of
  // its links went unanswered: its pushes were dropped, its reads missed.
  Member a("a");
  ASSERT_TRUE(a.node);
  std::vector<uint8_t> ids = put_blocks(a.server->store(), 8100, 8);
  RawMember raw(a.node->address());
  const ClusterView both = view_with_raw(a, raw);
  ASSERT_TRUE(a.node->set_view(both).ok());
  ASSERT_FALSE(raw.call(cluster::Op::kHello, static_cast<uint32_t>(raw.t->address().size()),
                        raw.t->address())
                   .empty());
  ASSERT_FALSE(raw.call(cluster::Op::kLease, 8, ids).empty());
  EXPECT_EQ(a.node->stats().peer_leases, 8u);
  // It leaves the view: what it holds ends at once ...
  ClusterView alone = view_of({{"a", a.node->address()}}, 2);
  ASSERT_TRUE(a.node->set_view(alone).ok());
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
  // ... and, past the deadline after which a stray is forgotten, it is
  // still answered, and its holdings stay ended.
  std::this_thread::sleep_for(2500ms);  // the timeout (500 ms) and two sweeps
  const std::vector<uint8_t> one(ids.begin(), ids.begin() + 16);
  EXPECT_FALSE(raw.call(cluster::Op::kLookup, 1, one).empty());
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
  // A new connection while it is out (its call to this owner failed, say):
  // it is still the member that left, kept past the deadline for strays.
  ASSERT_FALSE(raw.call(cluster::Op::kHello, static_cast<uint32_t>(raw.t->address().size()),
                        raw.t->address())
                   .empty());
  std::this_thread::sleep_for(2500ms);
  EXPECT_FALSE(raw.call(cluster::Op::kLookup, 1, one).empty());
  // Back in the view, its requests go on over the same connection.
  ClusterView again = both;
  again.version = 3;
  ASSERT_TRUE(a.node->set_view(again).ok());
  auto lease = raw.call(cluster::Op::kLease, 8, ids);
  ASSERT_EQ(lease.size(), sizeof(cluster::ReplyHead) + 8 * sizeof(cluster::LeaseReply));
  EXPECT_EQ(a.node->stats().peer_leases, 8u);
  // It leaves again before a sweep has run: what it holds ends at once again.
  alone.version = 4;
  ASSERT_TRUE(a.node->set_view(alone).ok());
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
}

TEST(ClusterNode, ATokenOfAnEndedConnectionNeverReleasesALeaseOfTheNextOne) {
  // A member that connects a lane again (its Hello ends what the lane held)
  // may still send a release of a lease the old connection was granted: it
  // must not end a lease the new connection holds.
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");
  ASSERT_TRUE(a.node);
  std::vector<uint8_t> ids = put_blocks(a.server->store(), 5000, 2);
  RawMember raw(a.node->address());
  ASSERT_TRUE(a.node->set_view(view_with_raw(a, raw)).ok());
  auto hello = [&] {
    return !raw.call(cluster::Op::kHello, static_cast<uint32_t>(raw.t->address().size()),
                     raw.t->address())
                .empty();
  };
  auto lease_one = [&](int k) {
    const std::vector<uint8_t> id(ids.begin() + 16 * k, ids.begin() + 16 * (k + 1));
    auto r = raw.call(cluster::Op::kLease, 1, id);
    cluster::LeaseReply l{};
    EXPECT_EQ(r.size(), sizeof(cluster::ReplyHead) + sizeof l);
    if (r.size() >= sizeof(cluster::ReplyHead) + sizeof l)
      std::memcpy(&l, r.data() + sizeof(cluster::ReplyHead), sizeof l);
    EXPECT_EQ(l.code, 0u);
    return l.token;
  };
  ASSERT_TRUE(hello());
  const uint64_t old_token = lease_one(0);
  EXPECT_EQ(a.node->stats().peer_leases, 1u);
  ASSERT_TRUE(hello());  // the lane again: the old connection's lease ends
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
  (void)lease_one(1);
  EXPECT_EQ(a.node->stats().peer_leases, 1u);
  std::vector<uint8_t> release = raw.head(cluster::Op::kRelease, 1, 0);
  const uint8_t* t = reinterpret_cast<const uint8_t*>(&old_token);
  release.insert(release.end(), t, t + sizeof old_token);
  raw.send_raw(release);
  poll_until([&] { return a.node->stats().peer_leases != 1; }, 500ms);
  EXPECT_EQ(a.node->stats().peer_leases, 1u);  // the new connection's lease holds
}

TEST(ClusterNode, WhatAReplyThatCannotBeDeliveredGrantedIsTakenBack) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");  // leases expire after a minute: the test must not wait for that
  ASSERT_TRUE(a.node);
  std::vector<uint8_t> ids = put_blocks(a.server->store(), 3000, 4);
  RawMember raw(a.node->address());
  ASSERT_TRUE(a.node->set_view(view_with_raw(a, raw)).ok());
  // The hello names another endpoint as where replies go, then that
  // endpoint closes: the owner's replies cannot be delivered.
  TransportOptions o;
  o.fabrics = "tcp";
  o.progress_thread = true;
  auto gone = Transport::Open(o);
  ASSERT_TRUE(gone.ok());
  std::vector<uint8_t> hello =
      raw.head(cluster::Op::kHello, static_cast<uint32_t>((*gone)->address().size()),
               cluster::kReplyTagBit | 77);
  hello.insert(hello.end(), (*gone)->address().begin(), (*gone)->address().end());
  raw.send_raw(hello);
  auto hr =
      (*gone)->receive(cluster::kReplyTagBit | 77, cluster::kMaxReplyBytes, deadline_in(2000ms));
  ASSERT_TRUE(hr.ok()) << hr.status().ToString();
  (*gone)->close();
  // A full batch: its reply (80 KiB) is too large to leave in a send
  // buffer, so its send fails when nobody receives it.
  for (int i = 4; i < int(cluster::kMaxItems); ++i) {
    BlockId id = id_of(900000 + i);  // absent
    ids.insert(ids.end(), id.bytes.begin(), id.bytes.end());
  }
  std::vector<uint8_t> lease =
      raw.head(cluster::Op::kLease, cluster::kMaxItems, cluster::kReplyTagBit | 78);
  lease.insert(lease.end(), ids.begin(), ids.end());
  raw.send_raw(lease);
  const auto t0 = std::chrono::steady_clock::now();
  bool granted = false;
  while (std::chrono::steady_clock::now() - t0 < 6s) {
    const ClusterStats st = a.node->stats();
    granted |= st.served_leases >= 4;
    if (granted && st.peer_leases == 0) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(granted);
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
  EXPECT_EQ(a.node->stats().expired, 0u);  // taken back, not expired
}

TEST(ClusterNode, LeasesGrantedOutsideTheOwnersArenaAreReleasedAndAreMisses) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");
  ASSERT_TRUE(a.node);
  // Every lease lies outside the owner's arena: past its end, or longer than it.
  RawOwner owner(RawOwner::each_item(cluster::Op::kLease, [](uint32_t k) {
    cluster::LeaseReply l{};
    l.offset = k % 2 ? kRawArena : 0;
    l.size = k % 2 ? 4096 : kRawArena + 4096;
    l.token = 100 + k;
    l.checksum = 1;
    return l;
  }));
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  std::vector<BlockId> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(id_of(5000 + i));
  std::vector<uint8_t> fetched(ids.size(), 0);
  a.node->fetch(ids, fetched);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(fetched[i], 0) << i;
    EXPECT_FALSE(a.server->store()->contains(ids[i])) << i;
  }
  EXPECT_EQ(a.node->stats().fetched, 0u);
  EXPECT_GE(a.node->stats().bad_messages, ids.size());
  // Releases are sent without waiting for the owner.
  std::vector<uint64_t> released;
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < 3s) {
    released = owner.released_tokens();
    if (released.size() >= ids.size()) break;
    std::this_thread::sleep_for(10ms);
  }
  std::sort(released.begin(), released.end());
  std::vector<uint64_t> want;
  for (uint64_t k = 0; k < ids.size(); ++k) want.push_back(100 + k);
  EXPECT_EQ(released, want);
}

// Pushes an owner refuses to reserve (its arena full, say) are counted
// as dropped, not as pushed: stats() must not hide the blocks an owner
// does not hold.
TEST(ClusterNode, PushesTheOwnerRefusesAreCountedAsDropped) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");
  ASSERT_TRUE(a.node);
  RawOwner owner(RawOwner::each_item(cluster::Op::kReserve, [](uint32_t) {
    cluster::ReserveReply r{};
    r.code = static_cast<uint32_t>(Code::kNoSpace);
    return r;
  }));
  constexpr int kBlocks = 5;
  ASSERT_NO_FATAL_FAILURE(push_to_raw_owner(a, owner, 8000, kBlocks));
  const ClusterStats s = a.node->stats();
  EXPECT_EQ(s.pushed, 0u);
  EXPECT_EQ(s.push_dropped, uint64_t(kBlocks));
}

// A reservation an owner grants at an offset outside its arena is not
// written (a bad message) and is aborted at the owner, which would
// otherwise hold the space until the reservation expired.
TEST(ClusterNode, ReservationsGrantedOutsideTheOwnersArenaAreAborted) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");
  ASSERT_TRUE(a.node);
  std::atomic<uint64_t> next_token{500};  // the pushes may come in several calls
  RawOwner owner(RawOwner::each_item(cluster::Op::kReserve, [&](uint32_t) {
    cluster::ReserveReply r{};
    r.offset = kRawArena;  // past the end
    r.token = next_token++;
    return r;
  }));
  constexpr int kBlocks = 3;
  ASSERT_NO_FATAL_FAILURE(push_to_raw_owner(a, owner, 8100, kBlocks));
  EXPECT_EQ(a.node->stats().push_dropped, uint64_t(kBlocks));
  EXPECT_GE(a.node->stats().bad_messages, uint64_t(kBlocks));
  EXPECT_EQ(owner.aborted_once(kBlocks), (std::vector<uint64_t>{500, 501, 502}));
}

TEST(ClusterNode, ReservationsWhoseCommitGoesUnansweredAreAborted) {
  SKIP_WITHOUT_TRANSPORT();
  // The owner grants reservations (the bytes travel into its memory) and
  // never answers the commit: the pushing member gives the reservations back
  // rather than leave the owner holding them until they expire.
  Member a("a", 60000, 4, /*timeout_ms=*/300);
  ASSERT_TRUE(a.node);
  std::atomic<uint64_t> next_token{700};
  RawOwner owner(RawOwner::each_item(cluster::Op::kReserve, [&](uint32_t) {
    cluster::ReserveReply r{};
    r.token = next_token++;
    r.offset = (r.token - 700) * 4096;
    return r;
  }));
  constexpr int kBlocks = 3;
  ASSERT_NO_FATAL_FAILURE(push_to_raw_owner(a, owner, 8200, kBlocks));
  EXPECT_EQ(a.node->stats().push_dropped, uint64_t(kBlocks));
  std::vector<uint64_t> granted;
  for (uint64_t t = 700; t < next_token.load(); ++t) granted.push_back(t);
  EXPECT_FALSE(granted.empty());  // pushes after the first failure may find the link down
  EXPECT_EQ(owner.aborted_once(granted.size()), granted);
}

TEST(ClusterNode, ARemoveWaitsForThisMembersPushOfTheIdUnderWay) {
  SKIP_WITHOUT_TRANSPORT();
  // A block put through a, then removed through a while a's push of it to
  // the owner is under way. Before, the remove reached the owner first and
  // the push's commit stored the removed bytes there again.
  Member a("a", 60000, 4, /*timeout_ms=*/2000);
  ASSERT_TRUE(a.node);
  std::mutex mu;
  std::vector<cluster::Op> seen;  // guarded by mu
  std::atomic<uint64_t> next_token{900};
  RawOwner owner([&](cluster::Op op, uint32_t count, const uint8_t*) {
    {
      std::lock_guard<std::mutex> l(mu);
      seen.push_back(op);
    }
    std::optional<std::vector<uint8_t>> out;
    out.emplace();
    auto append = [&](const auto& item) { append_item(&*out, item); };
    for (uint32_t k = 0; k < count; ++k) {
      if (op == cluster::Op::kReserve) {
        cluster::ReserveReply r{};
        r.token = next_token++;
        r.offset = (r.token - 900) * 4096;
        append(r);
      } else {  // commit: stored; remove: not held
        append(cluster::CodeReply{op == cluster::Op::kRemove ? 1u : 0u});
      }
    }
    return out;
  });
  owner.reply_delay = 300ms;
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  auto ca = a.client();
  ASSERT_TRUE(ca);
  const auto data = bytes_of(1, 4096);
  ASSERT_TRUE(ca->put(id_of(8300), data.data(), data.size()).ok());
  auto saw = [&](cluster::Op op) {
    std::lock_guard<std::mutex> l(mu);
    return std::find(seen.begin(), seen.end(), op) != seen.end();
  };
  poll_until([&] { return saw(cluster::Op::kReserve); }, 5000ms, 1ms);
  ASSERT_TRUE(saw(cluster::Op::kReserve));  // the push holds the bytes and waits for its reply
  ASSERT_TRUE(ca->remove(id_of(8300)).ok());
  // The push, whose id was removed here while its bytes travelled, gives
  // its reservation back rather than commit it (before this, it committed,
  // and the remove waited for that). Either way the remove reaches the
  // owner after the push has ended.
  EXPECT_EQ(owner.aborted_once(1), std::vector<uint64_t>{900});
  std::lock_guard<std::mutex> l(mu);
  EXPECT_EQ(std::find(seen.begin(), seen.end(), cluster::Op::kCommit), seen.end());
  EXPECT_NE(std::find(seen.begin(), seen.end(), cluster::Op::kRemove), seen.end());
}

TEST(ClusterNode, APushUnderWayWhenAnotherMemberRemovesItsIdCommitsNothing) {
  SKIP_WITHOUT_TRANSPORT();
  // A block put through a, and removed through b while a's push of it to
  // the owner waits for its reserve. b's remove reaches the owner and a at
  // about the same time; the owner, with no reservation for the id yet,
  // removes nothing. Before, a's push then committed the removed bytes at
  // the owner, which served them to every member from then on.
  Member a("a", 60000, 4, /*timeout_ms=*/2000), b("b", 60000, 4, /*timeout_ms=*/2000);
  ASSERT_TRUE(a.node && b.node);
  std::mutex mu;
  std::vector<cluster::Op> seen;  // guarded by mu
  std::atomic<uint64_t> next_token{900};
  RawOwner owner([&](cluster::Op op, uint32_t count, const uint8_t*) {
    {
      std::lock_guard<std::mutex> l(mu);
      seen.push_back(op);
    }
    std::optional<std::vector<uint8_t>> out;
    out.emplace();
    for (uint32_t k = 0; k < count; ++k) {
      if (op == cluster::Op::kReserve) {
        cluster::ReserveReply r{};
        r.token = next_token++;
        r.offset = (r.token - 900) * 4096;
        append_item(&*out, r);
      } else {  // commit: stored; remove: not held
        append_item(&*out, cluster::CodeReply{op == cluster::Op::kRemove ? 1u : 0u});
      }
    }
    return out;
  });
  owner.reply_delay = 300ms;
  owner.start();
  // a knows b; b knows a alone (the hand-made owner answers one member).
  ClusterView v = view_owned_by("a", a.node->address(), owner.t->address());
  v.members.push_back(ClusterMember{"b", 7, b.node->address()});
  ASSERT_TRUE(a.node->set_view(v).ok());
  ClusterView vb = view_owned_by("b", b.node->address(), a.node->address());
  vb.members[1].node_id = "a";
  ASSERT_TRUE(b.node->set_view(vb).ok());
  auto ca = a.client();
  auto cb = b.client();
  ASSERT_TRUE(ca && cb);
  const auto data = bytes_of(1, 4096);
  ASSERT_TRUE(ca->put(id_of(8350), data.data(), data.size()).ok());
  auto saw = [&](cluster::Op op) {
    std::lock_guard<std::mutex> l(mu);
    return std::find(seen.begin(), seen.end(), op) != seen.end();
  };
  poll_until([&] { return saw(cluster::Op::kReserve); }, 5000ms, 1ms);
  ASSERT_TRUE(saw(cluster::Op::kReserve));  // a's push waits for its reserve
  (void)cb->remove(id_of(8350));
  EXPECT_EQ(owner.aborted_once(1), std::vector<uint64_t>{900});
  EXPECT_FALSE(a.server->store()->contains(id_of(8350)));
  std::lock_guard<std::mutex> l(mu);
  EXPECT_EQ(std::find(seen.begin(), seen.end(), cluster::Op::kCommit), seen.end())
      << "the push committed bytes removed while they travelled";
}

TEST(ClusterNode, AFetchUnderWayWhenItsIdIsRemovedStoresNothing) {
  SKIP_WITHOUT_TRANSPORT();
  // A view through a fetches X from its owner, whose hello comes late; a
  // remove of X through a meanwhile. Before, the fetch was not listed while
  // it connected: the remove did not wait for it, and its copy was stored
  // here after the remove returned, served from then on, and a put of other
  // bytes under X was answered "present".
  Member a("a", 60000, 1, /*timeout_ms=*/1500);
  ASSERT_TRUE(a.node);
  const BlockId x = id_of(8400);
  const auto old_bytes = bytes_of(3, 4096);
  RawOwner owner([&](cluster::Op op, uint32_t count, const uint8_t*) {
    std::optional<std::vector<uint8_t>> out;
    out.emplace();
    auto append = [&](const auto& item) { append_item(&*out, item); };
    for (uint32_t k = 0; k < count; ++k) {
      if (op == cluster::Op::kLease) {
        cluster::LeaseReply l{};
        l.size = old_bytes.size();
        l.token = 77;
        l.checksum = block_checksum(old_bytes.data(), old_bytes.size());
        append(l);
      } else {  // a remove (not held here)
        append(cluster::CodeReply{static_cast<uint32_t>(Code::kNotFound)});
      }
    }
    return out;
  });
  std::memcpy(owner.memory.data(), old_bytes.data(), old_bytes.size());
  owner.hello_delay = 600ms;
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  auto reader = a.client();
  auto remover = a.client();
  ASSERT_TRUE(reader && remover);
  std::thread read([&] {
    auto view = reader->acquire(x);  // a view: fetched into a's store
    if (view.ok()) view->reset();
  });
  std::this_thread::sleep_for(200ms);  // the fetch is connecting to the owner
  (void)remover->remove(x);
  read.join();
  EXPECT_FALSE(remover->contains(x)) << "the fetched copy outlived the remove";
}

TEST(ClusterNode, AConnectWithTwoHellosTakesOneDeadlineInAll) {
  SKIP_WITHOUT_TRANSPORT();
  // Two lanes here. The owner answers its hello after most of a deadline and
  // lists a second lane that never answers: the lane that talks to it needs
  // a second connect and hello after the first.
  Member a("a", 60000, /*lanes=*/2, /*timeout_ms=*/1000);
  ASSERT_TRUE(a.node);
  RawOwner owner(RawOwner::each_item(cluster::Op::kLease,
                                     [](uint32_t) {
                                       cluster::LeaseReply l{};
                                       l.code = static_cast<uint32_t>(Code::kNotFound);
                                       return l;
                                     }),
                 /*silent_lane=*/true);
  owner.hello_delay = 800ms;
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  // Enough ids for a part on each lane.
  std::vector<BlockId> ids;
  for (int i = 0; i < 16; ++i) ids.push_back(id_of(6000 + i));
  std::vector<uint8_t> fetched(ids.size(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  a.node->fetch(ids, fetched);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 1000ms + 300ms);
  EXPECT_GT(a.node->stats().timeouts, 0u);
  for (uint8_t f : fetched) EXPECT_EQ(f, 0);
}

TEST(ClusterNode, AConnectToASlowMemberHoldsUpNeitherStatsNorMappings) {
  SKIP_WITHOUT_TRANSPORT();
  // A member that takes most of a deadline to answer its hello (stopped,
  // overloaded): while a call connects to it, the node's stats and the
  // lookup of a mapped arena (which a pool server's workers make for every
  // client release) answer at once.
  Member a("a", 60000, 4, /*timeout_ms=*/2000);
  ASSERT_TRUE(a.node);
  RawOwner owner(RawOwner::lookups(0));
  owner.hello_delay = 1500ms;
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  std::atomic<bool> done{false};
  std::thread caller([&] {
    (void)lookup_one(a.node, id_of(9800));
    done.store(true);
  });
  std::this_thread::sleep_for(200ms);  // the caller is waiting for the hello's reply
  std::chrono::steady_clock::duration worst{};
  for (int i = 0; i < 5 && !done.load(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    (void)a.node->stats();
    (void)a.node->mapped_arena(1);
    worst = std::max(worst, std::chrono::steady_clock::now() - t0);
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_FALSE(done.load()) << "the connect ended before the checks";
  EXPECT_LT(worst, 300ms);
  caller.join();
}

// A member in the view that takes connections and never answers (stopped,
// or cut off from the others while its lease lives), or answers its hellos
// but none of its requests (its service threads stuck): each failure in a
// row doubles its skip, so lookups pay its deadline ever more rarely
// instead of once every retry_after_ms. A hello answered is not an answer.
class ClusterNodeSilentMember : public ::testing::TestWithParam<bool> {};

TEST_P(ClusterNodeSilentMember, CostsADeadlineEverMoreRarely) {
  SKIP_WITHOUT_TRANSPORT();
  const bool answers_hellos = GetParam();
  Member a("a", 60000, 4, /*timeout_ms=*/200);
  ASSERT_TRUE(a.node);
  RawOwner owner(
      [](cluster::Op, uint32_t, const uint8_t*) { return std::optional<std::vector<uint8_t>>(); });
  if (!answers_hellos) owner.hello_delay = 60000ms;  // past every deadline
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  const auto t0 = std::chrono::steady_clock::now();
  int lookups = 0;
  while (std::chrono::steady_clock::now() - t0 < 3s) {
    EXPECT_FALSE(lookup_one(a.node, id_of(9950)).first);
    ++lookups;
    std::this_thread::sleep_for(10ms);
  }
  // Skips of 100, 200, 400, 800 and 1600 ms after attempts of 200 ms: five
  // attempts in 3 s, where a fixed skip made ten.
  const uint64_t timeouts = a.node->stats().timeouts;
  EXPECT_GE(timeouts, 3u);
  EXPECT_LE(timeouts, 6u) << lookups << " lookups";
}

INSTANTIATE_TEST_SUITE_P(HellosAnsweredOrNot, ClusterNodeSilentMember, ::testing::Bool());

// A member that just cost a call its deadline is skipped for at least a
// deadline, however short the retry period: before, with a retry period
// below the deadline, each of the requests of one client batch that came
// after the retry period waited a deadline for it again.
TEST(ClusterNode, AMemberThatCostADeadlineIsSkippedForAtLeastOne) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 4, /*timeout_ms=*/300);  // retry_after_ms 100
  ASSERT_TRUE(a.node);
  RawOwner silent(
      [](cluster::Op, uint32_t, const uint8_t*) { return std::optional<std::vector<uint8_t>>(); });
  silent.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), silent.t->address())).ok());
  EXPECT_FALSE(lookup_one(a.node, id_of(9970)).first);  // waits its deadline
  EXPECT_EQ(a.node->stats().timeouts, 1u);
  std::this_thread::sleep_for(150ms);  // past the retry period, within a deadline
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(lookup_one(a.node, id_of(9971)).first);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 100ms);
  EXPECT_EQ(a.node->stats().timeouts, 1u);
}

// A remove that cannot reach a member of the view (one that never answers,
// asked again although it failed just before), or made through a partial
// view, says so: that member may keep the block and serve it. Before, the
// caller was told the remove succeeded.
TEST(ClusterNode, ARemoveThatMissesAMemberSaysSo) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 4, /*timeout_ms=*/200);
  ASSERT_TRUE(a.node);
  RawOwner silent(
      [](cluster::Op, uint32_t, const uint8_t*) { return std::optional<std::vector<uint8_t>>(); });
  silent.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), silent.t->address())).ok());
  const BlockId x = id_of(9960);
  std::vector<uint8_t> removed(1);
  for (int attempt = 0; attempt < 2; ++attempt) {  // the second within the member's skip period
    SCOPED_TRACE(attempt);
    Status st = a.node->remove({&x, 1}, removed);
    EXPECT_TRUE(st.is(Code::kUnavailable)) << st.ToString();
    EXPECT_NE(st.message().find("raw"), std::string::npos) << st.ToString();
  }
  EXPECT_EQ(a.node->stats().remove_incomplete, 2u);
  // Through the client: the remove raises, and says why.
  auto client = a.client();
  ASSERT_TRUE(client);
  const auto data = bytes_of(3, 4096);
  ASSERT_TRUE(client->put(x, data.data(), data.size()).ok());
  Status st = client->remove(x);
  EXPECT_TRUE(st.is(Code::kUnavailable)) << st.ToString();
  EXPECT_NE(st.message().find("may still hold"), std::string::npos) << st.ToString();
  EXPECT_FALSE(client->contains(x));  // removed here all the same

  // Alone in a partial view (cut off from the coordination service).
  ClusterView alone = view_of({{"a", a.node->address()}}, 2);
  alone.partial = true;
  ASSERT_TRUE(a.node->set_view(alone).ok());
  EXPECT_TRUE(a.node->remove({&x, 1}, removed).is(Code::kUnavailable));
  alone.partial = false;
  alone.version = 3;
  ASSERT_TRUE(a.node->set_view(alone).ok());
  EXPECT_TRUE(a.node->remove({&x, 1}, removed).ok());
}

TEST(ClusterNode, AConnectToAMembersOldAddressThatFailsDoesNotHoldOffItsNewOne) {
  SKIP_WITHOUT_TRANSPORT();
  // A call connects to a member at the address of its old record (a
  // process that never answers its hello); meanwhile the view names the
  // member at a new address. The old connect's failure must not mark the
  // new record's member as failed: the next call reaches it at once.
  Member a("a", 60000, 4, /*timeout_ms=*/500);
  ASSERT_TRUE(a.node);
  RawOwner old_owner(
      [](cluster::Op, uint32_t, const uint8_t*) { return std::optional<std::vector<uint8_t>>(); });
  old_owner.hello_delay = 5000ms;  // past every deadline
  old_owner.start();
  RawOwner new_owner(RawOwner::lookups(4096));
  new_owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), old_owner.t->address())).ok());
  const BlockId id = id_of(9900);
  std::thread old_call([&] { (void)lookup_one(a.node, id); });
  std::this_thread::sleep_for(100ms);  // connecting to the old address
  ClusterView v = view_owned_by("a", a.node->address(), new_owner.t->address());
  v.version = 2;
  ASSERT_TRUE(a.node->set_view(v).ok());
  // Waits for the old connect, then makes its own.
  const auto [found, size] = lookup_one(a.node, id);
  old_call.join();
  EXPECT_TRUE(found);
  EXPECT_EQ(size, 4096u);
}

TEST(ClusterNode, AHelloWhoseSenderStoppedHoldsUpNoOtherRequestOnItsLane) {
  SKIP_WITHOUT_TRANSPORT();
  // A hello names an address whose process is stopped: answering it means
  // connecting back there, which lasts the owner's deadline. Meanwhile a
  // member that said hello before is answered on the same lane at once.
  ForkedPeerOptions fo;
  fo.transport.fabrics = "tcp";
  fo.region_bytes = 1 << 20;
  auto stopped = ForkedPeer::Start(fo, deadline_in(10000ms));  // before any transport here
  ASSERT_TRUE(stopped.ok()) << stopped.status().ToString();
  (*stopped)->signal(SIGSTOP);
  Member a("a", 60000, 4, /*timeout_ms=*/1500);
  ASSERT_TRUE(a.node);
  std::vector<uint8_t> ids = put_blocks(a.server->store(), 9600, 1);
  RawMember known(a.node->address());
  known.id = "known";
  RawMember stray(a.node->address());
  ASSERT_TRUE(
      a.node->set_view(view_of({{"a", a.node->address()}, {"known", known.t->address()}})).ok());
  ASSERT_FALSE(known
                   .call(cluster::Op::kHello, static_cast<uint32_t>(known.t->address().size()),
                         known.t->address())
                   .empty());
  // The stray member's hello names the stopped process's address.
  const std::vector<uint8_t>& gone = (*stopped)->address();
  std::vector<uint8_t> hello = stray.head(cluster::Op::kHello, static_cast<uint32_t>(gone.size()),
                                          cluster::kReplyTagBit | 1);
  hello.insert(hello.end(), gone.begin(), gone.end());
  stray.send_raw(hello);
  std::this_thread::sleep_for(100ms);  // the owner is connecting back to it
  const auto t0 = std::chrono::steady_clock::now();
  auto found = known.call(cluster::Op::kLookup, 1, ids);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_FALSE(found.empty());
  EXPECT_LT(took, 500ms);
  (*stopped)->signal(SIGKILL);
}

TEST(ClusterNode, RepliesThatComeAfterTheirCallGaveUpAreDropped) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 4, /*timeout_ms=*/300);
  ASSERT_TRUE(a.node);
  // An owner that answers hellos at once and lookups after twice the deadline.
  RawOwner owner(RawOwner::lookups(0));
  owner.reply_delay = 600ms;
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  constexpr int kCalls = 4;
  for (int i = 0; i < kCalls; ++i) {
    // Each timeout doubles the member's skip: calls in the meantime are
    // skipped, until one reaches the member again and times out.
    const uint64_t before = a.node->stats().timeouts;
    const auto t1 = std::chrono::steady_clock::now();
    while (a.node->stats().timeouts == before && std::chrono::steady_clock::now() - t1 < 5s) {
      EXPECT_FALSE(lookup_one(a.node, id_of(9000 + i)).first);
      std::this_thread::sleep_for(50ms);
    }
  }
  EXPECT_GE(a.node->stats().timeouts, uint64_t(kCalls));
  // Every late reply is taken and dropped, none is left waiting.
  poll_until([&] { return a.node->stats().late_replies >= uint64_t(kCalls); }, 5000ms, 20ms);
  EXPECT_EQ(a.node->stats().late_replies, uint64_t(kCalls));
}

TEST(ClusterNode, AClientThatDiesDuringAMemberCallHoldsBackNoOtherClientsEnd) {
  SKIP_WITHOUT_TRANSPORT();
  // Client A dies while the server calls an owner for it (the owner never
  // answers, so the call lasts its deadline); client B dies after it. What
  // B held is given back at once, not after A's call returns.
  Member a("a", 60000, 4, /*timeout_ms=*/2000);
  ASSERT_TRUE(a.node);
  RawOwner owner(
      [](cluster::Op, uint32_t, const uint8_t*) { return std::optional<std::vector<uint8_t>>(); });
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  auto dying = std::make_unique<RawClient>();
  ASSERT_TRUE(dying->connect(a.socket).ok());
  const BlockId missing = id_of(9700);
  dying->post(dying->write(pool::Op::kLeaseRead, missing.bytes.data(), 1, 16));
  std::this_thread::sleep_for(100ms);  // the server is calling the owner
  const auto t0 = std::chrono::steady_clock::now();
  dying.reset();
  {
    RawClient b;
    ASSERT_TRUE(b.connect(a.socket).ok());
    pool::ReserveItem item{};
    const BlockId id = id_of(9701);
    std::memcpy(item.id, id.bytes.data(), 16);
    item.size = 4096;
    pool::ReplyHeader reply;
    ASSERT_EQ(b.request(pool::Op::kReserve, &item, 1, sizeof item, &reply), 0u);
  }
  while (a.server->stats().reclaimed_reservations < 1 && std::chrono::steady_clock::now() - t0 < 5s)
    std::this_thread::sleep_for(5ms);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(a.server->stats().reclaimed_reservations, 1u);
  EXPECT_LT(waited, 1000ms) << "B's reservation waited for A's call to the owner";
  // A is ended too once its call returns.
  while (a.server->stats().disconnects < 2 && std::chrono::steady_clock::now() - t0 < 10s)
    std::this_thread::sleep_for(20ms);
  EXPECT_EQ(a.server->stats().disconnects, 2u);
  EXPECT_EQ(a.server->stats().reservations, 0u);
}

TEST(ClusterNode, BadViewsAreRefused) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");
  ASSERT_TRUE(a.node);
  ClusterView v = view_of({{"a", a.node->address()}});
  ClusterView unsorted = v;
  std::swap(unsorted.positions[0], unsorted.positions[1]);
  EXPECT_TRUE(a.node->set_view(unsorted).is(Code::kInvalidArgument));
  ClusterView out_of_range = v;
  out_of_range.owners[0] = 5;
  EXPECT_TRUE(a.node->set_view(out_of_range).is(Code::kInvalidArgument));
  ClusterView three = v;
  three.replicas = 3;
  EXPECT_TRUE(a.node->set_view(three).is(Code::kInvalidArgument));
  EXPECT_TRUE(a.node->set_view(v).ok());
}

TEST(ClusterNode, TimeoutsThatCannotHoldAreRefused) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");
  ASSERT_TRUE(a.node);
  struct Case {
    const char* why;
    uint32_t lease_expiry_ms, request_budget_ms;
  };
  const Case cases[] = {
      {"an expiry below three calls' deadlines and a sweep", 2001, 0},
      {"a budget below one call's deadline", 60000, 1999},
      {"a budget above an hour", 60000, 3600 * 1000 + 1},
  };
  for (const Case& c : cases) {
    ClusterNodeOptions o;
    o.node_id = "b";
    o.fabrics = "tcp";
    o.request_timeout_ms = 2000;
    o.lease_expiry_ms = c.lease_expiry_ms;
    o.request_budget_ms = c.request_budget_ms;
    auto n = ClusterNode::Start(a.server->store(), a.server->store()->shared_arena(), o);
    EXPECT_TRUE(n.status().is(Code::kInvalidArgument)) << c.why << ": " << n.status().ToString();
  }
}

TEST(ClusterNode, NoCallOfARequestStartsAfterItsBudget) {
  SKIP_WITHOUT_TRANSPORT();
  // Calls end at 1 s each, and a request starts none after 1 s. The owner
  // answers every lookup after 0.6 s (every id found): a lookup of four
  // batches' worth of ids would otherwise take four replies, 2.4 s. With the
  // budget the second call starts at 0.6 s, runs past the budget's end to
  // its reply, and the third and fourth are not made.
  Member a("a", 60000, 4, /*timeout_ms=*/1000, /*map_same_host=*/false, /*budget_ms=*/1000);
  ASSERT_TRUE(a.node);
  RawOwner owner(RawOwner::lookups(4096));
  owner.reply_delay = 600ms;
  owner.start();
  ASSERT_TRUE(a.node->set_view(view_owned_by("a", a.node->address(), owner.t->address())).ok());
  std::vector<BlockId> ids;
  for (uint64_t i = 0; i < 3 * cluster::kMaxItems + 1; ++i) ids.push_back(id_of(20000 + i));
  std::vector<uint8_t> found(ids.size(), 0);
  std::vector<uint64_t> sizes(ids.size(), 0);
  auto t0 = std::chrono::steady_clock::now();
  a.node->lookup(ids, found, sizes);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 1100ms);
  EXPECT_LT(took, 1200ms + 600ms);
  EXPECT_EQ(a.node->stats().remote_lookups, 2 * uint64_t(cluster::kMaxItems));
  // The call under way at the budget's end was waited for and its reply used.
  const size_t first_two = 2 * cluster::kMaxItems;
  EXPECT_EQ(std::count(found.begin(), found.begin() + first_two, 1), ptrdiff_t(first_two));
  EXPECT_EQ(std::count(found.begin() + first_two, found.end(), 1), 0);
  EXPECT_EQ(a.node->stats().budget_cuts, 2u);  // the third and fourth batches
  EXPECT_EQ(a.node->stats().late_replies, 0u);
  // The member answered every call in time: it is not skipped. The next
  // request asks it again and waits for it.
  EXPECT_EQ(a.node->stats().timeouts, 0u);
  const uint64_t asked = a.node->stats().remote_lookups;
  t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(lookup_one(a.node, ids[0]).first);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 500ms);
  EXPECT_EQ(a.node->stats().remote_lookups, asked + 1);
  uint8_t one_found = 0;
  uint64_t one_size = 0;
  // Three lookups that share one budget: the third starts after it and
  // makes no call.
  const Deadline budget = a.node->request_deadline();
  t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < 3; ++k) {
    one_found = 0;
    a.node->lookup({ids.data(), 1}, {&one_found, 1}, {&one_size, 1}, budget);
    EXPECT_EQ(one_found, k < 2 ? 1 : 0) << k;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1200ms + 600ms);
  EXPECT_EQ(a.node->stats().remote_lookups, asked + 3);
  EXPECT_EQ(a.node->stats().budget_cuts, 3u);
  EXPECT_EQ(a.node->stats().timeouts, 0u);
}

// ---- members on one host: arenas mapped --------------------------------------

// Mappings of `path` in this process (lines of /proc/self/maps).
int mappings_of(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) n += line.find(path) != std::string::npos;
  return n;
}

// A view of the members in which `owner` owns every point.
ClusterView view_owned_by(const std::vector<Member*>& members, size_t owner) {
  ClusterView v;
  v.version = 1;
  const char* names[] = {"a", "b", "c", "d"};
  for (size_t m = 0; m < members.size(); ++m)
    v.members.push_back(ClusterMember{names[m], 7, members[m]->node->address()});
  for (int p = 0; p < 8; ++p) {
    v.positions.push_back(uint64_t(p) << 60);
    v.owners.push_back(static_cast<uint32_t>(owner));
  }
  return v;
}

TEST(ClusterNode, ABlockStoredAgainWithOtherBytesIsServedWithItsNewChecksum) {
  SKIP_WITHOUT_TRANSPORT();
  // The owner remembers the checksum a member's push carried. The block is
  // removed there and stored again by a client of the owner with other
  // bytes (KV blocks of one id are not always bit-identical): members that
  // fetch it get the new bytes, not a checksum failure for ever.
  Member a("a"), b("b");
  ASSERT_TRUE(a.node && b.node);
  const ClusterView v = view_owned_by({&a, &b}, 0);
  ASSERT_TRUE(a.node->set_view(v).ok() && b.node->set_view(v).ok());
  auto ca = a.client();
  auto cb = b.client();
  ASSERT_TRUE(ca && cb);
  const BlockId x = id_of(9900);
  const auto first = bytes_of(1, 65536), second = bytes_of(2, 65536);
  ASSERT_TRUE(cb->put(x, first.data(), first.size()).ok());
  ASSERT_TRUE(b.node->drain(5000));
  ASSERT_EQ(a.node->stats().served_commits, 1u);
  ASSERT_TRUE(ca->remove(x).ok());
  ASSERT_TRUE(ca->put(x, second.data(), second.size()).ok());
  EXPECT_FALSE(b.server->store()->contains(x));  // a's remove took b's copy too
  expect_block(cb.get(), x, second);
  EXPECT_EQ(b.node->stats().checksum_failures, 0u);
  EXPECT_EQ(b.node->stats().fetched, 1u);
}

TEST(ClusterNode, MembersOnOneHostCopyFromTheOwnersMappedArena) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 4, 500, true), b("b", 60000, 4, 500, true);
  ASSERT_TRUE(a.node && b.node);
  ASSERT_TRUE(share_view(a, b));
  auto ca = a.client();
  auto cb = b.client();
  ASSERT_TRUE(ca && cb);
  constexpr int kBlocks = 64;
  for (int i = 0; i < kBlocks; ++i) {
    auto data = bytes_of(i, 4096 * (1 + i % 16));
    ASSERT_TRUE(ca->put(id_of(i), data.data(), data.size()).ok());
  }
  ASSERT_TRUE(a.node->drain(5000));
  ASSERT_EQ(a.node->stats().push_dropped, 0u);
  // Views (acquire) need the block in b's own arena: fetched, copied from
  // the mapping. Reads into memory (get) of the others: b's client copies
  // them straight from a's arena, which it maps too.
  for (int i = 0; i < kBlocks; i += 2) {
    auto v = cb->acquire(id_of(i));
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    const auto want = bytes_of(i, 4096 * (1 + i % 16));
    ASSERT_EQ(v->size(), want.size());
    EXPECT_EQ(0, std::memcmp(v->data(), want.data(), want.size())) << i;
  }
  for (int i = 1; i < kBlocks; i += 2)
    expect_block(cb.get(), id_of(i), bytes_of(i, 4096 * (1 + i % 16)));
  const ClusterStats sb = b.node->stats();
  EXPECT_GT(sb.fetched, 0u);
  EXPECT_EQ(sb.fetched_mapped, sb.fetched);  // every fetch copied from the mapping
  EXPECT_GT(sb.mapped_leases, 0u);           // reads leased where the blocks are
  EXPECT_EQ(sb.mapped, 1u);
  EXPECT_EQ(sb.map_failures, 0u);
  EXPECT_EQ(sb.checksum_failures, 0u);
  poll_until([&] { return a.node->stats().peer_leases == 0; }, 2000ms);
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
}

TEST(ClusterNode, ABlockCorruptedInTheOwnersArenaIsAMissThroughTheMapping) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 1, 500, true), b("b", 60000, 1, 500, true), c("c", 60000, 1, 500, true),
      d("d", 60000, 1, 500, true);
  ASSERT_TRUE(a.node && b.node && c.node && d.node);
  // b owns every block: a's puts are pushed there, c and d read them.
  const ClusterView v = view_owned_by({&a, &b, &c, &d}, 1);
  for (Member* m : {&a, &b, &c, &d}) ASSERT_TRUE(m->node->set_view(v).ok());
  auto ca = a.client();
  auto cc = c.client();
  auto cd = d.client();
  ASSERT_TRUE(ca && cc && cd);
  const std::vector<uint8_t> good = bytes_of(42, 64 << 10), other = bytes_of(43, 64 << 10);
  ASSERT_TRUE(ca->put(id_of(1), good.data(), good.size()).ok());
  ASSERT_TRUE(ca->put(id_of(2), other.data(), other.size()).ok());
  ASSERT_TRUE(a.node->drain(5000));
  expect_block(cd.get(), id_of(1), good);
  // The blocks came to their owner with their checksums (a's pushes): the
  // owner answered d's lease without hashing the block again.
  EXPECT_GT(b.node->stats().served_leases, 0u);
  EXPECT_EQ(b.node->stats().lease_hashes, 0u);
  // Flip one byte of block 1 where the owner holds it: found by its bytes
  // in the owner's arena file.
  {
    const int fd = ::open(b.shm_path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    struct stat st;
    ASSERT_EQ(::fstat(fd, &st), 0);
    void* p = ::mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ASSERT_NE(p, MAP_FAILED);
    auto* file = static_cast<uint8_t*>(p);
    uint8_t* at = nullptr;
    for (off_t off = 0; off + off_t(good.size()) <= st.st_size && !at; off += 4096)
      if (std::memcmp(file + off, good.data(), good.size()) == 0) at = file + off;
    ASSERT_NE(at, nullptr) << "block 1 not found in the owner's arena";
    at[1000] ^= 0x5a;
    ::munmap(p, st.st_size);
    ::close(fd);
  }
  // Read into memory, c's client copies from b's arena and checks: a miss.
  std::vector<uint8_t> out(good.size());
  GetResult r;
  ASSERT_TRUE(cc->get(id_of(1), out.data(), out.size(), &r).ok());
  EXPECT_FALSE(r.found);  // a miss, never the corrupted bytes
  EXPECT_GT(c.node->stats().mapped_leases, 0u);
  // As a view, c's server fetches it from the mapping and checks: a miss.
  EXPECT_TRUE(cc->acquire(id_of(1)).status().is(Code::kNotFound));
  const ClusterStats sc = c.node->stats();
  EXPECT_EQ(sc.mapped, 1u);
  EXPECT_GE(sc.checksum_failures, 1u);
  EXPECT_EQ(sc.fetched, 0u);
  expect_block(cc.get(), id_of(2), other);  // the intact block is served
}

TEST(ClusterNode, APartOfABlockThatChangesInTheOwnersArenaWhileCopiedIsAMissNeverWrongBytes) {
  // A block's bytes change under a client's copy from the owner's mapped
  // arena (what a range reused after its lease ended looks like): a read
  // of part of the block either returns the block's bytes or misses.
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 1, 500, true), b("b", 60000, 1, 500, true), c("c", 60000, 1, 500, true);
  ASSERT_TRUE(a.node && b.node && c.node);
  const ClusterView v = view_owned_by({&a, &b, &c}, 1);
  for (Member* m : {&a, &b, &c}) ASSERT_TRUE(m->node->set_view(v).ok());
  auto ca = a.client();
  auto cc = c.client();
  ASSERT_TRUE(ca && cc);
  const std::vector<uint8_t> good = bytes_of(44, 64 << 10);
  ASSERT_TRUE(ca->put(id_of(1), good.data(), good.size()).ok());
  ASSERT_TRUE(a.node->drain(5000));
  const int fd = ::open(b.shm_path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  struct stat st;
  ASSERT_EQ(::fstat(fd, &st), 0);
  void* p = ::mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(p, MAP_FAILED);
  auto* file = static_cast<uint8_t*>(p);
  volatile uint8_t* at = nullptr;
  for (off_t off = 0; off + off_t(good.size()) <= st.st_size && !at; off += 4096)
    if (std::memcmp(file + off, good.data(), good.size()) == 0) at = file + off;
  ASSERT_NE(at, nullptr) << "block 1 not found in the owner's arena";
  constexpr uint64_t kFrom = 8192, kBytes = 16384, kByte = kFrom + 100;
  std::atomic<bool> stop{false};
  std::thread flipper([&] {
    while (!stop.load(std::memory_order_relaxed)) at[kByte] = uint8_t(at[kByte] ^ 0x5a);
    at[kByte] = good[kByte];
  });
  int wrong = 0, hits = 0;
  std::vector<uint8_t> out(kBytes);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 4000 && std::chrono::steady_clock::now() - t0 < 5s && wrong == 0; ++i) {
    GetResult r;
    ASSERT_TRUE(cc->get_range(id_of(1), kFrom, out.data(), out.size(), &r).ok());
    if (!r.found) continue;
    ++hits;
    if (std::memcmp(out.data(), good.data() + kFrom, kBytes) != 0) ++wrong;
  }
  stop.store(true);
  flipper.join();
  ::munmap(p, st.st_size);
  EXPECT_GT(c.node->stats().mapped_leases, 0u);
  EXPECT_EQ(wrong, 0) << "after " << hits << " hits";
}

TEST(ClusterNode, AMemberLeavingTheViewIsUnmapped) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 2, 500, true), b("b", 60000, 2, 500, true);
  ASSERT_TRUE(a.node && b.node);
  const ClusterView v = view_owned_by({&a, &b}, 0);
  ASSERT_TRUE(a.node->set_view(v).ok() && b.node->set_view(v).ok());
  auto ca = a.client();
  auto cb = b.client();
  ASSERT_TRUE(ca && cb);
  const std::vector<uint8_t> data = bytes_of(7, 32 << 10);
  ASSERT_TRUE(ca->put(id_of(1), data.data(), data.size()).ok());
  const int before = mappings_of(a.shm_path);
  expect_block(cb.get(), id_of(1), data);
  EXPECT_EQ(b.node->stats().mapped, 1u);
  EXPECT_GT(b.node->stats().mapped_leases, 0u);
  // b's server maps a's arena, and so does b's client, which read from it.
  EXPECT_EQ(mappings_of(a.shm_path), before + 2);
  // b's view without a: b's mapping of a's arena goes at once, its client's
  // within a couple of seconds.
  ClusterView alone;
  alone.version = 2;
  alone.members.push_back(ClusterMember{"b", 7, b.node->address()});
  alone.positions.push_back(0);
  alone.owners.push_back(0);
  ASSERT_TRUE(b.node->set_view(alone).ok());
  EXPECT_EQ(b.node->stats().mapped, 0u);
  poll_until([&] { return mappings_of(a.shm_path) <= before; }, 5000ms, 50ms);
  EXPECT_EQ(mappings_of(a.shm_path), before);
}

TEST(ClusterNode, AClientWhoseServerIsGoneUnmapsTheMembersArenas) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 2, 500, true), b("b", 60000, 2, 500, true);
  ASSERT_TRUE(a.node && b.node);
  const ClusterView v = view_owned_by({&a, &b}, 0);
  ASSERT_TRUE(a.node->set_view(v).ok() && b.node->set_view(v).ok());
  auto ca = a.client();
  auto cb = b.client();
  ASSERT_TRUE(ca && cb);
  const std::vector<uint8_t> data = bytes_of(8, 32 << 10);
  ASSERT_TRUE(ca->put(id_of(1), data.data(), data.size()).ok());
  const int before = mappings_of(a.shm_path);
  expect_block(cb.get(), id_of(1), data);
  EXPECT_EQ(mappings_of(a.shm_path), before + 2);  // b's server and b's client map a's arena
  // b's server goes: nothing more is read through it, and its client keeps
  // no mapping of a's arena (which would pin its memory once a replaced it).
  ASSERT_TRUE(b.server->close().ok());
  poll_until([&] { return mappings_of(a.shm_path) <= before; }, 5000ms, 50ms);
  EXPECT_EQ(mappings_of(a.shm_path), before);
  std::vector<uint8_t> out(data.size());
  GetResult r;
  EXPECT_FALSE(cb->get(id_of(1), out.data(), out.size(), &r).ok() && r.found);
}

TEST(ClusterNode, WithoutMappingMembersOnOneHostUseTheTransport) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a"), b("b");
  ASSERT_TRUE(a.node && b.node);
  const ClusterView v = view_owned_by({&a, &b}, 0);
  ASSERT_TRUE(a.node->set_view(v).ok() && b.node->set_view(v).ok());
  auto ca = a.client();
  auto cb = b.client();
  ASSERT_TRUE(ca && cb);
  const std::vector<uint8_t> data = bytes_of(9, 32 << 10);
  ASSERT_TRUE(ca->put(id_of(1), data.data(), data.size()).ok());
  expect_block(cb.get(), id_of(1), data);
  const ClusterStats sb = b.node->stats();
  EXPECT_EQ(sb.fetched, 1u);
  EXPECT_EQ(sb.fetched_mapped, 0u);
  EXPECT_EQ(sb.mapped_leases, 0u);
  EXPECT_EQ(sb.mapped, 0u);
}

}  // namespace
}  // namespace cascade
