// FileTier: writing (puts, aliases, segments, flush). Reading is in
// file_tier_read.cc, opening in file_tier_open.cc, space management
// (compaction, holes, clear) in file_tier_space.cc. Design: file_tier.h.
#include "tiers/file/file_tier.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>

#include "cuda/device_copy.h"
#include "tiers/file/segment_scan.h"
#include "util/xxh3.h"

namespace cascade {

using file::AlignedBuffer;
using file::IoRequest;
using file::kPage;
using file::RecordHeader;
using file::Segment;

namespace {

constexpr uint64_t kStagingPiece = 8 << 20;  // largest staged write

// Copies bytes [from, from + len) of the record image
// [header][zeros][payload][zeros] into dst.
void fill_record(uint8_t* dst, uint64_t from, uint64_t len, const RecordHeader& h,
                 const uint8_t* payload) {
  const uint64_t size = h.payload_length;
  const uint64_t poff = file::payload_offset(size);
  const uint64_t end = from + len;
  const uint64_t ps = std::max(from, poff), pe = std::min(end, poff + size);
  if (ps < pe) {
    std::memcpy(dst + (ps - from), payload + (ps - poff), pe - ps);
    if (from < ps) std::memset(dst, 0, ps - from);
    if (pe < end) std::memset(dst + (pe - from), 0, end - pe);
  } else {
    std::memset(dst, 0, len);
  }
  if (from < file::kRecordHeaderSize) {
    uint64_t n = std::min<uint64_t>(file::kRecordHeaderSize, end) - from;
    std::memcpy(dst, reinterpret_cast<const uint8_t*>(&h) + from, n);
  }
}

Status with_context(const Status& st, const std::string& context) {
  return Status(st.code(), context + ": " + st.message());
}

}  // namespace

// ---- writing -------------------------------------------------------------------

std::unique_lock<std::mutex> FileTier::lock_lane(Lane** out) {
  // Threads spread over the lanes in the order they first write.
  static std::atomic<size_t> next_hint{0};
  thread_local const size_t hint = next_hint.fetch_add(1, std::memory_order_relaxed);
  const size_t n = lanes_.size();
  const size_t start = hint % n;
  for (size_t i = 0; i < n; ++i) {
    Lane& lane = *lanes_[(start + i) % n];
    std::unique_lock<std::mutex> lock(lane.mu, std::try_to_lock);
    if (lock.owns_lock()) {
      *out = &lane;
      return lock;
    }
  }
  *out = lanes_[start].get();
  return std::unique_lock<std::mutex>((*out)->mu);
}

Status FileTier::admit(uint64_t record_bytes, bool removal) {
  if (disk_full_.exchange(false)) (void)reclaim_space(record_bytes, /*disk_full=*/true);
  if (!put_limit_) {
    disk_bytes_.fetch_add(record_bytes);
    return Status::OK();
  }
  auto take = [&](uint64_t limit) {
    uint64_t cur = disk_bytes_.load();
    while (cur + record_bytes <= limit) {
      if (disk_bytes_.compare_exchange_weak(cur, cur + record_bytes)) return true;
    }
    return false;
  };
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (take(put_limit_)) return Status::OK();
    if (!reclaim_space(record_bytes, /*disk_full=*/false)) break;
  }
  // The reserve only once reclaiming found no room: compaction needs it.
  if (removal && take(capacity_)) return Status::OK();
  return Status::NoSpace("file tier is full: " + std::to_string(disk_bytes_.load()) + " of " +
                         std::to_string(capacity_) + " bytes on disk (" +
                         std::to_string(dead_bytes()) + " dead)");
}

Status FileTier::check_directory() const {
  const std::string lock = file::join_path(dir_, file::kLockFileName);
  auto info = env_->stat(lock);
  if (info.ok() && (lock_file_id_ == 0 || info->file_id == lock_file_id_)) return Status::OK();
  if (info.ok() || info.status().is(Code::kNotFound)) {
    return Status::IOError("the file tier directory " + dir_ +
                           " has lost the LOCK file this store holds: it was removed or replaced "
                           "while the store ran, so blocks written since are not on disk; "
                           "restart the store");
  }
  return with_context(info.status(), "cannot check the file tier directory " + dir_);
}

