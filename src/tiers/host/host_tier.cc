#include "tiers/host/host_tier.h"

#include "cuda/device_copy.h"

namespace cascade {

Result<std::unique_ptr<HostTier>> HostTier::Open(const CascadeConfig& config, ThreadPool* pool) {
  auto arena = ShmArena::Create(config.shm_path, config.shm_capacity_bytes, false);
  if (!arena.ok()) return arena.status();
  ShmArena& a = **arena;
  const ShmPopulate populate = config.shm_prefault ? ShmPopulate::kFull : config.shm_populate;
  if (populate != ShmPopulate::kLazy)
    a.warm(populate == ShmPopulate::kFull ? a.capacity() : CommittedMemory::kAheadBytes,
           default_warm_threads());
  // Prefault: open backs the whole arena, the warmers helping.
  if (config.shm_prefault) CASCADE_RETURN_IF_ERROR(a.commit(a.capacity()));
  std::unique_ptr<HostTier> tier(new HostTier(config, std::move(arena.value()), pool));
  if (gpu_usable(config.gpu_device_id)) {
    // Registration lets the GPU DMA straight from the arena; failure only
    // costs speed (copies then stage), so it is not an error.
    tier->registered_ = register_host_memory(tier->arena_base(), tier->capacity()).ok();
  }
  return tier;
}

HostTier::HostTier(const CascadeConfig& config, std::unique_ptr<ShmArena> arena, ThreadPool* pool)
    : HostArenaTier(config, arena->base(), arena->capacity(), pool, "the host tier"),
      arena_(std::move(arena)) {}

TierStats HostTier::stats() const {
  TierStats s = HostArenaTier::stats();
  s.warmed_bytes = arena_->warmed_bytes();
  s.warming = arena_->warming();
  return s;
}

HostTier::~HostTier() {
  if (registered_) unregister_host_memory(arena_base());
}

SharedArena HostTier::shared_arena() const {
  SharedArena a;
  a.fd = arena_->fd();
  a.file_offset = arena_->header_bytes();
  a.capacity = arena_->capacity();
  a.base = arena_base();
  return a;
}

Status HostTier::copy_in(uint64_t offset, const void* src, uint64_t n, const PutOptions& options) {
  uint8_t* dst = arena_base() + offset;
  CASCADE_RETURN_IF_ERROR(copy_to_arena(dst, src, n, options));
  // Loads to the GPU then find the block's memory registered already.
  if (registered_) prepare_host_for_device(dst, n);
  return Status::OK();
}

}  // namespace cascade
