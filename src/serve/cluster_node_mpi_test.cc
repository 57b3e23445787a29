// The cluster's block protocol over the MPI transport: every rank of an MPI
// job runs a node server whose ClusterNode uses TransportBackend::kMpi, the
// members' addresses exchanged with MPI_Allgather (a static view of the
// communicator's ranks). Blocks that one rank's clients store are pushed to
// their owners and read back, byte for byte, through every other rank.
// Run with mpirun -np 2 or more (ctest runs it with 2 and 3 ranks); prints
// "N passed, N failed"; exits 77 when this MPI cannot expose memory for
// one-sided access (skipped).
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cascade/store.h"
#include "serve/cluster_node.h"
#include "serve/pool_server.h"
#include "transport/transport.h"

namespace cascade {
namespace {

using namespace std::chrono_literals;

int g_rank = 0, g_size = 1;
int g_failures = 0;

#define CHECK(cond)                                                                               \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      ++::cascade::g_failures;                                                                    \
      std::fprintf(stderr, "rank %d: %s:%d: failed: %s\n", ::cascade::g_rank, __FILE__, __LINE__, \
                   #cond);                                                                        \
    }                                                                                             \
  } while (0)
#define CHECK_OK(expr)                                                                        \
  do {                                                                                        \
    const ::cascade::Status st_ = (expr);                                                     \
    if (!st_.ok()) {                                                                          \
      ++::cascade::g_failures;                                                                \
      std::fprintf(stderr, "rank %d: %s:%d: %s: %s\n", ::cascade::g_rank, __FILE__, __LINE__, \
                   #expr, st_.ToString().c_str());                                            \
    }                                                                                         \
  } while (0)

BlockId id_of(uint64_t v) { return compute_block_id(&v, sizeof v); }

std::vector<uint8_t> bytes_of(uint64_t i, size_t n) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(i);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Block k of rank r: its id and size.
uint64_t key_of(int r, int k) { return 1000000ull * (r + 1) + k; }
size_t size_of(int k) { return 4096 * (1 + k % 16) + (k % 3) * 100; }

std::vector<std::vector<uint8_t>> all_gather(const std::vector<uint8_t>& mine) {
  int n = static_cast<int>(mine.size());
  std::vector<int> sizes(g_size), at(g_size);
  MPI_Allgather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < g_size; ++r) {
    at[r] = total;
    total += sizes[r];
  }
  std::vector<uint8_t> flat(total);
  MPI_Allgatherv(mine.data(), n, MPI_BYTE, flat.data(), sizes.data(), at.data(), MPI_BYTE,
                 MPI_COMM_WORLD);
  std::vector<std::vector<uint8_t>> out(g_size);
  for (int r = 0; r < g_size; ++r)
    out[r].assign(flat.begin() + at[r], flat.begin() + at[r] + sizes[r]);
  return out;
}

// The view every rank installs: the communicator's ranks, each with points
// spread over the ring.
ClusterView view_of(const std::vector<std::vector<uint8_t>>& addresses) {
  ClusterView v;
  v.version = 1;
  std::vector<std::pair<uint64_t, uint32_t>> points;
  for (uint32_t m = 0; m < addresses.size(); ++m) {
    v.members.push_back(ClusterMember{"rank-" + std::to_string(m), 7, addresses[m]});
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

struct Member {
  std::string socket, shm;
  std::unique_ptr<PoolServer> server;
  ClusterNode* node = nullptr;

  explicit Member(uint32_t lanes) {
    const std::string tag = std::to_string(getpid()) + "-" + std::to_string(g_rank);
    socket = "/tmp/cascade-cluster-mpi-" + tag + ".sock";
    shm = "/dev/shm/cascade-cluster-mpi-" + tag;
    CascadeConfig c;
    c.pipeline = "host";
    c.shm_capacity_bytes = 64 << 20;
    c.shm_path = shm;
    c.num_io_threads = 2;
    c.index_shards = 16;
    PoolServerOptions o;
    o.socket_path = socket;
    auto s = PoolServer::Start(c, o);
    CHECK_OK(s.status());
    if (!s.ok()) return;
    server = std::move(s.value());
    ClusterNodeOptions co;
    co.node_id = "rank-" + std::to_string(g_rank);
    co.generation = 7;
    co.transport = TransportBackend::kMpi;
    co.lanes = lanes;
    co.map_same_host = false;  // every block crosses the transport
    auto n = server->start_cluster(co);
    CHECK_OK(n.status());
    if (n.ok()) node = *n;
  }
  ~Member() {
    if (server) (void)server->close();
  }
  std::unique_ptr<CascadeStore> client(uint32_t threads) {
    CascadeConfig c;
    c.pipeline = "pool";
    c.pool_socket = socket;
    c.pool_namespace = "ns";
    c.pool_channels = threads;
    c.num_io_threads = threads;
    c.use_gpu = false;
    auto s = CascadeStore::Open(c);
    CHECK_OK(s.status());
    return s.ok() ? std::move(s.value()) : nullptr;
  }
};

void BlocksStoredOnOneRankAreReadThroughEveryOther(uint32_t lanes, int blocks) {
  Member m(lanes);
  // Every rank started (or failed) its node; they go on only together.
  int mine = m.node != nullptr, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) return;
  CHECK(m.node->backend() == "mpi");
  const ClusterView view = view_of(all_gather(m.node->address()));
  CHECK_OK(m.node->set_view(view));
  MPI_Barrier(MPI_COMM_WORLD);
  auto store = m.client(4);
  CHECK(store != nullptr);
  if (store) {
    for (int k = 0; k < blocks; ++k) {
      const auto data = bytes_of(key_of(g_rank, k), size_of(k));
      CHECK_OK(store->put(id_of(key_of(g_rank, k)), data.data(), data.size()));
    }
  }
  CHECK(m.node->drain(20000));
  MPI_Barrier(MPI_COMM_WORLD);
  // Every rank's blocks, read here: those owned elsewhere are fetched.
  if (store) {
    for (int r = 0; r < g_size; ++r) {
      if (r == g_rank) continue;
      for (int k = 0; k < blocks; ++k) {
        const auto want = bytes_of(key_of(r, k), size_of(k));
        std::vector<uint8_t> out(want.size() + 4096);
        GetResult got;
        CHECK_OK(store->get(id_of(key_of(r, k)), out.data(), out.size(), &got));
        CHECK(got.found);
        CHECK(got.size == want.size());
        CHECK(got.found && std::memcmp(out.data(), want.data(), want.size()) == 0);
      }
    }
  }
  const ClusterStats st = m.node->stats();
  CHECK(st.push_dropped == 0);
  CHECK(st.checksum_failures == 0);
  CHECK(st.mapped == 0);
  // Pushes and fetches happened somewhere (which rank owns what is the ring's).
  uint64_t moved[2] = {st.pushed, st.fetched}, sum[2] = {0, 0};
  MPI_Allreduce(moved, sum, 2, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum[0] > 0);
  CHECK(sum[1] > 0);
  if (g_rank == 0)
    std::printf("  lanes %u: %llu blocks pushed, %llu fetched over the MPI transport\n", lanes,
                static_cast<unsigned long long>(sum[0]), static_cast<unsigned long long>(sum[1]));
  // Nobody closes its node while another still reads from it.
  MPI_Barrier(MPI_COMM_WORLD);
  store.reset();
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
  int passed = 0, failed = 0;
  const std::pair<uint32_t, int> runs[] = {{1, 48}, {3, 96}};
  for (const auto& [lanes, blocks] : runs) {
    g_failures = 0;
    BlocksStoredOnOneRankAreReadThroughEveryOther(lanes, blocks);
    int total = 0;
    MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    (total == 0 ? passed : failed) += 1;
    if (g_rank == 0)
      std::printf("[%s] BlocksStoredOnOneRankAreReadThroughEveryOther (%u lanes, %d ranks)\n",
                  total == 0 ? "  OK  " : "FAILED", lanes, g_size);
    std::fflush(stdout);
  }
  if (g_rank == 0) std::printf("%d passed, %d failed\n", passed, failed);
  MPI_Finalize();
  return failed == 0 ? 0 : 1;
}
