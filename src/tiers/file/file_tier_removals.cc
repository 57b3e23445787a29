// FileTier: dead records and removal records. Design: file_tier.h
// ("Removal records") and docs/design.md.
#include <algorithm>
#include <cstring>

#include "tiers/file/file_tier.h"

namespace cascade {

using file::AlignedBuffer;
using file::IoRequest;
using file::kPage;
using file::RecordHeader;
using file::Segment;

void FileTier::note_dead(const BlockId& id, const Location& loc, const RecordHeader* h) {
  SegmentRef seg;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    seg = segment_at(file::location_slot(loc.offset));
  }
  // A record of a segment already gone (a reclaim that a lease delayed
  // past a compaction) is on no disk: nothing to weigh.
  if (!seg) return;
  DeadRecord d;
  d.offset = loc.offset;
  d.size = loc.size;
  if (h) {
    d.sequence = h->sequence;
    d.content = file::record_content(*h);
    d.state = kKnown;
  }
  std::lock_guard<std::mutex> lock(dead_mu_);
  // Checked under dead_mu_: a retire sets the flag before it forgets the
  // segment's dead records under dead_mu_, so no entry outlives it.
  if (seg->retired.load()) return;
  auto [b, e] = dead_.equal_range(id);
  for (auto it = b; it != e; ++it) {
    if (it->second.offset != d.offset) continue;
    if (it->second.state == kUnread) {  // noted before (a remove, then its reclaim)
      d.covered = it->second.covered;
      d.removal_written = it->second.removal_written;
      it->second = d;
    }
    return;
  }
  dead_.emplace(id, d);
  dead_ids_by_slot_[file::location_slot(loc.offset)].push_back(id);
}

void FileTier::note_dead_alias(const BlockId& alias, const AliasEntry& e) {
  // The alias record's header as written (record_content needs the kind,
  // length and payload checksum only).
  RecordHeader h{};
  h.flags = file::kFlagAlias;
  h.payload_length = 16;
  h.payload_xxh3 = file::payload_checksum(key_, e.target.bytes.data(), 16);
  h.sequence = e.sequence;
  note_dead(alias, e.loc, &h);
}

bool FileTier::records_left_on_disk(const BlockId& id) const {
  // Records this tier knows of only: a segment not read at open may hold
  // some too, but every remove of an absent id would then write a record
  // that stays for good.
  std::lock_guard<std::mutex> lock(dead_mu_);
  auto [b, e] = dead_.equal_range(id);
  for (auto it = b; it != e; ++it) {
    const DeadRecord& d = it->second;
    if (d.state != kUnusable && !d.covered && !d.removal_written) return true;
  }
  return false;
}

bool FileTier::removal_needed(const BlockId& id, uint64_t sequence) const {
  // A segment file that could not be read at open may hold older records.
  if (unread_segments_) return true;
  auto [b, e] = dead_.equal_range(id);
  for (auto it = b; it != e; ++it) {
    const DeadRecord& d = it->second;
    if (d.state == kUnusable) continue;
    if (d.state == kUnread || d.sequence < sequence) return true;
  }
  return false;
}

void FileTier::supersede_removals(const BlockId& id, uint64_t sequence,
                                  std::vector<Location>* unneeded) {
  auto [b, e] = removals_.equal_range(id);
  for (auto r = b; r != e;) {
    if (r->second.sequence < sequence) {
      unneeded->push_back(r->second.loc);
      r = removals_.erase(r);
    } else {
      ++r;
    }
  }
}

void FileTier::removals_synced(const Segment& seg, bool ok) {
  std::vector<Location> unneeded;
  {
    std::lock_guard<std::mutex> lock(dead_mu_);
    auto it = undurable_removals_.find(seg.slot);
    if (it == undurable_removals_.end()) return;
    std::vector<UndurableRemoval> pending = std::move(it->second);
    undurable_removals_.erase(it);
    if (!ok) return;  // they stay live (while needed), superseding nothing
    for (const UndurableRemoval& u : pending) removal_durable(u, &unneeded);
  }
  for (const Location& loc : unneeded) forget_record(loc);
}

void FileTier::removal_durable(const UndurableRemoval& u, std::vector<Location>* unneeded) {
  bool here = false;
  auto [b, e] = removals_.equal_range(u.id);
  for (auto r = b; r != e; ++r) {
    if (r->second.sequence != u.sequence || r->second.durable) continue;
    r->second.durable = true;
    here = true;
  }
  if (!here) return;  // superseded or no longer needed meanwhile
  supersede_removals(u.id, u.sequence, unneeded);
  auto [db, de] = dead_.equal_range(u.id);
  for (auto d = db; d != de; ++d)
    if (std::find(u.covers.begin(), u.covers.end(), d->second.offset) != u.covers.end())
      d->second.covered = true;
}

