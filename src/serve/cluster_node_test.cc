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
#include <cstring>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "cascade/store.h"
#include "serve/cluster_wire.h"
#include "serve/pool_server.h"
#include "transport/transport.h"

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

struct Member {
  std::string socket = "/tmp/" + unique("cascade-cluster-test-") + ".sock";
  std::unique_ptr<PoolServer> server;
  ClusterNode* node = nullptr;

  std::string shm_path;

  // map_same_host off by default: these tests are about the transport; the
  // ones about mapped arenas turn it on.
  Member(const std::string& id, uint32_t expiry_ms = 60000, uint32_t lanes = 4,
         bool map_same_host = false) {
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
    co.request_timeout_ms = 500;
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
};

BlockId id_of(uint64_t v) { return compute_block_id(&v, sizeof v); }

// Reads id through `store` and checks it holds `want`.
void expect_block(CascadeStore* store, const BlockId& id, const std::vector<uint8_t>& want) {
  std::vector<uint8_t> out(want.size() + 4096);
  GetResult r;
  ASSERT_TRUE(store->get(id, out.data(), out.size(), &r).ok());
  ASSERT_TRUE(r.found);
  ASSERT_EQ(r.size, want.size());
  ASSERT_EQ(0, std::memcmp(out.data(), want.data(), want.size()));
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
  const auto t0 = std::chrono::steady_clock::now();
  while (a.node->stats().peer_leases > 0 && std::chrono::steady_clock::now() - t0 < 2s)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
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
  ASSERT_TRUE(
      a.node->set_view(view_of({{"a", a.node->address()}, {"raw", raw.t->address()}})).ok());
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
  const auto t0 = std::chrono::steady_clock::now();
  while (a.node->stats().peer_leases > 0 && std::chrono::steady_clock::now() - t0 < 8s)
    std::this_thread::sleep_for(50ms);
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
  EXPECT_GE(a.node->stats().expired, 8u);

  // Leased again, then the member leaves the view: its leases end at once.
  lease = raw.call(cluster::Op::kLease, 8, ids);
  ASSERT_FALSE(lease.empty());
  EXPECT_EQ(a.node->stats().peer_leases, 8u);
  ASSERT_TRUE(a.node->set_view(view_of({{"a", a.node->address()}}, 2)).ok());
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
}

TEST(ClusterNode, WhatAReplyThatCannotBeDeliveredGrantedIsTakenBack) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");  // leases expire after a minute: the test must not wait for that
  ASSERT_TRUE(a.node);
  std::vector<uint8_t> ids = put_blocks(a.server->store(), 3000, 4);
  RawMember raw(a.node->address());
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

TEST(ClusterNode, AnExpiryShorterThanAPushCanTakeIsRefused) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a");
  ASSERT_TRUE(a.node);
  ClusterNodeOptions o;
  o.node_id = "b";
  o.fabrics = "tcp";
  o.request_timeout_ms = 2000;
  o.lease_expiry_ms = 2001;  // below three calls' deadlines and a sweep
  auto n = ClusterNode::Start(a.server->store(), a.server->store()->shared_arena(), o);
  EXPECT_TRUE(n.status().is(Code::kInvalidArgument)) << n.status().ToString();
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

TEST(ClusterNode, MembersOnOneHostCopyFromTheOwnersMappedArena) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 4, true), b("b", 60000, 4, true);
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
  const auto t0 = std::chrono::steady_clock::now();
  while (a.node->stats().peer_leases > 0 && std::chrono::steady_clock::now() - t0 < 2s)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(a.node->stats().peer_leases, 0u);
}

TEST(ClusterNode, ABlockCorruptedInTheOwnersArenaIsAMissThroughTheMapping) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 1, true), b("b", 60000, 1, true), c("c", 60000, 1, true),
      d("d", 60000, 1, true);
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

TEST(ClusterNode, AMemberLeavingTheViewIsUnmapped) {
  SKIP_WITHOUT_TRANSPORT();
  Member a("a", 60000, 2, true), b("b", 60000, 2, true);
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
  const auto t0 = std::chrono::steady_clock::now();
  while (mappings_of(a.shm_path) > before && std::chrono::steady_clock::now() - t0 < 5s)
    std::this_thread::sleep_for(50ms);
  EXPECT_EQ(mappings_of(a.shm_path), before);
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
