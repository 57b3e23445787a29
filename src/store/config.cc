// CascadeConfig validation and pipeline resolution.
#include "cascade/config.h"

#include <algorithm>

#include <string_view>

namespace cascade {

const char* tier_kind_name(TierKind kind) {
  switch (kind) {
    case TierKind::kGpu: return "gpu";
    case TierKind::kHost: return "host";
    case TierKind::kFile: return "file";
    case TierKind::kRemote: return "remote";
    case TierKind::kPool: return "pool";
  }
  return "?";
}

namespace {

Result<TierKind> parse_tier(std::string_view name) {
  // Each tier also answers to the names other KV-cache stores give that
  // level of memory (docs/configuration.md lists them).
  if (name == "gpu" || name == "hbm" || name == "device") return TierKind::kGpu;
  if (name == "host" || name == "shm" || name == "cache" || name == "dram") return TierKind::kHost;
  if (name == "file" || name == "lustre" || name == "posix" || name == "disk")
    return TierKind::kFile;
  if (name == "remote") return TierKind::kRemote;
  if (name == "pool" || name == "node") return TierKind::kPool;
  return Status::InvalidArgument("unknown tier '" + std::string(name) +
                                 "' in pipeline (expected gpu, host, pool, remote or file)");
}

// Position in the pipeline: host and remote are one level (the remote tier
// holds this rank's host arena), so a pipeline names one of them.
int tier_level(TierKind k) {
  switch (k) {
    case TierKind::kGpu: return 0;
    case TierKind::kHost:
    case TierKind::kRemote:
    case TierKind::kPool: return 1;
    case TierKind::kFile: return 2;
  }
  return 3;
}

std::string trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

Result<std::vector<TierKind>> CascadeConfig::resolve_pipeline(bool gpu_available) const {
  std::vector<TierKind> tiers;
  if (trim(pipeline).empty()) {
    if (use_gpu && gpu_available) tiers.push_back(TierKind::kGpu);
    tiers.push_back(pool_socket.empty() ? TierKind::kHost : TierKind::kPool);
    if (!file_path.empty()) tiers.push_back(TierKind::kFile);
    return tiers;
  }
  std::string_view rest = pipeline;
  while (true) {
    size_t bar = rest.find('|');
    std::string name = trim(rest.substr(0, bar));
    if (name.empty()) return Status::InvalidArgument("empty stage in pipeline '" + pipeline + "'");
    auto kind = parse_tier(name);
    if (!kind.ok()) return kind.status();
    if (!tiers.empty() && tier_level(*kind) <= tier_level(tiers.back())) {
      return Status::InvalidArgument(
          "pipeline '" + pipeline +
          "': tiers must be ordered gpu, host (or remote, or pool), file, each at most once");
    }
    tiers.push_back(*kind);
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  return tiers;
}

Status CascadeConfig::validate() const {
  auto tiers = resolve_pipeline(true);
  if (!tiers.ok()) return tiers.status();
  // A pool's blocks are in its server's arena, not this process's, and its
  // server writes them down to the tiers below it: a file tier of this
  // process below the pool would take none of them, and a flush would say
  // OK with nothing written.
  if (std::find(tiers->begin(), tiers->end(), TierKind::kPool) != tiers->end() &&
      std::find(tiers->begin(), tiers->end(), TierKind::kFile) != tiers->end())
    return Status::InvalidArgument(
        "a file tier below a pool tier is not supported: the pool's server owns the tiers below "
        "its arena (give it a file tier in its own configuration) and writes them down; leave "
        "file_path empty in a pool client's configuration");
  // The pool's clients share its blocks; an alias table of one client's
  // would name blocks the others (and this client, reopened) never find.
  if (dedup_enabled && std::find(tiers->begin(), tiers->end(), TierKind::kPool) != tiers->end())
    return Status::InvalidArgument(
        "dedup_enabled is not supported by a node pool's client: its aliases would be this "
        "process's alone, and what it stored under them lost to every other client and to "
        "itself once reopened");
  for (TierKind t : *tiers) {
    if (t == TierKind::kHost || t == TierKind::kRemote) {
      if (shm_capacity_bytes == 0)
        return Status::InvalidArgument(
            "shm_capacity_bytes is 0: the host tier needs room for at least one block");
      if (shm_path.empty()) return Status::InvalidArgument("shm_path is empty");
      if (shm_populate != ShmPopulate::kLazy && shm_populate != ShmPopulate::kAhead &&
          shm_populate != ShmPopulate::kFull)
        return Status::InvalidArgument("shm_populate must be lazy, ahead or full");
      if (shm_table_slots > (1ull << 30))
        return Status::InvalidArgument("shm_table_slots " + std::to_string(shm_table_slots) +
                                       " is larger than 2^30");
    }
    if (t == TierKind::kPool) {
      if (pool_socket.empty())
        return Status::InvalidArgument("the pipeline has a pool tier but pool_socket is empty");
      if (pool_channels < 0 || pool_channels > 64)
        return Status::InvalidArgument("pool_channels must be 0 (one per core) to 64");
      if (pool_timeout_ms == 0)
        return Status::InvalidArgument(
            "pool_timeout_ms is 0: every request would fail before the server could answer it "
            "(the default is 15000)");
      if (pool_namespace.size() > 256)
        return Status::InvalidArgument("pool_namespace is longer than 256 bytes");
    }
    if (t == TierKind::kGpu) {
      if (gpu_capacity_bytes == 0)
        return Status::InvalidArgument(
            "gpu_capacity_bytes is 0: the gpu tier needs room for at least one block");
      if (gpu_device_id < 0) return Status::InvalidArgument("gpu_device_id is negative");
    }
    if (t == TierKind::kFile) {
      if (file_path.empty())
        return Status::InvalidArgument("the pipeline has a file tier but file_path is empty");
      if (segment_size_bytes < (1u << 20))
        return Status::InvalidArgument("segment_size_bytes must be at least 1 MiB");
    }
  }
  if (file_read_bytes_per_s != 0 && file_read_bytes_per_s < (64u << 10))
    return Status::InvalidArgument("file_read_bytes_per_s must be 0 (no cap) or at least 64 KiB/s");
  if (file_stripe_count < 0) return Status::InvalidArgument("file_stripe_count is negative");
  if (file_mode & ~0777u)
    return Status::InvalidArgument("file_mode takes permission bits only (at most 0777)");
  if (!(file_mode & 0600u) || (file_mode & 0600u) != 0600u)
    return Status::InvalidArgument("file_mode must let the owner read and write (0600 at least)");
  if (compression_enabled)
    return Status::NotSupported(
        "compression_enabled: compression is not implemented (KV tensors in bf16/fp8 compress "
        "poorly and a codec would cap tier throughput); set it to false");
  if (num_io_threads < 0 || num_io_threads > 1024)
    return Status::InvalidArgument("num_io_threads must be 0 (one per core) to 1024");
  if (index_shards < 1 || index_shards > 65536 || (index_shards & (index_shards - 1)) != 0)
    return Status::InvalidArgument("index_shards must be a power of two from 1 to 65536");
  return Status::OK();
}

}  // namespace cascade
