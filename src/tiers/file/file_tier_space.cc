// FileTier: space management. Compaction, deletion of dead segments, clear.
// Design and crash-safety argument: file_tier.h and docs/design.md.
#include <algorithm>
#include <cstring>

#include "tiers/file/file_tier.h"
#include "tiers/file/segment_scan.h"

namespace cascade {

using file::AlignedBuffer;
using file::IoRequest;
using file::RecordHeader;
using file::Segment;

namespace {

uint64_t dead_of(const Segment& s) {
  uint64_t bytes = s.bytes.load(), live = s.live_bytes.load();
  return bytes > live ? bytes - live : 0;
}

}  // namespace

uint64_t FileTier::dead_bytes() const {
  uint64_t disk = disk_bytes_.load(), live = live_record_bytes_.load();
  return disk > live ? disk - live : 0;
}

size_t FileTier::segment_count() const {
  std::shared_lock<std::shared_mutex> lock(table_mu_);
  return slots_.size();
}

Status FileTier::drop_page_cache() {
  std::vector<SegmentRef> all;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    for (auto& [slot, seg] : slots_) all.push_back(seg);
  }
  Status result;
  for (auto& seg : all) {
    Status st = seg->file->drop_cache();
    if (result.ok() && !st.ok()) result = st;
  }
  return result;
}

void FileTier::retire_segment(const SegmentRef& seg) {
  if (seg->retired.exchange(true)) return;
  {
    std::unique_lock<std::shared_mutex> lock(table_mu_);
    auto it = slots_.find(seg->slot);
    if (it != slots_.end() && it->second == seg) slots_.erase(it);
  }
  // Readers still holding the segment keep reading through its open file.
  (void)env_->unlink(seg->path);
  (void)env_->unlink(file::join_path(dir_, file::summary_file_name(seg->id)));
  disk_bytes_.fetch_sub(seg->bytes.load());
}

bool FileTier::delete_if_dead(const SegmentRef& seg) {
  if (!seg->sealed.load() || seg->live_bytes.load() != 0) return false;
  retire_segment(seg);
  return true;
}

void FileTier::maybe_schedule_compaction() {
  if (!pool_ || pool_->size() == 0) return;
  // Worth a background pass when at least half the bytes on disk are dead
  // and that is more than two segments' worth.
  uint64_t dead = dead_bytes();
  if (dead < 2 * segment_bytes_ || dead * 2 < disk_bytes_.load()) return;
  {
    std::lock_guard<std::mutex> lock(background_mu_);
    if (background_running_ || closing_) return;
    background_running_ = true;
  }
  pool_->submit([this] {
    {
      std::lock_guard<std::mutex> compacting(compact_mu_);
      std::vector<SegmentRef> candidates;
      {
        std::shared_lock<std::shared_mutex> lock(table_mu_);
        for (auto& [slot, seg] : slots_)
          if (seg->sealed.load() && dead_of(*seg) * 2 >= seg->bytes.load()) candidates.push_back(seg);
      }
      std::sort(candidates.begin(), candidates.end(),
                [](const SegmentRef& a, const SegmentRef& b) { return dead_of(*a) > dead_of(*b); });
      for (auto& seg : candidates) {
        if (!delete_if_dead(seg)) {
          if (capacity_ && disk_bytes_.load() + seg->live_bytes.load() > capacity_) continue;
          if (!compact_segment(seg).ok()) break;
        }
        std::lock_guard<std::mutex> lock(background_mu_);
        if (closing_) break;
      }
    }
    std::lock_guard<std::mutex> lock(background_mu_);
    background_running_ = false;
    background_cv_.notify_all();
  });
}

void FileTier::seal_lanes_with_dead_bytes() {
  auto seal_if_dead = [this](Lane& lane) {
    std::lock_guard<std::mutex> lock(lane.mu);
    if (lane.active && dead_of(*lane.active) > 0) {
      seal_segment(*lane.active);
      lane.active.reset();
    }
  };
  for (auto& lane : lanes_) seal_if_dead(*lane);
  seal_if_dead(*compaction_lane_);
}

bool FileTier::reclaim_space(uint64_t need) {
  std::lock_guard<std::mutex> compacting(compact_mu_);
  auto sealed_candidates = [this] {
    std::vector<SegmentRef> out;
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    for (auto& [slot, seg] : slots_)
      if (seg->sealed.load() && !seg->retired.load() && dead_of(*seg) > 0) out.push_back(seg);
    std::sort(out.begin(), out.end(),
              [](const SegmentRef& a, const SegmentRef& b) { return dead_of(*a) > dead_of(*b); });
    return out;
  };
  auto room = [&] { return !put_limit_ || disk_bytes_.load() + need <= put_limit_; };
  bool freed = false;
  auto candidates = sealed_candidates();
  if (candidates.empty()) {
    // The dead bytes may sit in segments still open for writing.
    seal_lanes_with_dead_bytes();
    candidates = sealed_candidates();
  }
  for (auto& seg : candidates) {
    if (delete_if_dead(seg)) freed = true;
  }
  if (freed && room()) return true;
  for (auto& seg : candidates) {
    if (seg->retired.load()) continue;
    // Copying a segment to win back a sliver of it is not worth it: wait
    // (NoSpace) until eviction has freed the put's size or a quarter of it.
    if (dead_of(*seg) < std::min(need, seg->bytes.load() / 4)) continue;
    if (capacity_ && disk_bytes_.load() + seg->live_bytes.load() > capacity_) continue;
    if (compact_segment(seg).ok()) {
      freed = true;
      if (room()) break;
    }
  }
  return freed;
}

