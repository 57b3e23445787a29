// The MPI backend of Transport, as every rank of an MPI job sees it: run
// with mpirun -np 2 or more (ctest runs it with 2 and 3 ranks). Every rank
// runs every test; a check that fails on any rank fails the test. Prints
// "N passed, N failed" and exits 0 when all passed, 77 when this MPI cannot
// expose memory for one-sided access (skipped), 1 otherwise.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transport/key_format.h"
#include "transport/transport.h"

namespace cascade {
namespace {

using namespace std::chrono_literals;

int g_rank = 0, g_size = 1;
int g_failures = 0;  // this rank's, in the running test

void fail_check(const char* file, int line, const std::string& what) {
  ++g_failures;
  std::fprintf(stderr, "rank %d: %s:%d: %s\n", g_rank, file, line, what.c_str());
}

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) ::cascade::fail_check(__FILE__, __LINE__, "failed: " #cond); \
  } while (0)
#define CHECK_OK(expr)                                                                     \
  do {                                                                                     \
    const ::cascade::Status st_ = (expr);                                                  \
    if (!st_.ok()) ::cascade::fail_check(__FILE__, __LINE__, #expr ": " + st_.ToString()); \
  } while (0)
#define CHECK_CODE(expr, want)                                                    \
  do {                                                                            \
    const ::cascade::Status st_ = (expr);                                         \
    if (st_.code() != (want))                                                     \
      ::cascade::fail_check(__FILE__, __LINE__, #expr " gave " + st_.ToString()); \
  } while (0)

uint8_t pattern(int rank, uint64_t i) {
  uint64_t x =
      (i + 1) * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(rank) * 0xbf58476d1ce4e5b9ULL;
  return static_cast<uint8_t>(x ^ (x >> 29) ^ (x >> 47));
}

// Every rank's bytes, in the rank order of `comm`.
std::vector<std::vector<uint8_t>> all_gather(const std::vector<uint8_t>& mine,
                                             MPI_Comm comm = MPI_COMM_WORLD) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  int n = static_cast<int>(mine.size());
  std::vector<int> sizes(size), at(size);
  MPI_Allgather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    at[r] = total;
    total += sizes[r];
  }
  std::vector<uint8_t> flat(total);
  MPI_Allgatherv(mine.data(), n, MPI_BYTE, flat.data(), sizes.data(), at.data(), MPI_BYTE, comm);
  std::vector<std::vector<uint8_t>> out(size);
  for (int r = 0; r < size; ++r)
    out[r].assign(flat.begin() + at[r], flat.begin() + at[r] + sizes[r]);
  return out;
}

// One Transport per rank with a registered region filled with the rank's
// pattern, connected to every rank (itself included), each peer's region
// imported.
struct Net {
  std::unique_ptr<Transport> t;
  std::vector<uint8_t> memory;
  std::unique_ptr<MemoryRegion> region;
  std::vector<std::vector<uint8_t>> addresses, keys;
  std::vector<std::shared_ptr<Peer>> peers;
  std::vector<std::shared_ptr<RemoteRegion>> regions;

