// inspect_directory: a file-tier directory read from outside. See
// include/cascade/file_tier.h.
#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "cascade/env.h"
#include "cascade/file_tier.h"
#include "tiers/file/segment_scan.h"
#include "tiers/file/store_key.h"

namespace cascade {

Result<InspectReport> inspect_directory(const std::string& dir, bool verify) {
  Env* env = Env::Default();
  auto there = env->stat(dir);
  if (!there.ok()) return there.status();  // NotFound when it does not exist
  auto names = env->list_dir(dir);
  if (!names.ok()) return names.status();
  InspectReport report;
  report.dir = dir;
  report.verified = verify;
  std::map<uint64_t, bool> segments;  // id -> has summary file
  for (const auto& name : *names) {
    uint64_t id = 0;
    switch (file::classify_dir_entry(name, &id)) {
      case file::DirEntryKind::kSegment:
        segments.emplace(id, false);
        ++report.tier_files;
        break;
      case file::DirEntryKind::kSummary:
      case file::DirEntryKind::kTemporary: ++report.tier_files; break;
      case file::DirEntryKind::kOther:
        if (name != file::kLockFileName && name != file::kKeyFileName) ++report.other_files;
        else ++report.tier_files;
        break;
    }
  }
  for (const auto& name : *names) {
    uint64_t id = 0;
    if (file::classify_dir_entry(name, &id) == file::DirEntryKind::kSummary && segments.count(id))
      segments[id] = true;
  }
  auto loaded_key = file::load_store_key(env, dir, 0777, /*create=*/false, /*check_owner=*/false);
  bool have_key = loaded_key.ok();
  if (!have_key && !loaded_key.status().is(Code::kNotFound))
    return Status(loaded_key.status().code(),
                  "cannot read the directory's key (needed to check its records): " +
                      loaded_key.status().message());
  file::RecordKey key = have_key ? loaded_key.value() : file::RecordKey();

  struct Seen {
    file::SegmentScan scan;
    bool usable = false;
  };
  std::vector<Seen> seen(segments.size());
  size_t k = 0;
  for (auto& [id, has_summary] : segments) {
    Seen& z = seen[k++];
    SegmentInspection s;
    s.segment_id = id;
    s.file = file::segment_file_name(id);
    FileOpenOptions o;
    o.no_follow = true;
    auto f = env->open(file::join_path(dir, s.file), o);
    if (!f.ok()) {
      ++report.unreadable_segments;
      report.segments.push_back(s);
      continue;
    }
    auto size = (*f)->size();
    s.file_bytes = size.ok() ? *size : 0;
    file::SegmentScan& scan = z.scan;
    bool have = false;
    if (has_summary && have_key) {
      auto sum = file::read_summary(env, dir, id, key);
      if (sum.ok() && sum->file_bytes <= s.file_bytes) {
        s.sealed = true;
        s.format_version = file::kFormatVersion;
        scan = std::move(sum.value());
        scan.tail_bytes = 0;
        have = true;
        if (verify) {  // every record the summary lists must read back intact
          std::vector<file::RecordHeader> good;
          std::vector<BlockId> targets;
          size_t t = 0;
          for (const auto& h : scan.records) {
            BlockId target = h.is_alias() ? scan.alias_targets[t++] : BlockId{};
            if (file::verify_record(f->get(), id, key, h).ok()) {
              good.push_back(h);
              if (h.is_alias()) targets.push_back(target);
            } else {
              ++scan.corrupt_records;
            }
          }
          scan.records = std::move(good);
          scan.alias_targets = std::move(targets);
        }
      }
    }
    if (!have) {
      auto sc = file::scan_segment(f->get(), id, key, verify);
      if (!sc.ok()) {
        ++report.unreadable_segments;
        report.segments.push_back(s);
        continue;
      }
      scan = std::move(sc.value());
      s.format_version = scan.first_version;
      if (scan.first_header != file::HeaderCheck::kValid &&
          scan.first_header != file::HeaderCheck::kZero) {
        if (!have_key && scan.first_version == file::kFormatVersion)
          return Status::IOError(
              file::join_path(dir, file::kKeyFileName) +
              " is missing: the directory's records cannot be checked without its key");
        s.foreign = true;
        ++report.foreign_segments;
        report.file_bytes += s.file_bytes;
        report.segments.push_back(s);
        continue;
      }
    }
    z.usable = true;
    s.records = scan.records.size();
    s.corrupt_records = scan.corrupt_records;
    s.tail_bytes = scan.tail_bytes;
    report.segments.push_back(std::move(s));
  }

  // Live: the newest record of each id (largest sequence, segment, offset),
  // as a store opening the directory resolves them.
  struct Best {
    uint64_t sequence, segment, offset;
    size_t seg_index;
    uint64_t bytes, payload;
    bool alias;
    BlockId target;
  };
  auto newer = [](const Best& a, const Best& b) {
    return std::tie(a.sequence, a.segment, a.offset) > std::tie(b.sequence, b.segment, b.offset);
  };
  std::unordered_map<BlockId, Best> blocks, aliases, removals;
  std::unordered_map<BlockId, uint64_t> oldest;  // smallest sequence of an id's block or alias
  for (size_t i = 0; i < seen.size(); ++i) {
    if (!seen[i].usable) continue;
    const auto& scan = seen[i].scan;
    size_t t = 0;
    for (const auto& h : scan.records) {
      if (h.is_removal()) {
        ++report.removal_records;
        Best b{h.sequence, report.segments[i].segment_id, h.record_offset, i, file::kPage, 0, false,
               BlockId{}};
        auto [it, fresh] = removals.emplace(h.id(), b);
        if (!fresh && newer(b, it->second)) it->second = b;
        continue;
      }
      auto [o, first] = oldest.emplace(h.id(), h.sequence);
      if (!first) o->second = std::min(o->second, h.sequence);
      Best b{h.sequence,
             report.segments[i].segment_id,
             h.record_offset,
             i,
             file::record_size(h.payload_length),
             h.payload_length,
             h.is_alias(),
             BlockId{}};
      auto& table = h.is_alias() ? aliases : blocks;
      if (h.is_alias()) b.target = scan.alias_targets[t++];
      auto [it, fresh] = table.emplace(h.id(), b);
      if (!fresh) {
        ++report.duplicate_records;
        if (newer(b, it->second)) it->second = b;
      }
    }
  }
  // An id with a block record and an alias record keeps the newer kind.
  for (auto it = aliases.begin(); it != aliases.end();) {
    auto block = blocks.find(it->first);
    if (block == blocks.end()) {
      ++it;
      continue;
    }
    ++report.duplicate_records;
    if (newer(it->second, block->second)) {
      blocks.erase(block);
      ++it;
    } else {
      it = aliases.erase(it);
    }
  }
  // A removal record at least as new as an id's block or alias removes it;
  // it counts as live while an older record of its id is there.
  for (const auto& [id, r] : removals) {
    for (auto* table : {&blocks, &aliases}) {
      auto it = table->find(id);
      if (it != table->end() && it->second.sequence <= r.sequence) table->erase(it);
    }
    auto o = oldest.find(id);
    if (o != oldest.end() && o->second < r.sequence) {
      report.segments[r.seg_index].live_bytes += r.bytes;
      ++report.needed_removal_records;
    }
  }
  auto count_live = [&](const Best& b) {
    SegmentInspection& s = report.segments[b.seg_index];
    ++s.live_records;
    s.live_bytes += b.bytes;
  };
  for (const auto& [id, b] : blocks) {
    count_live(b);
    report.payload_bytes += b.payload;
  }
  for (const auto& [id, b] : aliases) {
    if (!blocks.count(b.target)) continue;
    count_live(b);
    ++report.segments[b.seg_index].aliases;
    ++report.aliases;
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    if (!seen[i].usable) continue;
    SegmentInspection& s = report.segments[i];
    s.dead_bytes = s.file_bytes > s.live_bytes ? s.file_bytes - s.live_bytes : 0;
    report.records += s.records;
    report.live_records += s.live_records;
    report.live_bytes += s.live_bytes;
    report.dead_bytes += s.dead_bytes;
    report.file_bytes += s.file_bytes;
    report.corrupt_records += s.corrupt_records;
    report.tail_bytes += s.tail_bytes;
  }
  return report;
}

}  // namespace cascade