Result<FileTier::SegmentRef> FileTier::create_segment() {
  // Not into a directory made again in place of ours: its segments would
  // be under our key without the KEY file to read them by.
  CASCADE_RETURN_IF_ERROR(check_directory());
  uint64_t id;
  {
    std::unique_lock<std::shared_mutex> lock(table_mu_);
    id = next_segment_id_;
    while (slots_.count(file::slot_of_segment(id))) ++id;
    next_segment_id_ = id + 1;
  }
  std::string path = file::join_path(dir_, file::segment_file_name(id));
  FileOpenOptions o;
  o.write = o.create = true;
  o.exclusive = true;  // never append to a file we did not create
  o.no_follow = true;
  o.direct = direct_;
  o.mode = file_mode_;
  if (stripe_size_ || stripe_count_) {
    // Lustre: the layout is fixed when the file is created. Elsewhere (or
    // without the lfs tool) this is a no-op and the file is created plainly.
    if (env_->create_striped(path, stripe_size_, stripe_count_, file_mode_).ok())
      o.exclusive = false;
  }
  auto f = env_->open(path, o);
  if (!f.ok()) return with_context(f.status(), "cannot create a segment file in " + dir_);
  if (sync_writes_) {
    Status st = env_->sync_dir(dir_);
    if (!st.ok()) {
      f->reset();
      (void)env_->unlink(path);
      return st;
    }
  }
  auto seg = std::make_shared<Segment>(id, path, std::move(f.value()));
  std::unique_lock<std::shared_mutex> lock(table_mu_);
  slots_[seg->slot] = seg;
  return seg;
}

Status FileTier::seal_segment(Segment& seg, bool report) {
  seg.sealed.store(true);
  if (seg.bytes.load() == 0) {
    auto ref = [&]() -> SegmentRef {
      std::shared_lock<std::shared_mutex> lock(table_mu_);
      return segment_at(seg.slot);
    }();
    if (ref.get() == &seg) (void)retire_segment(ref);
    return Status::OK();
  }
  Status st = seg.file->sync();
  seg.unsynced.store(false);
  // No later flush syncs a sealed segment again: the next one says so.
  if (!st.ok()) {
    if (report) seal_sync_failed_.store(true);
    seg.sync_failed.store(true);
  }
  removals_synced(seg, st.ok() && !seg.sync_failed.load());
  // No summary into a directory made again in place of ours.
  if (st.ok() && check_directory().ok())
    (void)file::write_summary(env_, dir_, seg.id, key_, seg.headers, seg.alias_targets,
                              seg.bytes.load(),
                              /*sync=*/true, file_mode_);
  seg.headers = {};
  seg.alias_targets = {};
  return st;
}

void FileTier::give_up_segment(Lane& lane) {
  lane.active->sync_failed.store(true);
  (void)seal_segment(*lane.active, /*report=*/false);  // the caller reports the failure
  lane.active.reset();
}

Status FileTier::ensure_room(Lane& lane, uint64_t record_bytes) {
  if (lane.active && !lane.active->retired.load()) {
    uint64_t used = lane.active->bytes.load();
    if (used == 0 || used + record_bytes <= segment_bytes_) return Status::OK();
    // A segment whose fsync failed holds records no later sync covers: the
    // write that needed the room fails (a compaction then keeps its source).
    Status sealed = seal_segment(*lane.active);
    lane.active.reset();
    if (!sealed.ok()) return with_context(sealed, "file tier segment sync failed");
  }
  lane.active.reset();
  auto seg = create_segment();
  if (!seg.ok()) return seg.status();
  lane.active = std::move(seg.value());
  return Status::OK();
}