  explicit Net(uint64_t bytes = 8 << 20, bool progress_thread = true) {
    TransportOptions o;
    o.backend = TransportBackend::kMpi;
    o.progress_thread = progress_thread;
    auto tr = Transport::Open(o);
    CHECK_OK(tr.status());
    if (!tr.ok()) return;
    t = std::move(tr.value());
    CHECK(t->backend() == "mpi");
    memory.resize(bytes);
    for (uint64_t i = 0; i < bytes; ++i) memory[i] = pattern(g_rank, i);
    auto r = t->register_memory(memory.data(), memory.size());
    CHECK_OK(r.status());
    if (r.ok()) region = std::move(r.value());
    addresses = all_gather(t->address());
    keys = all_gather(region ? region->remote_key() : std::vector<uint8_t>{});
    for (int p = 0; p < g_size; ++p) {
      auto peer = t->connect(addresses[p], deadline_in(2s));
      CHECK_OK(peer.status());
      peers.push_back(peer.ok() ? *peer : nullptr);
      std::shared_ptr<RemoteRegion> rr;
      if (peer.ok()) {
        auto k = (*peer)->import_key(keys[p]);
        CHECK_OK(k.status());
        if (k.ok()) rr = *k;
      }
      regions.push_back(rr);
    }
  }
  bool ok() const {
    return t && region && std::all_of(regions.begin(), regions.end(), [](auto& r) { return r; });
  }
};

void barrier() { MPI_Barrier(MPI_COMM_WORLD); }

// ---- the tests -----------------------------------------------------------------

void GetsAndPutsOfEverySizeMoveEveryByte() {
  Net net;
  if (!net.ok()) return;
  const uint64_t sizes[] = {1, 7, 4096, 65536 + 3, 1 << 20, (4 << 20) + 5};
  for (int p = 0; p < g_size; ++p) {
    for (uint64_t n : sizes) {
      const uint64_t offset = (n * 13 + 5) % (net.memory.size() - n);
      std::vector<uint8_t> got(n, 0xee);
      auto c = net.peers[p]->get(*net.regions[p], offset, got.data(), n);
      CHECK_OK(c.status());
      if (!c.ok()) continue;
      CHECK_OK((*c)->wait(deadline_in(10s)));
      uint64_t bad = 0;
      for (uint64_t i = 0; i < n; ++i) bad += got[i] != pattern(p, offset + i);
      CHECK(bad == 0);
    }
  }
  barrier();
  // Every rank writes its own slice of every rank's region.
  const uint64_t slice = net.memory.size() / g_size;
  for (int p = 0; p < g_size; ++p) {
    std::vector<uint8_t> src(slice);
    for (uint64_t i = 0; i < slice; ++i) src[i] = static_cast<uint8_t>(pattern(g_rank + 100, i));
    uint64_t at = 0;
    for (uint64_t n : sizes) {
      if (at + n > slice) break;
      auto c = net.peers[p]->put(*net.regions[p], g_rank * slice + at, src.data() + at, n);
      CHECK_OK(c.status());
      if (c.ok()) CHECK_OK((*c)->wait(deadline_in(10s)));
      at += n;
    }
  }
  barrier();
  // What the others put is here, byte for byte, and nothing else moved.
  for (int w = 0; w < g_size; ++w) {
    uint64_t at = 0, bad = 0;
    for (uint64_t n : sizes) {
      if (at + n > slice) break;
      at += n;
    }
    for (uint64_t i = 0; i < slice; ++i) {
      const uint8_t want =
          i < at ? static_cast<uint8_t>(pattern(w + 100, i)) : pattern(g_rank, w * slice + i);
      bad += net.memory[w * slice + i] != want;
    }
    CHECK(bad == 0);
  }
  barrier();
}

void BatchesMixGetsAndPuts() {
  Net net(4 << 20);
  if (!net.ok()) return;
  const uint64_t slice = net.memory.size() / g_size;
  const uint64_t half = slice / 2;
  // Into each peer: put the first half of our slice in pieces, and get the
  // peer's untouched second half of our slice.
  std::vector<std::vector<uint8_t>> src(g_size), got(g_size);
  std::vector<TransferOp> ops;
  for (int p = 0; p < g_size; ++p) {
    src[p].resize(half);
    for (uint64_t i = 0; i < half; ++i) src[p][i] = static_cast<uint8_t>(i * 31 + g_rank + p);
    got[p].assign(half, 0);
    for (uint64_t at = 0; at < half; at += 100000) {
      const uint64_t n = std::min<uint64_t>(100000, half - at);
      ops.push_back(TransferOp{TransferKind::kPut, net.regions[p].get(), g_rank * slice + at,
                               src[p].data() + at, n});
      ops.push_back(TransferOp{TransferKind::kGet, net.regions[p].get(), g_rank * slice + half + at,
                               got[p].data() + at, n});
    }
  }
  // Empty ops are allowed.
  ops.push_back(TransferOp{TransferKind::kGet, net.regions[0].get(), 0, nullptr, 0});
  // Batches of one peer's region only.
  for (int p = 0; p < g_size; ++p) {
    std::vector<TransferOp> mine;
    for (const auto& op : ops)
      if (op.region == net.regions[p].get()) mine.push_back(op);
    CHECK_OK(net.peers[p]->run_batch(mine, deadline_in(10s)));
    uint64_t bad = 0;
    for (uint64_t i = 0; i < half; ++i) bad += got[p][i] != pattern(p, g_rank * slice + half + i);
    CHECK(bad == 0);
  }
  // A batch with one bad op moves nothing.
  std::vector<uint8_t> probe(16, 0);
  std::vector<TransferOp> bad_batch = {
      TransferOp{TransferKind::kGet, net.regions[0].get(), 0, probe.data(), 16},
      TransferOp{TransferKind::kGet, net.regions[0].get(), net.memory.size() - 8, probe.data(),
                 16}};
  CHECK_CODE(net.peers[0]->run_batch(bad_batch, deadline_in(1s)), Code::kInvalidArgument);
  CHECK(std::all_of(probe.begin(), probe.end(), [](uint8_t b) { return b == 0; }));
  barrier();
  for (int w = 0; w < g_size; ++w) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < half; ++i)
      bad += net.memory[w * slice + i] != static_cast<uint8_t>(i * 31 + w + g_rank);
    CHECK(bad == 0);
  }
  barrier();
}

