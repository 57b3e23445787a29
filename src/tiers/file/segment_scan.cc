// Segment scanning and summaries. See segment_scan.h.
#include "tiers/file/segment_scan.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "tiers/file/aligned_buffer.h"
#include "util/xxh3.h"

namespace cascade::file {
namespace {

constexpr uint32_t kSummaryMagic = 0x53534143u;  // bytes 'C','A','S','S'
constexpr size_t kScanChunk = 1 << 20;           // bytes read at a time while scanning

struct SummaryHeader {
  uint32_t magic;
  uint16_t format_version;
  uint16_t zero0;
  uint64_t segment_id;
  uint64_t record_count;
  uint64_t segment_bytes;
  uint64_t entries_xxh3;
  uint8_t zero1[16];
  uint64_t header_xxh3;
};
static_assert(sizeof(SummaryHeader) == 64, "summary header must be 64 bytes");

// Reads a file forward in aligned chunks (works with O_DIRECT files) and
// hands out views of byte ranges inside the current chunk.
class ChunkReader {
 public:
  ChunkReader(File* file, uint64_t file_bytes, size_t chunk = kScanChunk)
      : file_(file), file_bytes_(file_bytes), chunk_(chunk) {}

  // The first offset at or after pos that may hold data (holes skipped).
  uint64_t data_from(uint64_t pos) { return file_->data_from(pos); }

  // Makes [pos, pos + n) readable; returns a pointer to pos, or nullptr when
  // the range passes the end of the file. REQUIRES: n <= kScanChunk.
  Result<const uint8_t*> view(uint64_t pos, size_t n) {
    if (pos + n > file_bytes_) return static_cast<const uint8_t*>(nullptr);
    if (pos < start_ || pos + n > start_ + len_) {
      uint64_t aligned = pos & ~(kPage - 1);
      size_t want =
          static_cast<size_t>(std::max<uint64_t>(chunk_, round_up_page(pos + n) - aligned));
      if (!buf_.reserve(want)) return Status::NoSpace("out of memory scanning " + file_->path());
      auto got = file_->pread(buf_.data(), want, aligned);
      if (!got.ok()) return got.status();
      start_ = aligned;
      len_ = *got;
      if (pos + n > start_ + len_) return static_cast<const uint8_t*>(nullptr);  // shrank meanwhile
    }
    return static_cast<const uint8_t*>(buf_.data() + (pos - start_));
  }

 private:
  File* file_;
  uint64_t file_bytes_;
  size_t chunk_;
  AlignedBuffer buf_;
  uint64_t start_ = 0;
  size_t len_ = 0;
};

// Checksum of the payload of a record whose header is valid. false when the
// file ends first.
Result<bool> payload_matches(ChunkReader& reader, uint64_t record_pos, const RecordHeader& h,
                             const RecordKey& key) {
  uint64_t pos = record_pos + payload_offset(h.payload_length);
  uint64_t left = h.payload_length;
  xxh3::State state;
  xxh3::reset_with_secret(&state, key.secret(), kKeySecretBytes);
  while (left) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(left, kScanChunk));
    auto v = reader.view(pos, n);
    if (!v.ok()) return v.status();
    if (!*v) return false;
    xxh3::update(&state, *v, n);
    pos += n;
    left -= n;
  }
  const uint64_t sum = xxh3::digest(&state);
  return sum == h.payload_xxh3;
}

// Whether [from, to) holds only zero bytes. Holes are zeros without reading
// them: a file of terabytes that holds nothing is checked in no time.
Result<bool> all_zero(ChunkReader& reader, uint64_t from, uint64_t to) {
  for (uint64_t pos = from; pos < to;) {
    pos = std::max(pos, reader.data_from(pos));
    if (pos >= to) break;
    size_t n = static_cast<size_t>(std::min<uint64_t>(to - pos, kScanChunk - (pos % kPage)));
    auto v = reader.view(pos, n);
    if (!v.ok()) return v.status();
    if (!*v) return true;  // shrank meanwhile
    for (size_t i = 0; i < n; ++i)
      if ((*v)[i]) return false;
    pos += n;
  }
  return true;
}

}  // namespace

std::string segment_file_name(uint64_t segment_id) {
  char name[32];
  std::snprintf(name, sizeof(name), "seg-%016" PRIx64 ".dat", segment_id);
  return name;
}

std::string summary_file_name(uint64_t segment_id) {
  char name[32];
  std::snprintf(name, sizeof(name), "seg-%016" PRIx64 ".sum", segment_id);
  return name;
}

