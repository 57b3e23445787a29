// Segment files on disk: their names, how they are scanned for records, and
// the summary written when a segment is sealed.
//
// Names in the tier's directory:
//   seg-<16 lowercase hex digits of the segment id>.dat  records (record_format.h)
//   seg-<id>.sum                                        summary of a sealed segment
//   <name>.tmp                                          a file being written (removed on open)
//   LOCK                                                flock'ed by the store that owns the directory
//
// A segment is written by one writer at a time, record after record, and
// sealed when full or when the store closes: its data is fsynced, then a
// summary (the list of its record headers) is written to seg-<id>.sum.tmp,
// fsynced and renamed into place. A sealed segment is never written again.
// Reopening trusts a valid summary (every read verifies the record anyway)
// and scans segments without one: header by header, verifying payloads, so
// a record cut short by a crash is dropped.
//
// Summary layout (little endian):
//   off size field
//     0   4  magic          0x53534143 ("CASS" as bytes)
//     4   2  format_version 1
//     6   2  zero
//     8   8  segment_id
//    16   8  record_count
//    24   8  segment_bytes  bytes of the segment the summary covers
//    32   8  entries_xxh3   XXH3-64 of the entries
//    40  16  zero
//    56   8  header_xxh3    XXH3-64 of bytes [0, 56)
//    64   -  record_count RecordHeaders (64 bytes each), in offset order
//
// Thread-safety: free functions; a File may be scanned by one thread while
// others read it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cascade/env.h"
#include "tiers/file/record_format.h"

namespace cascade::file {

inline constexpr const char* kLockFileName = "LOCK";

std::string segment_file_name(uint64_t segment_id);
std::string summary_file_name(uint64_t segment_id);
inline std::string join_path(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

enum class DirEntryKind : uint8_t { kOther, kSegment, kSummary, kTemporary };
// What a name in the tier's directory is; *segment_id set for segments and
// summaries.
DirEntryKind classify_dir_entry(const std::string& name, uint64_t* segment_id);

struct SegmentScan {
  std::vector<RecordHeader> records;  // valid records, in offset order
  uint64_t file_bytes = 0;            // size of the segment file
  uint64_t end = 0;                   // offset just past the last valid record
  // Damaged records followed by a valid one (skipped). Invalid bytes after
  // the last valid record are a torn tail (a write cut short), not counted
  // here but in tail_bytes.
  uint64_t corrupt_records = 0;
  uint64_t tail_bytes = 0;            // file_bytes - end
  bool from_summary = false;
};

// Reads every record header of the segment (and, with verify_payloads, every
// payload, checking its checksum). IOError only when the file cannot be read
// at all; damage is reported in the result.
Result<SegmentScan> scan_segment(File* file, uint64_t segment_id, bool verify_payloads);

// Reads and checks seg-<id>.sum. NotFound when absent; Corruption when it
// fails a check (the caller then scans the segment).
Result<SegmentScan> read_summary(Env* env, const std::string& dir, uint64_t segment_id);

// Writes seg-<id>.sum atomically (temporary file, rename). sync: fsync the
// summary and the directory.
Status write_summary(Env* env, const std::string& dir, uint64_t segment_id,
                     const std::vector<RecordHeader>& records, uint64_t segment_bytes, bool sync);

// Reads the record at (segment_id, header.record_offset) and checks its
// header and payload checksum. OK or Corruption; IOError when unreadable.
Status verify_record(File* file, uint64_t segment_id, const RecordHeader& header);

}  // namespace cascade::file