void MessagesWithAnyTagGoBothWays() {
  Net net(1 << 20);
  if (!net.ok()) return;
  const uint64_t tags[] = {0, 1, 32767, 32768, 1ull << 40, (1ull << 63) | 5, ~0ull};
  const size_t lens[] = {0, 1, 100, 5000, 1 << 20};
  auto body = [](int from, int to, uint64_t tag, size_t len, int k) {
    std::vector<uint8_t> b(len);
    for (size_t i = 0; i < len; ++i)
      b[i] = static_cast<uint8_t>(i * 7 + from * 3 + to * 5 + tag + k);
    return b;
  };
  // Every rank sends to every rank (itself included) on a thread, while
  // this one receives: in order per sender and tag.
  std::thread sender([&] {
    for (int p = 0; p < g_size; ++p)
      for (uint64_t tag : tags)
        for (int k = 0; k < 5; ++k)
          CHECK_OK(net.peers[p]->send(tag ^ uint64_t(g_rank) << 8, body(g_rank, p, tag, lens[k], k),
                                      deadline_in(10s)));
  });
  for (int from = 0; from < g_size; ++from) {
    for (uint64_t tag : tags) {
      for (int k = 0; k < 5; ++k) {
        auto m = net.t->receive(tag ^ uint64_t(from) << 8, 2 << 20, deadline_in(10s));
        CHECK_OK(m.status());
        if (m.ok()) CHECK(*m == body(from, g_rank, tag, lens[k], k));
      }
    }
  }
  sender.join();
  barrier();
  // A message longer than the receive allows fails it.
  CHECK_OK(
      net.peers[(g_rank + 1) % g_size]->send(77, std::vector<uint8_t>(300, 1), deadline_in(5s)));
  auto m = net.t->receive(77, 100, deadline_in(5s));
  CHECK_CODE(m.status(), Code::kInvalidArgument);
  CHECK_CODE(net.t->receive(1, (64ull << 20) + 1, deadline_in(1s)).status(),
             Code::kInvalidArgument);
  CHECK_CODE(net.peers[0]->send(1, std::vector<uint8_t>((64 << 20) + 1), deadline_in(1s)),
             Code::kInvalidArgument);
  barrier();
}

void MalformedKeysAndAddressesAreRefused() {
  Net net(1 << 20);
  Net other(1 << 20);
  if (!net.ok() || !other.ok()) return;
  const int next = (g_rank + 1) % g_size;
  Peer& peer = *net.peers[next];
  const std::vector<uint8_t>& key = net.keys[next];
  std::mt19937_64 rng(g_rank + 1);
  // Bytes that are not a key.
  CHECK_CODE(peer.import_key({}).status(), Code::kInvalidArgument);
  for (int i = 0; i < 200; ++i) {
    std::vector<uint8_t> junk(rng() % 96);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    CHECK_CODE(peer.import_key(junk).status(), Code::kInvalidArgument);
  }
  for (size_t n = 0; n < key.size(); ++n)
    CHECK_CODE(peer.import_key(std::span(key).first(n)).status(), Code::kInvalidArgument);
  for (size_t i = 0; i < key.size(); ++i) {
    std::vector<uint8_t> k = key;
    k[i] ^= 0x10;
    CHECK_CODE(peer.import_key(k).status(), Code::kInvalidArgument);
  }
  // A real key of another rank, or of another endpoint of the same rank.
  if (g_size > 1) CHECK_CODE(peer.import_key(net.keys[g_rank]).status(), Code::kInvalidArgument);
  CHECK_CODE(peer.import_key(other.keys[next]).status(), Code::kInvalidArgument);
  // Bytes that are not an address: junk, damaged, another job's endpoint.
  for (int i = 0; i < 200; ++i) {
    std::vector<uint8_t> junk(rng() % 64);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    CHECK_CODE(net.t->connect(junk, deadline_in(1s)).status(), Code::kInvalidArgument);
  }
  const std::vector<uint8_t>& addr = net.addresses[next];
  for (size_t i = 0; i < addr.size(); ++i) {
    std::vector<uint8_t> a = addr;
    a[i] ^= 0x01;
    CHECK_CODE(net.t->connect(a, deadline_in(1s)).status(), Code::kInvalidArgument);
  }
  // Well-formed frames that no endpoint here made: another job's address
  // (an unknown nonce), a rank beyond the communicator, a key whose region
  // is not attached at the peer.
  {
    std::vector<uint8_t> payload(addr.begin() + 16, addr.end());
    std::vector<uint8_t> forged = payload;
    forged[16] ^= 0x5a;
    CHECK_CODE(net.t->connect(pack_address(forged), deadline_in(1s)).status(),
               Code::kInvalidArgument);
    forged = payload;
    forged[4] = static_cast<uint8_t>(g_size);
    CHECK_CODE(net.t->connect(pack_address(forged), deadline_in(1s)).status(),
               Code::kInvalidArgument);
    auto frame = unpack_key(key);
    CHECK_OK(frame.status());
    if (frame.ok()) {
      std::vector<uint8_t> stray(frame->backend_key.begin(), frame->backend_key.end());
      auto k = peer.import_key(pack_key(frame->base + (64 << 20), 4096, stray));
      CHECK_OK(k.status());
      std::vector<uint8_t> b(4096);
      if (k.ok()) {
        auto c = peer.get(**k, 0, b.data(), b.size());
        const Status st = c.ok() ? (*c)->wait(deadline_in(5s)) : c.status();
        CHECK(!st.ok());
      }
    }
    // A UCX frame with a payload of the right length but its own magic.
    std::vector<uint8_t> other_magic = payload;
    other_magic[0] ^= 0xff;
    CHECK_CODE(net.t->connect(pack_address(other_magic), deadline_in(1s)).status(),
               Code::kInvalidArgument);
  }
  // Out-of-range transfers are refused before anything moves.
  std::vector<uint8_t> buf(64);
  RemoteRegion& r = *net.regions[next];
  CHECK_CODE(peer.get(r, r.size(), buf.data(), 1).status(), Code::kInvalidArgument);
  CHECK_CODE(peer.get(r, r.size() - 8, buf.data(), 9).status(), Code::kInvalidArgument);
  CHECK_CODE(peer.get(r, ~0ull, buf.data(), 2).status(), Code::kInvalidArgument);
  CHECK_CODE(peer.put(r, 1, buf.data(), ~0ull).status(), Code::kInvalidArgument);
  CHECK_CODE(peer.get(r, 0, nullptr, 8).status(), Code::kInvalidArgument);
  // A region imported on another peer.
  CHECK_CODE(peer.get(*net.regions[g_rank], 0, buf.data(), 8).status(), Code::kInvalidArgument);
  CHECK_CODE(peer.get(*other.regions[next], 0, buf.data(), 8).status(), Code::kInvalidArgument);
  // Registrations: empty, and overlapping one already there.
  CHECK_CODE(net.t->register_memory(nullptr, 8).status(), Code::kInvalidArgument);
  CHECK_CODE(net.t->register_memory(buf.data(), 0).status(), Code::kInvalidArgument);
  CHECK_CODE(net.t->register_memory(net.memory.data() + 100, 10).status(), Code::kInvalidArgument);
  {
    // A region next to one registered, then gone: a new one may take its place.
    std::vector<uint8_t> side(4096);
    auto a = net.t->register_memory(side.data(), 2048);
    CHECK_OK(a.status());
    auto b = net.t->register_memory(side.data() + 2048, 2048);
    CHECK_OK(b.status());
    a.value().reset();
    CHECK_OK(net.t->register_memory(side.data(), 1024).status());
  }
  // The fabric list is UCX's notion.
  TransportOptions bad;
  bad.backend = TransportBackend::kMpi;
  bad.fabrics = "tcp";
  CHECK_CODE(Transport::Open(bad).status(), Code::kInvalidArgument);
  // The checks did not disturb the endpoint.
  auto c = peer.get(r, 0, buf.data(), buf.size());
  CHECK_OK(c.status());
  if (c.ok()) CHECK_OK((*c)->wait(deadline_in(5s)));
  for (size_t i = 0; i < buf.size(); ++i) CHECK(buf[i] == pattern(next, i));
  CHECK_OK(peer.health());
  barrier();
}

