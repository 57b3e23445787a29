#include "tiers/host/host_tier.h"

#include <cstring>

#include "cuda/device_copy.h"
#include "tiers/arena_victims.h"

namespace cascade {

Result<std::unique_ptr<HostTier>> HostTier::Open(const CascadeConfig& config, ThreadPool* pool) {
  auto arena = ShmArena::Create(config.shm_path, config.shm_capacity_bytes, config.shm_prefault);
  if (!arena.ok()) return arena.status();
  std::unique_ptr<HostTier> tier(new HostTier(config, std::move(arena.value()), pool));
  if (gpu_usable(config.gpu_device_id)) {
    // Registration lets the GPU DMA straight from the arena; failure only
    // costs speed (copies then stage), so it is not an error.
    tier->registered_ = register_host_memory(tier->arena_->base(), tier->arena_->capacity()).ok();
  }
  return tier;
}

HostTier::HostTier(const CascadeConfig& config, std::unique_ptr<ShmArena> arena, ThreadPool* pool)
    : arena_(std::move(arena)),
      alloc_(arena_->capacity(), 4096),
      index_(config.index_shards, config.eviction_policy,
             [this](const BlockId&, const Location& loc) {
               if (loc.size) alloc_.free(loc.offset, loc.size);
             }),
      pool_(pool),
      parallel_threshold_(config.parallel_copy_threshold) {}

HostTier::~HostTier() {
  if (registered_) unregister_host_memory(arena_->base());
}

Status HostTier::copy_in(uint8_t* dst, const void* src, uint64_t n, MemoryKind kind, void* stream) {
  if (kind == MemoryKind::kHost) {
    parallel_memcpy(pool_, dst, src, n, parallel_threshold_);
    return Status::OK();
  }
  return device_copy(dst, MemoryKind::kHost, src, kind, n, stream);
}

Status HostTier::copy_out(void* dst, const uint8_t* src, uint64_t n, MemoryKind kind, void* stream) {
  if (kind == MemoryKind::kHost) {
    parallel_memcpy(pool_, dst, src, n, parallel_threshold_);
    return Status::OK();
  }
  return device_copy(dst, kind, src, MemoryKind::kHost, n, stream);
}

Status HostTier::put(const BlockId& id, const void* data, uint64_t size, const PutOptions& options) {
  if (size > arena_->capacity())
    return Status::InvalidArgument("block of " + std::to_string(size) +
                                   " bytes is larger than the host tier (" +
                                   std::to_string(arena_->capacity()) + " bytes)");
  if (index_.contains(id)) return Status::OK();
  Location loc{0, size};
  if (size > 0) {
    auto off = alloc_.allocate(size);
    if (!off) return Status::NoSpace("host tier is full");
    loc.offset = *off;
    Status st = arena_->commit(*off + alloc_.round_up(size));
    if (st.ok()) st = copy_in(arena_->base() + *off, data, size, options.src_kind, options.cuda_stream);
    // Loads to the GPU then find the block's memory registered already.
    if (st.ok() && registered_) prepare_host_for_device(arena_->base() + *off, size);
    if (!st.ok()) {
      alloc_.free(*off, size);
      return st;
    }
  }
  if (!index_.insert(id, loc, options.is_prefix)) {
    // Another thread stored the same id first; blocks are immutable, so theirs is ours.
    if (size) alloc_.free(loc.offset, size);
    return Status::OK();
  }
  counters_.stored(options, size);
  return Status::OK();
}

Status HostTier::read(const BlockId& id, const ReadRequest& req, ReadResult* result) {
  auto lease = index_.acquire(id);
  if (!lease) {
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    return Status::NotFound("not in host tier");
  }
  counters_.hits.fetch_add(1, std::memory_order_relaxed);
  const uint64_t size = lease->loc.size;
  result->block_size = size;
  result->is_prefix = lease->is_prefix;
  result->copied = 0;
  Status st;
  uint64_t n = 0;
  if (req.whole) {
    if (size > req.capacity) {
      st = Status::InvalidArgument("output buffer holds " + std::to_string(req.capacity) +
                                   " bytes; the block has " + std::to_string(size));
    } else {
      n = size;
    }
  } else if (req.offset > size) {
    st = Status::InvalidArgument("offset " + std::to_string(req.offset) + " is past the end of a " +
                                 std::to_string(size) + "-byte block");
  } else {
    n = std::min(req.capacity, size - req.offset);
  }
  if (st.ok() && n) {
    st = copy_out(req.out, arena_->base() + lease->loc.offset + (req.whole ? 0 : req.offset), n,
                  req.out_kind, req.cuda_stream);
  }
  index_.release(lease->token);
  if (st.ok()) {
    result->copied = n;
    counters_.bytes_read.fetch_add(n, std::memory_order_relaxed);
  }
  return st;
}

Result<BlockView> HostTier::acquire(const BlockId& id) {
  auto lease = index_.acquire(id);
  if (!lease) {
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    return Status::NotFound("not in host tier");
  }
  counters_.hits.fetch_add(1, std::memory_order_relaxed);
  return BlockView(this, arena_->base() + lease->loc.offset, lease->loc.size, MemoryKind::kHost,
                   lease->token);
}

bool HostTier::contains(const BlockId& id) const { return index_.contains(id); }

Status HostTier::remove(const BlockId& id) {
  return index_.remove(id) ? Status::OK() : Status::NotFound("not in host tier");
}

std::vector<Victim> HostTier::claim_victims(uint64_t bytes) {
  std::vector<Victim> out =
      arena_victims(this, index_.claim_victims(bytes), arena_->base(), MemoryKind::kHost);
  counters_.evictions.fetch_add(out.size(), std::memory_order_relaxed);
  return out;
}

void HostTier::unclaim(Victim victim) {
  uint64_t token = victim.view.token();
  victim.view.detach();
  counters_.evictions.fetch_sub(1, std::memory_order_relaxed);
  index_.unclaim(victim.id, token);
}

TierStats HostTier::stats() const {
  TierStats s;
  s.name = name();
  s.capacity_bytes = arena_->capacity();
  s.used_bytes = index_.payload_bytes();
  s.reserved_bytes = alloc_.used();
  s.committed_bytes = arena_->committed();
  s.blocks = index_.size();
  counters_.fill(&s);
  s.leased_blocks = index_.leased();
  return s;
}

void HostTier::clear() { index_.clear(); }

void HostTier::for_each_block(const std::function<void(const BlockId&, uint64_t)>& fn) const {
  index_.for_each([&](const BlockId& id, const Location& loc, bool) { fn(id, loc.size); });
}

}  // namespace cascade
