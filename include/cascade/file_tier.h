// inspect_directory: a file tier's directory read from outside.
//
// The file tier keeps blocks in segment files of one directory (on NVMe,
// Lustre or any POSIX file system); a store's pipeline opens it, and
// TierHandle (cascade/tier_handle.h) opens it on its own.
//
// inspect_directory() reads a directory without opening it for writing (it
// may run while a store has it open): segments, records, live and dead
// bytes, and with verify a checksum check of every record. Records are
// checked with the directory's key (its KEY file), which it must be able to
// read. It is what `cascade inspect DIR` prints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/status.h"

namespace cascade {

struct SegmentInspection {
  uint64_t segment_id = 0;
  std::string file;  // file name inside the directory
  uint64_t file_bytes = 0;
  bool sealed = false;        // has a valid summary
  uint64_t records = 0;       // valid records
  uint64_t live_records = 0;  // newest valid record of its id in the directory
  uint64_t live_bytes = 0;    // record bytes of live records
  uint64_t dead_bytes = 0;    // file_bytes - live_bytes
  uint64_t corrupt_records = 0;
  uint64_t tail_bytes = 0;  // bytes after the last valid record (a torn tail)
  uint64_t aliases = 0;     // alias records among the records
  // Not this directory's (format 1, or written with another key): a store
  // leaves it alone and serves nothing from it.
  bool foreign = false;
  uint16_t format_version = 0;  // of its first record (0: none)
};

struct InspectReport {
  std::string dir;
  bool verified = false;  // payload checksums were checked
  std::vector<SegmentInspection> segments;
  uint64_t records = 0;
  uint64_t live_records = 0;
  uint64_t duplicate_records = 0;
  uint64_t payload_bytes = 0;  // sum of live block sizes
  uint64_t live_bytes = 0;
  uint64_t dead_bytes = 0;
  uint64_t file_bytes = 0;
  uint64_t corrupt_records = 0;  // damaged records; with verify also payload mismatches
  uint64_t tail_bytes = 0;
  uint64_t unreadable_segments = 0;
  uint64_t foreign_segments = 0;  // segment files a store would not read (see SegmentInspection)
  uint64_t aliases = 0;           // live alias records
  uint64_t removal_records = 0;   // removal records (an id's older records are dead)
  // Of them, those still needed: an older record of their id is in the
  // directory. Their pages count in live_bytes, not in live_records (which
  // counts records that serve a block).
  uint64_t needed_removal_records = 0;
  uint64_t other_files = 0;  // names that are not the tier's
  // Names of the tier's own (its key, lock, segments, summaries, files being
  // written): none in a directory no file tier has opened.
  uint64_t tier_files = 0;

  // Nothing damaged was found (torn tails after a crash are not damage;
  // foreign segments are reported, not damage).
  bool ok() const { return corrupt_records == 0 && unreadable_segments == 0; }
};

// Reads every segment of dir with the directory's key (dir/KEY). verify:
// read every payload and check its checksum (segments with a summary are
// scanned in full too). NotFound when dir does not exist; IOError when KEY
// cannot be read (permissions) or is missing while segments of this format
// are there.
// "Live" counts what a store opening dir would serve (the newest record of
// each id); removals made by a running store are not on disk, so it is an
// upper bound.
Result<InspectReport> inspect_directory(const std::string& dir, bool verify);

}  // namespace cascade