void ReceivesAndSendsEndAtTheirDeadlines() {
  // Rank 1's endpoint has no progress thread and nobody drives it until
  // the end: a large message to it cannot finish (its receiver must take
  // part), nor can a receive of a tag nobody sends.
  Net net(1 << 20, /*progress_thread=*/false);
  if (!net.ok()) return;
  auto t0 = TransportClock::now();
  auto m = net.t->receive(4242, 100, deadline_in(300ms));
  auto took = TransportClock::now() - t0;
  CHECK_CODE(m.status(), Code::kUnavailable);
  CHECK(took >= 300ms && took < 2s);  // by the deadline, give or take a loaded machine
  barrier();
  const std::vector<uint8_t> big(8 << 20, 0x5a);
  if (g_rank == 0 && g_size > 1) {
    t0 = TransportClock::now();
    Status st = net.peers[1]->send(99, big, deadline_in(300ms));
    took = TransportClock::now() - t0;
    CHECK_CODE(st, Code::kUnavailable);
    CHECK(took >= 300ms && took < 2s);  // by the deadline, give or take a loaded machine
    // The peer failed with it; connecting again gives a fresh one.
    CHECK_CODE(net.peers[1]->health(), Code::kUnavailable);
    CHECK_CODE(net.peers[1]->send(1, big, deadline_in(1s)), Code::kUnavailable);
    auto again = net.t->connect(net.addresses[1], deadline_in(1s));
    CHECK_OK(again.status());
    if (again.ok()) CHECK_OK((*again)->health());
  }
  barrier();
  // Once rank 1 drives its endpoint, the message that missed its deadline
  // arrives whole.
  if (g_rank == 1) {
    auto got = net.t->receive(99, big.size(), deadline_in(10s));
    CHECK_OK(got.status());
    if (got.ok()) CHECK(*got == big);
  }
  barrier();
  // The sender's endpoint ends its lingering send.
  auto until = TransportClock::now() + 5s;
  while (net.t->progress() && TransportClock::now() < until) {
  }
  barrier();
}

