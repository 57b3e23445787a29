// LustreBackend (the file tier as a standalone object) and inspect_directory.
#include <algorithm>
#include <map>
#include <unordered_set>

#include "cascade/env.h"
#include "cascade/file_tier.h"
#include "io/thread_pool.h"
#include "tiers/file/file_tier.h"
#include "tiers/file/segment_scan.h"

namespace cascade {

struct LustreBackend::Parts {
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<FileTier> tier;
};

LustreBackend::LustreBackend(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

LustreBackend::~LustreBackend() {
  parts_->tier.reset();  // before the pool its background work runs on
}

Result<std::unique_ptr<LustreBackend>> LustreBackend::Open(const std::string& path, uint64_t stripe_size,
                                                           int stripe_count,
                                                           const FileBackendOptions& options) {
  CascadeConfig config;
  config.pipeline = "file";
  config.lustre_path = path;
  config.lustre_stripe_size = stripe_size;
  config.lustre_stripe_count = stripe_count;
  config.file_capacity_bytes = options.capacity_bytes;
  config.segment_size_bytes = options.segment_size_bytes;
  config.io_direct = options.io_direct;
  config.file_io_engine = options.io_engine;
  config.sync_writes = options.sync_writes;
  auto parts = std::make_unique<Parts>();
  auto pool = ThreadPool::Create(options.threads);
  if (!pool.ok()) return pool.status();
  parts->pool = std::move(pool.value());
  auto tier = FileTier::Open(config, parts->pool.get());
  if (!tier.ok()) return tier.status();
  parts->tier = std::move(tier.value());
  return std::unique_ptr<LustreBackend>(new LustreBackend(std::move(parts)));
}

Status LustreBackend::put(const BlockId& id, const void* data, uint64_t size, bool is_prefix) {
  PutOptions o;
  o.is_prefix = is_prefix;
  return parts_->tier->put(id, data, size, o);
}

Status LustreBackend::get(const BlockId& id, void* out, uint64_t capacity, bool* found, uint64_t* size) {
  ReadRequest req;
  req.out = out;
  req.capacity = capacity;
  ReadResult r;
  Status st = parts_->tier->read(id, req, &r);
  *found = st.ok() || st.is(Code::kInvalidArgument);
  *size = *found ? r.block_size : 0;
  if (st.is(Code::kNotFound)) return Status::OK();
  return st;
}

bool LustreBackend::contains(const BlockId& id) const { return parts_->tier->contains(id); }
Status LustreBackend::remove(const BlockId& id) { return parts_->tier->remove(id); }
void LustreBackend::clear() { parts_->tier->clear(); }
Status LustreBackend::flush() { return parts_->tier->flush(); }
Status LustreBackend::compact() { return parts_->tier->compact(); }
TierStats LustreBackend::stats() const { return parts_->tier->stats(); }
const std::string& LustreBackend::path() const { return parts_->tier->dir(); }

Result<InspectReport> inspect_directory(const std::string& dir, bool verify) {
  Env* env = Env::Default();
  auto names = env->list_dir(dir);
  if (!names.ok()) return names.status();
  InspectReport report;
  report.dir = dir;
  report.verified = verify;
  std::map<uint64_t, bool> segments;  // id -> has summary file
  for (const auto& name : *names) {
    uint64_t id = 0;
    switch (file::classify_dir_entry(name, &id)) {
      case file::DirEntryKind::kSegment: segments.emplace(id, false); break;
      case file::DirEntryKind::kSummary: break;
      case file::DirEntryKind::kTemporary: break;
      case file::DirEntryKind::kOther:
        if (name != file::kLockFileName) ++report.other_files;
        break;
    }
  }
  for (const auto& name : *names) {
    uint64_t id = 0;
    if (file::classify_dir_entry(name, &id) == file::DirEntryKind::kSummary && segments.count(id))
      segments[id] = true;
  }
  std::unordered_set<BlockId> seen;
  for (auto& [id, has_summary] : segments) {
    SegmentInspection s;
    s.segment_id = id;
    s.file = file::segment_file_name(id);
    FileOpenOptions o;
    auto f = env->open(file::join_path(dir, s.file), o);
    if (!f.ok()) {
      ++report.unreadable_segments;
      report.segments.push_back(s);
      continue;
    }
    auto size = (*f)->size();
    s.file_bytes = size.ok() ? *size : 0;
    file::SegmentScan scan;
    bool have = false;
    if (has_summary) {
      auto sum = file::read_summary(env, dir, id);
      if (sum.ok() && sum->file_bytes <= s.file_bytes) {
        s.sealed = true;
        scan = std::move(sum.value());
        scan.tail_bytes = 0;
        have = true;
        if (verify) {  // every record the summary lists must read back intact
          std::vector<file::RecordHeader> good;
          for (const auto& h : scan.records) {
            if (file::verify_record(f->get(), id, h).ok()) {
              good.push_back(h);
            } else {
              ++scan.corrupt_records;
            }
          }
          scan.records = std::move(good);
        }
      }
    }
    if (!have) {
      auto sc = file::scan_segment(f->get(), id, verify);
      if (!sc.ok()) {
        ++report.unreadable_segments;
        report.segments.push_back(s);
        continue;
      }
      scan = std::move(sc.value());
    }
    s.records = scan.records.size();
    s.corrupt_records = scan.corrupt_records;
    s.tail_bytes = scan.tail_bytes;
    for (const auto& h : scan.records) {
      if (seen.insert(h.id()).second) {
        ++s.live_records;
        s.live_bytes += file::record_size(h.payload_length);
        report.payload_bytes += h.payload_length;
      } else {
        ++report.duplicate_records;
      }
    }
    s.dead_bytes = s.file_bytes > s.live_bytes ? s.file_bytes - s.live_bytes : 0;
    report.records += s.records;
    report.live_records += s.live_records;
    report.live_bytes += s.live_bytes;
    report.dead_bytes += s.dead_bytes;
    report.file_bytes += s.file_bytes;
    report.corrupt_records += s.corrupt_records;
    report.tail_bytes += s.tail_bytes;
    report.segments.push_back(std::move(s));
  }
  return report;
}

}  // namespace cascade
