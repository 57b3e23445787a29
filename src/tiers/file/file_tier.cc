// FileTier: opening, writing and reading. Space management (compaction,
// clear) is in file_tier_space.cc. Design: file_tier.h.
#include "tiers/file/file_tier.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "port/device_copy.h"
#include "tiers/file/segment_scan.h"

namespace cascade {

using file::AlignedBuffer;
using file::IoRequest;
using file::kPage;
using file::RecordHeader;
using file::Segment;

namespace {

constexpr uint64_t kMinSegmentBytes = 64 << 10;
constexpr uint64_t kStagingPiece = 8 << 20;     // largest staged write
constexpr size_t kKeepBounceBytes = 64 << 20;   // larger per-thread bounce buffers are freed

// Copies bytes [from, from + len) of the record image
// [header][zeros][payload][zeros] into dst.
void fill_record(uint8_t* dst, uint64_t from, uint64_t len, const RecordHeader& h, const uint8_t* payload) {
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

AlignedBuffer& thread_bounce() {
  thread_local AlignedBuffer buf;
  return buf;
}

}  // namespace

Result<std::unique_ptr<Tier>> open_file_tier(const CascadeConfig& config, ThreadPool* pool, Env* env) {
  auto t = FileTier::Open(config, pool, env);
  if (!t.ok()) return t.status();
  return std::unique_ptr<Tier>(std::move(t.value()));
}

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

FileTier::FileTier(const CascadeConfig& config, ThreadPool* pool, Env* env)
    : dir_(config.lustre_path),
      env_(env),
      pool_(pool),
      capacity_(config.file_capacity_bytes),
      put_limit_(config.file_capacity_bytes
                     ? config.file_capacity_bytes -
                           std::min<uint64_t>(
                               file::round_up_page(std::clamp<uint64_t>(config.segment_size_bytes,
                                                                        kMinSegmentBytes,
                                                                        file::kMaxSegmentBytes)),
                               config.file_capacity_bytes / 4)
                     : 0),
      segment_bytes_(file::round_up_page(
          std::clamp<uint64_t>(config.segment_size_bytes, kMinSegmentBytes, file::kMaxSegmentBytes))),
      direct_(config.io_direct),
      sync_writes_(config.sync_writes),
      stripe_size_(config.lustre_stripe_size),
      stripe_count_(config.lustre_stripe_count),
      engine_kind_(config.file_io_engine),
      parallel_copy_threshold_(config.parallel_copy_threshold),
      index_(config.index_shards, config.eviction_policy,
             [this](const BlockId&, const Location& loc) { on_reclaim(loc); }) {
  int lanes = std::clamp(pool ? pool->size() : 1, 1, 8);
  for (int i = 0; i < lanes; ++i) lanes_.push_back(std::make_unique<Lane>());
  compaction_lane_ = std::make_unique<Lane>();
}

Result<std::unique_ptr<FileTier>> FileTier::Open(const CascadeConfig& config, ThreadPool* pool, Env* env) {
  auto t0 = std::chrono::steady_clock::now();
  if (config.lustre_path.empty())
    return Status::InvalidArgument("the file tier needs a directory: set lustre_path");
  if (config.file_capacity_bytes && config.file_capacity_bytes < 4 * kPage)
    return Status::InvalidArgument("file_capacity_bytes must be 0 (unbounded) or at least 16 KiB");
  if (!env) env = Env::Default();
  std::unique_ptr<FileTier> tier(new FileTier(config, pool, env));
  const std::string& dir = tier->dir_;

  Status st = env->create_dirs(dir);
  if (!st.ok()) return with_context(st, "cannot create the file tier directory " + dir);
  auto lock = env->lock_file(file::join_path(dir, file::kLockFileName));
  if (!lock.ok()) {
    if (lock.status().is(Code::kBusy))
      return Status::Busy("the file tier directory " + dir +
                          " is in use by another store (its LOCK file is locked); "
                          "two stores cannot share one directory");
    return with_context(lock.status(), "the file tier directory " + dir + " is not writable");
  }
  tier->dir_lock_ = std::move(lock.value());

  if (config.file_io_engine == FileIoEngine::kIoUring) {
    auto e = file::make_uring_engine(64);
    if (!e.ok()) return e.status();
    tier->engine_ = std::move(e.value());
  } else {
    tier->engine_ = file::make_psync_engine(pool);
  }

  st = tier->load_directory();
  if (!st.ok()) return st;
  tier->recovery_.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return tier;
}

Status FileTier::load_directory() {
  auto names = env_->list_dir(dir_);
  if (!names.ok()) return with_context(names.status(), "cannot list the file tier directory");
  std::map<uint64_t, std::pair<bool, bool>> found;  // id -> (segment, summary)
  for (const auto& name : *names) {
    uint64_t id = 0;
    switch (file::classify_dir_entry(name, &id)) {
      case file::DirEntryKind::kTemporary:
        (void)env_->unlink(file::join_path(dir_, name));  // an interrupted summary write
        break;
      case file::DirEntryKind::kSegment: found[id].first = true; break;
      case file::DirEntryKind::kSummary: found[id].second = true; break;
      case file::DirEntryKind::kOther: break;
    }
  }
  struct Loaded {
    uint64_t id = 0;
    bool has_summary = false;
    std::unique_ptr<File> file;
    uint64_t file_bytes = 0;
    file::SegmentScan scan;
    bool scanned = false;
    Status status;
  };
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
      auto s = file::read_summary(env_, dir_, l.id);
      if (s.ok() && s->file_bytes <= l.file_bytes) {
        l.scan = std::move(s.value());
        return;
      }
    }
    auto s = file::scan_segment(l.file.get(), l.id, /*verify_payloads=*/true);
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
      continue;
    }
    ++recovery_.segments;
    std::string path = file::join_path(dir_, file::segment_file_name(l.id));
    if (l.scanned) {
      ++recovery_.segments_scanned;
      recovery_.corrupt_records += l.scan.corrupt_records;
      recovery_.tail_bytes += l.scan.tail_bytes;
      if (l.scan.records.empty()) {
        ++recovery_.segments_removed;
        l.file.reset();
        (void)env_->unlink(path);
        (void)env_->unlink(file::join_path(dir_, file::summary_file_name(l.id)));
        continue;
      }
      // Seal it: it is never appended to again, and the next open is fast.
      (void)file::write_summary(env_, dir_, l.id, l.scan.records, l.scan.end, /*sync=*/true);
    } else {
      ++recovery_.segments_from_summary;
    }
    auto seg = std::make_shared<Segment>(l.id, path, std::move(l.file));
    seg->bytes.store(l.file_bytes);
    seg->sealed.store(true);
    {
      std::unique_lock<std::shared_mutex> lock(table_mu_);
      if (slots_.count(seg->slot)) continue;  // ids 2^20 apart: cannot index both
      slots_[seg->slot] = seg;
    }
    disk_bytes_.fetch_add(l.file_bytes);
    uint64_t live = 0;
    for (const RecordHeader& h : l.scan.records) {
      ++recovery_.records;
      Location loc{file::encode_location(seg->slot, h.record_offset), h.payload_length};
      if (index_.insert(h.id(), loc, h.is_prefix())) {
        live += file::record_size(h.payload_length);
      } else {
        ++recovery_.duplicate_records;
      }
    }
    seg->live_bytes.fetch_add(live);
    live_record_bytes_.fetch_add(live);
    l.scan.records = {};
  }
  corrupt_blocks_.fetch_add(recovery_.corrupt_records);
  next_segment_id_ = max_id + 1;
  return Status::OK();
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
    if (lane.active) seal_segment(*lane.active);
    lane.active.reset();
  };
  for (auto& lane : lanes_) seal_lane(*lane);
  seal_lane(*compaction_lane_);
}

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

