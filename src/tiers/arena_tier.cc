#include "tiers/arena_tier.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "cuda/device_copy.h"
#include "tiers/leased_reads.h"
#include "util/arena_ranges.h"

namespace cascade {

ArenaTier::ArenaTier(const CascadeConfig& config, uint8_t* base, uint64_t capacity,
                     MemoryKind memory, std::string where)
    : base_(base),
      capacity_(capacity),
      memory_(memory),
      where_(std::move(where)),
      index_(
          config.index_shards, config.eviction_policy,
          [this](const BlockId&, const Location& loc) {
            if (loc.size) free_space(loc.offset, loc.size);
          },
          [this](const BlockId& id, const Location& loc) { on_unpublish(id, loc); }),
      max_blocks_(std::max<uint64_t>(capacity / kEntryBytes, 1)) {
  add_arena_range(base_, capacity_);  // no read writes into stored blocks
}

ArenaTier::~ArenaTier() { remove_arena_range(base_); }

// Empty blocks take no range, so bytes alone would never bound them: past
// as many of them as the arena holds ranges of kEntryBytes, one more is
// NoSpace (the store then moves blocks out, as it does for bytes).
Status ArenaTier::room_for_entry() const {
  if (index_.empty_entries() < max_blocks_) return Status::OK();
  return Status::NoSpace(where_ + " holds " + std::to_string(max_blocks_) +
                         " empty blocks, as many as it keeps");
}

Status ArenaTier::check_fits(uint64_t size) const {
  if (size <= capacity_) return Status::OK();
  return Status::InvalidArgument("block of " + std::to_string(size) + " bytes is larger than " +
                                 where_ + " (" + std::to_string(capacity_) + " bytes)");
}

bool ArenaTier::publish(const BlockId& id, const Location& loc, const PutOptions& options) {
  on_publish(id, loc, options.is_prefix);
  if (!index_.insert(id, loc, options.is_prefix)) return false;
  counters_.stored(options, loc.size);
  return true;
}

Status ArenaTier::put(const BlockId& id, const void* data, uint64_t size,
                      const PutOptions& options) {
  CASCADE_RETURN_IF_ERROR(check_fits(size));
  if (size && !data) return Status::InvalidArgument("data is null");
  if (options.stored) *options.stored = false;
  if (index_.contains(id)) return Status::OK();  // blocks are immutable
  Location loc{0, size};
  if (size == 0) CASCADE_RETURN_IF_ERROR(room_for_entry());
  if (size > 0) {
    auto off = allocate(size);
    if (!off) return Status::NoSpace(where_ + " is full");
    loc.offset = *off;
    Status st = commit(*off + size);
    if (st.ok()) st = copy_in(*off, data, size, options);
    if (!st.ok()) {
      free_space(*off, size);
      return st;
    }
  }
  // Another thread stored the same id first: blocks are immutable, so theirs is ours.
  const bool published = publish(id, loc, options);
  if (!published && size) free_space(loc.offset, size);
  if (options.stored) *options.stored = published;
  return Status::OK();
}

Result<Reservation> ArenaTier::reserve(const BlockId& id, uint64_t size,
                                       const PutOptions& options) {
  CASCADE_RETURN_IF_ERROR(check_fits(size));
  Reservation r;
  r.id = id;
  r.size = size;
  r.is_prefix = options.is_prefix;
  if (index_.contains(id)) {
    r.present = true;
    return r;
  }
  if (size == 0) {
    CASCADE_RETURN_IF_ERROR(room_for_entry());
    return r;
  }
  auto off = allocate(size);
  if (!off) return Status::NoSpace(where_ + " is full");
  Status st = commit(*off + size);
  if (!st.ok()) {
    free_space(*off, size);
    return st;
  }
  r.offset = *off;
  return r;
}

// As reserve() per item, with the ranges placed under one allocator lock
// and backed by one commit.
void ArenaTier::reserve_batch(std::span<const BlockId> ids, std::span<const uint64_t> sizes,
                              const PutOptions& options, std::span<Reservation> reservations,
                              std::span<Status> statuses) {
  std::vector<size_t> place;
  std::vector<uint64_t> place_sizes;
  for (size_t i = 0; i < ids.size(); ++i) {
    Reservation& r = reservations[i];
    r = Reservation{};
    r.id = ids[i];
    r.size = sizes[i];
    r.is_prefix = options.is_prefix;
    statuses[i] = check_fits(sizes[i]);
    if (!statuses[i].ok()) continue;
    if (index_.contains(ids[i])) {
      r.present = true;
    } else if (sizes[i] == 0) {
      statuses[i] = room_for_entry();
    } else {
      place.push_back(i);
      place_sizes.push_back(sizes[i]);
    }
  }
  if (place.empty()) return;
  std::vector<std::optional<uint64_t>> offsets(place.size());
  allocate_batch(place_sizes, offsets);
  uint64_t end = 0;
  for (size_t k = 0; k < place.size(); ++k) {
    if (!offsets[k]) {
      statuses[place[k]] = Status::NoSpace(where_ + " is full");
      continue;
    }
    reservations[place[k]].offset = *offsets[k];
    end = std::max(end, *offsets[k] + place_sizes[k]);
  }
  Status st = end ? commit(end) : Status::OK();
  if (st.ok()) return;
  for (size_t k = 0; k < place.size(); ++k) {
    if (!offsets[k]) continue;
    free_space(*offsets[k], place_sizes[k]);
    statuses[place[k]] = st;
  }
}

Status ArenaTier::commit_reserved(const Reservation& r, const PutOptions& options) {
  if (r.present) return Status::OK();
  PutOptions o = options;
  o.is_prefix = r.is_prefix;
  // Another reservation of the id committed first: blocks are immutable.
  const bool published = publish(r.id, Location{r.offset, r.size}, o);
  if (!published && r.size) free_space(r.offset, r.size);
  if (options.stored) *options.stored = published;
  return Status::OK();
}

void ArenaTier::abort_reserved(const Reservation& r) {
  if (!r.present && r.size) free_space(r.offset, r.size);
}

std::optional<BlockIndex::Lease> ArenaTier::lease_counted(const BlockId& id) {
  auto lease = index_.acquire(id);
  TierCounters::add(lease ? counters_.hits : counters_.misses);
  return lease;
}

Status ArenaTier::read(const BlockId& id, const ReadRequest& req, ReadResult* result) {
  auto lease = lease_counted(id);
  if (!lease) return not_found();
  result->found = true;
  result->block_size = lease->loc.size;
  result->is_prefix = lease->is_prefix;
  result->copied = 0;
  uint64_t from = 0, n = 0;
  Status st = req.span(lease->loc.size, &from, &n);
  if (st.ok() && n) st = copy_out(req.out, base_ + lease->loc.offset + from, n, req);
  index_.release(lease->token);
  if (st.ok()) {
    result->copied = n;
    TierCounters::add(counters_.bytes_read, n);
  }
  return st;
}

void ArenaTier::read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                           std::span<ReadResult> results, std::span<Status> statuses) {
  if (!any_device_out(reqs)) {
    Tier::read_batch(ids, reqs, results, statuses);
    return;
  }
  std::vector<uint64_t> tokens(ids.size());
  std::vector<uint8_t> held(ids.size(), 0);
  auto lease = [&](size_t begin, size_t end, std::span<LeasedBytes> blocks) {
    for (size_t i = begin; i < end; ++i) {
      auto l = lease_counted(ids[i]);
      if (!l) {
        statuses[i] = not_found();
        continue;
      }
      statuses[i] = Status::OK();
      results[i].is_prefix = l->is_prefix;
      blocks[i] = LeasedBytes{base_ + l->loc.offset, l->loc.size};
      tokens[i] = l->token;
      held[i] = 1;
    }
  };
  auto release = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i)
      if (held[i]) index_.release(tokens[i]);
  };
  TierCounters::add(counters_.bytes_read,
                    read_leased_in_parts(memory_, reqs, results, statuses, lease, release));
}

