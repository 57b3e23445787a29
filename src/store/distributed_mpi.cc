// OpenDistributed: a CascadeStore per rank whose host-memory level is the
// remote tier.
#include <mpi.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include "cascade/distributed.h"
#include "cuda/device_copy.h"
#include "store/store_open.h"
#include "tiers/remote/mpi_status.h"
#include "tiers/remote/rank_fabric.h"
#include "tiers/remote/remote_tier.h"

namespace cascade {

bool distributed_available() { return true; }

namespace {

std::string lower_trimmed(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// config.pipeline with the host tier read as the remote tier; an empty
// pipeline resolved as CascadeStore::Open resolves it.
std::string distributed_pipeline(const CascadeConfig& config) {
  if (lower_trimmed(config.pipeline).empty()) {
    std::string p;
    if (config.use_gpu && gpu_usable(config.gpu_device_id)) p = "gpu|";
    p += "remote";
    if (!config.file_path.empty()) p += "|file";
    return p;
  }
  std::string out;
  std::string_view rest = config.pipeline;
  while (true) {
    size_t bar = rest.find('|');
    std::string stage = lower_trimmed(rest.substr(0, bar));
    if (stage == "host" || stage == "shm" || stage == "cache" || stage == "dram") stage = "remote";
    out += (out.empty() ? "" : "|") + stage;
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  return out;
}

Status prepare_rank_config(const CascadeConfig& config, const DistributedOptions& options, int rank,
                           CascadeConfig* out) {
  if (config.shm_persist)
    return Status::InvalidArgument(
        "shm_persist is not available to distributed stores: a rank's share of the remote tier "
        "is emptied when the rank leaves (keep blocks across restarts with a file tier)");
  *out = config;
  out->pipeline = distributed_pipeline(config);
  if (("|" + out->pipeline + "|").find("|remote|") == std::string::npos)
    return Status::InvalidArgument(
        "the pipeline of a distributed store needs a host level (host, shm or remote), which "
        "spans every rank's arena; got '" +
        config.pipeline + "'");
  if (options.file_dir_per_rank && !config.file_path.empty()) {
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05d", rank);
    std::filesystem::path dir = std::filesystem::path(config.file_path) / name;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec)
      return Status::IOError("create the file tier directory '" + dir.string() +
                             "': " + ec.message());
    out->file_path = dir.string();
  }
  return out->validate();
}

void finalize_mpi_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

Result<MPI_Comm> communicator(MpiCommunicator comm) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return Status::Unavailable("MPI has been finalized in this process");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    if (comm.fortran_handle != MpiCommunicator::kWorldHandle)
      return Status::InvalidArgument("a communicator was given but MPI is not initialized");
    int provided = 0;
    if (int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
        rc != MPI_SUCCESS)
      return remote::mpi_status(rc, "MPI_Init_thread");
    std::atexit(finalize_mpi_at_exit);
  }
  if (comm.fortran_handle == MpiCommunicator::kWorldHandle) return MPI_COMM_WORLD;
  MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(comm.fortran_handle));
  if (c == MPI_COMM_NULL)
    return Status::InvalidArgument("the communicator handle is MPI_COMM_NULL");
  return c;
}

// Local checks, agreed on before any rank starts the collective open, so a
// rank with a bad config fails together with the others instead of leaving
// them waiting.
Status agree_on_user_comm(MPI_Comm comm, const Status& local) {
  int mine = local.ok() ? 1 : 0, all = 0;
  if (int rc = MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, comm); rc != MPI_SUCCESS)
    return remote::mpi_status(rc, "MPI_Allreduce");
  if (!local.ok()) return local;
  if (!all)
    return Status::InvalidArgument(
        "another rank's configuration of the distributed store is unusable");
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<CascadeStore>> OpenDistributed(const CascadeConfig& config,
                                                      const DistributedOptions& options,
                                                      MpiCommunicator comm) {
  auto c = communicator(comm);
  if (!c.ok()) return c.status();
  int rank = 0;
  MPI_Comm_rank(*c, &rank);
  CascadeConfig rank_config;
  Status local = options.validate();
  if (local.ok()) local = prepare_rank_config(config, options, rank, &rank_config);
  CASCADE_RETURN_IF_ERROR(agree_on_user_comm(*c, local));

  auto fabric =
      remote::RankFabric::Open(*c, rank_config.shm_capacity_bytes, options.node_local_loads);
  if (!fabric.ok()) return fabric.status();
  std::shared_ptr<remote::RankFabric> f = *fabric;
  // Settings every rank must share (ownership and transfers depend on them).
  uint64_t shared = uint64_t(options.ring_points_per_rank) << 16 |
                    uint64_t(options.node_local_loads) << 8 | uint64_t(options.checksum);
  auto same = f->all_equal(shared);
  if (!same.ok()) return same.status();
  if (!*same)
    return Status::InvalidArgument(
        "ring_points_per_rank, node_local_loads and checksum must be the same on every rank");

  auto open_remote = [&](TierKind, const CascadeConfig& cfg,
                         ThreadPool* pool) -> Result<std::unique_ptr<Tier>> {
    return std::unique_ptr<Tier>(new remote::RemoteTier(f, cfg, options, pool));
  };
  auto store = StoreOpener::Open(rank_config, open_remote);
  // Every rank has its store, or none keeps one (a store that closes here
  // leaves the group, so the others would only see misses).
  Status all = f->agree(store.status());
  if (!all.ok()) return all;
  return std::move(store.value());
}

}  // namespace cascade