DirEntryKind classify_dir_entry(const std::string& name, uint64_t* segment_id) {
  if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0)
    return DirEntryKind::kTemporary;
  if (name.size() != 24 || name.compare(0, 4, "seg-") != 0) return DirEntryKind::kOther;
  uint64_t id = 0;
  for (size_t i = 4; i < 20; ++i) {
    char c = name[i];
    int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (d < 0) return DirEntryKind::kOther;
    id = id << 4 | static_cast<uint64_t>(d);
  }
  *segment_id = id;
  if (name.compare(20, 4, ".dat") == 0) return DirEntryKind::kSegment;
  if (name.compare(20, 4, ".sum") == 0) return DirEntryKind::kSummary;
  return DirEntryKind::kOther;
}

Result<SegmentScan> scan_segment(File* file, uint64_t segment_id, const RecordKey& key,
                                 bool verify_payloads) {
  auto size = file->size();
  if (!size.ok()) return size.status();
  SegmentScan scan;
  scan.file_bytes = *size;
  ChunkReader reader(file, *size);
  uint64_t pos = 0;
  uint64_t bad_payloads = 0;  // damaged payloads not yet followed by a valid record
  bool stopped_at_header = false;
  HeaderCheck stop = HeaderCheck::kValid;
  while (pos + kRecordHeaderSize <= *size) {
    auto v = reader.view(pos, kRecordHeaderSize);
    if (!v.ok()) return v.status();
    if (!*v) break;
    HeaderCheck check = check_record_header(key, *v, segment_id, pos);
    if (pos == 0) {
      scan.first_header = check;
      scan.first_version = header_format_version(*v);
    }
    if (check != HeaderCheck::kValid) {
      stopped_at_header = true;
      stop = check;
      break;
    }
    RecordHeader h;
    std::memcpy(&h, *v, sizeof(h));
    const uint64_t rec = record_size(h.payload_length);
    if (h.is_hole()) {
      if (pos + rec > *size) break;
      pos += rec;
      if (bad_payloads == 0) scan.end = pos;
      continue;
    }
    if (pos + payload_offset(h.payload_length) + h.payload_length > *size) break;  // cut short
    bool good = true;
    if (verify_payloads) {
      auto m = payload_matches(reader, pos, h, key);
      if (!m.ok()) return m.status();
      good = *m;
    }
    if (good && h.is_alias()) {
      auto t = reader.view(pos + payload_offset(h.payload_length), 16);
      if (!t.ok()) return t.status();
      if (!*t) break;
      BlockId target;
      std::memcpy(target.bytes.data(), *t, 16);
      scan.alias_targets.push_back(target);
    }
    if (good) {
      scan.corrupt_records += bad_payloads;
      bad_payloads = 0;
      scan.records.push_back(h);
      scan.end = pos + rec;
    } else {
      ++bad_payloads;
    }
    pos += rec;
  }
  if (stopped_at_header) {
    // Nothing after an invalid header is trusted. Zeros are the unwritten
    // end of the segment; anything else is damage (a destroyed header).
    bool damaged = stop != HeaderCheck::kZero;
    if (!damaged) {
      auto z = all_zero(reader, pos, *size);
      if (!z.ok()) return z.status();
      damaged = !*z;
    }
    // Damaged payloads before a damaged header are damage too.
    if (damaged) scan.corrupt_records += bad_payloads + 1;
  }
  scan.end = std::min(scan.end, *size);
  scan.tail_bytes = *size - scan.end;
  return scan;
}

Result<SegmentScan> read_summary(Env* env, const std::string& dir, uint64_t segment_id,
                                 const RecordKey& key) {
  std::string path = join_path(dir, summary_file_name(segment_id));
  FileOpenOptions o;
  auto file = env->open(path, o);
  if (!file.ok()) {
    auto there = env->stat(path);
    if (!there.ok() && there.status().is(Code::kNotFound)) return there.status();
    return file.status();
  }
  auto size = (*file)->size();
  if (!size.ok()) return size.status();
  auto bad = [&](const char* why) { return Status::Corruption(path + ": " + why); };
  if (*size < sizeof(SummaryHeader)) return bad("impossible size");
  std::vector<uint8_t> bytes(*size);
  auto got = (*file)->pread(bytes.data(), bytes.size(), 0);
  if (!got.ok()) return got.status();
  if (*got != bytes.size()) return bad("short read");
  SummaryHeader sh;
  std::memcpy(&sh, bytes.data(), sizeof(sh));
  if (sh.magic != kSummaryMagic) return bad("bad magic");
  if (sh.format_version != kFormatVersion) return bad("unknown format version");
  if (sh.header_xxh3 != key.summary_checksum(&sh, offsetof(SummaryHeader, header_xxh3)))
    return bad("bad header checksum");
  if (sh.segment_id != segment_id) return bad("names another segment");
  const uint64_t count = sh.record_count;
  if (count > (*size - sizeof(SummaryHeader)) / kRecordHeaderSize)
    return bad("record count past its size");
  const uint8_t* entries = bytes.data() + sizeof(SummaryHeader);
  const uint64_t rest = *size - sizeof(SummaryHeader) - count * kRecordHeaderSize;  // alias targets
  if (sh.entries_xxh3 != key.summary_checksum(entries, *size - sizeof(SummaryHeader)))
    return bad("bad entries checksum");
  SegmentScan scan;
  scan.from_summary = true;
  scan.records.resize(count);
  uint64_t next = 0;
  for (uint64_t i = 0; i < count; ++i) {
    RecordHeader& h = scan.records[i];
    std::memcpy(&h, entries + i * kRecordHeaderSize, sizeof(h));
    if (check_record_header(key, &h, segment_id, h.record_offset) != HeaderCheck::kValid ||
        h.is_hole())
      return bad("bad entry");
    if (h.record_offset < next || h.record_offset % kPage) return bad("entries out of order");
    next = h.record_offset + record_size(h.payload_length);
  }
  if (next > sh.segment_bytes) return bad("entries past the covered length");
  uint64_t aliases = 0;
  for (const RecordHeader& h : scan.records) aliases += h.is_alias() ? 1 : 0;
  if (rest != aliases * 16) return bad("alias targets do not match the entries");
  scan.alias_targets.resize(aliases);
  const uint8_t* targets = entries + count * kRecordHeaderSize;
  for (uint64_t i = 0; i < aliases; ++i)
    std::memcpy(scan.alias_targets[i].bytes.data(), targets + 16 * i, 16);
  scan.end = next;
  scan.file_bytes = sh.segment_bytes;
  return scan;
}