void ArenaTier::put_batch_from_device(std::span<const BlockId> ids,
                                      std::span<const void* const> data,
                                      std::span<const uint64_t> sizes, const PutOptions& options,
                                      std::span<Status> statuses) {
  const size_t n = ids.size();
  std::vector<Reservation> reserved(n);
  std::vector<uint8_t> placed(n, 0);  // holds arena space until committed or aborted
  PipelinePart parts[2];              // declared before the pipeline, which writes their statuses
  DeviceCopyPipeline copies(MemoryKind::kHost, options.src_kind, options.cuda_stream);
  // Reserves a part's blocks and queues the copies into their ranges.
  auto start = [&](size_t k, size_t begin, size_t end) {
    PipelinePart& p = parts[k % 2];
    p = PipelinePart{};
    const size_t m = end - begin;
    reserve_batch(ids.subspan(begin, m), sizes.subspan(begin, m), options,
                  std::span<Reservation>(reserved).subspan(begin, m), statuses.subspan(begin, m));
    for (size_t i = begin; i < end; ++i) {
      if (!statuses[i].ok()) continue;
      placed[i] = !reserved[i].present && sizes[i] > 0;
      if (sizes[i] && !data[i]) {
        statuses[i] = Status::InvalidArgument("data is null");  // as put(), stored or not
        continue;
      }
      if (!placed[i]) continue;
      p.push(i, CopyItem{base_ + reserved[i].offset, data[i], sizes[i]});
    }
    p.queue(copies);
  };
  // Once a part's copies are done: commits what landed, aborts the rest.
  auto finish = [&](size_t k, size_t begin, size_t end) {
    parts[k % 2].settle(copies, statuses);
    for (size_t i = begin; i < end; ++i) {
      if (statuses[i].ok()) statuses[i] = commit_reserved(reserved[i], options);
      else if (placed[i]) abort_reserved(reserved[i]);
    }
  };
  for_each_part_two_deep(
      n, [&](size_t i) { return std::pair<size_t, uint64_t>(1, sizes[i]); }, start, finish);
}