void DiscardedTagsAreDropped() {
  Net net(1 << 20);
  if (!net.ok()) return;
  const int next = (g_rank + 1) % g_size;
  // A discard before its message: the message is dropped when it comes.
  net.t->discard(500);
  CHECK(net.t->counters().held == 1);
  barrier();
  CHECK_OK(net.peers[next]->send(500, std::vector<uint8_t>(10, 1), deadline_in(5s)));
  CHECK_OK(net.peers[next]->send(501, std::vector<uint8_t>(10, 2), deadline_in(5s)));
  // 501 is kept (sent after 500 by the same sender: 500 has been dropped by then).
  auto m = net.t->receive(501, 100, deadline_in(5s));
  CHECK_OK(m.status());
  CHECK(net.t->counters().held == 0);
  CHECK(net.t->counters().dropped == 1);
  CHECK_CODE(net.t->receive(500, 100, deadline_in(100ms)).status(), Code::kUnavailable);
  barrier();
  // A discard of a message that is here, or still on its way: dropped
  // either way, never kept.
  CHECK_OK(net.peers[next]->send(502, std::vector<uint8_t>(10, 3), deadline_in(5s)));
  barrier();
  net.t->discard(502);
  auto until = TransportClock::now() + 5s;
  while (net.t->counters().dropped < 2 && TransportClock::now() < until)
    std::this_thread::sleep_for(1ms);
  CHECK(net.t->counters().dropped == 2);
  CHECK(net.t->counters().held == 0);
  CHECK_CODE(net.t->receive(502, 100, deadline_in(100ms)).status(), Code::kUnavailable);
  // The bound: the oldest discards are given up.
  for (uint64_t i = 0; i < Transport::kMaxDiscards + 10; ++i) net.t->discard(10000 + i);
  CHECK(net.t->counters().held == Transport::kMaxDiscards);
  barrier();
}

