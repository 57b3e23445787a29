#include "tiers/remote/local_share.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

#include "util/block_checksum.h"
#include "util/errno_status.h"

namespace cascade::remote {

LocalShare::LocalShare(uint8_t* base, uint64_t capacity, const CascadeConfig& config,
                       ThreadPool* pool, bool checksums)
    : HostArenaTier(config, base, capacity, pool, "this rank's share of the remote tier"),
      checksums_(checksums),
      checksum_shards_(new ChecksumShard[kChecksumShards]),
      committed_(capacity, [this](uint64_t from, uint64_t to) { return back(from, to); }) {
  if (config.shm_prefault) (void)commit(capacity);  // a full /dev/shm shows at the first put
}

LocalShare::~LocalShare() {
  std::unique_lock<std::mutex> lock(ahead_mu_);
  ahead_cv_.wait(lock, [&] { return !ahead_running_; });
}

Status LocalShare::back(uint64_t from, uint64_t to) {
  const int err = populate_pages(base() + from, to - from);
  if (err == 0) return Status::OK();
  if (err == EINVAL) {
    // Kernels without MADV_POPULATE_WRITE: touch the pages instead (a full
    // /dev/shm then shows as SIGBUS, as for any shared-memory program).
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    for (uint64_t off = from; off < to; off += page)
      reinterpret_cast<volatile uint8_t*>(base())[off] = 0;
    return Status::OK();
  }
  if (err == EFAULT || err == ENOMEM || err == ENOSPC)
    return Status::NoSpace("cannot back " + std::to_string((to - from) >> 20) +
                           " MiB more of the remote tier's shared memory (is /dev/shm full?)");
  return errno_status(err, "commit remote tier memory");
}

Status LocalShare::commit(uint64_t end) {
  Status st = committed_.commit(end);
  commit_ahead();
  return st;
}

void LocalShare::commit_ahead() {
  const uint64_t have = committed();
  if (have >= capacity() || alloc_.high_water() + kCommitStep <= have || pool_ == nullptr ||
      pool_->size() == 0)
    return;
  {
    std::lock_guard<std::mutex> lock(ahead_mu_);
    if (ahead_running_) return;
    ahead_running_ = true;
  }
  pool_->submit([this, want = have + kCommitStep] {
    (void)committed_.commit(
        want);  // a failure shows again, synchronously, at the put that needs the memory
    std::lock_guard<std::mutex> lock(ahead_mu_);
    ahead_running_ = false;
    ahead_cv_.notify_all();
  });
}

void LocalShare::release_memory() {
  index().clear();
  // Best effort: the window is freed at finalize anyway.
  committed_.release([this](uint64_t bytes) {
    if (bytes) ::madvise(base(), bytes, MADV_REMOVE);
  });
}

void LocalShare::set_checksum(uint64_t offset, uint64_t sum) {
  ChecksumShard& s = checksum_shards_[(offset / kUnit) % kChecksumShards];
  std::lock_guard<std::mutex> lock(s.mu);
  s.by_offset[offset] = sum;
}

void LocalShare::free_space(uint64_t offset, uint64_t size) {
  if (checksums_) {
    ChecksumShard& s = checksum_shards_[(offset / kUnit) % kChecksumShards];
    std::lock_guard<std::mutex> lock(s.mu);
    s.by_offset.erase(offset);
  }
  alloc_.free(offset, size);
}

uint64_t LocalShare::checksum_at(const Location& loc) const {
  if (!checksums_) return 0;
  if (loc.size == 0) return block_checksum(nullptr, 0);
  const ChecksumShard& s = checksum_shards_[(loc.offset / kUnit) % kChecksumShards];
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.by_offset.find(loc.offset);
  return it == s.by_offset.end() ? 0 : it->second;
}

Status LocalShare::copy_in(uint64_t offset, const void* src, uint64_t n,
                           const PutOptions& options) {
  uint8_t* dst = base() + offset;
  if (!checksums_) return copy_to_arena(dst, src, n, options);
  uint64_t sum = 0;
  if (options.src_kind == MemoryKind::kHost) {
    sum = copy_with_checksum(dst, src, n, pool_, parallel_threshold_);  // one pass over the bytes
  } else {
    CASCADE_RETURN_IF_ERROR(copy_to_arena(dst, src, n, options));
    sum = block_checksum(dst, n, pool_, parallel_threshold_);
  }
  set_checksum(offset, sum);
  return Status::OK();
}

Result<Extent> LocalShare::reserve(uint64_t size) {
  if (size > capacity()) return Status::InvalidArgument("larger than the owner's share");
  Extent e{0, size};
  if (size == 0) {
    // At the bound of empty blocks an empty one goes (blocks of bytes would
    // make no room), dropped as the bytes path below drops blocks.
    for (int round = 0; round < 4 && !room_for_entry().ok(); ++round) {
      auto victims = index().claim_empty(1);
      if (victims.empty()) break;
      for (auto& v : victims) {
        index().remove(v.id);
        index().release(v.lease.token);
      }
      evicted_for_peers_.fetch_add(victims.size(), std::memory_order_relaxed);
    }
    CASCADE_RETURN_IF_ERROR(room_for_entry());
    return e;
  }
  for (int round = 0; round < 64; ++round) {
    if (auto off = alloc_.allocate(size)) {
      e.offset = *off;
      Status st = commit(*off + size);
      if (!st.ok()) {
        alloc_.free(*off, size);
        return st;
      }
      return e;
    }
    // Full: drop the least valuable unleased blocks. A peer's put cannot
    // ask this rank's store to demote them, so they leave the tier here
    // (write_through keeps a copy in the file tier of the rank that put them).
    auto victims = index().claim_victims(size);
    if (victims.empty()) break;
    for (auto& v : victims) {
      index().remove(v.id);
      index().release(v.lease.token);
    }
    evicted_for_peers_.fetch_add(victims.size(), std::memory_order_relaxed);
  }
  return Status::NoSpace(
      "the owner's share of the remote tier is full and every block in it is leased");
}

bool LocalShare::publish(const BlockId& id, const Extent& extent, bool is_prefix,
                         uint64_t checksum) {
  if (checksums_ && extent.size) set_checksum(extent.offset, checksum);
  if (index().insert(id, Location{extent.offset, extent.size}, is_prefix)) return true;
  free_extent(extent);
  return false;
}

void LocalShare::free_extent(const Extent& extent) {
  if (extent.size) free_space(extent.offset, extent.size);
}

}  // namespace cascade::remote