BlockView ArenaTier::view_of(const BlockIndex::Lease& lease) {
  return BlockView(this, base_ + lease.loc.offset, lease.loc.size, memory_, lease.token,
                   lease.is_prefix);
}

Result<BlockView> ArenaTier::acquire_to_copy(const BlockId& id) {
  auto lease = index_.acquire(id, /*touch=*/false);
  if (!lease) return not_found();
  return view_of(*lease);
}

Result<BlockView> ArenaTier::acquire(const BlockId& id) {
  auto lease = lease_counted(id);
  if (!lease) return not_found();
  return view_of(*lease);
}

Result<uint64_t> ArenaTier::size_of(const BlockId& id) {
  auto loc = index_.peek(id);
  if (loc) return loc->size;
  TierCounters::add(counters_.misses);
  return not_found();
}

Status ArenaTier::remove(const BlockId& id) {
  return index_.remove(id) ? Status::OK() : not_found();
}

Status ArenaTier::remove_victim(const Victim& victim) {
  if (!victim.view) return remove(victim.id);
  return index_.remove_leased(victim.view.token()) ? Status::OK() : not_found();
}

// bytes 0: room for another empty block (room_for_entry refused one), so
// an empty block is claimed; blocks of bytes would not make that room.
std::vector<Victim> ArenaTier::claim_victims(uint64_t bytes) {
  std::vector<BlockIndex::Claimed> claims =
      bytes == 0 ? index_.claim_empty(1) : index_.claim_victims(bytes);
  std::vector<Victim> out;
  out.reserve(claims.size());
  for (auto& c : claims) {
    Victim v;
    v.id = c.id;
    v.size = c.lease.loc.size;
    v.is_prefix = c.lease.is_prefix;
    // The view leases the bytes in place while the store copies them down.
    v.view = view_of(c.lease);
    v.cuda_stream = copy_out_stream();
    out.push_back(std::move(v));
  }
  TierCounters::add(counters_.evictions, out.size());
  return out;
}

void ArenaTier::unclaim(Victim victim) {
  const uint64_t token = victim.view.token();
  victim.view.detach();  // the index takes the lease back
  counters_.evictions.fetch_sub(1, std::memory_order_relaxed);
  index_.unclaim(victim.id, token);
}

TierStats ArenaTier::stats() const {
  TierStats s;
  s.name = name();
  s.capacity_bytes = capacity_;
  s.used_bytes = index_.payload_bytes();
  s.reserved_bytes = reserved_bytes();
  s.committed_bytes = committed_bytes();
  s.blocks = index_.size();
  counters_.fill(&s);
  s.leased_blocks = index_.leased();
  return s;
}

void ArenaTier::for_each_block(const std::function<void(const BlockId&, uint64_t)>& fn) const {
  index_.for_each([&](const BlockId& id, const Location& loc, bool) { fn(id, loc.size); });
}

HostArenaTier::HostArenaTier(const CascadeConfig& config, uint8_t* base, uint64_t capacity,
                             ThreadPool* pool, std::string where)
    : ArenaTier(config, base, capacity, MemoryKind::kHost, std::move(where)),
      pool_(pool),
      parallel_threshold_(config.parallel_copy_threshold),
      alloc_(capacity, kUnit) {}

Status HostArenaTier::copy_to_arena(uint8_t* dst, const void* src, uint64_t n,
                                    const PutOptions& options) {
  if (options.src_kind == MemoryKind::kHost) {
    parallel_memcpy(pool_, dst, src, n, parallel_threshold_);
    return Status::OK();
  }
  return device_copy(dst, MemoryKind::kHost, src, options.src_kind, n, options.cuda_stream);
}

Status HostArenaTier::copy_out(void* dst, const uint8_t* src, uint64_t n, const ReadRequest& req) {
  if (req.out_kind == MemoryKind::kHost) {
    parallel_memcpy(pool_, dst, src, n, parallel_threshold_);
    return Status::OK();
  }
  return device_copy(dst, req.out_kind, src, MemoryKind::kHost, n, req.cuda_stream);
}

}  // namespace cascade
