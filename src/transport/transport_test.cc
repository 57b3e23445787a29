// Transport between real processes: forked children serve registered regions
// over the fabric under test (TCP and shared memory), the test process reads
// and writes them. Every byte is compared; failures must come within their
// deadlines.
#include "transport/transport.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <thread>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "transport/forked_peer.h"
#include "transport/key_format.h"

namespace cascade {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kRegion = 16ull << 20;

TEST(TransportKeyFormat, AddressRoundTripAndDamage) {
  std::vector<uint8_t> raw = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<uint8_t> frame = pack_address(raw);
  Result<std::span<const uint8_t>> back = unpack_address(frame);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(std::vector<uint8_t>(back->begin(), back->end()), raw);

  for (size_t i = 0; i < frame.size(); ++i) {
    std::vector<uint8_t> bad = frame;
    bad[i] ^= 0x40;
    EXPECT_TRUE(unpack_address(bad).status().is(Code::kInvalidArgument)) << "byte " << i;
  }
  std::vector<uint8_t> shorter(frame.begin(), frame.end() - 1);
  EXPECT_TRUE(unpack_address(shorter).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(unpack_address({}).status().is(Code::kInvalidArgument));
  std::vector<uint8_t> key = pack_key(0x1000, 64, raw);
  EXPECT_TRUE(unpack_address(key).status().is(Code::kInvalidArgument));
}

TEST(TransportKeyFormat, KeyRoundTripAndDamage) {
  std::vector<uint8_t> raw(40, 0x5a);
  std::vector<uint8_t> frame = pack_key(0x7f0000001000, 1 << 20, raw);
  Result<KeyFrame> k = unpack_key(frame);
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->base, 0x7f0000001000u);
  EXPECT_EQ(k->size, 1u << 20);
  EXPECT_EQ(k->backend_key.size(), raw.size());
  for (size_t i = 0; i < frame.size(); ++i) {
    std::vector<uint8_t> bad = frame;
    bad[i] ^= 0x01;
    EXPECT_TRUE(unpack_key(bad).status().is(Code::kInvalidArgument)) << "byte " << i;
  }
  // A region that wraps the address space is refused even with a good checksum.
  EXPECT_TRUE(
      unpack_key(pack_key(~uint64_t{0} - 10, 100, raw)).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(unpack_key(pack_key(0x1000, 0, raw)).status().is(Code::kInvalidArgument));
}

TEST(TransportKeyFormat, RangeWithin) {
  EXPECT_TRUE(range_within(0, 0, 0));
  EXPECT_TRUE(range_within(10, 0, 10));
  EXPECT_TRUE(range_within(0, 10, 10));
  EXPECT_FALSE(range_within(1, 10, 10));
  EXPECT_FALSE(range_within(11, 0, 10));
  EXPECT_FALSE(range_within(5, ~uint64_t{0}, 10));
}

TEST(TransportOpen, ReportsWhetherBuilt) {
  Result<std::unique_ptr<Transport>> t = Transport::Open({});
  if (!Transport::available()) {
    EXPECT_TRUE(t.status().is(Code::kUnavailable));
    return;
  }
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->backend(), "ucx");
  EXPECT_TRUE(unpack_address((*t)->address()).ok());
  // Unknown fabric names are refused at open, not at the first transfer.
  TransportOptions bad;
  bad.fabrics = "no-such-fabric";
  EXPECT_FALSE(Transport::Open(bad).ok());
}

// Without MPI the MPI backend says why it is missing. With MPI it runs in
// its own program under mpirun (transport_mpi_test.cc): initialising MPI
// here would tie this process to an MPI job.
TEST(TransportOpen, TheMpiBackendIsNotSupportedWithoutMpi) {
  if (Transport::available(TransportBackend::kMpi))
    GTEST_SKIP() << "built with MPI: transport_mpi_test covers the backend under mpirun";
  TransportOptions o;
  o.backend = TransportBackend::kMpi;
  Result<std::unique_ptr<Transport>> t = Transport::Open(o);
  EXPECT_TRUE(t.status().is(Code::kNotSupported)) << t.status().ToString();
  EXPECT_NE(t.status().message().find("MPI"), std::string::npos);
}

// Shared memory alone cannot detect a dead peer in UCX 1.13: refused with a
// clear error rather than served without deadlines that hold.
TEST(TransportOpen, SharedMemoryAloneRefused) {
  if (!Transport::available()) GTEST_SKIP() << "built without UCX";
  TransportOptions o;
  o.fabrics = "posix";
  Result<std::unique_ptr<Transport>> a = Transport::Open(o);
  Result<std::unique_ptr<Transport>> b = Transport::Open(o);
  ASSERT_TRUE(a.ok() && b.ok());
  Result<std::shared_ptr<Peer>> p = (*a)->connect((*b)->address(), deadline_in(1s));
  EXPECT_TRUE(p.status().is(Code::kUnavailable)) << p.status().ToString();
  EXPECT_NE(p.status().message().find("failure detection"), std::string::npos);
}

// A child serving its region over shared memory alone, without failure
// detection, and this process connected to it with the region imported.
struct SharedMemoryLink {
  std::unique_ptr<ForkedPeer> child;
  std::unique_ptr<Transport> t;
  std::shared_ptr<Peer> p;
  std::shared_ptr<RemoteRegion> r;
};

void open_shared_memory_link(uint64_t region_bytes, uint8_t seed, SharedMemoryLink* link) {
  ForkedPeerOptions fo;
  fo.transport.fabrics = "sm";
  fo.transport.require_failure_detection = false;
  fo.region_bytes = region_bytes;
  fo.seed = seed;
  Result<std::unique_ptr<ForkedPeer>> child = ForkedPeer::Start(fo, deadline_in(30s));
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  link->child = std::move(*child);
  Result<std::unique_ptr<Transport>> t = Transport::Open(fo.transport);
  ASSERT_TRUE(t.ok());
  link->t = std::move(*t);
  Result<std::shared_ptr<Peer>> p = link->t->connect(link->child->address(), deadline_in(10s));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  link->p = *p;
  Result<std::shared_ptr<RemoteRegion>> r = link->p->import_key(link->child->key());
  ASSERT_TRUE(r.ok());
  link->r = *r;
}

// Shared memory alone, allowed without failure detection: bytes are right, and
// a wait on a stopped peer ends by its deadline.
TEST(TransportOpen, SharedMemoryWithoutFailureDetection) {
  if (!Transport::available()) GTEST_SKIP() << "built without UCX";
  SharedMemoryLink link;
  open_shared_memory_link(8 << 20, 12, &link);
  if (HasFatalFailure()) return;
  // Kept until the Transport is closed: a transfer past its deadline may still land here.
  std::vector<uint8_t> buf(8 << 20);
  for (uint64_t n : {uint64_t{1}, uint64_t{4096}, uint64_t{1 << 20}, uint64_t{8 << 20}}) {
    uint64_t offset = (8 << 20) - n;
    Result<std::unique_ptr<Completion>> c = link.p->get(*link.r, offset, buf.data(), n);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE((*c)->wait(deadline_in(10s)).ok());
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(buf[i], pattern_byte(offset + i, 12)) << i;
  }
  std::vector<uint8_t> src(1 << 20, 0x3c);
  Result<std::unique_ptr<Completion>> c = link.p->put(*link.r, 0, src.data(), src.size());
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->wait(deadline_in(10s)).ok());
  Result<uint64_t> sum = link.child->checksum(0, src.size(), deadline_in(10s));
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, bytes_checksum(src.data(), src.size()));

  // A stopped peer: the kernel's cross-process copy may still reach its
  // memory (then the put completes, and the bytes are there), otherwise the
  // wait ends by its deadline and the Peer is failed.
  std::vector<uint8_t> second(1 << 20, 0xc3);
  link.child->signal(SIGSTOP);
  auto t0 = TransportClock::now();
  c = link.p->put(*link.r, 0, second.data(), second.size());
  Status st = c.ok() ? (*c)->wait(t0 + 300ms) : c.status();
  EXPECT_LT(TransportClock::now() - t0, 2s);
  link.child->signal(SIGCONT);
  if (st.ok()) {
    sum = link.child->checksum(0, second.size(), deadline_in(10s));
    ASSERT_TRUE(sum.ok());
    EXPECT_EQ(*sum, bytes_checksum(second.data(), second.size()));
  } else {
    EXPECT_TRUE(st.is(Code::kUnavailable)) << st.ToString();
    EXPECT_TRUE(link.p->health().is(Code::kUnavailable));
  }
  link.t->close();
}

