// Segment files on disk: their names, how they are scanned for records, and
// the summary written when a segment is sealed.
//
// Names in the tier's directory:
//   seg-<16 lowercase hex digits of the segment id>.dat  records (record_format.h)
//   seg-<id>.sum                                        summary of a sealed segment
//   <name>.tmp                                          a file being written (removed on open)
//   LOCK                                                flock'ed by the store that owns the
//   directory KEY                                                 the directory's secret
//   (store_key.h)
//
// A segment is written by one writer at a time, record after record, and
// sealed when full or when the store closes: its data is fsynced, then a
// summary (the list of its record headers) is written to seg-<id>.sum.tmp,
// fsynced and renamed into place. A sealed segment is never written again.
// Reopening trusts a valid summary (every read verifies the record anyway)
// and scans segments without one: record by record from offset 0, each
// header telling where the next one starts, verifying payloads. The scan
// never looks for a record inside another record's bytes: it stops at the
// first header that does not validate (an all-zero one included); what
// follows is the torn tail of a crash, counted as damage when it holds any
// non-zero byte. Holes (dead space given back to the file system) are
// records of their own and are walked over.
//
// Summary layout (little endian):
//   off size field
//     0   4  magic          0x53534143 ("CASS" as bytes)
//     4   2  format_version 2
//     6   2  zero
//     8   8  segment_id
//    16   8  record_count
//    24   8  segment_bytes  bytes of the segment the summary covers
//    32   8  entries_xxh3   keyed XXH3-64 of the entries and alias targets
//    40  16  zero
//    56   8  header_xxh3    keyed XXH3-64 of bytes [0, 56)
//    64   -  record_count RecordHeaders (64 bytes each), in offset order
//     -   -  16 bytes per alias entry: its target id (the alias record's
//            payload), in the order of the alias entries
//
// The entries are the segment's records a reopen should index (blocks and
// aliases); after dead space was punched, only the records still live then.
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
  std::vector<RecordHeader> records;   // valid records (blocks, aliases), in offset order
  std::vector<BlockId> alias_targets;  // payloads of the alias records among them, in order
  uint64_t file_bytes = 0;             // size of the segment file
  uint64_t end = 0;                    // offset just past the last valid record (or hole)
  // Records whose header validates but whose payload does not, unless only
  // zeros or the end of the file follow them (a torn tail); plus one when
  // the walk stopped at a damaged header or with non-zero bytes after where
  // it stopped. Torn tails are not counted here but in tail_bytes.
  uint64_t corrupt_records = 0;
  uint64_t tail_bytes = 0;  // file_bytes - end
  // The header at offset 0: kValid for a segment of this directory, kZero
  // for one with nothing written; anything else (a format 1 segment, another
  // directory's key) means the file is not this store's.
  HeaderCheck first_header = HeaderCheck::kZero;
  uint16_t first_version = 0;  // its format version (0: no record magic)
  bool from_summary = false;
};

// Walks the records of the segment from offset 0 (with verify_payloads,
// checking every payload). IOError only when the file cannot be read at
// all; damage is reported in the result.
Result<SegmentScan> scan_segment(File* file, uint64_t segment_id, const RecordKey& key,
                                 bool verify_payloads);

// Reads and checks seg-<id>.sum. NotFound when absent; Corruption when it
// fails a check (the caller then scans the segment).
Result<SegmentScan> read_summary(Env* env, const std::string& dir, uint64_t segment_id,
                                 const RecordKey& key);

// Writes seg-<id>.sum atomically (temporary file with permission bits
// file_mode, rename). sync: fsync the summary and the directory.
Status write_summary(Env* env, const std::string& dir, uint64_t segment_id, const RecordKey& key,
                     const std::vector<RecordHeader>& records,
                     const std::vector<BlockId>& alias_targets, uint64_t segment_bytes, bool sync,
                     uint32_t file_mode = 0600);

// Reads the record at (segment_id, header.record_offset) and checks its
// header and payload checksum. OK or Corruption; IOError when unreadable.
Status verify_record(File* file, uint64_t segment_id, const RecordKey& key,
                     const RecordHeader& header);

}  // namespace cascade::file