void ConcurrentThreadsMoveBytesAndMessages() {
  Net net(8 << 20);
  if (!net.ok()) return;
  constexpr int kThreads = 4;
  const uint64_t slice = net.memory.size() / (g_size * kThreads);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937_64 rng(g_rank * 100 + th);
      std::vector<uint8_t> buf(64 << 10), src(64 << 10);
      for (int i = 0; i < 150; ++i) {
        const int p = static_cast<int>(rng() % g_size);
        const uint64_t n = 1 + rng() % buf.size();
        const uint64_t off = rng() % (net.memory.size() - n);
        switch (i % 3) {
          case 0: {
            // Reads only where nobody writes: the second half of every region.
            const uint64_t roff = net.memory.size() / 2 + off / 2;
            const uint64_t rn = std::min<uint64_t>(n, net.memory.size() - roff);
            auto c = net.peers[p]->get(*net.regions[p], roff, buf.data(), rn);
            if (!c.ok() || !(*c)->wait(deadline_in(10s)).ok()) {
              ++bad;
              break;
            }
            for (uint64_t k = 0; k < rn; ++k)
              if (buf[k] != pattern(p, roff + k)) {
                ++bad;
                break;
              }
            break;
          }
          case 1: {
            // Writes into this thread's own slice of the first half.
            const uint64_t base = (g_rank * kThreads + th) * slice / 2;
            const uint64_t wn = std::min<uint64_t>(n, slice / 2);
            for (uint64_t k = 0; k < wn; ++k) src[k] = static_cast<uint8_t>(k + i);
            auto c = net.peers[p]->put(*net.regions[p], base, src.data(), wn);
            if (!c.ok() || !(*c)->wait(deadline_in(10s)).ok()) {
              ++bad;
              break;
            }
            // Read back what was just put.
            std::vector<uint8_t> back(wn);
            auto g = net.peers[p]->get(*net.regions[p], base, back.data(), wn);
            if (!g.ok() || !(*g)->wait(deadline_in(10s)).ok() ||
                std::memcmp(back.data(), src.data(), wn) != 0)
              ++bad;
            break;
          }
          case 2: {
            // A message to ourselves through the peer, on this thread's tag.
            const uint64_t tag = (uint64_t(g_rank) << 32) | (uint64_t(th) << 16) | i;
            std::vector<uint8_t> msg(rng() % 3000);
            for (auto& b : msg) b = static_cast<uint8_t>(rng());
            if (!net.peers[g_rank]->send(tag, msg, deadline_in(10s)).ok()) {
              ++bad;
              break;
            }
            auto got = net.t->receive(tag, 4096, deadline_in(10s));
            if (!got.ok() || *got != msg) ++bad;
            break;
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(bad.load() == 0);
  barrier();
}

void CloseWhileTransfersArePending() {
  Net net(16 << 20);
  if (!net.ok()) return;
  const int next = (g_rank + 1) % g_size;
  // Peer::close with transfers in flight: their waits end with OK (they
  // finished first) or Unavailable, and the peer is closed for later ones.
  {
    std::vector<std::vector<uint8_t>> bufs(8, std::vector<uint8_t>(2 << 20));
    std::vector<std::unique_ptr<Completion>> cs;
    for (auto& b : bufs) {
      auto c = net.peers[next]->get(*net.regions[next], 0, b.data(), b.size());
      CHECK_OK(c.status());
      if (c.ok()) cs.push_back(std::move(c.value()));
    }
    net.peers[next]->close();
    for (auto& c : cs) {
      Status st = c->wait(deadline_in(5s));
      CHECK(st.ok() || st.is(Code::kUnavailable));
    }
    CHECK_CODE(net.peers[next]->health(), Code::kUnavailable);
    CHECK_CODE(net.peers[next]->get(*net.regions[next], 0, bufs[0].data(), 8).status(),
               Code::kUnavailable);
    CHECK_CODE(net.peers[next]->send(1, {}, deadline_in(1s)), Code::kUnavailable);
    // MPI may still be writing: the buffers live until the endpoint is done.
    while (net.t->progress()) {
    }
  }
  barrier();
  // Transport::close from another thread while threads move bytes and wait
  // for messages: every call ends, with OK or Unavailable.
  std::vector<std::thread> threads;
  std::atomic<int> odd{0};
  std::vector<std::vector<uint8_t>> bufs(3, std::vector<uint8_t>(4 << 20));
  for (int th = 0; th < 3; ++th) {
    threads.emplace_back([&, th] {
      const int p = (g_rank + th) % g_size;
      for (int i = 0; i < 1000; ++i) {
        auto c = net.peers[p]->get(*net.regions[p], 0, bufs[th].data(), bufs[th].size());
        Status st = c.ok() ? (*c)->wait(deadline_in(5s)) : c.status();
        if (!st.ok() && !st.is(Code::kUnavailable)) ++odd;
        if (!st.ok()) break;
      }
    });
  }
  threads.emplace_back([&] {
    auto m = net.t->receive(31337, 10, deadline_in(20s));
    if (!m.status().is(Code::kUnavailable)) ++odd;
  });
  std::this_thread::sleep_for(30ms);
  const auto t0 = TransportClock::now();
  net.t->close();
  for (auto& t : threads) t.join();
  CHECK(TransportClock::now() - t0 < 10s);
  CHECK(odd.load() == 0);
  for (auto& p : net.peers) CHECK_CODE(p->health(), Code::kUnavailable);
  CHECK_CODE(net.t->receive(1, 10, deadline_in(10ms)).status(), Code::kUnavailable);
  CHECK_CODE(net.t->connect(net.addresses[next], deadline_in(1s)).status(), Code::kUnavailable);
  CHECK_CODE(net.t->register_memory(bufs[0].data(), 8).status(), Code::kUnavailable);
  net.t->close();  // idempotent
  barrier();
}

void AnyEndpointReachesTheTwinOfAnAddress() {
  // Two endpoints per rank: connecting from the first to the second's
  // address reaches the second's receive and region on that rank.
  Net a(1 << 20), b(1 << 20);
  if (!a.ok() || !b.ok()) return;
  const int next = (g_rank + 1) % g_size;
  auto p = a.t->connect(b.addresses[next], deadline_in(1s));
  CHECK_OK(p.status());
  if (!p.ok()) return;
  CHECK_OK((*p)->send(9, std::vector<uint8_t>{1, 2, 3}, deadline_in(5s)));
  auto m = b.t->receive(9, 10, deadline_in(5s));
  CHECK_OK(m.status());
  if (m.ok()) CHECK((*m == std::vector<uint8_t>{1, 2, 3}));
  CHECK_CODE(a.t->receive(9, 10, deadline_in(50ms)).status(), Code::kUnavailable);
  auto k = (*p)->import_key(b.keys[next]);
  CHECK_OK(k.status());
  if (k.ok()) {
    std::vector<uint8_t> got(1000);
    auto c = (*p)->get(**k, 5, got.data(), got.size());
    CHECK_OK(c.status());
    if (c.ok()) CHECK_OK((*c)->wait(deadline_in(5s)));
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == pattern(next, 5 + i));
  }
  // a's own key does not fit that peer.
  CHECK_CODE((*p)->import_key(a.keys[next]).status(), Code::kInvalidArgument);
  barrier();
}

// A job that exchanges keys once: each rank opens a Transport over `comm`
// (`handle` is the communicator as TransportOptions takes it), registers
// one region, gathers the addresses and keys, reads every rank's region in
// turn (itself included), then writes its own slice of every rank's region.
// Every byte is checked. A region serves its peers only while it is
// registered (a transfer into a region its owner has destroyed fails with
// InvalidArgument), so the barriers keep every rank's region until every
// rank is done with it.
void ReadAndWriteEveryRankOnce(MPI_Comm comm, int64_t handle, uint64_t bytes) {
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  TransportOptions o;
  o.backend = TransportBackend::kMpi;
  o.mpi_communicator = handle;
  auto t = Transport::Open(o);
  CHECK_OK(t.status());
  if (!t.ok()) return;
  std::vector<uint8_t> memory(bytes);
  for (uint64_t i = 0; i < bytes; ++i) memory[i] = pattern(rank, i);
  auto region = (*t)->register_memory(memory.data(), memory.size());
  CHECK_OK(region.status());
  const auto addresses = all_gather((*t)->address(), comm);
  const auto keys =
      all_gather(region.ok() ? (*region)->remote_key() : std::vector<uint8_t>{}, comm);
  std::vector<std::shared_ptr<Peer>> peers(size);
  std::vector<std::shared_ptr<RemoteRegion>> regions(size);
  for (int p = 0; p < size; ++p) {
    auto peer = (*t)->connect(addresses[p], deadline_in(2s));
    CHECK_OK(peer.status());
    if (!peer.ok()) continue;
    peers[p] = *peer;
    auto r = peers[p]->import_key(keys[p]);
    CHECK_OK(r.status());
    if (r.ok()) regions[p] = *r;
  }
  std::vector<uint8_t> got(bytes);
  for (int p = 0; p < size; ++p) {
    if (!regions[p]) continue;
    std::fill(got.begin(), got.end(), 0);
    auto c = peers[p]->get(*regions[p], 0, got.data(), got.size());
    CHECK_OK(c.ok() ? (*c)->wait(deadline_in(10s)) : c.status());
    uint64_t bad = 0;
    for (uint64_t i = 0; i < bytes; ++i) bad += got[i] != pattern(p, i);
    CHECK(bad == 0);
  }
  MPI_Barrier(comm);
  const uint64_t slice = bytes / size;
  std::vector<uint8_t> src(slice);
  for (uint64_t i = 0; i < slice; ++i) src[i] = pattern(rank + 100, i);
  for (int p = 0; p < size; ++p) {
    if (!regions[p]) continue;
    auto c = peers[p]->put(*regions[p], rank * slice, src.data(), slice);
    CHECK_OK(c.ok() ? (*c)->wait(deadline_in(10s)) : c.status());
  }
  MPI_Barrier(comm);
  uint64_t bad = 0;
  for (uint64_t i = 0; i < bytes; ++i) {
    const uint64_t w = i / slice;
    bad += memory[i] != (w < static_cast<uint64_t>(size)
                             ? pattern(static_cast<int>(w) + 100, i - w * slice)
                             : pattern(rank, i));
  }
  CHECK(bad == 0);
  MPI_Barrier(comm);
}

void EveryRankIsReachedRightAfterItRegisters() {
  ReadAndWriteEveryRankOnce(MPI_COMM_WORLD, TransportOptions::kMpiWorld, 1 << 20);
  ReadAndWriteEveryRankOnce(MPI_COMM_WORLD, TransportOptions::kMpiWorld, 4096 + 3);
  barrier();
}

void TransfersOverACallersCommunicator() {
  // The world's ranks in reverse: the communicator's rank r is world rank
  // size - 1 - r, so a mix-up of the two shows as wrong bytes.
  MPI_Comm reversed = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, 0, g_size - 1 - g_rank, &reversed);
  ReadAndWriteEveryRankOnce(reversed, MPI_Comm_c2f(reversed), 1 << 20);
  ReadAndWriteEveryRankOnce(reversed, MPI_Comm_c2f(reversed), 4096 + 3);
  // The Transports hold duplicates of it: the caller may free its own.
  MPI_Comm_free(&reversed);
  barrier();
}

// Reads `n` bytes of every rank's region in `regions` and checks them
// against pattern(seed + rank, i).
void read_every_rank(Net& net, const std::vector<std::shared_ptr<RemoteRegion>>& regions,
                     uint64_t n, int seed) {
  std::vector<uint8_t> got(n);
  for (int p = 0; p < g_size; ++p) {
    std::fill(got.begin(), got.end(), 0);
    auto c = net.peers[p]->get(*regions[p], 0, got.data(), n);
    CHECK_OK(c.ok() ? (*c)->wait(deadline_in(10s)) : c.status());
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; ++i) bad += got[i] != pattern(seed + p, i);
    CHECK(bad == 0);
  }
}

