// FileTier: space management. Compaction, deletion of dead segments, holes
// punched in dead space, clear. Design and crash-safety argument:
// file_tier.h and docs/design.md.
#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "tiers/file/file_tier.h"
#include "tiers/file/segment_scan.h"

namespace cascade {

using file::AlignedBuffer;
using file::IoRequest;
using file::kPage;
using file::RecordHeader;
using file::Segment;

using file::dead_of;

void file::sort_most_dead_first(std::vector<std::shared_ptr<Segment>>* segments) {
  std::vector<std::pair<uint64_t, std::shared_ptr<Segment>>> keyed;
  keyed.reserve(segments->size());
  for (auto& s : *segments) keyed.emplace_back(dead_of(*s), std::move(s));
  std::sort(keyed.begin(), keyed.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = 0; i < keyed.size(); ++i) (*segments)[i] = std::move(keyed[i].second);
}

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

bool FileTier::retire_segment(const SegmentRef& seg) {
  if (seg->retired.load()) return true;
  // Readers still holding the segment keep reading through its open file.
  Status gone = env_->unlink(seg->path);
  // Left behind, it is read at the next open: it stays in the table, its
  // dead records still count, and a later pass deletes it.
  if (!gone.ok() && env_->file_exists(seg->path)) return false;
  if (seg->retired.exchange(true)) return true;
  // Forgotten while the segment holds its slot: no new segment can take
  // the slot and have dead records of its own forgotten here.
  forget_dead_in(*seg);
  {
    std::unique_lock<std::shared_mutex> lock(table_mu_);
    auto it = slots_.find(seg->slot);
    if (it != slots_.end() && it->second == seg) slots_.erase(it);
  }
  (void)env_->unlink(file::join_path(dir_, file::summary_file_name(seg->id)));
  disk_bytes_.fetch_sub(seg->bytes.load());
  return true;
}

bool FileTier::delete_if_dead(const SegmentRef& seg) {
  if (!seg->sealed.load() || seg->live_bytes.load() != 0) return false;
  std::vector<BlockId> contested;
  {
    // What the decision weighs, taken with no remove half done.
    std::unique_lock<std::shared_mutex> no_removes(removing_);
    contested = contested_ids(*seg);
  }
  std::vector<PlannedRemoval> plan;
  if (!plan_removals(*seg, contested, &plan).ok()) return false;
  if (!plan.empty()) {
    Lane& lane = *compaction_lane_;
    std::lock_guard<std::mutex> lock(lane.mu);
    std::vector<WrittenRemoval> written;
    Status st = write_removals(lane, plan, &written);
    if (st.ok()) st = sync_compaction_lane(lane);
    if (!st.ok()) return false;  // the segment stays until its removal records are durable
    keep_removals(written);
  }
  return retire_segment(seg);
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
          if (seg->sealed.load() && dead_of(*seg) * 2 >= seg->bytes.load())
            candidates.push_back(seg);
      }
      file::sort_most_dead_first(&candidates);
      for (auto& seg : candidates) {
        if (!delete_if_dead(seg)) {
          if (capacity_ && disk_bytes_.load() + seg->live_bytes.load() > capacity_) continue;
          (void)compact_segment(seg);  // one that fails stays; the others go on
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

void FileTier::seal_lanes_with_dead_bytes(uint64_t need) {
  auto seal_if_dead = [this, need](Lane& lane) {
    std::lock_guard<std::mutex> lock(lane.mu);
    if (lane.active && dead_of(*lane.active) > 0 &&
        (!need || dead_of(*lane.active) >= std::min(need, lane.active->bytes.load() / 4))) {
      (void)seal_segment(*lane.active);
      lane.active.reset();
    }
  };
  for (auto& lane : lanes_) seal_if_dead(*lane);
  seal_if_dead(*compaction_lane_);
}

bool FileTier::reclaim_space(uint64_t need, bool disk_full) {
  std::lock_guard<std::mutex> compacting(compact_mu_);
  auto sealed_candidates = [this] {
    std::vector<SegmentRef> out;
    {
      std::shared_lock<std::shared_mutex> lock(table_mu_);
      for (auto& [slot, seg] : slots_)
        if (seg->sealed.load() && !seg->retired.load() && dead_of(*seg) > 0) out.push_back(seg);
    }
    file::sort_most_dead_first(&out);
    return out;
  };
  auto room = [&] { return !put_limit_ || disk_bytes_.load() + need <= put_limit_; };
  bool freed = false;
  // Deletes the wholly dead candidates, then compacts those worth it until
  // there is room; true when that is done.
  auto reclaim = [&](const std::vector<SegmentRef>& candidates) {
    for (auto& seg : candidates) {
      if (delete_if_dead(seg)) freed = true;
    }
    if (disk_full) {
      // Copying live records needs free space the file system does not have:
      // give dead space back in place first. Compaction can then proceed.
      for (auto& seg : candidates) {
        if (!seg->retired.load() && punch_dead_space(seg)) freed = true;
      }
      if (freed) return true;
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
        if (room()) return true;
      }
    }
    return false;
  };
  auto candidates = sealed_candidates();
  bool sealed = false;
  if (candidates.empty() || disk_full) {
    // The dead bytes may sit in segments still open for writing.
    seal_lanes_with_dead_bytes();
    sealed = true;
    candidates = sealed_candidates();
  }
  if (reclaim(candidates)) return true;
  if (!sealed && !room()) {
    // The sealed segments could not make the room: the open ones may hold
    // the dead bytes (records put and removed since they opened). Only
    // those worth it: a tier kept full by eviction would otherwise seal
    // every lane with one dead record at each refused put.
    seal_lanes_with_dead_bytes(need);
    if (reclaim(sealed_candidates())) return true;
  }
  return freed;
}

Status FileTier::rewrite_sync_failed() {
  std::vector<SegmentRef> failed;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    for (auto& [slot, seg] : slots_)
      if (seg->sync_failed.load()) failed.push_back(seg);
  }
  if (failed.empty()) return Status::OK();
  std::lock_guard<std::mutex> compacting(compact_mu_);
  size_t left = 0;
  Status why;
  for (auto& seg : failed) {
    if (seg->retired.load() || delete_if_dead(seg)) continue;
    Status st = compact_segment(seg);
    if (st.ok() && seg->retired.load()) continue;
    ++left;
    if (why.ok()) why = st;
  }
  if (!left) return Status::OK();
  return Status::IOError(std::to_string(left) +
                         " file tier segment(s) failed an fsync and could not be rewritten yet: "
                         "blocks put before this flush may not be durable" +
                         (why.ok() ? std::string() : " (" + why.message() + ")"));
}

std::vector<FileTier::LiveRecord> FileTier::live_records_of(const Segment& seg) const {
  std::vector<LiveRecord> live;
  index_.for_each([&](const BlockId& id, const Location& loc, bool is_prefix) {
    if (file::location_slot(loc.offset) == seg.slot)
      live.push_back({id, loc, is_prefix, false, BlockId{}});
  });
  {
    std::lock_guard<std::mutex> lock(alias_mu_);
    for (const auto& [alias, e] : aliases_)
      if (file::location_slot(e.loc.offset) == seg.slot)
        live.push_back({alias, e.loc, false, true, e.target});
  }
  {
    std::lock_guard<std::mutex> lock(dead_mu_);
    for (const auto& [id, r] : removals_)
      if (file::location_slot(r.loc.offset) == seg.slot)
        live.push_back({id, r.loc, false, false, BlockId{}, true, r.sequence});
  }
  std::sort(live.begin(), live.end(),
            [](const LiveRecord& a, const LiveRecord& b) { return a.loc.offset < b.loc.offset; });
  return live;
}

bool FileTier::punch_dead_space(const SegmentRef& seg) {
  const uint64_t dead = dead_of(*seg);
  if (dead <= seg->punched_dead.load()) return false;  // nothing new since the last time
  const uint64_t end = seg->bytes.load();
  // Runs of dead records between the live ones; records are page aligned.
  // A dead record that another record of its id is weighed against stays
  // as if live (its drop may need a removal record, and a full disk has
  // no room for one).
  std::unique_lock<std::shared_mutex> no_removes(removing_);
  std::vector<LiveRecord> live = live_records_of(*seg);
  {
    const std::vector<BlockId> contested = contested_ids(*seg);
    std::lock_guard<std::mutex> lock(dead_mu_);
    for (const BlockId& id : contested) {
      auto [b, e] = dead_.equal_range(id);
      for (auto d = b; d != e; ++d)
        if (file::location_slot(d->second.offset) == seg->slot)
          live.push_back({id, Location{d->second.offset, d->second.size}, false, false, BlockId{}});
    }
  }
  no_removes.unlock();
  std::sort(live.begin(), live.end(),
            [](const LiveRecord& a, const LiveRecord& b) { return a.loc.offset < b.loc.offset; });
  std::vector<std::pair<uint64_t, uint64_t>> holes;  // [begin, end)
  uint64_t pos = 0;
  auto add_gap = [&](uint64_t b, uint64_t e) {
    if (e > b && e - b >= 2 * kPage) holes.emplace_back(b, e);
  };
  for (const LiveRecord& r : live) {
    uint64_t off = file::location_record_offset(r.loc.offset);
    add_gap(pos, off);
    pos = std::max(pos, off + file::record_size(r.loc.size));
  }
  add_gap(pos, end);
  if (holes.empty()) return false;

  // The records a new summary lists: the live ones, from the old summary
  // (or, without one, a walk of the segment, which holes do not stop).
  auto listed = file::read_summary(env_, dir_, seg->id, key_);
  if (!listed.ok())
    listed = file::scan_segment(seg->file.get(), seg->id, key_, /*verify_payloads=*/false);
  if (!listed.ok()) return false;
  // A stale summary must not list records about to become holes: remove it
  // first; until the new one exists a reopen walks the segment.
  const std::string summary = file::join_path(dir_, file::summary_file_name(seg->id));
  Status st = env_->unlink(summary);
  if (!st.ok() && env_->file_exists(summary)) return false;
  if (!env_->sync_dir(dir_).ok()) return false;

  AlignedBuffer page;
  if (!page.reserve(kPage)) return false;
  bool punched = false;
  std::vector<std::pair<uint64_t, uint64_t>> made;  // holes whose header was written
  for (auto [b, e] : holes) {
    // The hole's first page becomes a hole record, so a walk of the
    // segment steps over the zeros; then the rest goes back to the disk.
    RecordHeader h = file::make_hole_header(key_, e - b, seg->id, b);
    std::memset(page.data(), 0, kPage);
    std::memcpy(page.data(), &h, sizeof(h));
    if (!seg->file->pwrite(page.data(), kPage, b).ok()) break;
    made.emplace_back(b, e);
    if (!seg->file->punch_hole(b + kPage, e - b - kPage).ok()) break;
    punched = true;
  }
  (void)seg->file->sync();
  seg->punched_dead.store(dead);

  // The new summary lists every record outside the holes made: dead ones
  // left in a gap too small for a hole are still on disk, and a reopen
  // must know them as a walk of the segment would.
  std::vector<RecordHeader> keep;
  std::vector<BlockId> targets;
  size_t next_target = 0;
  size_t hi = 0;
  for (const RecordHeader& h : listed->records) {
    BlockId target;
    if (h.is_alias()) target = listed->alias_targets[next_target++];
    while (hi < made.size() && made[hi].second <= h.record_offset) ++hi;
    if (hi < made.size() && made[hi].first <= h.record_offset) continue;
    keep.push_back(h);
    if (h.is_alias()) targets.push_back(target);
  }
  (void)file::write_summary(env_, dir_, seg->id, key_, keep, targets, end, /*sync=*/true,
                            file_mode_);
  return punched;
}

Status FileTier::compact(int max_segments) {
  std::lock_guard<std::mutex> compacting(compact_mu_);
  seal_lanes_with_dead_bytes();
  std::vector<SegmentRef> candidates;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    for (auto& [slot, seg] : slots_)
      if (seg->sealed.load() && !seg->retired.load() && dead_of(*seg) > 0)
        candidates.push_back(seg);
  }
  file::sort_most_dead_first(&candidates);
  int done = 0;
  Status first_failure;
  for (auto& seg : candidates) {
    if (max_segments >= 0 && done >= max_segments) break;
    if (delete_if_dead(seg)) {
      ++done;
      continue;
    }
    if (capacity_ && disk_bytes_.load() + seg->live_bytes.load() > capacity_)
      return Status::NoSpace("not enough free capacity to compact " + seg->path);
    // A segment that cannot be compacted now (a record or a header it needs
    // unreadable) stays; the others are still compacted.
    Status st = compact_segment(seg);
    if (!st.ok() && first_failure.ok()) first_failure = st;
    ++done;
  }
  return first_failure;
}