// Without failure detection an endpoint closes with a flush, which a
// stopped peer never answers: closing it does not wait for that, so the
// thread closing it, and the worker it holds meanwhile, hold up no other
// peer's transfers.
TEST(TransportOpen, ClosingAStoppedPeerWithoutFailureDetectionHoldsUpNoOtherPeer) {
  if (!Transport::available()) GTEST_SKIP() << "built without UCX";
  ForkedPeerOptions fo;
  fo.transport.fabrics = "tcp";
  fo.transport.require_failure_detection = false;
  fo.region_bytes = 1 << 20;
  fo.seed = 21;
  auto stopped = ForkedPeer::Start(fo, deadline_in(30s));
  fo.seed = 22;
  auto live = ForkedPeer::Start(fo, deadline_in(30s));
  ASSERT_TRUE(stopped.ok() && live.ok());
  TransportOptions lo = fo.transport;
  lo.progress_thread = true;
  auto t = Transport::Open(lo);
  ASSERT_TRUE(t.ok());
  auto p1 = (*t)->connect((*stopped)->address(), deadline_in(10s));
  auto p2 = (*t)->connect((*live)->address(), deadline_in(10s));
  ASSERT_TRUE(p1.ok() && p2.ok());
  auto r1 = (*p1)->import_key((*stopped)->key());
  auto r2 = (*p2)->import_key((*live)->key());
  ASSERT_TRUE(r1.ok() && r2.ok());
  // Kept until the transport closes: a get past its deadline may still land.
  std::vector<uint8_t> b1(1 << 20), b2(64 << 10);
  (*stopped)->signal(SIGSTOP);
  // A get the stopped peer never serves: it misses its deadline, and the
  // endpoint's flush would wait for it.
  auto c = (*p1)->get(**r1, 0, b1.data(), b1.size());
  if (c.ok()) (void)(*c)->wait(deadline_in(100ms));
  // The close on one thread, gets from the live peer on this one.
  std::atomic<bool> closed{false};
  TransportClock::duration close_took{};
  std::thread closer([&] {
    const auto t0 = TransportClock::now();
    (*p1)->close();
    close_took = TransportClock::now() - t0;
    closed.store(true);
  });
  TransportClock::duration slowest{};
  for (int i = 0; i < 20 || !closed.load(); ++i) {
    const auto t0 = TransportClock::now();
    auto g = (*p2)->get(**r2, 0, b2.data(), b2.size());
    ASSERT_TRUE(g.ok());
    ASSERT_TRUE((*g)->wait(deadline_in(5s)).ok());
    slowest = std::max(slowest, TransportClock::now() - t0);
  }
  closer.join();
  for (size_t i = 0; i < b2.size(); ++i) ASSERT_EQ(b2[i], pattern_byte(i, 22)) << i;
  EXPECT_LT(close_took, 150ms);
  EXPECT_LT(slowest, 150ms) << "a get from the live peer waited for the close";
  (*stopped)->signal(SIGCONT);
  (*t)->close();
}

// Shared memory alone: a send to a stopped peer misses its deadline, and the
// caller then reuses its buffer. The send, which nothing can cancel, goes on
// from its own copy once the peer runs again: the peer gets the bytes sent.
TEST(TransportOpen, ASendThatMissedItsDeadlineWithoutFailureDetectionSendsItsOwnBytes) {
  if (!Transport::available()) GTEST_SKIP() << "built without UCX";
  SharedMemoryLink link;
  open_shared_memory_link(4096, 14, &link);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(link.child->start_echo(link.t->address(), 84, 85, deadline_in(10s)).ok());
  std::vector<uint8_t> msg(1 << 20);
  for (size_t i = 0; i < msg.size(); ++i) msg[i] = static_cast<uint8_t>(i * 13 + i / 253);
  const std::vector<uint8_t> want(msg.rbegin(), msg.rend());
  link.child->signal(SIGSTOP);
  const Status st = link.p->send(84, msg, deadline_in(100ms));
  std::fill(msg.begin(), msg.end(), 0);  // the caller's buffer, reused
  link.child->signal(SIGCONT);
  Result<std::vector<uint8_t>> got = link.t->receive(85, msg.size(), deadline_in(10s));
  ASSERT_TRUE(got.ok()) << got.status().ToString() << " (the send: " << st.ToString() << ")";
  EXPECT_TRUE(*got == want) << "the peer got the caller's reused buffer (the send: "
                            << st.ToString() << ")";
  link.t->close();
}