Status FileTier::compact(int max_segments) {
  std::lock_guard<std::mutex> compacting(compact_mu_);
  seal_lanes_with_dead_bytes();
  std::vector<SegmentRef> candidates;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    for (auto& [slot, seg] : slots_)
      if (seg->sealed.load() && !seg->retired.load() && dead_of(*seg) > 0) candidates.push_back(seg);
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const SegmentRef& a, const SegmentRef& b) { return dead_of(*a) > dead_of(*b); });
  int done = 0;
  for (auto& seg : candidates) {
    if (max_segments >= 0 && done >= max_segments) break;
    if (delete_if_dead(seg)) {
      ++done;
      continue;
    }
    if (capacity_ && disk_bytes_.load() + seg->live_bytes.load() > capacity_)
      return Status::NoSpace("not enough free capacity to compact " + seg->path);
    CASCADE_RETURN_IF_ERROR(compact_segment(seg));
    ++done;
  }
  return Status::OK();
}

// REQUIRES: compact_mu_ held; seg sealed.
Status FileTier::compact_segment(const SegmentRef& seg) {
  struct Live {
    BlockId id;
    Location loc;
    bool is_prefix;
  };
  std::vector<Live> live;
  index_.for_each([&](const BlockId& id, const Location& loc, bool is_prefix) {
    if (file::location_slot(loc.offset) == seg->slot) live.push_back({id, loc, is_prefix});
  });
  std::sort(live.begin(), live.end(), [](const Live& a, const Live& b) { return a.loc.offset < b.loc.offset; });

  struct Moved {
    BlockId id;
    Location from, to;
    SegmentRef dest;
  };
  std::vector<Moved> moved;
  Lane& lane = *compaction_lane_;
  std::unique_lock<std::mutex> lane_lock(lane.mu);
  AlignedBuffer buf;
  Status failure;
  for (const Live& e : live) {
    const uint64_t size = e.loc.size;
    const uint64_t rec = file::record_size(size);
    const uint64_t from_off = file::location_record_offset(e.loc.offset);
    if (!buf.reserve(rec)) {
      failure = Status::NoSpace("out of memory compacting " + seg->path);
      break;
    }
    IoRequest io;
    io.file = seg->file.get();
    io.offset = from_off;
    io.add(buf.data(), rec);
    IoRequest* one = &io;
    engine_->run({&one, 1});
    RecordHeader h;
    std::memcpy(&h, buf.data(), sizeof(h));
    bool good = io.status.ok() &&
                file::check_record_header(buf.data(), seg->id, from_off) == file::HeaderCheck::kValid &&
                h.id() == e.id && h.payload_length == size &&
                file::payload_checksum(buf.data() + file::payload_offset(size), size) == h.payload_xxh3;
    if (!good) {  // unreadable or damaged: a miss from now on
      drop_damaged(e.id, e.loc);
      continue;
    }
    failure = ensure_room(lane, rec);
    if (!failure.ok()) break;
    Segment& dest = *lane.active;
    const uint64_t to_off = dest.bytes.load();
    RecordHeader nh = file::make_record_header(e.id, size, h.payload_xxh3, e.is_prefix, dest.id, to_off);
    std::memcpy(buf.data(), &nh, sizeof(nh));
    io = IoRequest();
    io.file = dest.file.get();
    io.write = true;
    io.offset = to_off;
    io.add(buf.data(), rec);
    disk_bytes_.fetch_add(rec);
    engine_->run({&one, 1});
    if (!io.status.ok()) {
      disk_bytes_.fetch_sub(rec);
      (void)dest.file->truncate(to_off);
      failure = io.status;
      if (failure.is(Code::kNoSpace)) disk_full_.store(true);
      break;
    }
    dest.headers.push_back(nh);
    dest.bytes.store(to_off + rec);
    dest.unsynced.store(true);
    moved.push_back({e.id, e.loc, Location{file::encode_location(dest.slot, to_off), size}, lane.active});
  }
  // The copies must be durable before the index (and, below, the old
  // segment's deletion) depends on them.
  if (lane.active && lane.active->unsynced.exchange(false)) {
    Status st = lane.active->file->sync();
    if (st.ok()) st = env_->sync_dir(dir_);
    if (!st.ok()) {
      lane.active->unsynced.store(true);
      if (failure.ok()) failure = st;
    }
  }
  lane_lock.unlock();
  if (!failure.ok()) {
    // Copies already written stay as dead records; the old segment keeps
    // serving. Nothing was repointed.
    return failure;
  }
  for (const Moved& m : moved) {
    const uint64_t rec = file::record_size(m.from.size);
    if (index_.relocate(m.id, m.from, m.to)) {
      m.dest->live_bytes.fetch_add(rec);
      seg->live_bytes.fetch_sub(rec);
    }
  }
  retire_segment(seg);
  (void)env_->sync_dir(dir_);
  compactions_.fetch_add(1, std::memory_order_relaxed);
  return Status::OK();
}

void FileTier::clear() {
  std::lock_guard<std::mutex> compacting(compact_mu_);
  std::vector<std::unique_lock<std::mutex>> locks;
  for (auto& lane : lanes_) locks.emplace_back(lane->mu);
  locks.emplace_back(compaction_lane_->mu);
  index_.clear();
  for (auto& lane : lanes_) lane->active.reset();
  compaction_lane_->active.reset();
  std::vector<SegmentRef> all;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    for (auto& [slot, seg] : slots_) all.push_back(seg);
  }
  for (auto& seg : all) retire_segment(seg);
  (void)env_->sync_dir(dir_);
}

}  // namespace cascade