Status FileTier::write_record(Lane& lane, const BlockId& id, const void* data, uint64_t size,
                              uint16_t flags, Location* loc, SegmentRef* seg_out,
                              RecordHeader* header) {
  Segment& seg = *lane.active;
  const uint64_t off = seg.bytes.load();
  const uint64_t rec = file::record_size(size);
  const auto* payload = static_cast<const uint8_t*>(data);
  RecordHeader h =
      file::make_record_header(key_, id, size, file::payload_checksum(key_, data, size), flags,
                               next_sequence_.fetch_add(1), seg.id, off);
  AlignedBuffer& staging = lane.staging;
  IoRequest io;
  io.file = seg.file.get();
  io.write = true;
  io.offset = off;
  Status st;
  const bool direct = seg.file->direct();
  if (size > file::kInlinePayloadMax && (!direct || file::is_aligned(data))) {
    // Zero copy: header page from staging, payload from the caller.
    if (!staging.reserve(2 * kPage)) return Status::NoSpace("out of memory for a staging buffer");
    fill_record(staging.data(), 0, kPage, h, payload);
    io.add(staging.data(), kPage);
    if (!direct) {
      io.add(const_cast<uint8_t*>(payload), size);
      uint64_t pad = rec - kPage - size;
      if (pad) {
        std::memset(staging.data() + kPage, 0, pad);
        io.add(staging.data() + kPage, pad);
      }
    } else {
      uint64_t full = size & ~(kPage - 1);
      io.add(const_cast<uint8_t*>(payload), full);
      if (full < size) {
        fill_record(staging.data() + kPage, kPage + full, kPage, h, payload);
        io.add(staging.data() + kPage, kPage);
      }
    }
    IoRequest* one = &io;
    engine_->run({&one, 1});
    st = io.status;
  } else {
    // Staged: the record image in pieces of at most kStagingPiece.
    const uint64_t piece = std::min(rec, kStagingPiece);
    if (!staging.reserve(piece)) return Status::NoSpace("out of memory for a staging buffer");
    for (uint64_t pos = 0; pos < rec && st.ok(); pos += piece) {
      uint64_t n = std::min(piece, rec - pos);
      fill_record(staging.data(), pos, n, h, payload);
      io.iovcnt = 0;
      io.add(staging.data(), n);
      io.offset = off + pos;
      IoRequest* one = &io;
      engine_->run({&one, 1});
      st = io.status;
    }
  }
  if (st.ok() && sync_writes_) st = seg.file->sync();
  if (!st.ok()) {
    (void)seg.file->truncate(off);  // drop the partial record (and give back its blocks)
    if (!st.is(Code::kNoSpace) && off > 0) {
      // The next write would fail at the same offset (a file size limit,
      // a bad extent): the segment is sealed with what it holds, and the
      // lane's next record starts a new one. A write that failed at the
      // start of a segment would fail in a new one too (a disk refusing
      // every write), so that segment stays, empty, for the next try. A
      // full file system keeps the segment: the caller wins space back and
      // writes here again.
      (void)seal_segment(seg);
      lane.active.reset();
    }
    return with_context(st, "file tier write failed");
  }
  if (!sync_writes_) seg.unsynced.store(true);
  seg.headers.push_back(h);
  if (h.is_alias()) {
    BlockId target;
    std::memcpy(target.bytes.data(), data, 16);
    seg.alias_targets.push_back(target);
  }
  seg.bytes.store(off + rec);
  *loc = Location{file::encode_location(seg.slot, off), size};
  *seg_out = lane.active;
  *header = h;
  return Status::OK();
}