// Shared memory alone, a peer killed mid-loop: without failure detection the
// deadlines alone end the waits; no wait overruns, no read that succeeded
// holds a wrong byte.
TEST(TransportOpen, SharedMemoryWithoutFailureDetectionPeerKilled) {
  if (!Transport::available()) GTEST_SKIP() << "built without UCX";
  SharedMemoryLink link;
  open_shared_memory_link(16 << 20, 13, &link);
  if (HasFatalFailure()) return;
  constexpr uint64_t kBlock = 1 << 20;
  std::vector<uint8_t> buf(kBlock);  // outlives the Transport (closed below)
  int ok_reads = 0, failed = 0;
  for (int iter = 0; iter < 30; ++iter) {
    if (iter == 10) link.child->signal(SIGKILL);
    uint64_t offset = (iter % 16) * kBlock;
    auto t0 = TransportClock::now();
    Result<std::unique_ptr<Completion>> c = link.p->get(*link.r, offset, buf.data(), kBlock);
    Status st = c.ok() ? (*c)->wait(t0 + 500ms) : c.status();
    EXPECT_LT(TransportClock::now() - t0, 500ms + 1s);
    if (st.ok()) {
      EXPECT_LT(iter, 10) << "a read from a killed peer succeeded";
      for (uint64_t i = 0; i < kBlock; ++i) ASSERT_EQ(buf[i], pattern_byte(offset + i, 13));
      ++ok_reads;
    } else {
      EXPECT_TRUE(st.is(Code::kUnavailable)) << st.ToString();
      ++failed;
    }
  }
  EXPECT_EQ(ok_reads, 10);
  EXPECT_EQ(failed, 20);
  link.t->close();
}

// One fabric list per instantiation (UCX_TLS names).
class TransportFabricTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!Transport::available()) GTEST_SKIP() << "built without UCX";
  }

  TransportOptions options() const {
    TransportOptions o;
    o.fabrics = GetParam();
    return o;
  }

  // Starts a child serving a region. REQUIRES: before open_local().
  std::unique_ptr<ForkedPeer> start_child(uint8_t seed, uint64_t bytes = kRegion) {
    ForkedPeerOptions fo;
    fo.transport = options();
    fo.region_bytes = bytes;
    fo.seed = seed;
    Result<std::unique_ptr<ForkedPeer>> c = ForkedPeer::Start(fo, deadline_in(30s));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Starts a get of each buffer's size from `region`, buffer i from
  // offset_of(i); the pending Completions, in order.
  template <class Offset>
  static void start_gets(Peer& peer, const RemoteRegion& region,
                         std::vector<std::vector<uint8_t>>& bufs, Offset offset_of,
                         std::vector<std::unique_ptr<Completion>>* pending) {
    for (size_t i = 0; i < bufs.size(); ++i) {
      Result<std::unique_ptr<Completion>> c =
          peer.get(region, offset_of(i), bufs[i].data(), bufs[i].size());
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      pending->push_back(std::move(*c));
    }
  }

  void open_local(bool progress_thread = false) {
    TransportOptions o = options();
    o.progress_thread = progress_thread;
    Result<std::unique_ptr<Transport>> t = Transport::Open(o);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    local_ = std::move(*t);
  }

  // Connects to a child and imports its region.
  void attach(const ForkedPeer& child, std::shared_ptr<Peer>* peer,
              std::shared_ptr<RemoteRegion>* region) {
    Result<std::shared_ptr<Peer>> p = local_->connect(child.address(), deadline_in(10s));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    Result<std::shared_ptr<RemoteRegion>> r = (*p)->import_key(child.key());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ((*r)->size(), child.region_bytes());
    *peer = *p;
    *region = *r;
  }

  static bool matches_pattern(const uint8_t* data, uint64_t n, uint64_t first, uint8_t seed) {
    for (uint64_t i = 0; i < n; ++i)
      if (data[i] != pattern_byte(first + i, seed)) return false;
    return true;
  }

  std::unique_ptr<Transport> local_;
};

const uint64_t kSizes[] = {0, 1, 7, 64, 4096, 65536 + 3, 1 << 20, 8 << 20};

TEST_P(TransportFabricTest, GetsAndPutsEveryByte) {
  auto child = start_child(3);
  ASSERT_NE(child, nullptr);
  open_local();
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;

  // Local buffers: plain memory, and a registered region.
  std::vector<uint8_t> plain(kRegion);
  std::vector<uint8_t> backing(kRegion);
  Result<std::unique_ptr<MemoryRegion>> reg = local_->register_memory(backing.data(), kRegion);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();

  std::mt19937_64 rng(42);
  for (uint64_t n : kSizes) {
    for (int round = 0; round < 3; ++round) {
      uint64_t offset = round == 0 ? 0 : rng() % (kRegion - n + 1);
      if (round == 2) offset = kRegion - n;  // ending at the region's last byte
      uint8_t* dst = (round % 2 ? (*reg)->data() : plain.data()) + 5;
      std::memset(dst, 0xee, n);
      Result<std::unique_ptr<Completion>> c = peer->get(*region, offset, dst, n);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      Status st = (*c)->wait(deadline_in(10s));
      ASSERT_TRUE(st.ok()) << st.ToString();
      ASSERT_TRUE(matches_pattern(dst, n, offset, 3)) << "get of " << n << " at " << offset;
    }
  }

  // Puts of fresh bytes, checked by the child reading its own memory, then read back.
  for (uint64_t n : kSizes) {
    uint64_t offset = rng() % (kRegion - n + 1);
    std::vector<uint8_t> src(n);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    Result<std::unique_ptr<Completion>> c = peer->put(*region, offset, src.data(), n);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE((*c)->wait(deadline_in(10s)).ok());
    Result<uint64_t> sum = child->checksum(offset, n, deadline_in(10s));
    ASSERT_TRUE(sum.ok()) << sum.status().ToString();
    EXPECT_EQ(*sum, bytes_checksum(src.data(), n)) << "put of " << n << " at " << offset;
    std::vector<uint8_t> back(n + 1, 0xee);
    c = peer->get(*region, offset, back.data(), n);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE((*c)->wait(deadline_in(10s)).ok());
    if (n > 0) {
      EXPECT_EQ(0, std::memcmp(back.data(), src.data(), n));
    }
    EXPECT_EQ(back[n], 0xee) << "a get wrote past its end";
  }
}