// REQUIRES: compact_mu_ held; seg sealed.
Status FileTier::compact_segment(const SegmentRef& seg) {
  // An alias leaving the tier: dropped as a dead record (weighed by the plan).
  auto drop_alias_here = [&](const BlockId& alias) {
    AliasEntry dropped;
    {
      std::lock_guard<std::mutex> lock(alias_mu_);
      auto it = aliases_.find(alias);
      if (it == aliases_.end() || file::location_slot(it->second.loc.offset) != seg->slot) return;
      dropped = it->second;
      aliases_.erase(it);
      unlink_alias(alias, dropped.target);
    }
    seg->live_bytes.fetch_sub(kPage);
    live_record_bytes_.fetch_sub(kPage);
    note_dead_alias(alias, dropped);
  };
  // The live records first, then the plan. No remove falls between the snapshot and what the
  // decision weighs (a remove takes the record out of the index, then notes it dead). A remove
  // after them finds the record live in the snapshot: it is copied, and the copy (the same sequence
  // and bytes) stays the id's newest.
  std::unique_lock<std::shared_mutex> no_removes(removing_);
  std::vector<LiveRecord> live = live_records_of(*seg);
  live.erase(std::remove_if(live.begin(), live.end(),
                            [&](const LiveRecord& e) {
                              if (!e.alias || index_.contains(e.target)) return false;
                              drop_alias_here(e.id);  // its target left the tier
                              return true;
                            }),
             live.end());
  const std::vector<BlockId> contested = contested_ids(*seg);
  no_removes.unlock();
  std::vector<PlannedRemoval> plan;
  CASCADE_RETURN_IF_ERROR(plan_removals(*seg, contested, &plan));
  struct Moved {
    LiveRecord rec;
    Location to;
    SegmentRef dest;
    RecordHeader header{};  // of the copy (blocks and aliases)
  };
  std::vector<Moved> moved;
  std::vector<BlockId> stale_aliases;  // damaged: not copied
  Lane& lane = *compaction_lane_;
  std::unique_lock<std::mutex> lane_lock(lane.mu);
  AlignedBuffer buf;
  Status failure;
  std::vector<WrittenRemoval> written;
  for (const LiveRecord& e : live) {
    if (e.removal) {
      // Written again from what the tier holds: the same id and sequence.
      const size_t before = written.size();
      failure = write_removals(lane, {PlannedRemoval{e.id, e.sequence}}, &written);
      if (!failure.ok()) break;
      moved.push_back({e, written[before].entry.loc, written[before].seg});
      written.pop_back();
      continue;
    }
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
    if (!io.status.ok() && !io.status.is(Code::kCorruption)) {  // unreadable now, not damaged:
      // keep the segment serving
      failure = io.status;
      break;
    }
    RecordHeader h;
    std::memcpy(&h, buf.data(), sizeof(h));
    const uint8_t* payload = buf.data() + file::payload_offset(size);
    bool good = io.status.ok() &&
                file::check_record_header(key_, buf.data(), seg->id, from_off) ==
                    file::HeaderCheck::kValid &&
                h.id() == e.id && h.payload_length == size && h.is_alias() == e.alias &&
                !h.is_hole() && file::payload_checksum(key_, payload, size) == h.payload_xxh3 &&
                (!e.alias || std::memcmp(payload, e.target.bytes.data(), 16) == 0);
    if (!good) {  // damaged: a miss from now on
      if (e.alias) {
        stale_aliases.push_back(e.id);
      } else {
        drop_damaged(e.id, e.loc);
      }
      continue;
    }
    failure = ensure_room(lane, rec);
    if (!failure.ok()) break;
    Segment& dest = *lane.active;
    const uint64_t to_off = dest.bytes.load();
    // The copy keeps the record's sequence: it is the same write.
    RecordHeader nh = file::make_record_header(key_, e.id, size, h.payload_xxh3, h.flags,
                                               h.sequence, dest.id, to_off);
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
    if (e.alias) dest.alias_targets.push_back(e.target);
    dest.bytes.store(to_off + rec);
    dest.unsynced.store(true);
    moved.push_back({e, Location{file::encode_location(dest.slot, to_off), size}, lane.active, nh});
  }
  // The removal records that dropping the segment's dead records needs.
  if (failure.ok()) failure = write_removals(lane, plan, &written);
  // The copies must be durable before the index (and, below, the old
  // segment's deletion) depends on them.
  if (Status st = sync_compaction_lane(lane); !st.ok() && failure.ok()) failure = st;
  lane_lock.unlock();
  // Removal records count only once durable: a later plan takes them as
  // guarding their ids.
  if (failure.ok()) keep_removals(written);
  for (const BlockId& alias : stale_aliases) drop_alias_here(alias);
  if (!failure.ok()) {
    // Copies already written stay as dead records; the old segment keeps
    // serving. Nothing was repointed.
    for (const Moved& m : moved)
      if (!m.rec.removal) note_dead(m.rec.id, m.to, &m.header);
    return failure;
  }
  for (const Moved& m : moved) {
    const uint64_t rec = file::record_size(m.rec.loc.size);
    bool repointed = false;
    if (m.rec.removal) {
      std::lock_guard<std::mutex> lock(dead_mu_);
      auto [b, e] = removals_.equal_range(m.rec.id);
      for (auto it = b; it != e; ++it) {
        if (it->second.loc.offset != m.rec.loc.offset) continue;
        it->second.loc = m.to;
        repointed = true;
        break;
      }
    } else if (m.rec.alias) {
      std::lock_guard<std::mutex> lock(alias_mu_);
      auto it = aliases_.find(m.rec.id);
      if (it != aliases_.end() && it->second.loc.offset == m.rec.loc.offset) {
        it->second.loc = m.to;
        repointed = true;
      }
    } else {
      repointed = index_.relocate(m.rec.id, m.rec.loc, m.to);
    }
    if (repointed) {
      m.dest->live_bytes.fetch_add(rec);
      seg->live_bytes.fetch_sub(rec);
    } else if (!m.rec.removal) {
      note_dead(m.rec.id, m.to, &m.header);  // removed or moved meanwhile: the copy is dead
    }
  }
  if (!retire_segment(seg)) {
    // Left behind (a later pass deletes it): the old copies of the records
    // moved out are dead records on disk now.
    for (const Moved& m : moved)
      if (!m.rec.removal) note_dead(m.rec.id, m.rec.loc, &m.header);
  }
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
  {
    std::lock_guard<std::mutex> lock(alias_mu_);
    live_record_bytes_.fetch_sub(aliases_.size() * file::record_size(16));
    aliases_.clear();
    alias_targets_.clear();
  }
  std::unordered_set<uint64_t> guarding;  // slots of segments holding removal records
  // Every segment goes: nothing older is left for a removal record to guard,
  // unless a segment's file cannot be deleted (then, below, what the
  // segments left behind hold is known again).
  std::unordered_multimap<BlockId, RemovalEntry> removals;
  std::unordered_multimap<BlockId, DeadRecord> dead;
  std::unordered_map<uint64_t, std::vector<UndurableRemoval>> undurable;
  {
    std::lock_guard<std::mutex> lock(dead_mu_);
    for (const auto& [id, r] : removals_) guarding.insert(file::location_slot(r.loc.offset));
    live_record_bytes_.fetch_sub(removals_.size() * kPage);
    removals.swap(removals_);
    undurable.swap(undurable_removals_);
    dead.swap(dead_);
    dead_ids_by_slot_.clear();
  }
  for (auto& lane : lanes_) lane->active.reset();
  compaction_lane_->active.reset();
  std::vector<SegmentRef> all;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    for (auto& [slot, seg] : slots_) all.push_back(seg);
  }
  // Segments with removal records last: a kill in between must not leave
  // an older record without the removal record that guards it.
  std::stable_partition(all.begin(), all.end(),
                        [&](const SegmentRef& seg) { return !guarding.count(seg->slot); });
  bool left_behind = false;
  for (auto& seg : all) {
    // A segment with removal records goes only if every other one went.
    if (left_behind && guarding.count(seg->slot)) continue;
    if (!retire_segment(seg)) left_behind = true;
  }
  (void)env_->sync_dir(dir_);
  if (!left_behind) return;
  // The segments left behind keep their dead records and removal records,
  // as before: a later compaction or deletion weighs them, and keeps an
  // older record from outliving the removal record that guards it.
  std::unordered_set<uint64_t> stayed;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    for (const auto& [slot, seg] : slots_) stayed.insert(slot);
  }
  std::lock_guard<std::mutex> lock(dead_mu_);
  for (const auto& [id, d] : dead) {
    const uint64_t slot = file::location_slot(d.offset);
    if (!stayed.count(slot)) continue;
    dead_.emplace(id, d);
    dead_ids_by_slot_[slot].push_back(id);
  }
  for (const auto& [id, r] : removals) {
    if (!stayed.count(file::location_slot(r.loc.offset))) continue;
    removals_.emplace(id, r);
    live_record_bytes_.fetch_add(kPage);  // its segment's live bytes still count it
  }
  for (auto& [slot, u] : undurable)
    if (stayed.count(slot)) undurable_removals_[slot] = std::move(u);
}

}  // namespace cascade
