#include "tiers/remote/local_share.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

#include "cuda/device_copy.h"
#include "os/errno_status.h"
#include "tiers/remote/block_checksum.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace cascade::remote {

LocalShare::LocalShare(uint8_t* base, uint64_t capacity, const CascadeConfig& config, ThreadPool* pool,
                       bool checksums)
    : base_(base),
      capacity_(capacity),
      pool_(pool),
      parallel_threshold_(config.parallel_copy_threshold),
      checksums_(checksums),
      alloc_(capacity, kUnit),
      index_(config.index_shards, config.eviction_policy,
             [this](const BlockId&, const Location& loc) {
               if (loc.size == 0) return;
               forget_checksum(loc.offset);
               alloc_.free(loc.offset, loc.size);
             }),
      checksum_shards_(new ChecksumShard[kChecksumShards]) {
  if (config.shm_prefault) (void)commit(capacity_);  // a full /dev/shm shows at the first put
}

LocalShare::~LocalShare() {
  std::unique_lock<std::mutex> lock(ahead_mu_);
  ahead_cv_.wait(lock, [&] { return !ahead_running_; });
}

void LocalShare::commit_ahead() {
  uint64_t have = committed_.load(std::memory_order_acquire);
  if (have >= capacity_ || alloc_.high_water() + kCommitStep <= have || pool_ == nullptr || pool_->size() == 0)
    return;
  {
    std::lock_guard<std::mutex> lock(ahead_mu_);
    if (ahead_running_) return;
    ahead_running_ = true;
  }
  pool_->submit([this, want = have + kCommitStep] {
    (void)commit(want);  // a failure shows again, synchronously, at the put that needs the memory
    std::lock_guard<std::mutex> lock(ahead_mu_);
    ahead_running_ = false;
    ahead_cv_.notify_all();
  });
}

Status LocalShare::commit(uint64_t end) {
  if (end <= committed_.load(std::memory_order_acquire)) return Status::OK();
  std::lock_guard<std::mutex> lock(commit_mu_);
  uint64_t have = committed_.load(std::memory_order_relaxed);
  if (end <= have) return Status::OK();
  uint64_t want = std::min(capacity_, (end + kCommitStep - 1) / kCommitStep * kCommitStep);
  if (::madvise(base_ + have, want - have, MADV_POPULATE_WRITE) != 0) {
    int err = errno;
    if (err == EINVAL) {
      // Kernels before 5.14: touch the pages instead (a full /dev/shm then
      // shows as SIGBUS, as for any shared-memory program).
      long page = ::sysconf(_SC_PAGESIZE);
      for (uint64_t off = have; off < want; off += static_cast<uint64_t>(page))
        reinterpret_cast<volatile uint8_t*>(base_)[off] = 0;
    } else if (err == EFAULT || err == ENOMEM || err == ENOSPC) {
      return Status::NoSpace("cannot back " + std::to_string((want - have) >> 20) +
                             " MiB more of the remote tier's shared memory (is /dev/shm full?)");
    } else {
      return errno_status(err, "commit remote tier memory");
    }
  }
  committed_.store(want, std::memory_order_release);
  return Status::OK();
}

void LocalShare::release_memory() {
  index_.clear();
  std::lock_guard<std::mutex> lock(commit_mu_);
  uint64_t have = committed_.load(std::memory_order_relaxed);
  if (have) ::madvise(base_, have, MADV_REMOVE);  // best effort: the window is freed at finalize anyway
  committed_.store(0, std::memory_order_release);
}

void LocalShare::forget_checksum(uint64_t offset) {
  if (!checksums_) return;
  ChecksumShard& s = checksum_shards_[(offset / kUnit) % kChecksumShards];
  std::lock_guard<std::mutex> lock(s.mu);
  s.by_offset.erase(offset);
}

uint64_t LocalShare::checksum_at(const Location& loc) const {
  if (!checksums_) return 0;
  if (loc.size == 0) return block_checksum(nullptr, 0);
  const ChecksumShard& s = checksum_shards_[(loc.offset / kUnit) % kChecksumShards];
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.by_offset.find(loc.offset);
  return it == s.by_offset.end() ? 0 : it->second;
}

Status LocalShare::copy_in(uint8_t* dst, const void* src, uint64_t n, const PutOptions& o,
                           uint64_t* checksum) {
  if (o.src_kind == MemoryKind::kHost) {
    if (checksums_) {
      *checksum = copy_with_checksum(dst, src, n, pool_, parallel_threshold_);
    } else {
      parallel_memcpy(pool_, dst, src, n, parallel_threshold_);
    }
    return Status::OK();
  }
  CASCADE_RETURN_IF_ERROR(device_copy(dst, MemoryKind::kHost, src, o.src_kind, n, o.cuda_stream));
  if (checksums_) *checksum = block_checksum(dst, n, pool_, parallel_threshold_);
  return Status::OK();
}