TEST_P(TransportFabricTest, BatchOfManyOutstanding) {
  auto child = start_child(9);
  ASSERT_NE(child, nullptr);
  open_local();
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;

  constexpr uint64_t kBlock = 1 << 20, kCount = 12;
  std::vector<uint8_t> dst(kBlock * kCount, 0);
  std::vector<uint8_t> src(kBlock * 2);
  fill_pattern(src.data(), src.size(), 777, 42);
  std::vector<TransferOp> ops;
  for (uint64_t i = 0; i < kCount; ++i)
    ops.push_back({TransferKind::kGet, region.get(), (kCount - 1 - i) * kBlock,
                   dst.data() + i * kBlock, kBlock});
  // Two puts to the region's top, away from the ranges read.
  ops.push_back({TransferKind::kPut, region.get(), kRegion - 2 * kBlock, src.data(), kBlock});
  ops.push_back({TransferKind::kPut, region.get(), kRegion - kBlock, src.data() + kBlock, kBlock});
  Status st = peer->run_batch(ops, deadline_in(20s));
  ASSERT_TRUE(st.ok()) << st.ToString();
  for (uint64_t i = 0; i < kCount; ++i)
    ASSERT_TRUE(matches_pattern(dst.data() + i * kBlock, kBlock, (kCount - 1 - i) * kBlock, 9))
        << "block " << i;
  Result<uint64_t> sum = child->checksum(kRegion - 2 * kBlock, 2 * kBlock, deadline_in(10s));
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, bytes_checksum(src.data(), src.size()));

  // One bad op refuses the whole batch before anything moves.
  std::fill(dst.begin(), dst.end(), 0);
  ops[0].offset = kRegion;  // with kBlock bytes: past the end
  EXPECT_TRUE(peer->run_batch(ops, deadline_in(10s)).is(Code::kInvalidArgument));
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0; }));
}

TEST_P(TransportFabricTest, ThreeProcesses) {
  auto a = start_child(11);
  auto b = start_child(22);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  open_local();
  std::shared_ptr<Peer> pa, pb;
  std::shared_ptr<RemoteRegion> ra, rb;
  attach(*a, &pa, &ra);
  attach(*b, &pb, &rb);
  if (HasFatalFailure()) return;
  // A region imported on one peer cannot be used on another.
  std::vector<uint8_t> buf(8 << 20);
  EXPECT_TRUE(pb->get(*ra, 0, buf.data(), 16).status().is(Code::kInvalidArgument));

  // A's bytes to B through this process, then read back from B.
  for (uint64_t n : {uint64_t{4096}, uint64_t{3 << 20}, uint64_t{8 << 20}}) {
    ASSERT_TRUE(
        pa->run_batch(std::vector<TransferOp>{{TransferKind::kGet, ra.get(), 100, buf.data(), n}},
                      deadline_in(10s))
            .ok());
    ASSERT_TRUE(matches_pattern(buf.data(), n, 100, 11));
    ASSERT_TRUE(
        pb->run_batch(std::vector<TransferOp>{{TransferKind::kPut, rb.get(), 1, buf.data(), n}},
                      deadline_in(10s))
            .ok());
    Result<uint64_t> sum = b->checksum(1, n, deadline_in(10s));
    ASSERT_TRUE(sum.ok());
    EXPECT_EQ(*sum, bytes_checksum(buf.data(), n));
  }
  // B's untouched bytes are still its own pattern.
  std::vector<uint8_t> tail(4096);
  ASSERT_TRUE(pb->run_batch(std::vector<TransferOp>{{TransferKind::kGet, rb.get(), kRegion - 4096,
                                                     tail.data(), 4096}},
                            deadline_in(10s))
                  .ok());
  EXPECT_TRUE(matches_pattern(tail.data(), 4096, kRegion - 4096, 22));
}