// Imports every rank's key of `mine` on net's peers.
std::vector<std::shared_ptr<RemoteRegion>> import_every_rank(Net& net, const MemoryRegion& mine) {
  const auto keys = all_gather(mine.remote_key());
  std::vector<std::shared_ptr<RemoteRegion>> out(g_size);
  for (int p = 0; p < g_size; ++p) {
    auto r = net.peers[p]->import_key(keys[p]);
    CHECK_OK(r.status());
    if (r.ok()) out[p] = *r;
  }
  return out;
}

void RegionsRegisteredAndUnregisteredLaterAreSeenAtOnce() {
  // Every rank has read every rank's first region (whatever MPI learns of
  // a target's regions on a first access, it has learned). A region
  // registered after that is reached at once, in the same epoch.
  Net net(1 << 20);
  if (!net.ok()) return;
  read_every_rank(net, net.regions, 1 << 20, 0);
  barrier();
  std::vector<uint8_t> second(256 << 10);
  for (uint64_t i = 0; i < second.size(); ++i) second[i] = pattern(g_rank + 50, i);
  auto r2 = net.t->register_memory(second.data(), second.size());
  CHECK_OK(r2.status());
  if (!r2.ok()) return;
  auto seconds = import_every_rank(net, **r2);
  if (!std::all_of(seconds.begin(), seconds.end(), [](auto& r) { return r; })) return;
  read_every_rank(net, seconds, second.size(), 50);
  barrier();
  // A region its owner has unregistered is out of reach: a transfer into
  // it fails with InvalidArgument, naming the cause, and the Peer stays
  // usable for the owner's other regions.
  net.region.reset();
  barrier();
  std::vector<uint8_t> buf(4096);
  for (int p = 0; p < g_size; ++p) {
    auto c = net.peers[p]->get(*net.regions[p], 0, buf.data(), buf.size());
    const Status st = c.ok() ? (*c)->wait(deadline_in(10s)) : c.status();
    CHECK_CODE(st, Code::kInvalidArgument);
    CHECK(st.message().find("no registered region") != std::string::npos);
    auto w = net.peers[p]->put(*net.regions[p], 0, buf.data(), buf.size());
    CHECK_CODE(w.ok() ? (*w)->wait(deadline_in(10s)) : w.status(), Code::kInvalidArgument);
    CHECK_OK(net.peers[p]->health());
  }
  read_every_rank(net, seconds, second.size(), 50);
  barrier();
  // The same memory registered again is reached through its new key.
  auto again = net.t->register_memory(net.memory.data(), net.memory.size());
  CHECK_OK(again.status());
  if (!again.ok()) return;
  auto firsts = import_every_rank(net, **again);
  if (!std::all_of(firsts.begin(), firsts.end(), [](auto& r) { return r; })) return;
  read_every_rank(net, firsts, net.memory.size(), 0);
  barrier();
}

}  // namespace
}  // namespace cascade

