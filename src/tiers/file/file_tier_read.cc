// FileTier: reading, removal, eviction candidates and stats. Design:
// file_tier.h.
#include <algorithm>
#include <cstring>

#include "cuda/device_copy.h"
#include "tiers/file/file_tier.h"

namespace cascade {

using file::AlignedBuffer;
using file::IoRequest;
using file::kPage;
using file::RecordHeader;
using file::Segment;

namespace {

constexpr size_t kKeepBounceBytes = 64 << 20;  // larger per-thread bounce buffers are freed

AlignedBuffer& thread_bounce() {
  thread_local AlignedBuffer buf;
  return buf;
}

}  // namespace

struct FileTier::ReadPlan {
  enum class Mode : uint8_t { kDirectToUser, kToUser, kBounce };
  BlockId id;
  SegmentRef seg;
  uint64_t token = 0;
  Location loc;
  uint64_t record_offset = 0;
  uint64_t copy_bytes = 0;  // bytes to hand to the caller
  Mode mode = Mode::kBounce;
  AlignedBuffer* bounce = nullptr;
  IoRequest io;
};

// ---- reading -------------------------------------------------------------------

FileTier::SegmentRef FileTier::segment_at(uint64_t slot) const {
  auto it = slots_.find(slot);
  return it == slots_.end() ? nullptr : it->second;
}

void FileTier::on_reclaim(const BlockId& id, const Location& loc) {
  forget_record(loc);
  note_dead(id, loc, nullptr);
  drop_aliases_of(id);
  if (!loading_.load(std::memory_order_relaxed)) maybe_schedule_compaction();
}

bool FileTier::drop_damaged(const BlockId& id, const Location& loc) {
  auto now = index_.peek(id);
  if (!now || now->offset != loc.offset || now->size != loc.size) return false;
  // Removed and re-put, or moved, meanwhile: its old record may be a hole.
  corrupt_blocks_.fetch_add(1, std::memory_order_relaxed);
  std::shared_lock<std::shared_mutex> not_while_deciding(removing_);
  (void)index_.remove(id);
  note_dead(id, loc, nullptr);
  return true;
}

bool FileTier::plan_read(const BlockId& id, const ReadRequest& req, ReadResult* result,
                         ReadPlan* plan, Status* status, AlignedBuffer* bounce) {
  std::optional<BlockIndex::Lease> lease;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    lease = index_.acquire(id);
    if (lease) plan->seg = segment_at(file::location_slot(lease->loc.offset));
  }
  if (!lease) {
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    *status = Status::NotFound("not in file tier");
    return false;
  }
  if (!plan->seg) {  // its segment was deleted by clear()
    index_.release(lease->token);
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    *status = Status::NotFound("not in file tier");
    return false;
  }
  const uint64_t size = lease->loc.size;
  result->found = true;
  result->block_size = size;
  result->is_prefix = lease->is_prefix;
  result->copied = 0;
  uint64_t n = 0;
  if (req.whole) {
    if (size > req.capacity) {
      index_.release(lease->token);
      *status = Status::InvalidArgument("output buffer holds " + std::to_string(req.capacity) +
                                        " bytes; the block has " + std::to_string(size));
      return false;
    }
    n = size;
  } else if (req.offset > size) {
    index_.release(lease->token);
    *status =
        Status::InvalidArgument("offset " + std::to_string(req.offset) + " is past the end of a " +
                                std::to_string(size) + "-byte block");
    return false;
  } else {
    n = std::min(req.capacity, size - req.offset);
  }
  plan->id = id;
  plan->token = lease->token;
  plan->loc = lease->loc;
  plan->record_offset = file::location_record_offset(lease->loc.offset);
  plan->copy_bytes = n;
  plan->bounce = bounce;
  const bool direct = plan->seg->file->direct();
  const bool to_user =
      req.whole && req.out_kind == MemoryKind::kHost && size > file::kInlinePayloadMax;
  IoRequest& io = plan->io;
  io = IoRequest();
  io.file = plan->seg->file.get();
  io.offset = plan->record_offset;
  bool ok = true;
  if (to_user && direct && file::is_aligned(req.out)) {
    plan->mode = ReadPlan::Mode::kDirectToUser;
    ok = bounce->reserve(2 * kPage);
    uint64_t full = size & ~(kPage - 1);
    io.add(bounce->data(), kPage);
    io.add(req.out, full);
    if (full < size) io.add(bounce->data() + kPage, kPage);
  } else if (to_user && !direct) {
    plan->mode = ReadPlan::Mode::kToUser;
    ok = bounce->reserve(kPage);
    io.add(bounce->data(), kPage);
    io.add(req.out, size);
  } else {
    plan->mode = ReadPlan::Mode::kBounce;
    uint64_t len = direct ? file::record_size(size) : file::payload_offset(size) + size;
    ok = bounce->reserve(len);
    io.add(bounce->data(), len);
  }
  if (!ok) {
    index_.release(lease->token);
    *status = Status::NoSpace("out of memory for a read buffer");
    return false;
  }
  return true;
}

