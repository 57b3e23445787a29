#include "tiers/host/host_tier.h"

#include <algorithm>
#include <random>

#include "cuda/device_copy.h"

namespace cascade {

uint64_t HostTier::new_kept_since() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t(rd()) << 32) ^ rd();
  return v;
}

uint32_t HostTier::table_slots_for(const CascadeConfig& config) {
  if (!config.shm_persist) return 0;
  if (config.shm_table_slots)
    return uint32_t(std::min<uint64_t>(config.shm_table_slots, ShmArena::kMaxTableSlots));
  const uint64_t most = std::max<uint64_t>(1, config.shm_capacity_bytes / kUnit);
  const uint64_t n = std::max<uint64_t>(config.shm_capacity_bytes / (64 << 10), 1024);
  return uint32_t(std::min<uint64_t>({n, most, ShmArena::kMaxTableSlots}));
}

Result<std::unique_ptr<HostTier>> HostTier::Open(const CascadeConfig& config, ThreadPool* pool) {
  auto arena =
      ShmArena::Create(config.shm_path, config.shm_capacity_bytes, false, table_slots_for(config));
  if (!arena.ok()) return arena.status();
  ShmArena& a = **arena;
  const ShmPopulate populate = config.shm_prefault ? ShmPopulate::kFull : config.shm_populate;
  if (populate != ShmPopulate::kLazy)
    a.warm(populate == ShmPopulate::kFull ? a.capacity() : CommittedMemory::kAheadBytes,
           default_warm_threads());
  // Prefault: open backs the whole arena, the warmers helping.
  if (config.shm_prefault) CASCADE_RETURN_IF_ERROR(a.commit(a.capacity()));
  std::unique_ptr<HostTier> tier(new HostTier(config, std::move(arena.value()), pool));
  tier->kept_since_ = new_kept_since();
  if (tier->table_) {
    // Unknown while this start decides: one killed while it drops blocks
    // leaves no mark that says it kept them.
    const uint64_t kept = tier->arena_->reattached() ? tier->arena_->kept_mark() : 0;
    tier->arena_->set_kept_mark(0);
    if (tier->arena_->reattached()) {
      tier->below_mark_ = tier->arena_->take_below_mark();
      tier->reattach();
    }
    if (kept != 0 && tier->reattach_dropped_ == 0) tier->kept_since_ = kept;
    tier->arena_->set_kept_mark(tier->kept_since_);
    tier->start_sealer();
  }
  if (gpu_usable(config.gpu_device_id)) {
    // Registration lets the GPU DMA straight from the arena; failure only
    // costs speed (copies then stage), so it is not an error.
    tier->registered_ = register_host_memory(tier->arena_base(), tier->capacity()).ok();
    // The GPU set up now rather than by a first batch (where the process
    // uses it already), unless the store asked for no GPU.
    if (config.use_gpu) prepare_device(config.gpu_device_id);
  }
  return tier;
}

HostTier::HostTier(const CascadeConfig& config, std::unique_ptr<ShmArena> arena, ThreadPool* pool)
    : HostArenaTier(config, arena->base(), arena->capacity(), pool, "the host tier"),
      arena_(std::move(arena)) {
  if (arena_->persistent())
    table_ = std::make_unique<BlockTable>(arena_->table(), arena_->table_slots(), arena_->key(),
                                          ShmArena::kKeyBytes);
}

HostTier::~HostTier() {
  stop_sealer();  // seals what is queued: a closed tier keeps every block
  if (registered_) unregister_host_memory(arena_base());
}

SharedArena HostTier::shared_arena() const {
  SharedArena a;
  a.fd = arena_->fd();
  a.file_offset = arena_->header_bytes();
  a.capacity = arena_->capacity();
  a.base = arena_base();
  a.committed = arena_->committed();
  a.kept_since = kept_since_;
  return a;
}

void HostTier::free_space(uint64_t offset, uint64_t size) {
  // The slot goes first: no slot may name a range the allocator hands out.
  if (table_) table_->drop(offset);
  alloc_.free(offset, size);
}

Status HostTier::copy_in(uint64_t offset, const void* src, uint64_t n, const PutOptions& options) {
  uint8_t* dst = arena_base() + offset;
  CASCADE_RETURN_IF_ERROR(copy_to_arena(dst, src, n, options));
  // Loads to the GPU then find the block's memory registered already.
  if (registered_) prepare_host_for_device(dst, n);
  return Status::OK();
}

void HostTier::put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                         std::span<const uint64_t> sizes, const PutOptions& options,
                         std::span<Status> statuses) {
  if (options.src_kind == MemoryKind::kHost) {
    Tier::put_batch(ids, data, sizes, options, statuses);
    return;
  }
  put_batch_from_device(ids, data, sizes, options, statuses);
}

TierStats HostTier::stats() const {
  // Warming is read before the committed bytes: committed memory only
  // grows, so stats that say warming has ended also show all it committed.
  const bool warming = arena_->warming();
  TierStats s = ArenaTier::stats();
  s.warmed_bytes = arena_->warmed_bytes();
  s.warming = warming;
  s.reattached_blocks = reattached_blocks_;
  s.arena_discarded = arena_->discarded() || dropped_for_place_;
  s.arena_replaced_in_use = arena_->replaced_in_use();
  s.reattach_dropped = reattach_dropped_;
  s.reattach_bytes = reattach_bytes_;
  s.reattach_seconds = reattach_seconds_;
  s.corrupt_blocks += reattach_corrupt_;
  s.unpersisted_blocks = unkept({});
  return s;
}

}  // namespace cascade