template <typename Publish>
Status FileTier::append(const BlockId& id, const void* data, uint64_t size, uint16_t flags,
                        Publish&& publish) {
  const uint64_t rec = file::record_size(size);
  for (int attempt = 0;; ++attempt) {
    CASCADE_RETURN_IF_ERROR(admit(rec, flags & file::kFlagRemoval));
    Lane* lane = nullptr;
    auto lock = lock_lane(&lane);
    Location loc;
    SegmentRef seg;
    RecordHeader h;
    Status st = ensure_room(*lane, rec);
    if (st.ok()) st = write_record(*lane, id, data, size, flags, &loc, &seg, &h);
    if (st.ok()) {
      seg->live_bytes.fetch_add(rec);
      live_record_bytes_.fetch_add(rec);
      // Published under the lane lock: the segment cannot be sealed (and so
      // compacted) before the record is known live.
      bool live = publish(loc, seg, h);
      lock.unlock();
      if (!live) {
        seg->live_bytes.fetch_sub(rec);
        live_record_bytes_.fetch_sub(rec);
        if (!h.is_removal()) note_dead(id, loc, &h);
      }
      return Status::OK();
    }
    lock.unlock();
    disk_bytes_.fetch_sub(rec);
    if (!st.is(Code::kNoSpace)) return st;
    // The file system is full: win space back in place, then try once more.
    if (attempt > 0 || !reclaim_space(rec, /*disk_full=*/true)) {
      disk_full_.store(true);
      file_system_full_.fetch_add(1, std::memory_order_relaxed);
      return st;
    }
  }
}

Status FileTier::put(const BlockId& id, const void* data, uint64_t size,
                     const PutOptions& options) {
  if (options.stored) *options.stored = false;
  std::lock_guard<std::mutex> one_at_a_time(id_stripe(id));
  if (index_.contains(id)) return Status::OK();
  const uint64_t rec = file::record_size(size);
  if (rec > file::kMaxSegmentBytes || (put_limit_ && rec > put_limit_))
    return Status::InvalidArgument("block of " + std::to_string(size) +
                                   " bytes cannot fit in the file tier");
  AlignedBuffer device_staging;
  if (options.src_kind != MemoryKind::kHost && size) {
    if (!device_staging.reserve(size))
      return Status::NoSpace("out of memory staging a device block");
    CASCADE_RETURN_IF_ERROR(device_copy(device_staging.data(), MemoryKind::kHost, data,
                                        options.src_kind, size, options.cuda_stream));
    data = device_staging.data();
  }
  bool inserted = false;
  CASCADE_RETURN_IF_ERROR(append(id, data, size, options.is_prefix ? file::kFlagPrefix : 0,
                                 [&](const Location& loc, const SegmentRef&, const RecordHeader&) {
                                   // false: a concurrent put of the id won; ours is a dead record
                                   inserted = index_.insert(id, loc, options.is_prefix);
                                   return inserted;
                                 }));
  if (inserted) {
    counters_.stored(options, size);
    (void)drop_alias(id);  // an alias of the id removed before: the block is newer
    removal_superseded(id);
  }
  if (options.stored) *options.stored = inserted;
  return Status::OK();
}

Status FileTier::remove_lasting(const BlockId& id) {
  std::lock_guard<std::mutex> one_at_a_time(id_stripe(id));
  Status st = remove(id);
  // An id that is not here may still have records on disk (evicted, which
  // is not written down): a reopen would find it again without a removal.
  if (st.is(Code::kNotFound) ? !records_left_on_disk(id) : !st.ok()) return st;
  if (!write_removal(id).ok()) {
    std::lock_guard<std::mutex> lock(unwritten_mu_);
    unwritten_removals_.insert(id);
  }
  return st;
}

Status FileTier::write_removal(const BlockId& id) {
  // The removal record outlives the records it removes while one of them
  // is on disk (removal_needed), as one a compaction writes does.
  std::vector<Location> unneeded;
  Status st =
      append(id, nullptr, 0, file::kFlagRemoval,
             [&](const Location& loc, const SegmentRef&, const RecordHeader& h) {
               std::lock_guard<std::mutex> lock(dead_mu_);
               // The removed record may have left the disk meanwhile (a
               // reclaim to make room for this one): then it guards nothing.
               if (!removal_needed(id, h.sequence)) return false;
               // Synced already with sync_writes; else at the segment's
               // next sync (removals_synced), and until then the older
               // removal records of the id stay live.
               removals_.emplace(id, RemovalEntry{loc, h.sequence, false});
               // Every record of the id on disk is older than it, and
               // covered by it once it is durable: until then a
               // compaction weighs them as if it were not there.
               UndurableRemoval u{id, h.sequence, {}};
               auto [b, e] = dead_.equal_range(id);
               for (auto d = b; d != e; ++d) {
                 u.covers.push_back(d->second.offset);
                 d->second.removal_written = true;
               }
               if (sync_writes_) removal_durable(u, &unneeded);
               else undurable_removals_[file::location_slot(loc.offset)].push_back(std::move(u));
               return true;
             });
  for (const Location& loc : unneeded) forget_record(loc);
  return st;
}