Status FileTier::finish_read(ReadPlan* plan, const ReadRequest& req, ReadResult* result) {
  const uint64_t size = plan->loc.size;
  const uint8_t* bounce = plan->bounce->data();
  std::string problem;
  const uint8_t* payload = nullptr;
  if (plan->io.status.is(Code::kCorruption)) {  // the file ends inside the record
    problem = plan->io.status.ToString();
  } else if (!plan->io.status.ok()) {
    // The device did not answer: that says nothing about the record, which
    // stays indexed. This read fails (a miss to the store); a later one may
    // succeed.
    index_.release(plan->token);
    plan->seg.reset();
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    read_errors_.fetch_add(1, std::memory_order_relaxed);
    return Status::IOError("reading block " + plan->id.hex() +
                           " from the file tier failed: " + plan->io.status.message());
  } else {
    file::HeaderCheck check =
        file::check_record_header(key_, bounce, plan->seg->id, plan->record_offset);
    RecordHeader h;
    std::memcpy(&h, bounce, sizeof(h));
    if (check != file::HeaderCheck::kValid) {
      problem = file::header_check_name(check);
    } else if (h.id() != plan->id || h.payload_length != size || h.is_alias() || h.is_hole()) {
      problem = "record holds another block";
    } else {
      switch (plan->mode) {
        case ReadPlan::Mode::kDirectToUser: {
          uint64_t full = size & ~(kPage - 1);
          if (full < size)
            std::memcpy(static_cast<uint8_t*>(req.out) + full, bounce + kPage, size - full);
          payload = static_cast<const uint8_t*>(req.out);
          break;
        }
        case ReadPlan::Mode::kToUser: payload = static_cast<const uint8_t*>(req.out); break;
        case ReadPlan::Mode::kBounce: payload = bounce + file::payload_offset(size); break;
      }
      if (file::payload_checksum(key_, payload, size) != h.payload_xxh3)
        problem = "payload checksum mismatch";
    }
  }
  Status st;
  if (problem.empty() && plan->mode == ReadPlan::Mode::kBounce && plan->copy_bytes) {
    const uint8_t* src = payload + (req.whole ? 0 : req.offset);
    if (req.out_kind == MemoryKind::kHost) {
      parallel_memcpy(pool_, req.out, src, plan->copy_bytes, parallel_copy_threshold_);
    } else {
      st = device_copy(req.out, req.out_kind, src, MemoryKind::kHost, plan->copy_bytes,
                       req.cuda_stream);
    }
  }
  index_.release(plan->token);
  plan->seg.reset();
  if (!problem.empty()) {
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    if (!drop_damaged(plan->id, plan->loc)) return Status::NotFound("not in file tier");
    return Status::NotFound("block " + plan->id.hex() + " failed verification in the file tier (" +
                            problem + "); dropped");
  }
  if (!st.ok()) return st;
  counters_.hits.fetch_add(1, std::memory_order_relaxed);
  counters_.bytes_read.fetch_add(plan->copy_bytes, std::memory_order_relaxed);
  result->copied = plan->copy_bytes;
  return Status::OK();
}

Status FileTier::read(const BlockId& id, const ReadRequest& req, ReadResult* result) {
  AlignedBuffer& bounce = thread_bounce();
  ReadPlan plan;
  Status st;
  if (!plan_read(id, req, result, &plan, &st, &bounce)) return st;
  IoRequest* one = &plan.io;
  const auto start = file::ReadPacer::Clock::now();
  engine_->run({&one, 1});
  st = finish_read(&plan, req, result);
  if (st.ok()) read_pacer_.pace(result->copied, start);
  if (bounce.capacity() > kKeepBounceBytes) bounce = AlignedBuffer();
  return st;
}