Status write_summary(Env* env, const std::string& dir, uint64_t segment_id, const RecordKey& key,
                     const std::vector<RecordHeader>& records,
                     const std::vector<BlockId>& alias_targets, uint64_t segment_bytes, bool sync,
                     uint32_t file_mode) {
  const size_t body = records.size() * kRecordHeaderSize + alias_targets.size() * 16;
  std::vector<uint8_t> bytes(sizeof(SummaryHeader) + body);
  uint8_t* entries = bytes.data() + sizeof(SummaryHeader);
  if (!records.empty()) std::memcpy(entries, records.data(), records.size() * kRecordHeaderSize);
  for (size_t i = 0; i < alias_targets.size(); ++i)
    std::memcpy(entries + records.size() * kRecordHeaderSize + 16 * i,
                alias_targets[i].bytes.data(), 16);
  SummaryHeader sh;
  std::memset(&sh, 0, sizeof(sh));
  sh.magic = kSummaryMagic;
  sh.format_version = kFormatVersion;
  sh.segment_id = segment_id;
  sh.record_count = records.size();
  sh.segment_bytes = segment_bytes;
  sh.entries_xxh3 = key.summary_checksum(entries, body);
  sh.header_xxh3 = key.summary_checksum(&sh, offsetof(SummaryHeader, header_xxh3));
  std::memcpy(bytes.data(), &sh, sizeof(sh));

  std::string final_path = join_path(dir, summary_file_name(segment_id));
  std::string tmp_path = final_path + ".tmp";
  FileOpenOptions o;
  o.write = o.create = o.truncate = o.no_follow = true;
  o.mode = file_mode;
  auto file = env->open(tmp_path, o);
  if (!file.ok()) return file.status();
  Status st = (*file)->pwrite(bytes.data(), bytes.size(), 0);
  if (st.ok() && sync) st = (*file)->sync();
  file->reset();
  if (st.ok()) st = env->rename(tmp_path, final_path);
  if (!st.ok()) {
    (void)env->unlink(tmp_path);
    return st;
  }
  if (sync) (void)env->sync_dir(dir);  // a lost summary only costs a scan
  return Status::OK();
}

Status verify_record(File* file, uint64_t segment_id, const RecordKey& key,
                     const RecordHeader& header) {
  auto size = file->size();
  if (!size.ok()) return size.status();
  ChunkReader reader(
      file, *size,
      static_cast<size_t>(std::min<uint64_t>(record_size(header.payload_length), kScanChunk)));
  auto v = reader.view(header.record_offset, kRecordHeaderSize);
  if (!v.ok()) return v.status();
  if (!*v) return Status::Corruption("record past the end of " + file->path());
  HeaderCheck c = check_record_header(key, *v, segment_id, header.record_offset);
  if (c != HeaderCheck::kValid)
    return Status::Corruption(std::string(header_check_name(c)) + " in " + file->path());
  if (std::memcmp(*v, &header, sizeof(header)) != 0)
    return Status::Corruption("record differs from its summary in " + file->path());
  auto m = payload_matches(reader, header.record_offset, header, key);
  if (!m.ok()) return m.status();
  if (!*m) return Status::Corruption("payload checksum mismatch in " + file->path());
  return Status::OK();
}

}  // namespace cascade::file