std::vector<BlockId> FileTier::contested_ids(const Segment& seg) const {
  std::vector<BlockId> out;
  std::lock_guard<std::mutex> lock(dead_mu_);
  auto it = dead_ids_by_slot_.find(seg.slot);
  if (it == dead_ids_by_slot_.end()) return out;
  std::vector<BlockId> ids = it->second;
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (const BlockId& id : ids) {
    // Two dead records in seg count too: holes may take one and not the other.
    size_t here = 0;
    bool elsewhere = removals_.count(id) != 0;
    auto [b, e] = dead_.equal_range(id);
    for (auto d = b; d != e; ++d) {
      if (file::location_slot(d->second.offset) != seg.slot) elsewhere = true;
      else if (!d->second.covered) ++here;
    }
    if (here && (elsewhere || here > 1)) out.push_back(id);
  }
  return out;
}

// The header of a dead record, read from its segment. kUnusable when the
// record is no longer what it was (a hole, damage, its segment gone): no
// reopen would serve it either, as every read verifies the header.
Result<FileTier::DeadRecord> FileTier::read_dead_header(const BlockId& id, DeadRecord d) const {
  if (d.state != kUnread) return d;
  SegmentRef seg;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    seg = segment_at(file::location_slot(d.offset));
  }
  d.state = kUnusable;
  if (!seg) return d;
  AlignedBuffer page;
  if (!page.reserve(kPage)) return Status::NoSpace("out of memory reading a record header");
  const uint64_t off = file::location_record_offset(d.offset);
  IoRequest io;
  io.file = seg->file.get();
  io.offset = off;
  io.add(page.data(), kPage);
  IoRequest* one = &io;
  engine_->run({&one, 1});
  if (!io.status.ok()) {
    if (io.status.is(Code::kCorruption)) return d;  // the file ends before it
    return io.status;
  }
  RecordHeader h;
  std::memcpy(&h, page.data(), sizeof(h));
  if (file::check_record_header(key_, page.data(), seg->id, off) != file::HeaderCheck::kValid ||
      h.id() != id || h.is_hole() || h.is_removal() || h.payload_length != d.size)
    return d;
  d.state = kKnown;
  d.sequence = h.sequence;
  d.content = file::record_content(h);
  return d;
}

// For each contested id that is not live: the newest of its records on disk
// (dead ones and removal records) and the newest that stays once seg is
// gone. A removal record is needed when the newest is one of seg's and what
// stays is a record with other content.
Status FileTier::plan_removals(const Segment& seg, const std::vector<BlockId>& ids,
                               std::vector<PlannedRemoval>* out) {
  out->clear();
  if (ids.empty()) return Status::OK();
  // Every put that took its sequence before now has published its record:
  // its lane lock is held from the sequence to the index insert. A record
  // of an id live from here on is newer than any removal record planned.
  for (auto& lane : lanes_) std::lock_guard<std::mutex> wait_for_writer(lane->mu);
  for (const BlockId& id : ids) {
    if (index_.contains(id)) continue;
    {
      std::lock_guard<std::mutex> lock(alias_mu_);
      if (aliases_.count(id)) continue;
    }
    std::vector<DeadRecord> records;
    std::vector<RemovalEntry> removals;
    {
      std::lock_guard<std::mutex> lock(dead_mu_);
      auto [b, e] = dead_.equal_range(id);
      for (auto d = b; d != e; ++d) records.push_back(d->second);
      // Only durable removal records guard the id: one a power loss could
      // take must not stand for the record that this drop takes.
      auto [rb, re] = removals_.equal_range(id);
      for (auto r = rb; r != re; ++r)
        if (r->second.durable) removals.push_back(r->second);
    }
    for (DeadRecord& d : records) {
      auto read = read_dead_header(id, d);
      if (!read.ok()) return read.status();
      if (d.state == kUnread) {
        d = *read;
        std::lock_guard<std::mutex> lock(dead_mu_);
        auto [b, e] = dead_.equal_range(id);
        for (auto it = b; it != e; ++it)
          if (it->second.offset == d.offset && it->second.state == kUnread) it->second = d;
      }
    }
    const DeadRecord* dropped = nullptr;  // the newest of seg's
    const DeadRecord* stays = nullptr;    // the newest elsewhere
    for (const DeadRecord& d : records) {
      if (d.state != kKnown) continue;
      const DeadRecord*& slot = file::location_slot(d.offset) == seg.slot ? dropped : stays;
      if (!slot || d.sequence > slot->sequence) slot = &d;
    }
    if (!dropped) continue;
    // What a reopen finds once seg is gone: nothing, a removal record (the
    // id stays removed), or the newest record that stays.
    if (!removals.empty()) {
      uint64_t newest_removal = 0;
      for (const RemovalEntry& r : removals) newest_removal = std::max(newest_removal, r.sequence);
      if (!stays || newest_removal >= stays->sequence) continue;
    }
    if (!stays || stays->sequence > dropped->sequence || stays->content == dropped->content)
      continue;
    out->push_back(PlannedRemoval{id, dropped->sequence});
  }
  return Status::OK();
}