void FileTier::read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                          std::span<ReadResult> results, std::span<Status> statuses) {
  const size_t n = ids.size();
  if (n == 0) return;
  const bool uring = engine_kind_ == FileIoEngine::kIoUring;
  if (!uring || n == 1) {
    // psync: each item's read and verification on one thread, items in parallel.
    auto one = [&](size_t i) { statuses[i] = read(ids[i], reqs[i], &results[i]); };
    if (pool_ && pool_->size() > 0 && n > 1) {
      pool_->parallel_for(n, one, pool_->size());
    } else {
      for (size_t i = 0; i < n; ++i) one(i);
    }
    return;
  }
  // io_uring: plan everything, submit in chunks, then verify in parallel.
  constexpr size_t kChunk = 256;
  for (size_t base = 0; base < n; base += kChunk) {
    size_t m = std::min(kChunk, n - base);
    std::vector<ReadPlan> plans(m);
    std::vector<AlignedBuffer> buffers(m);
    std::vector<IoRequest*> requests;
    std::vector<size_t> planned;
    for (size_t k = 0; k < m; ++k) {
      size_t i = base + k;
      if (plan_read(ids[i], reqs[i], &results[i], &plans[k], &statuses[i], &buffers[k])) {
        requests.push_back(&plans[k].io);
        planned.push_back(k);
      }
    }
    const auto start = file::ReadPacer::Clock::now();
    engine_->run(requests);
    auto finish = [&](size_t j) {
      size_t k = planned[j];
      statuses[base + k] = finish_read(&plans[k], reqs[base + k], &results[base + k]);
    };
    if (pool_ && planned.size() > 1) {
      pool_->parallel_for(planned.size(), finish);
    } else {
      for (size_t j = 0; j < planned.size(); ++j) finish(j);
    }
    uint64_t copied = 0;
    for (size_t k : planned)
      if (statuses[base + k].ok()) copied += results[base + k].copied;
    read_pacer_.pace(copied, start);
  }
}

bool FileTier::contains(const BlockId& id) const { return index_.contains(id); }

Result<uint64_t> FileTier::size_of(const BlockId& id) {
  if (auto loc = index_.peek(id)) return loc->size;
  counters_.misses.fetch_add(1, std::memory_order_relaxed);
  return Status::NotFound("not in file tier");
}

Status FileTier::remove(const BlockId& id) {
  // Noted dead at once: a lease may hold the entry (and its reclaim, which
  // notes it too) for a while, and a compaction in between must know it.
  bool removed = false;
  {
    std::shared_lock<std::shared_mutex> not_while_deciding(removing_);
    const auto loc = index_.peek(id);
    removed = index_.remove(id);
    if (removed && loc) note_dead(id, *loc, nullptr);
  }
  if (drop_alias(id)) removed = true;
  uint64_t token = 0;
  {
    std::lock_guard<std::mutex> lock(claimed_mu_);
    auto it = claimed_.find(id);
    if (it != claimed_.end()) {
      token = it->second;
      claimed_.erase(it);
    }
  }
  if (token) index_.release(token);
  return removed ? Status::OK() : Status::NotFound("not in file tier");
}

std::vector<Victim> FileTier::claim_victims(uint64_t bytes) {
  std::vector<Victim> out;
  // bytes 0 (room for an empty block): a record takes room all the same.
  for (auto& c : index_.claim_victims(std::max<uint64_t>(bytes, 1))) {
    Victim v;
    v.id = c.id;
    v.size = c.lease.loc.size;
    v.is_prefix = c.lease.is_prefix;
    uint64_t stale = 0;
    {
      std::lock_guard<std::mutex> lock(claimed_mu_);
      auto [it, fresh] = claimed_.emplace(c.id, c.lease.token);
      if (!fresh) {  // claimed before and never removed nor unclaimed
        stale = it->second;
        it->second = c.lease.token;
      }
    }
    if (stale) index_.release(stale);
    out.push_back(std::move(v));
  }
  counters_.evictions.fetch_add(out.size(), std::memory_order_relaxed);
  return out;
}

void FileTier::unclaim(Victim victim) {
  uint64_t token = 0;
  {
    std::lock_guard<std::mutex> lock(claimed_mu_);
    auto it = claimed_.find(victim.id);
    if (it == claimed_.end()) return;
    token = it->second;
    claimed_.erase(it);
  }
  counters_.evictions.fetch_sub(1, std::memory_order_relaxed);
  index_.unclaim(victim.id, token);
}

TierStats FileTier::stats() const {
  TierStats s;
  s.name = name();
  s.capacity_bytes = capacity_;
  s.used_bytes = index_.payload_bytes();
  s.reserved_bytes = disk_bytes_.load(std::memory_order_relaxed);
  s.committed_bytes = s.reserved_bytes;
  s.blocks = index_.size();
  counters_.fill(&s);
  s.corrupt_blocks = corrupt_blocks_.load(std::memory_order_relaxed);
  s.read_errors = read_errors_.load(std::memory_order_relaxed);
  s.file_system_full = file_system_full_.load(std::memory_order_relaxed);
  s.leased_blocks = index_.leased();
  return s;
}

}  // namespace cascade
