// FileTier: opening a directory (key, lock, loading segments, resolving
// duplicates) and closing. Design: file_tier.h.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <tuple>
#include <unordered_map>

#include "tiers/file/file_tier.h"
#include "tiers/file/segment_scan.h"
#include "tiers/file/store_key.h"

namespace cascade {

using file::AlignedBuffer;
using file::IoRequest;
using file::kPage;
using file::RecordHeader;
using file::Segment;

namespace {

constexpr uint64_t kMinSegmentBytes = 64 << 10;

// The size at which a segment is sealed: the configured one, and with a
// capacity at most the compaction reserve (a quarter of the capacity), so
// that the live records of any sealed segment fit beside what is on disk
// when it is compacted. A capacity of under four configured segments
// otherwise leaves segments that can never be compacted.
uint64_t segment_bytes_for(const CascadeConfig& config) {
  uint64_t seg = file::round_up_page(
      std::clamp<uint64_t>(config.segment_size_bytes, kMinSegmentBytes, file::kMaxSegmentBytes));
  if (config.file_capacity_bytes) {
    const uint64_t quarter = config.file_capacity_bytes / 4 / file::kPage * file::kPage;
    seg = std::min(seg, std::max(quarter, kMinSegmentBytes));
  }
  return seg;
}

// What puts may fill: the capacity less the compaction reserve (one
// segment, at most a quarter of the capacity).
uint64_t put_limit_for(const CascadeConfig& config) {
  if (!config.file_capacity_bytes) return 0;
  return config.file_capacity_bytes -
         std::min<uint64_t>(segment_bytes_for(config), config.file_capacity_bytes / 4);
}

// The directory's mode: file_mode plus search (x) wherever read is granted.
uint32_t directory_mode(uint32_t file_mode) { return file_mode | ((file_mode & 0444) >> 2); }

Status with_context(const Status& st, const std::string& context) {
  return Status(st.code(), context + ": " + st.message());
}

}  // namespace

Result<std::unique_ptr<Tier>> open_file_tier(const CascadeConfig& config, ThreadPool* pool,
                                             Env* env) {
  auto t = FileTier::Open(config, pool, env);
  if (!t.ok()) return t.status();
  return std::unique_ptr<Tier>(std::move(t.value()));
}

namespace {

// A relative directory is taken from the working directory at open: a
// process that changes its working directory later keeps its tier.
std::string absolute_dir(const std::string& path) {
  if (path.empty() || path.front() == '/') return path;
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(path, ec);
  return ec ? path : p.lexically_normal().string();
}

}  // namespace

FileTier::FileTier(const CascadeConfig& config, ThreadPool* pool, Env* env)
    : dir_(absolute_dir(config.file_path)),
      file_mode_(config.file_mode),
      env_(env),
      pool_(pool),
      capacity_(config.file_capacity_bytes),
      put_limit_(put_limit_for(config)),
      segment_bytes_(segment_bytes_for(config)),
      direct_(config.io_direct),
      sync_writes_(config.sync_writes),
      stripe_size_(config.file_stripe_size),
      stripe_count_(config.file_stripe_count),
      engine_kind_(config.file_io_engine),
      parallel_copy_threshold_(config.parallel_copy_threshold),
      read_pacer_(config.file_read_bytes_per_s),
      index_(config.index_shards, config.eviction_policy,
             [this](const BlockId& id, const Location& loc) { on_reclaim(id, loc); }) {
  int lanes = std::clamp(pool ? pool->size() : 1, 1, 8);
  for (int i = 0; i < lanes; ++i) lanes_.push_back(std::make_unique<Lane>());
  compaction_lane_ = std::make_unique<Lane>();
}

Result<std::unique_ptr<FileTier>> FileTier::Open(const CascadeConfig& config, ThreadPool* pool,
                                                 Env* env) {
  auto t0 = std::chrono::steady_clock::now();
  if (config.file_path.empty())
    return Status::InvalidArgument("the file tier needs a directory: set file_path");
  // Four of the smallest segments: a quarter of the capacity, the
  // compaction reserve, holds a sealed segment's live records.
  if (config.file_capacity_bytes && config.file_capacity_bytes < 4 * kMinSegmentBytes)
    return Status::InvalidArgument(
        "file_capacity_bytes must be 0 (unbounded) or at least 256 KiB (four segments of the "
        "smallest size)");
  if ((config.file_mode & ~0777u) || (config.file_mode & 0600u) != 0600u)
    return Status::InvalidArgument(
        "file_mode must be permission bits (at most 0777) with 0600 set");
  if (!env) env = Env::Default();
  std::unique_ptr<FileTier> tier(new FileTier(config, pool, env));
  const std::string& dir = tier->dir_;

  Status st = env->create_dirs(dir, directory_mode(tier->file_mode_));
  if (!st.ok()) return with_context(st, "cannot create the file tier directory " + dir);
  auto lock = env->lock_file(file::join_path(dir, file::kLockFileName), tier->file_mode_);
  if (!lock.ok()) {
    if (lock.status().is(Code::kBusy))
      return Status::Busy("the file tier directory " + dir +
                          " is in use by another store (its LOCK file is locked); "
                          "two stores cannot share one directory");
    return with_context(lock.status(), "the file tier directory " + dir + " is not writable");
  }
  tier->dir_lock_ = std::move(lock.value());
  // The LOCK file this store holds, to tell it from one made in its place.
  auto lock_info = env->stat(file::join_path(dir, file::kLockFileName));
  if (lock_info.ok()) tier->lock_file_id_ = lock_info->file_id;
  auto key =
      file::load_store_key(env, dir, tier->file_mode_, /*create=*/true, /*check_owner=*/true);
  if (!key.ok())
    return with_context(key.status(), "the file tier directory " + dir + " has no usable key");
  tier->key_ = key.value();
  tier->nonces_ = file::advance_open_nonce(env, dir, tier->file_mode_, tier->key_);

  if (config.file_io_engine == FileIoEngine::kIoUring) {
    auto e = file::make_uring_engine(64);
    if (!e.ok()) return e.status();
    tier->engine_ = std::move(e.value());
  } else {
    tier->engine_ = file::make_psync_engine(pool);
  }

  tier->loading_.store(true);
  st = tier->load_directory();
  tier->loading_.store(false);
  if (!st.ok()) return st;
  tier->recovery_.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return tier;
}

struct FileTier::Loaded {
  uint64_t id = 0;
  bool has_summary = false;
  std::unique_ptr<File> file;
  uint64_t file_bytes = 0;
  file::SegmentScan scan;
  bool scanned = false;
  // Scanned (no summary: its store was killed) and its fsync here failed:
  // what it holds may not be on disk, so its removal records supersede none.
  bool unsure = false;
  Status status;
  SegmentRef seg;  // set once the segment is in the table
};

Status FileTier::load_directory() {
  auto names = env_->list_dir(dir_);
  if (!names.ok()) return with_context(names.status(), "cannot list the file tier directory");
  std::map<uint64_t, std::pair<bool, bool>> found;  // id -> (segment, summary)
  for (const auto& name : *names) {
    uint64_t id = 0;
    switch (file::classify_dir_entry(name, &id)) {
      case file::DirEntryKind::kTemporary:
        (void)env_->unlink(file::join_path(dir_, name));  // an interrupted summary or key write
        break;
      case file::DirEntryKind::kSegment: found[id].first = true; break;
      case file::DirEntryKind::kSummary: found[id].second = true; break;
      case file::DirEntryKind::kOther: break;
    }
  }
  std::vector<Loaded> loaded;
  for (auto& [id, what] : found) {
    if (!what.first) {  // a summary whose segment was deleted (compaction cut short)
      (void)env_->unlink(file::join_path(dir_, file::summary_file_name(id)));
      continue;
    }
    Loaded l;
    l.id = id;
    l.has_summary = what.second;
    loaded.push_back(std::move(l));
  }
  auto load_one = [&](size_t i) {
    Loaded& l = loaded[i];
    FileOpenOptions o;
    o.direct = direct_;
    o.no_follow = true;
    auto f = env_->open(file::join_path(dir_, file::segment_file_name(l.id)), o);
    if (!f.ok()) {
      l.status = f.status();
      return;
    }
    l.file = std::move(f.value());
    auto size = l.file->size();
    if (!size.ok()) {
      l.status = size.status();
      return;
    }
    l.file_bytes = *size;
    if (l.has_summary) {
      auto s = file::read_summary(env_, dir_, l.id, key_);
      if (s.ok() && s->file_bytes <= l.file_bytes) {
        l.scan = std::move(s.value());
        l.scan.first_header = file::HeaderCheck::kValid;
        return;
      }
    }
    auto s = file::scan_segment(l.file.get(), l.id, key_, /*verify_payloads=*/true);
    if (!s.ok()) {
      l.status = s.status();
      return;
    }
    l.scan = std::move(s.value());
    l.scanned = true;
  };
  if (pool_ && loaded.size() > 1) {
    pool_->parallel_for(loaded.size(), load_one, pool_->size());
  } else {
    for (size_t i = 0; i < loaded.size(); ++i) load_one(i);
  }

  uint64_t max_id = 0;
  for (Loaded& l : loaded) {
    max_id = std::max(max_id, l.id);
    if (!l.status.ok()) {
      // Unreadable: leave the file alone, serve nothing from it.
      ++recovery_.corrupt_records;
      unread_segments_ = true;
      continue;
    }
    std::string path = file::join_path(dir_, file::segment_file_name(l.id));
    if (l.scanned) {
      const file::HeaderCheck first = l.scan.first_header;
      if (first != file::HeaderCheck::kValid && first != file::HeaderCheck::kZero) {
        // Not this directory's: another format or key. Never indexed, never deleted.
        ++recovery_.foreign_segments;
        continue;
      }
      ++recovery_.segments_scanned;
      recovery_.corrupt_records += l.scan.corrupt_records;
      recovery_.tail_bytes += l.scan.tail_bytes;
      if (l.scan.records.empty()) {
        if (l.scan.corrupt_records) continue;  // damaged: keep the bytes, serve nothing
        ++recovery_.segments_removed;          // nothing (or only a torn record) written
        l.file.reset();
        (void)env_->unlink(path);
        (void)env_->unlink(file::join_path(dir_, file::summary_file_name(l.id)));
        continue;
      }
      // Seal it: it is never appended to again, and the next open is fast.
      // Its bytes first: a killed store's last writes may be in the page
      // cache alone, and a summary must not outlive them; nor may a removal
      // record in it stand alone for its id (index_loaded).
      if (l.file->sync().ok()) {
        (void)file::write_summary(env_, dir_, l.id, key_, l.scan.records, l.scan.alias_targets,
                                  l.scan.end,
                                  /*sync=*/true, file_mode_);
      } else {
        l.unsure = true;
      }
    } else {
      ++recovery_.segments_from_summary;
    }
    ++recovery_.segments;
    auto seg = std::make_shared<Segment>(l.id, path, std::move(l.file));
    seg->bytes.store(l.file_bytes);
    seg->sealed.store(true);
    {
      std::unique_lock<std::shared_mutex> lock(table_mu_);
      if (slots_.count(seg->slot)) continue;  // ids 2^20 apart: cannot index both
      slots_[seg->slot] = seg;
    }
    disk_bytes_.fetch_add(l.file_bytes);
    l.seg = std::move(seg);
  }
  index_loaded(loaded);
  corrupt_blocks_.fetch_add(recovery_.corrupt_records);
  next_segment_id_ = max_id + 1;
  return Status::OK();
}

// Indexes the records of the loaded segments. Where an id has several
// records, the newest write wins: the largest (sequence, segment id, offset).
void FileTier::index_loaded(std::vector<Loaded>& loaded) {
  struct Ref {
    uint64_t sequence, segment_id, offset;
    bool newer_than(const Ref& o) const {
      return std::tie(sequence, segment_id, offset) > std::tie(o.sequence, o.segment_id, o.offset);
    }
  };
  std::unordered_map<uint64_t, const Loaded*> by_slot;
  for (const Loaded& l : loaded)
    if (l.seg) by_slot[l.seg->slot] = &l;
  // The record an index location points at (a binary search in its segment).
  auto record_at = [&](const Location& loc) -> const RecordHeader* {
    auto it = by_slot.find(file::location_slot(loc.offset));
    if (it == by_slot.end()) return nullptr;
    const auto& recs = it->second->scan.records;
    uint64_t off = file::location_record_offset(loc.offset);
    auto r = std::lower_bound(recs.begin(), recs.end(), off, [](const RecordHeader& h, uint64_t o) {
      return h.record_offset < o;
    });
    return r != recs.end() && r->record_offset == off ? &*r : nullptr;
  };
  struct AliasCandidate {
    Ref ref;
    BlockId target;
    Location loc;
    const RecordHeader* header;
  };
  std::unordered_map<BlockId, AliasCandidate> alias_candidates;
  struct RemovalCandidate {
    Ref ref;
    Location loc;
    Segment* seg;
    bool unsure;  // its segment's fsync failed here (Loaded::unsure)
  };
  std::unordered_map<BlockId, std::vector<RemovalCandidate>> removal_candidates;
  uint64_t max_sequence = 0;
  for (Loaded& l : loaded) {
    if (!l.seg) continue;
    Segment& seg = *l.seg;
    size_t alias_index = 0;
    for (const RecordHeader& h : l.scan.records) {
      ++recovery_.records;
      max_sequence = std::max(max_sequence, h.sequence);
      const uint64_t rec = file::record_size(h.payload_length);
      Location loc{file::encode_location(seg.slot, h.record_offset), h.payload_length};
      Ref ref{h.sequence, seg.id, h.record_offset};
      if (h.is_removal()) {
        removal_candidates[h.id()].push_back({ref, loc, &seg, l.unsure});
        continue;
      }
      if (h.is_alias()) {
        AliasCandidate c{ref, l.scan.alias_targets[alias_index++], loc, &h};
        auto [it, fresh] = alias_candidates.emplace(h.id(), c);
        if (!fresh) {
          ++recovery_.duplicate_records;
          if (!ref.newer_than(it->second.ref)) {
            note_dead(h.id(), loc, &h);
            continue;
          }
          note_dead(h.id(), it->second.loc, it->second.header);
          it->second = c;
        }
        continue;
      }
      // Live bytes are counted as records are indexed, so that a remove()
      // below (on_reclaim) takes them off again.
      seg.live_bytes.fetch_add(rec);
      live_record_bytes_.fetch_add(rec);
      if (index_.insert(h.id(), loc, h.is_prefix())) continue;
      ++recovery_.duplicate_records;
      auto cur = index_.peek(h.id());
      const RecordHeader* old = cur ? record_at(*cur) : nullptr;
      bool newer =
          !old || ref.newer_than(Ref{old->sequence, by_slot[file::location_slot(cur->offset)]->id,
                                     old->record_offset});
      if (!newer) {
        seg.live_bytes.fetch_sub(rec);
        live_record_bytes_.fetch_sub(rec);
        note_dead(h.id(), loc, &h);
        continue;
      }
      if (old && old->is_prefix() == h.is_prefix() && index_.relocate(h.id(), *cur, loc)) {
        forget_record(*cur);
        note_dead(h.id(), *cur, old);
      } else {
        (void)index_.remove(h.id());  // on_reclaim forgets the old record
        (void)index_.insert(h.id(), loc, h.is_prefix());
      }
    }
  }
  // An id with both a block record and an alias record (removed under one
  // kind, put again as the other): the newer record wins, as between two
  // records of one kind.
  for (auto it = alias_candidates.begin(); it != alias_candidates.end();) {
    auto cur = index_.peek(it->first);
    const RecordHeader* block = cur ? record_at(*cur) : nullptr;
    if (!cur) {
      ++it;
      continue;
    }
    ++recovery_.duplicate_records;
    const Ref block_ref = block
                              ? Ref{block->sequence, by_slot[file::location_slot(cur->offset)]->id,
                                    block->record_offset}
                              : Ref{0, 0, 0};
    if (it->second.ref.newer_than(block_ref)) {
      (void)index_.remove(it->first);  // on_reclaim forgets the block's record
      ++it;
    } else {
      note_dead(it->first, it->second.loc, it->second.header);
      it = alias_candidates.erase(it);
    }
  }
  // Removal records: the newest one of an id at least as new as its block
  // or alias record removes it. A removal record stays live while a dead
  // record of its id older than it is on disk.
  for (auto& [id, found] : removal_candidates) {
    const RemovalCandidate* newest = &found[0];
    for (const RemovalCandidate& r : found)
      if (r.ref.newer_than(newest->ref)) newest = &r;
    if (auto cur = index_.peek(id)) {
      const RecordHeader* block = record_at(*cur);
      if (!block || block->sequence <= newest->ref.sequence)
        (void)index_.remove(id);  // on_reclaim forgets the block's record
    }
    auto alias = alias_candidates.find(id);
    if (alias != alias_candidates.end() && alias->second.ref.sequence <= newest->ref.sequence) {
      note_dead(id, alias->second.loc, alias->second.header);
      alias_candidates.erase(alias);
    }
  }
  for (auto& [id, found] : removal_candidates) {
    // The newest removal record of an id, on disk, removes everything older
    // than itself: the older ones (and copies of it left by an interrupted
    // compaction) guard nothing more and are dead. Unless it is in a
    // segment whose fsync failed here: then the next durable one is kept
    // live too, and so on (copies of one record count once).
    std::sort(found.begin(), found.end(), [](const RemovalCandidate& a, const RemovalCandidate& b) {
      return a.ref.newer_than(b.ref);
    });
    uint64_t kept_sequence = UINT64_MAX;
    for (const RemovalCandidate& r : found) {
      {
        std::lock_guard<std::mutex> lock(dead_mu_);
        if (r.ref.sequence == kept_sequence || !removal_needed(id, r.ref.sequence)) continue;
        removals_.emplace(id, RemovalEntry{r.loc, r.ref.sequence, !r.unsure});
        if (!r.unsure) {
          auto [b, e] = dead_.equal_range(id);
          for (auto d = b; d != e; ++d)
            if (d->second.state == kKnown && d->second.sequence < r.ref.sequence)
              d->second.covered = true;
        }
      }
      kept_sequence = r.ref.sequence;
      r.seg->live_bytes.fetch_add(kPage);
      live_record_bytes_.fetch_add(kPage);
      ++recovery_.removals;
      if (!r.unsure) break;
    }
  }
  // Aliases: the newest record of each alias, kept while its target is here.
  for (auto& [alias, c] : alias_candidates) {
    if (!index_.contains(c.target)) {
      note_dead(alias, c.loc, c.header);
      continue;
    }
    aliases_[alias] = AliasEntry{c.target, c.loc, c.ref.sequence};
    link_alias(alias, c.target);
    by_slot[file::location_slot(c.loc.offset)]->seg->live_bytes.fetch_add(
        file::record_size(c.loc.size));
    live_record_bytes_.fetch_add(file::record_size(c.loc.size));
    ++recovery_.aliases;
  }
  // With a segment file unread, its records' sequences are unknown: new
  // ones start far above any a run of the store could have written, so that
  // a removal record in it never outranks a later put.
  next_sequence_.store(max_sequence + 1 + (unread_segments_ ? uint64_t{1} << 40 : 0));
  for (Loaded& l : loaded) {
    l.scan.records = {};
    l.scan.alias_targets = {};
  }
}

FileTier::~FileTier() {
  {
    std::unique_lock<std::mutex> lock(background_mu_);
    closing_ = true;
    background_cv_.wait(lock, [this] { return !background_running_; });
  }
  std::lock_guard<std::mutex> compacting(compact_mu_);
  auto seal_lane = [this](Lane& lane) {
    std::lock_guard<std::mutex> lock(lane.mu);
    if (lane.active) (void)seal_segment(*lane.active);
    lane.active.reset();
  };
  for (auto& lane : lanes_) seal_lane(*lane);
  seal_lane(*compaction_lane_);
}

}  // namespace cascade