Status FileTier::admit(uint64_t record_bytes) {
  if (disk_full_.exchange(false)) (void)reclaim_space(record_bytes);
  if (!put_limit_) {
    disk_bytes_.fetch_add(record_bytes);
    return Status::OK();
  }
  for (int attempt = 0; attempt < 3; ++attempt) {
    uint64_t cur = disk_bytes_.load();
    while (cur + record_bytes <= put_limit_) {
      if (disk_bytes_.compare_exchange_weak(cur, cur + record_bytes)) return Status::OK();
    }
    if (!reclaim_space(record_bytes)) break;
  }
  return Status::NoSpace("file tier is full: " + std::to_string(disk_bytes_.load()) + " of " +
                         std::to_string(capacity_) + " bytes on disk (" +
                         std::to_string(dead_bytes()) + " dead)");
}

Result<FileTier::SegmentRef> FileTier::create_segment() {
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
  o.direct = direct_;
  if (stripe_size_ || stripe_count_) {
    // Lustre: the layout is fixed when the file is created. Elsewhere (or
    // without the lfs tool) this is a no-op and the file is created plainly.
    if (env_->create_striped(path, stripe_size_, stripe_count_).ok()) o.exclusive = false;
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

void FileTier::seal_segment(Segment& seg) {
  seg.sealed.store(true);
  if (seg.bytes.load() == 0) {
    auto ref = [&]() -> SegmentRef {
      std::shared_lock<std::shared_mutex> lock(table_mu_);
      return segment_at(seg.slot);
    }();
    if (ref.get() == &seg) retire_segment(ref);
    return;
  }
  Status st = seg.file->sync();
  seg.unsynced.store(false);
  if (st.ok()) (void)file::write_summary(env_, dir_, seg.id, seg.headers, seg.bytes.load(), /*sync=*/true);
  seg.headers = {};
}

Status FileTier::ensure_room(Lane& lane, uint64_t record_bytes) {
  if (lane.active && !lane.active->retired.load()) {
    uint64_t used = lane.active->bytes.load();
    if (used == 0 || used + record_bytes <= segment_bytes_) return Status::OK();
    seal_segment(*lane.active);
  }
  lane.active.reset();
  auto seg = create_segment();
  if (!seg.ok()) return seg.status();
  lane.active = std::move(seg.value());
  return Status::OK();
}

Status FileTier::write_record(Lane& lane, const BlockId& id, const void* data, uint64_t size,
                              bool is_prefix, Location* loc, SegmentRef* seg_out) {
  Segment& seg = *lane.active;
  const uint64_t off = seg.bytes.load();
  const uint64_t rec = file::record_size(size);
  const auto* payload = static_cast<const uint8_t*>(data);
  RecordHeader h = file::make_record_header(id, size, file::payload_checksum(data, size), is_prefix,
                                            seg.id, off);
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
    return with_context(st, "file tier write failed");
  }
  if (!sync_writes_) seg.unsynced.store(true);
  seg.headers.push_back(h);
  seg.bytes.store(off + rec);
  *loc = Location{file::encode_location(seg.slot, off), size};
  *seg_out = lane.active;
  return Status::OK();
}

Status FileTier::put(const BlockId& id, const void* data, uint64_t size, const PutOptions& options) {
  if (index_.contains(id)) return Status::OK();
  const uint64_t rec = file::record_size(size);
  if (rec > file::kMaxSegmentBytes || (put_limit_ && rec > put_limit_))
    return Status::InvalidArgument("block of " + std::to_string(size) + " bytes cannot fit in the file tier");
  AlignedBuffer device_staging;
  if (options.src_kind != MemoryKind::kHost && size) {
    if (!device_staging.reserve(size)) return Status::NoSpace("out of memory staging a device block");
    CASCADE_RETURN_IF_ERROR(device_copy(device_staging.data(), MemoryKind::kHost, data,
                                        options.src_kind, size, options.cuda_stream));
    data = device_staging.data();
  }
  CASCADE_RETURN_IF_ERROR(admit(rec));
  Lane* lane = nullptr;
  auto lock = lock_lane(&lane);
  Location loc;
  SegmentRef seg;
  Status st = ensure_room(*lane, rec);
  if (st.ok()) st = write_record(*lane, id, data, size, options.is_prefix, &loc, &seg);
  if (!st.ok()) {
    lock.unlock();
    disk_bytes_.fetch_sub(rec);
    if (st.is(Code::kNoSpace)) disk_full_.store(true);
    return st;
  }
  seg->live_bytes.fetch_add(rec);
  live_record_bytes_.fetch_add(rec);
  // Published under the lane lock: the segment cannot be sealed (and so
  // compacted) before its index entries exist.
  bool inserted = index_.insert(id, loc, options.is_prefix);
  lock.unlock();
  if (!inserted) {  // a concurrent put of the same id won; ours is a dead record
    seg->live_bytes.fetch_sub(rec);
    live_record_bytes_.fetch_sub(rec);
    return Status::OK();
  }
  counters_.stored(options, size);
  return Status::OK();
}

Status FileTier::flush() {
  Status result;
  auto flush_lane = [&](Lane& lane) {
    std::lock_guard<std::mutex> lock(lane.mu);
    if (lane.active && lane.active->unsynced.exchange(false)) {
      Status st = lane.active->file->sync();
      if (!st.ok()) {
        lane.active->unsynced.store(true);
        if (result.ok()) result = st;
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
  return result;
}

// ---- reading -------------------------------------------------------------------

FileTier::SegmentRef FileTier::segment_at(uint64_t slot) const {
  auto it = slots_.find(slot);
  return it == slots_.end() ? nullptr : it->second;
}

void FileTier::on_reclaim(const Location& loc) {
  const uint64_t rec = file::record_size(loc.size);
  SegmentRef seg;
  {
    std::shared_lock<std::shared_mutex> lock(table_mu_);
    seg = segment_at(file::location_slot(loc.offset));
  }
  if (seg) seg->live_bytes.fetch_sub(rec);
  live_record_bytes_.fetch_sub(rec);
  maybe_schedule_compaction();
}

void FileTier::drop_damaged(const BlockId& id, const Location& loc) {
  corrupt_blocks_.fetch_add(1, std::memory_order_relaxed);
  auto now = index_.peek(id);
  if (now && now->offset == loc.offset && now->size == loc.size) (void)index_.remove(id);
}

bool FileTier::plan_read(const BlockId& id, const ReadRequest& req, ReadResult* result, ReadPlan* plan,
                         Status* status, AlignedBuffer* bounce) {
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
    *status = Status::InvalidArgument("offset " + std::to_string(req.offset) + " is past the end of a " +
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
  const bool to_user = req.whole && req.out_kind == MemoryKind::kHost && size > file::kInlinePayloadMax;
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
  if (!plan->io.status.ok()) {
    problem = plan->io.status.ToString();
  } else {
    file::HeaderCheck check = file::check_record_header(bounce, plan->seg->id, plan->record_offset);
    RecordHeader h;
    std::memcpy(&h, bounce, sizeof(h));
    if (check != file::HeaderCheck::kValid) {
      problem = file::header_check_name(check);
    } else if (h.id() != plan->id || h.payload_length != size) {
      problem = "record holds another block";
    } else {
      switch (plan->mode) {
        case ReadPlan::Mode::kDirectToUser: {
          uint64_t full = size & ~(kPage - 1);
          if (full < size) std::memcpy(static_cast<uint8_t*>(req.out) + full, bounce + kPage, size - full);
          payload = static_cast<const uint8_t*>(req.out);
          break;
        }
        case ReadPlan::Mode::kToUser: payload = static_cast<const uint8_t*>(req.out); break;
        case ReadPlan::Mode::kBounce: payload = bounce + file::payload_offset(size); break;
      }
      if (file::payload_checksum(payload, size) != h.payload_xxh3) problem = "payload checksum mismatch";
    }
  }
  Status st;
  if (problem.empty() && plan->mode == ReadPlan::Mode::kBounce && plan->copy_bytes) {
    const uint8_t* src = payload + (req.whole ? 0 : req.offset);
    if (req.out_kind == MemoryKind::kHost) {
      parallel_memcpy(pool_, req.out, src, plan->copy_bytes, parallel_copy_threshold_);
    } else {
      st = device_copy(req.out, req.out_kind, src, MemoryKind::kHost, plan->copy_bytes, req.cuda_stream);
    }
  }
  index_.release(plan->token);
  plan->seg.reset();
  if (!problem.empty()) {
    drop_damaged(plan->id, plan->loc);
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
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
  engine_->run({&one, 1});
  st = finish_read(&plan, req, result);
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
  }
}

bool FileTier::contains(const BlockId& id) const { return index_.contains(id); }

Status FileTier::remove(const BlockId& id) {
  bool removed = index_.remove(id);
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
  for (auto& c : index_.claim_victims(bytes)) {
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
  s.leased_blocks = index_.leased();
  return s;
}

}  // namespace cascade