TEST_P(TransportFabricTest, BadInputRefused) {
  auto child = start_child(5, 1 << 20);
  ASSERT_NE(child, nullptr);
  open_local();
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;
  std::vector<uint8_t> buf(2 << 20);
  uint64_t size = region->size();
  EXPECT_TRUE(peer->get(*region, size - 1, buf.data(), 2).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(peer->get(*region, size + 1, buf.data(), 0).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(peer->get(*region, 0, buf.data(), size + 1).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(
      peer->get(*region, 8, buf.data(), ~uint64_t{0} - 4).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(peer->put(*region, size, buf.data(), 1).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(peer->get(*region, 0, nullptr, 1).status().is(Code::kInvalidArgument));

  std::vector<uint8_t> key = child->key();
  key[key.size() / 2] ^= 1;
  EXPECT_TRUE(peer->import_key(key).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(peer->import_key(std::vector<uint8_t>(3, 0)).status().is(Code::kInvalidArgument));
  std::vector<uint8_t> addr = child->address();
  addr.back() ^= 0x80;
  EXPECT_TRUE(local_->connect(addr, deadline_in(1s)).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(local_->register_memory(nullptr, 10).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(local_->register_memory(buf.data(), 0).status().is(Code::kInvalidArgument));
  // Still usable after all that.
  Result<std::unique_ptr<Completion>> c = peer->get(*region, 0, buf.data(), size);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->wait(deadline_in(10s)).ok());
  EXPECT_TRUE(matches_pattern(buf.data(), size, 0, 5));
}

TEST_P(TransportFabricTest, ControlMessages) {
  auto child = start_child(6, 4096);
  ASSERT_NE(child, nullptr);
  // The child connects to us while we wait on the socket: our endpoint must
  // make progress without a waiting caller.
  open_local(/*progress_thread=*/true);
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(child->start_echo(local_->address(), 70, 71, deadline_in(10s)).ok());
  std::vector<uint8_t> msg(3000);
  for (size_t i = 0; i < msg.size(); ++i) msg[i] = static_cast<uint8_t>(i * 7);
  ASSERT_TRUE(peer->send(70, msg, deadline_in(10s)).ok());
  Result<std::vector<uint8_t>> reply = local_->receive(71, 1 << 16, deadline_in(10s));
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  std::reverse(msg.begin(), msg.end());
  EXPECT_EQ(*reply, msg);

  // Nothing arrives with this tag: Unavailable at the deadline, not later.
  auto t0 = TransportClock::now();
  EXPECT_TRUE(local_->receive(72, 64, deadline_in(200ms)).status().is(Code::kUnavailable));
  EXPECT_LT(TransportClock::now() - t0, 2s);

  // A message longer than the receiver allows is refused.
  ASSERT_TRUE(child->start_echo(local_->address(), 73, 74, deadline_in(10s)).ok());
  ASSERT_TRUE(peer->send(73, std::vector<uint8_t>(100, 1), deadline_in(10s)).ok());
  EXPECT_TRUE(local_->receive(74, 10, deadline_in(10s)).status().is(Code::kInvalidArgument));
}

// A receive that matched a message whose bytes stop coming (its sender is
// stopped mid-message) cannot finish; it still returns by its deadline and a
// little, and the transport holds its buffer until UCX is done with it. The
// message goes to the next receive of its tag.
TEST_P(TransportFabricTest, ReceiveFromASenderStoppedMidMessageEndsByItsDeadline) {
  auto child = start_child(6, 4096);
  ASSERT_NE(child, nullptr);
  open_local(/*progress_thread=*/true);
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(child->start_echo(local_->address(), 80, 81, deadline_in(10s)).ok());
  // Too large to travel in one piece: the child announces its echo, and its
  // bytes follow only while the child runs.
  std::vector<uint8_t> msg(1 << 20);
  for (size_t i = 0; i < msg.size(); ++i) msg[i] = static_cast<uint8_t>(i * 7 + i / 251);
  ASSERT_TRUE(peer->send(80, msg, deadline_in(10s)).ok());
  std::this_thread::sleep_for(300ms);
  child->signal(SIGSTOP);
  auto t0 = TransportClock::now();
  Result<std::vector<uint8_t>> got = local_->receive(81, msg.size(), t0 + 200ms);
  auto took = TransportClock::now() - t0;
  EXPECT_EQ(local_->counters().held, 1u);
  // Again while the child is stopped: the same wait, the same bound.
  t0 = TransportClock::now();
  EXPECT_TRUE(local_->receive(81, msg.size(), t0 + 100ms).status().is(Code::kUnavailable));
  EXPECT_LT(TransportClock::now() - t0, 100ms + 500ms);
  child->signal(SIGCONT);
  EXPECT_TRUE(got.status().is(Code::kUnavailable)) << got.status().ToString();
  EXPECT_LT(took, 200ms + 500ms);
  // Once the child runs again the message ends in the held buffer, and the
  // next receive of its tag has it.
  got = local_->receive(81, msg.size(), deadline_in(5s));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  std::reverse(msg.begin(), msg.end());
  EXPECT_TRUE(*got == msg);
  EXPECT_EQ(local_->counters().held, 0u);
  EXPECT_EQ(local_->counters().dropped, 0u);
}

// A sender stopped in the middle of a large message holds the receive that
// matched it; later receives of the tag still take other senders' messages,
// and the stopped one's once it has arrived.
TEST_P(TransportFabricTest, ASenderStoppedMidMessageHoldsUpNoOtherSendersMessagesOfItsTag) {
  auto slow = start_child(6, 4096);
  auto quick = start_child(7, 4096);
  ASSERT_NE(slow, nullptr);
  ASSERT_NE(quick, nullptr);
  open_local(/*progress_thread=*/true);
  std::shared_ptr<Peer> slow_peer, quick_peer;
  std::shared_ptr<RemoteRegion> slow_region, quick_region;
  attach(*slow, &slow_peer, &slow_region);
  attach(*quick, &quick_peer, &quick_region);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(slow->start_echo(local_->address(), 80, 81, deadline_in(10s)).ok());
  ASSERT_TRUE(quick->start_echo(local_->address(), 82, 81, deadline_in(10s)).ok());
  std::vector<uint8_t> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7 + i / 251);
  ASSERT_TRUE(slow_peer->send(80, big, deadline_in(10s)).ok());
  std::this_thread::sleep_for(300ms);
  slow->signal(SIGSTOP);
  // The receive that matches the stopped sender's message gives up at its
  // deadline; the message's buffer stays held.
  EXPECT_TRUE(local_->receive(81, big.size(), deadline_in(200ms)).status().is(Code::kUnavailable));
  EXPECT_EQ(local_->counters().held, 1u);
  const std::vector<uint8_t> small = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  ASSERT_TRUE(quick_peer->send(82, small, deadline_in(10s)).ok());
  Result<std::vector<uint8_t>> got = Status::Unavailable("none yet");
  const auto t0 = TransportClock::now();
  while (!got.ok() && TransportClock::now() - t0 < 3s)
    got = local_->receive(81, big.size(), deadline_in(100ms));
  ASSERT_TRUE(got.ok()) << "the stopped sender held up the tag: " << got.status().ToString();
  EXPECT_TRUE(*got == std::vector<uint8_t>(small.rbegin(), small.rend()));
  // The stopped sender's message, once it runs again.
  slow->signal(SIGCONT);
  got = local_->receive(81, big.size(), deadline_in(5s));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  std::reverse(big.begin(), big.end());
  EXPECT_TRUE(*got == big);
  EXPECT_EQ(local_->counters().held, 0u);
}

// A message nobody will receive (the reply to a request whose receive gave
// up), small or large, is taken and dropped when it comes rather than kept.
TEST_P(TransportFabricTest, DiscardedMessagesAreDroppedWhenTheyCome) {
  // One child per message: each echoes once.
  std::unique_ptr<ForkedPeer> children[] = {start_child(6, 4096), start_child(7, 4096),
                                            start_child(8, 4096)};
  for (const auto& c : children) ASSERT_NE(c, nullptr);
  open_local(/*progress_thread=*/true);
  uint64_t dropped = 0;
  for (size_t n : {size_t{3000}, size_t{1} << 20}) {
    ForkedPeer& child = *children[dropped];
    std::shared_ptr<Peer> peer;
    std::shared_ptr<RemoteRegion> region;
    attach(child, &peer, &region);
    if (HasFatalFailure()) return;
    ASSERT_TRUE(child.start_echo(local_->address(), 90, 91, deadline_in(10s)).ok());
    local_->discard(91);
    EXPECT_EQ(local_->counters().held, 1u);
    ASSERT_TRUE(peer->send(90, std::vector<uint8_t>(n, 7), deadline_in(10s)).ok());
    auto t0 = TransportClock::now();
    while (local_->counters().held > 0 && TransportClock::now() - t0 < 5s)
      std::this_thread::sleep_for(10ms);
    EXPECT_EQ(local_->counters().held, 0u) << n;
    EXPECT_EQ(local_->counters().dropped, ++dropped) << n;
    EXPECT_TRUE(local_->receive(91, n, deadline_in(100ms)).status().is(Code::kUnavailable)) << n;
    // The child's send of the echo ended: it answers at once.
    EXPECT_TRUE(child.checksum(0, 16, deadline_in(2s)).ok()) << n;
  }
  // A discard of a tag whose receive gave up while its message was arriving
  // drops that message once it has.
  {
    ForkedPeer& child = *children[2];
    std::shared_ptr<Peer> peer;
    std::shared_ptr<RemoteRegion> region;
    attach(child, &peer, &region);
    if (HasFatalFailure()) return;
    ASSERT_TRUE(child.start_echo(local_->address(), 90, 91, deadline_in(10s)).ok());
    ASSERT_TRUE(peer->send(90, std::vector<uint8_t>(1 << 20, 9), deadline_in(10s)).ok());
    std::this_thread::sleep_for(300ms);
    child.signal(SIGSTOP);
    EXPECT_TRUE(local_->receive(91, 1 << 20, deadline_in(100ms)).status().is(Code::kUnavailable));
    local_->discard(91);
    EXPECT_EQ(local_->counters().held, 1u);
    child.signal(SIGCONT);
    auto t0 = TransportClock::now();
    while (local_->counters().held > 0 && TransportClock::now() - t0 < 5s)
      std::this_thread::sleep_for(10ms);
    EXPECT_EQ(local_->counters().held, 0u);
    EXPECT_EQ(local_->counters().dropped, ++dropped);
    EXPECT_TRUE(local_->receive(91, 1 << 20, deadline_in(100ms)).status().is(Code::kUnavailable));
  }
  // Discards whose message never comes are bounded.
  for (uint64_t k = 0; k < Transport::kMaxDiscards + 100; ++k) local_->discard(1000 + k);
  EXPECT_EQ(local_->counters().held, Transport::kMaxDiscards);
  EXPECT_EQ(local_->counters().dropped, dropped);
}

// Threads blocked in receive with nothing to receive, beside the progress
// thread, sleep instead of polling; and a message that comes while they
// sleep still reaches its receiver at once.
TEST_P(TransportFabricTest, IdleWaitsSleep) {
  auto child = start_child(6, 4096);
  ASSERT_NE(child, nullptr);
  open_local(/*progress_thread=*/true);
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;
  auto cpu_seconds = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  };
  const double cpu0 = cpu_seconds();
  const auto wall0 = TransportClock::now();
  std::vector<std::thread> waiters;
  for (int i = 0; i < 4; ++i)
    waiters.emplace_back([&, i] {
      for (int k = 0; k < 3; ++k)
        EXPECT_FALSE(local_->receive(90 + i, 64, deadline_in(400ms)).ok());
    });
  for (auto& t : waiters) t.join();
  const double wall = std::chrono::duration<double>(TransportClock::now() - wall0).count();
  const double cpu = cpu_seconds() - cpu0;
  // Polling, four waiters and the progress thread would take about a core
  // each; sleeping, next to nothing.
  EXPECT_LT(cpu, 0.25 * wall) << "CPU seconds " << cpu << " in " << wall << " s of idle waits";

  ASSERT_TRUE(child->start_echo(local_->address(), 70, 71, deadline_in(10s)).ok());
  std::atomic<int64_t> got_ns{0};
  std::thread receiver([&] {
    auto r = local_->receive(71, 64, deadline_in(10s));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    got_ns = TransportClock::now().time_since_epoch().count();
  });
  std::this_thread::sleep_for(200ms);  // the receiver is asleep by now
  const auto sent = TransportClock::now();
  const bool went = peer->send(70, std::vector<uint8_t>(16, 3), deadline_in(10s)).ok();
  EXPECT_TRUE(went);
  receiver.join();
  if (!went) return;
  const auto took = TransportClock::time_point(TransportClock::duration(got_ns.load())) - sent;
  EXPECT_LT(took, 100ms) << "a message took "
                         << std::chrono::duration<double, std::milli>(took).count()
                         << " ms to reach a sleeping receiver";
}

// A receive told that its message may come at any time sleeps after its
// first look beside a progress thread, and the progress thread wakes it
// when the message is in; without one it polls. Either way every message
// reaches it (one sent while it waits, and, beside a progress thread, one
// that came before it), and a message that never comes ends it by its
// deadline. A receive that expects its message soon polls before it sleeps.
TEST_P(TransportFabricTest, ReceivesWaitingForMessagesAtAnyTimeGetEachOne) {
  // Both children first: a child is forked before this process opens a
  // Transport of its own.
  std::unique_ptr<ForkedPeer> children[2] = {start_child(6, 4096), start_child(7, 4096)};
  ASSERT_NE(children[0], nullptr);
  ASSERT_NE(children[1], nullptr);
  for (bool progress_thread : {true, false}) {
    SCOPED_TRACE(progress_thread ? "with a progress thread" : "without a progress thread");
    ForkedPeer& child = *children[progress_thread ? 0 : 1];
    open_local(progress_thread);
    std::shared_ptr<Peer> peer;
    std::shared_ptr<RemoteRegion> region;
    attach(child, &peer, &region);
    if (HasFatalFailure()) return;
    const TransportCounters before = local_->counters();
    int waited = 0;  // receives that waited before their message was sent
    for (int i = 0; i < 6; ++i) {
      const uint64_t tag_in = 200 + 2 * i, tag_out = tag_in + 1;
      std::vector<uint8_t> msg(100 + 700 * i);
      for (size_t k = 0; k < msg.size(); ++k) msg[k] = static_cast<uint8_t>(k * 13 + i);
      Result<std::vector<uint8_t>> got = Status::Unavailable("not received");
      auto receive = [&] {
        got = local_->receive(tag_out, 1 << 16, deadline_in(10s), ReceiveWait::kAnyTime);
      };
      // The receiver waits before the child connects back and the message
      // goes out (without a progress thread its polls are what answer the
      // child's connection); beside a progress thread, every other reply is
      // in before its receive starts.
      const bool waits_first = !progress_thread || i % 2 == 0;
      std::thread receiver;
      if (waits_first) {
        receiver = std::thread(receive);
        std::this_thread::sleep_for(50ms);
        ++waited;
      }
      const bool echoing =
          child.start_echo(local_->address(), tag_in, tag_out, deadline_in(10s)).ok();
      EXPECT_TRUE(echoing) << "message " << i;
      const bool sent = echoing && peer->send(tag_in, msg, deadline_in(10s)).ok();
      EXPECT_TRUE(!echoing || sent) << "message " << i;
      if (waits_first) {
        receiver.join();
      } else if (sent) {
        std::this_thread::sleep_for(50ms);
        receive();
      }
      if (!sent) return;
      ASSERT_TRUE(got.ok()) << "message " << i << ": " << got.status().ToString();
      std::reverse(msg.begin(), msg.end());
      EXPECT_EQ(*got, msg) << "message " << i;
    }
    const TransportCounters after = local_->counters();
    if (progress_thread) {
      // Each receive that waited slept after its first look, and progress
      // (not a nap) ended at least one sleep.
      EXPECT_GE(after.slept_at_once - before.slept_at_once, uint64_t(waited));
      EXPECT_GE(after.woken - before.woken, 1u);
    } else {
      EXPECT_EQ(after.slept_at_once, before.slept_at_once);
      EXPECT_EQ(after.woken, before.woken);
    }
    auto t0 = TransportClock::now();
    EXPECT_TRUE(local_->receive(299, 64, deadline_in(200ms), ReceiveWait::kAnyTime)
                    .status()
                    .is(Code::kUnavailable));
    EXPECT_LT(TransportClock::now() - t0, 2s);
    // A receive expecting its message soon polls first, then sleeps.
    const uint64_t at_once = local_->counters().slept_at_once;
    t0 = TransportClock::now();
    EXPECT_TRUE(local_->receive(298, 64, deadline_in(200ms), ReceiveWait::kSoon)
                    .status()
                    .is(Code::kUnavailable));
    EXPECT_LT(TransportClock::now() - t0, 2s);
    EXPECT_EQ(local_->counters().slept_at_once, at_once);
    peer.reset();
    region.reset();
    local_->close();
    local_.reset();
  }
}

// A peer killed with SIGKILL while reads are in flight: every pending and
// later operation fails within its deadline, and no read that succeeded
// holds a wrong byte.
TEST_P(TransportFabricTest, PeerKilledMidLoop) {
  auto child = start_child(7);
  ASSERT_NE(child, nullptr);
  open_local();
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;

  constexpr uint64_t kBlock = 1 << 20, kInFlight = 4;
  constexpr auto kDeadline = 1500ms;
  std::vector<std::vector<uint8_t>> bufs(kInFlight, std::vector<uint8_t>(kBlock));
  int ok_reads = 0, failed_reads = 0;
  bool killed = false;
  auto loop_start = TransportClock::now();
  for (int iter = 0; iter < 40; ++iter) {
    std::vector<std::unique_ptr<Completion>> pending;
    for (uint64_t j = 0; j < kInFlight; ++j) {
      uint64_t offset = ((iter * kInFlight + j) % 15) * kBlock;
      std::memset(bufs[j].data(), 0, kBlock);
      Result<std::unique_ptr<Completion>> c = peer->get(*region, offset, bufs[j].data(), kBlock);
      if (!c.ok()) {
        EXPECT_TRUE(killed) << c.status().ToString();
        EXPECT_TRUE(c.status().is(Code::kUnavailable)) << c.status().ToString();
        ++failed_reads;
        pending.push_back(nullptr);
        continue;
      }
      pending.push_back(std::move(*c));
    }
    if (iter == 10) {
      child->signal(SIGKILL);
      killed = true;
    }
    for (uint64_t j = 0; j < kInFlight; ++j) {
      if (!pending[j]) continue;
      auto t0 = TransportClock::now();
      Status st = pending[j]->wait(t0 + kDeadline);
      auto waited = TransportClock::now() - t0;
      EXPECT_LT(waited, kDeadline + 1s) << "a wait overran its deadline";
      if (st.ok()) {
        uint64_t offset = ((iter * kInFlight + j) % 15) * kBlock;
        EXPECT_TRUE(matches_pattern(bufs[j].data(), kBlock, offset, 7)) << "iter " << iter;
        ++ok_reads;
      } else {
        EXPECT_TRUE(killed) << st.ToString();
        EXPECT_TRUE(st.is(Code::kUnavailable)) << st.ToString();
        ++failed_reads;
      }
    }
  }
  EXPECT_GE(ok_reads, 40);  // the ten rounds before the kill
  EXPECT_GT(failed_reads, 0);
  EXPECT_TRUE(peer->health().is(Code::kUnavailable));
  // The whole loop: at most one deadline per failure the fabric did not notice.
  EXPECT_LT(TransportClock::now() - loop_start, 30s);
}

// A stopped peer never answers: the deadline fails the read, and the
// connection with it.
TEST_P(TransportFabricTest, SilentPeerHitsDeadline) {
  auto child = start_child(8, 4 << 20);
  ASSERT_NE(child, nullptr);
  open_local();
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;
  std::vector<uint8_t> buf(4 << 20);
  // Warm the path first.
  ASSERT_TRUE(peer->run_batch(std::vector<TransferOp>{{TransferKind::kGet, region.get(), 0,
                                                       buf.data(), buf.size()}},
                              deadline_in(10s))
                  .ok());
  child->signal(SIGSTOP);
  // A put needs the peer's acknowledgement on every fabric.
  auto t0 = TransportClock::now();
  Result<std::unique_ptr<Completion>> c = peer->put(*region, 0, buf.data(), buf.size());
  Status st = c.ok() ? (*c)->wait(t0 + 300ms) : c.status();
  auto waited = TransportClock::now() - t0;
  child->signal(SIGCONT);
  EXPECT_TRUE(st.is(Code::kUnavailable)) << st.ToString();
  EXPECT_LT(waited, 300ms + 2s);
  EXPECT_TRUE(peer->health().is(Code::kUnavailable));
  EXPECT_TRUE(peer->get(*region, 0, buf.data(), 1).status().is(Code::kUnavailable));
  // A fresh connection works again.
  std::shared_ptr<Peer> again;
  std::shared_ptr<RemoteRegion> region2;
  attach(*child, &again, &region2);
  if (HasFatalFailure()) return;
  Result<std::unique_ptr<Completion>> g = again->get(*region2, 4096, buf.data(), 4096);
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE((*g)->wait(deadline_in(10s)).ok());
  EXPECT_TRUE(matches_pattern(buf.data(), 4096, 4096, 8));
}

TEST_P(TransportFabricTest, GetsOutliveTheRegionTheyReadFrom) {
  // The caller drops the remote region while large gets from it are under
  // way: its key stays valid until they have ended, and they bring the
  // region's bytes.
  auto child = start_child(5);
  ASSERT_NE(child, nullptr);
  open_local();
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;
  constexpr uint64_t kBlock = 8 << 20;
  std::vector<std::vector<uint8_t>> bufs(6, std::vector<uint8_t>(kBlock));
  std::vector<std::unique_ptr<Completion>> pending;
  start_gets(
      *peer, *region, bufs, [](size_t i) { return (i % 2) * kBlock; }, &pending);
  if (HasFatalFailure()) return;
  region.reset();
  for (size_t i = 0; i < pending.size(); ++i) {
    ASSERT_TRUE(pending[i]->wait(deadline_in(10s)).ok()) << i;
    EXPECT_TRUE(matches_pattern(bufs[i].data(), kBlock, (i % 2) * kBlock, 5)) << i;
  }
}

TEST_P(TransportFabricTest, CloseWhilePending) {
  auto child = start_child(4);
  ASSERT_NE(child, nullptr);
  open_local();
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;
  constexpr uint64_t kBlock = 8 << 20;
  std::vector<std::vector<uint8_t>> bufs(6, std::vector<uint8_t>(kBlock));
  std::vector<std::unique_ptr<Completion>> pending;
  start_gets(
      *peer, *region, bufs, [](size_t i) { return (i % 2) * kBlock; }, &pending);
  if (HasFatalFailure()) return;
  peer->close();
  auto t0 = TransportClock::now();
  for (size_t i = 0; i < pending.size(); ++i) {
    Status st = pending[i]->wait(deadline_in(5s));
    if (st.ok()) {
      EXPECT_TRUE(matches_pattern(bufs[i].data(), kBlock, (i % 2) * kBlock, 4));
    } else {
      EXPECT_TRUE(st.is(Code::kUnavailable)) << st.ToString();
    }
  }
  EXPECT_LT(TransportClock::now() - t0, 2s);
  EXPECT_TRUE(peer->get(*region, 0, bufs[0].data(), 1).status().is(Code::kUnavailable));

  // Closing the whole transport while reads are pending on a second peer.
  std::shared_ptr<Peer> second;
  std::shared_ptr<RemoteRegion> region2;
  attach(*child, &second, &region2);
  if (HasFatalFailure()) return;
  pending.clear();
  start_gets(
      *second, *region2, bufs, [](size_t) { return uint64_t{0}; }, &pending);
  if (HasFatalFailure()) return;
  local_->close();
  for (auto& c : pending) {
    Status st = c->wait(deadline_in(5s));
    EXPECT_TRUE(st.ok() || st.is(Code::kUnavailable)) << st.ToString();
  }
  EXPECT_TRUE(second->health().is(Code::kUnavailable));
  EXPECT_TRUE(local_->connect(child->address(), deadline_in(1s)).status().is(Code::kUnavailable));
}

// A peer that is gone before we connect: connect fails by its deadline.
TEST_P(TransportFabricTest, ConnectToDeadPeer) {
  auto child = start_child(2, 4096);
  ASSERT_NE(child, nullptr);
  std::vector<uint8_t> addr = child->address();
  child->signal(SIGKILL);
  open_local();
  auto t0 = TransportClock::now();
  Result<std::shared_ptr<Peer>> p = local_->connect(addr, t0 + 1s);
  Status st = p.status();
  if (p.ok()) {
    // Some fabrics connect without the peer; then the first transfer fails.
    Result<std::shared_ptr<RemoteRegion>> r = (*p)->import_key(child->key());
    std::vector<uint8_t> buf(64);
    if (r.ok()) {
      Result<std::unique_ptr<Completion>> c = (*p)->get(**r, 0, buf.data(), 64);
      st = c.ok() ? (*c)->wait(t0 + 2s) : c.status();
    } else {
      st = r.status();
    }
  }
  EXPECT_FALSE(st.ok());
  EXPECT_LT(TransportClock::now() - t0, 5s);
}

// A stopped peer does not answer the connection: connect fails by its deadline.
TEST_P(TransportFabricTest, ConnectToStoppedPeer) {
  auto child = start_child(2, 4096);
  ASSERT_NE(child, nullptr);
  child->signal(SIGSTOP);
  open_local();
  auto t0 = TransportClock::now();
  Result<std::shared_ptr<Peer>> p = local_->connect(child->address(), t0 + 500ms);
  Status st = p.status();
  if (p.ok()) {
    Result<std::shared_ptr<RemoteRegion>> r = (*p)->import_key(child->key());
    std::vector<uint8_t> buf(64);
    ASSERT_TRUE(r.ok());
    Result<std::unique_ptr<Completion>> c = (*p)->put(**r, 0, buf.data(), 64);
    st = c.ok() ? (*c)->wait(t0 + 1s) : c.status();
  }
  child->signal(SIGCONT);
  EXPECT_TRUE(st.is(Code::kUnavailable)) << st.ToString();
  EXPECT_LT(TransportClock::now() - t0, 3s);
}

// TCP alone, and shared memory: bulk bytes over UCX's shared-memory transports
// (cma, the kernel's cross-process copy), messages over tcp, the only
// message transport of UCX 1.13 that detects a dead peer.
INSTANTIATE_TEST_SUITE_P(Fabrics, TransportFabricTest, ::testing::Values("tcp", "sm,tcp"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "tcp" ? "tcp" : "shm";
                         });

// The address of a peer that was killed: the connect fails at once (the
// fabric refuses it), not at its deadline, and says the peer may be gone.
TEST_P(TransportFabricTest, ConnectingToAKilledPeerFailsAtOnceAndSaysSo) {
  auto child = start_child(9);
  ASSERT_NE(child, nullptr);
  open_local();
  std::shared_ptr<Peer> peer;
  std::shared_ptr<RemoteRegion> region;
  attach(*child, &peer, &region);
  if (HasFatalFailure()) return;
  const std::vector<uint8_t> address = child->address();
  child->signal(SIGKILL);
  for (int i = 0; i < 100 && peer->health().ok(); ++i) std::this_thread::sleep_for(10ms);
  auto t0 = TransportClock::now();
  Result<std::shared_ptr<Peer>> again = local_->connect(address, deadline_in(5s));
  ASSERT_FALSE(again.ok());
  EXPECT_TRUE(again.status().is(Code::kUnavailable)) << again.status().ToString();
  EXPECT_NE(again.status().message().find("gone"), std::string::npos) << again.status().ToString();
  EXPECT_LT(TransportClock::now() - t0, 2s);
}

}  // namespace
}  // namespace cascade