void FileTier::removal_superseded(const BlockId& id) {
  std::lock_guard<std::mutex> lock(unwritten_mu_);
  unwritten_removals_.erase(id);
}

Status FileTier::write_unwritten_removals() {
  std::vector<BlockId> ids;
  {
    std::lock_guard<std::mutex> lock(unwritten_mu_);
    ids.assign(unwritten_removals_.begin(), unwritten_removals_.end());
  }
  size_t failed = 0;
  Status first;
  for (const BlockId& id : ids) {
    std::lock_guard<std::mutex> one_at_a_time(id_stripe(id));
    {
      std::lock_guard<std::mutex> lock(unwritten_mu_);
      if (!unwritten_removals_.count(id)) continue;  // put again meanwhile
    }
    Status st = write_removal(id);
    if (!st.ok()) {
      if (failed++ == 0) first = st;
      continue;
    }
    std::lock_guard<std::mutex> lock(unwritten_mu_);
    unwritten_removals_.erase(id);
  }
  if (!failed) return Status::OK();
  return Status(first.code(), std::to_string(failed) + " of " + std::to_string(ids.size()) +
                                  " removals could not be written down: " + first.message());
}

Status FileTier::put_alias(const BlockId& alias, const BlockId& target) {
  if (alias == target) return Status::InvalidArgument("an alias cannot name itself");
  // Always a new record, also when the same pair is held already: the
  // record behind it may be on its way out (a compaction that found the
  // target gone drops it), and the caller asks because the pair must be on
  // disk now.
  if (!index_.contains(target))
    return Status::NotFound("alias target " + target.hex() + " is not in the file tier");
  std::lock_guard<std::mutex> one_at_a_time(id_stripe(alias));
  bool target_gone = false;
  Status st = append(
      alias, target.bytes.data(), 16, file::kFlagAlias,
      [&](const Location& loc, const SegmentRef&, const RecordHeader& h) {
        AliasEntry replaced;
        {
          std::lock_guard<std::mutex> lock(alias_mu_);
          // Evicted or removed since the check above: its aliases were
          // dropped (drop_aliases_of, under alias_mu_), and this one would
          // name nothing while counted live.
          if (!index_.contains(target)) {
            target_gone = true;
            return false;
          }
          auto [it, fresh] = aliases_.try_emplace(alias, AliasEntry{target, loc, h.sequence});
          if (fresh) {
            link_alias(alias, target);
            return true;
          }
          // Two writers of one alias: the larger sequence wins, as on reopen.
          if (it->second.sequence > h.sequence) return false;
          replaced = it->second;
          it->second = AliasEntry{target, loc, h.sequence};
          unlink_alias(alias, replaced.target);
          link_alias(alias, target);
        }
        forget_record(replaced.loc);
        note_dead_alias(alias, replaced);
        return true;
      });
  if (st.ok() && target_gone)
    return Status::NotFound("alias target " + target.hex() + " left the file tier");
  if (st.ok()) removal_superseded(alias);
  return st;
}

std::vector<std::pair<BlockId, BlockId>> FileTier::aliases() const {
  std::vector<std::pair<BlockId, BlockId>> out;
  std::lock_guard<std::mutex> lock(alias_mu_);
  for (const auto& [alias, e] : aliases_)
    if (index_.contains(e.target)) out.emplace_back(alias, e.target);
  return out;
}

uint64_t FileTier::identity_of(uint64_t nonce) const {
  // Keyed for any length (hash_with_secret): one value per directory key,
  // directory and open, so a copy of the directory (same key) is another
  // tier, and so is the directory once another store has opened it.
  struct stat st {};
  if (::stat(dir_.c_str(), &st) != 0) return 0;
  const uint64_t what[4] = {0x636173636164652dull, uint64_t(st.st_dev), uint64_t(st.st_ino), nonce};
  return xxh3::hash_with_secret(what, sizeof what, key_.secret(), file::kKeySecretBytes) | 1;
}