Status FileTier::write_removals(Lane& lane, const std::vector<PlannedRemoval>& plan,
                                std::vector<WrittenRemoval>* written) {
  if (plan.empty()) return Status::OK();
  AlignedBuffer page;
  if (!page.reserve(kPage)) return Status::NoSpace("out of memory writing a removal record");
  for (const PlannedRemoval& p : plan) {
    CASCADE_RETURN_IF_ERROR(ensure_room(lane, kPage));
    Segment& dest = *lane.active;
    const uint64_t off = dest.bytes.load();
    RecordHeader h = file::make_removal_header(key_, p.id, p.sequence, dest.id, off);
    std::memset(page.data(), 0, kPage);
    std::memcpy(page.data(), &h, sizeof(h));
    IoRequest io;
    io.file = dest.file.get();
    io.write = true;
    io.offset = off;
    io.add(page.data(), kPage);
    IoRequest* one = &io;
    disk_bytes_.fetch_add(kPage);
    engine_->run({&one, 1});
    if (!io.status.ok()) {
      disk_bytes_.fetch_sub(kPage);
      (void)dest.file->truncate(off);
      if (io.status.is(Code::kNoSpace)) disk_full_.store(true);
      return io.status;
    }
    dest.headers.push_back(h);
    dest.bytes.store(off + kPage);
    dest.unsynced.store(true);
    written->push_back(WrittenRemoval{
        p.id, RemovalEntry{Location{file::encode_location(dest.slot, off), 0}, p.sequence},
        lane.active});
  }
  return Status::OK();
}

void FileTier::keep_removals(const std::vector<WrittenRemoval>& written) {
  std::vector<Location> unneeded;
  for (const WrittenRemoval& w : written) {
    w.seg->live_bytes.fetch_add(kPage);
    live_record_bytes_.fetch_add(kPage);
    std::lock_guard<std::mutex> lock(dead_mu_);
    supersede_removals(w.id, w.entry.sequence, &unneeded);  // written and synced
    removals_.emplace(w.id, w.entry);
  }
  for (const Location& loc : unneeded) forget_record(loc);
}

Status FileTier::sync_compaction_lane(Lane& lane) {
  if (!lane.active || !lane.active->unsynced.exchange(false)) return Status::OK();
  Status st = lane.active->file->sync();
  if (!st.ok()) {
    // What the failed fsync should have written may never reach the disk
    // (and a scan stops at the first lost page): the compaction fails, and
    // the segment takes no more copies.
    give_up_segment(lane);
    return st;
  }
  st = env_->sync_dir(dir_);
  if (!st.ok()) lane.active->unsynced.store(true);
  return st;
}

void FileTier::forget_dead_in(const Segment& seg) {
  std::vector<Location> unneeded;
  {
    std::lock_guard<std::mutex> lock(dead_mu_);
    undurable_removals_.erase(seg.slot);  // none once sealed; the slot may be reused
    auto it = dead_ids_by_slot_.find(seg.slot);
    if (it == dead_ids_by_slot_.end()) return;
    std::vector<BlockId> ids = std::move(it->second);
    dead_ids_by_slot_.erase(it);
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    for (const BlockId& id : ids) {
      auto [b, e] = dead_.equal_range(id);
      for (auto d = b; d != e;) {
        if (file::location_slot(d->second.offset) == seg.slot) d = dead_.erase(d);
        else ++d;
      }
      auto [rb, re] = removals_.equal_range(id);
      for (auto r = rb; r != re;) {
        if (!removal_needed(id, r->second.sequence)) {
          unneeded.push_back(r->second.loc);
          r = removals_.erase(r);
        } else {
          ++r;
        }
      }
    }
  }
  for (const Location& loc : unneeded) forget_record(loc);
}

}  // namespace cascade