Status LocalShare::put(const BlockId& id, const void* data, uint64_t size, const PutOptions& options) {
  if (size > capacity_)
    return Status::InvalidArgument("block of " + std::to_string(size) +
                                   " bytes is larger than this rank's share of the remote tier (" +
                                   std::to_string(capacity_) + " bytes)");
  if (index_.contains(id)) return Status::OK();
  Location loc{0, size};
  uint64_t sum = 0;
  if (size > 0) {
    auto off = alloc_.allocate(size);
    if (!off) return Status::NoSpace("this rank's share of the remote tier is full");
    loc.offset = *off;
    Status st = commit(*off + alloc_.round_up(size));
    commit_ahead();
    if (st.ok()) st = copy_in(base_ + *off, data, size, options, &sum);
    if (!st.ok()) {
      alloc_.free(*off, size);
      return st;
    }
    if (checksums_) {
      ChecksumShard& s = checksum_shards_[(loc.offset / kUnit) % kChecksumShards];
      std::lock_guard<std::mutex> lock(s.mu);
      s.by_offset[loc.offset] = sum;
    }
  }
  if (!index_.insert(id, loc, options.is_prefix)) {
    // Stored first by another thread or a peer; blocks are immutable.
    if (size) {
      forget_checksum(loc.offset);
      alloc_.free(loc.offset, size);
    }
  }
  return Status::OK();
}

Status LocalShare::read(const BlockId& id, const ReadRequest& req, ReadResult* result) {
  auto lease = index_.acquire(id);
  if (!lease) return Status::NotFound("not in this rank's share of the remote tier");
  const uint64_t size = lease->loc.size;
  result->block_size = size;
  result->is_prefix = lease->is_prefix;
  result->copied = 0;
  Status st;
  uint64_t n = 0;
  if (req.whole) {
    if (size > req.capacity)
      st = Status::InvalidArgument("output buffer holds " + std::to_string(req.capacity) +
                                   " bytes; the block has " + std::to_string(size));
    else
      n = size;
  } else if (req.offset > size) {
    st = Status::InvalidArgument("offset " + std::to_string(req.offset) + " is past the end of a " +
                                 std::to_string(size) + "-byte block");
  } else {
    n = std::min(req.capacity, size - req.offset);
  }
  if (st.ok() && n) {
    const uint8_t* src = base_ + lease->loc.offset + (req.whole ? 0 : req.offset);
    if (req.out_kind == MemoryKind::kHost)
      parallel_memcpy(pool_, req.out, src, n, parallel_threshold_);
    else
      st = device_copy(req.out, req.out_kind, src, MemoryKind::kHost, n, req.cuda_stream);
  }
  index_.release(lease->token);
  if (st.ok()) result->copied = n;
  return st;
}

Result<Extent> LocalShare::reserve(uint64_t size) {
  if (size > capacity_) return Status::InvalidArgument("larger than the owner's share");
  Extent e{0, size};
  if (size == 0) return e;
  for (int round = 0; round < 64; ++round) {
    auto off = alloc_.allocate(size);
    if (off) {
      e.offset = *off;
      Status st = commit(*off + alloc_.round_up(size));
      if (!st.ok()) {
        alloc_.free(*off, size);
        return st;
      }
      commit_ahead();
      return e;
    }
    // Full: drop the least valuable unleased blocks. A peer's put cannot
    // ask this rank's store to demote them, so they leave the tier here
    // (write_through keeps a copy in the file tier of the rank that put them).
    auto victims = index_.claim_victims(size);
    if (victims.empty()) break;
    for (auto& v : victims) {
      index_.remove(v.id);
      index_.release(v.lease.token);
    }
    evicted_for_peers_.fetch_add(victims.size(), std::memory_order_relaxed);
  }
  return Status::NoSpace("the owner's share of the remote tier is full and every block in it is leased");
}

bool LocalShare::publish(const BlockId& id, const Extent& extent, bool is_prefix, uint64_t checksum) {
  if (checksums_ && extent.size) {
    ChecksumShard& s = checksum_shards_[(extent.offset / kUnit) % kChecksumShards];
    std::lock_guard<std::mutex> lock(s.mu);
    s.by_offset[extent.offset] = checksum;
  }
  if (index_.insert(id, Location{extent.offset, extent.size}, is_prefix)) return true;
  free_extent(extent);
  return false;
}

void LocalShare::free_extent(const Extent& extent) {
  if (extent.size == 0) return;
  forget_checksum(extent.offset);
  alloc_.free(extent.offset, extent.size);
}

}  // namespace cascade::remote