bool FileTier::drop_alias(const BlockId& alias) {
  {
    // Every put asks: most ids have no alias, and need no lock below.
    std::lock_guard<std::mutex> lock(alias_mu_);
    if (!aliases_.count(alias)) return false;
  }
  AliasEntry dropped;
  std::shared_lock<std::shared_mutex> not_while_deciding(removing_);
  {
    std::lock_guard<std::mutex> lock(alias_mu_);
    auto it = aliases_.find(alias);
    if (it == aliases_.end()) return false;
    dropped = it->second;
    aliases_.erase(it);
    unlink_alias(alias, dropped.target);
  }
  forget_record(dropped.loc);
  note_dead_alias(alias, dropped);
  return true;
}

void FileTier::unlink_alias(const BlockId& alias, const BlockId& target) {
  auto it = alias_targets_.find(target);
  if (it == alias_targets_.end()) return;
  it->second.erase(alias);
  if (it->second.empty()) alias_targets_.erase(it);
}

void FileTier::drop_aliases_of(const BlockId& target) {
  std::vector<std::pair<BlockId, AliasEntry>> dropped;
  {
    std::lock_guard<std::mutex> lock(alias_mu_);
    auto t = alias_targets_.find(target);
    if (t == alias_targets_.end() || index_.contains(target)) return;  // none, or it is back
    for (const BlockId& alias : t->second) {
      auto a = aliases_.find(alias);
      if (a == aliases_.end() || a->second.target != target) continue;
      dropped.emplace_back(a->first, a->second);
      aliases_.erase(a);
    }
    alias_targets_.erase(t);
  }
  for (const auto& [alias, entry] : dropped) {
    forget_record(entry.loc);
    note_dead_alias(alias, entry);
  }
}

void FileTier::forget_record(const Location& loc) {
  const uint64_t rec = file::record_size(loc.size);
  SegmentRef seg;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    seg = segment_at(file::location_slot(loc.offset));
  }
  if (seg) seg->live_bytes.fetch_sub(rec);
  live_record_bytes_.fetch_sub(rec);
}

void FileTier::for_each_block(const std::function<void(const BlockId&, uint64_t)>& fn) const {
  index_.for_each([&](const BlockId& id, const Location& loc, bool) { fn(id, loc.size); });
}

Status FileTier::flush() {
  // Written first, so this flush's syncs make them durable.
  Status result = write_unwritten_removals();
  auto flush_lane = [&](Lane& lane) {
    std::lock_guard<std::mutex> lock(lane.mu);
    if (lane.active && lane.active->unsynced.exchange(false)) {
      Status st = lane.active->file->sync();
      removals_synced(*lane.active, st.ok());
      if (!st.ok()) {
        // Linux drops the pages a failed fsync could not write, and a later
        // fsync succeeds without them: the segment takes no more records,
        // and its live ones are rewritten before a flush says OK again.
        if (result.ok()) result = st;
        give_up_segment(lane);
      }
    }
  };
  for (auto& lane : lanes_) flush_lane(*lane);
  {
    std::lock_guard<std::mutex> compacting(compact_mu_);
    flush_lane(*compaction_lane_);
  }
  Status st = env_->sync_dir(dir_);
  if (result.ok() && !st.ok()) result = st;
  // Synced records in a directory no longer there are not durable.
  st = check_directory();
  if (result.ok() && !st.ok()) result = st;
  // Segments whose fsync failed are rewritten (once the syncs work again),
  // whatever this flush reports: the next one can then say OK truthfully.
  Status rewritten = result.ok() ? rewrite_sync_failed() : Status::OK();
  if (result.ok() && seal_sync_failed_.exchange(false))
    result = Status::IOError(
        "a file tier segment failed its fsync when it was sealed: blocks put before this flush "
        "may not be durable");
  if (result.ok()) result = rewritten;
  return result;
}

}  // namespace cascade