int main(int argc, char** argv) {
  using namespace cascade;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  {
    // Can this MPI expose memory for one-sided access here at all?
    TransportOptions o;
    o.backend = TransportBackend::kMpi;
    auto t = Transport::Open(o);
    if (!t.ok()) {
      if (g_rank == 0)
        std::printf("SKIP: the MPI transport cannot be opened here: %s\n",
                    t.status().ToString().c_str());
      MPI_Finalize();
      return t.status().is(Code::kUnavailable) || t.status().is(Code::kNotSupported) ? 77 : 1;
    }
  }
  const std::pair<const char*, void (*)()> tests[] = {
      {"GetsAndPutsOfEverySizeMoveEveryByte", GetsAndPutsOfEverySizeMoveEveryByte},
      {"BatchesMixGetsAndPuts", BatchesMixGetsAndPuts},
      {"MessagesWithAnyTagGoBothWays", MessagesWithAnyTagGoBothWays},
      {"MalformedKeysAndAddressesAreRefused", MalformedKeysAndAddressesAreRefused},
      {"ReceivesAndSendsEndAtTheirDeadlines", ReceivesAndSendsEndAtTheirDeadlines},
      {"DiscardedTagsAreDropped", DiscardedTagsAreDropped},
      {"ConcurrentThreadsMoveBytesAndMessages", ConcurrentThreadsMoveBytesAndMessages},
      {"CloseWhileTransfersArePending", CloseWhileTransfersArePending},
      {"AnyEndpointReachesTheTwinOfAnAddress", AnyEndpointReachesTheTwinOfAnAddress},
      {"EveryRankIsReachedRightAfterItRegisters", EveryRankIsReachedRightAfterItRegisters},
      {"TransfersOverACallersCommunicator", TransfersOverACallersCommunicator},
      {"RegionsRegisteredAndUnregisteredLaterAreSeenAtOnce",
       RegionsRegisteredAndUnregisteredLaterAreSeenAtOnce},
  };
  // CASCADE_MPI_TEST_FILTER: run only the tests whose name contains it.
  const char* filter = std::getenv("CASCADE_MPI_TEST_FILTER");
  int passed = 0, failed = 0;
  for (const auto& [name, fn] : tests) {
    if (filter != nullptr && std::strstr(name, filter) == nullptr) continue;
    g_failures = 0;
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    int total = 0;
    MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    (total == 0 ? passed : failed) += 1;
    if (g_rank == 0)
      std::printf("[%s] %s (%d ranks, %.0f ms)\n", total == 0 ? "  OK  " : "FAILED", name, g_size,
                  ms);
    std::fflush(stdout);
  }
  if (g_rank == 0) std::printf("%d passed, %d failed\n", passed, failed);
  MPI_Finalize();
  return failed == 0 ? 0 : 1;
}
