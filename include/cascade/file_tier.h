// LustreBackend and inspect_directory: the file tier on its own.
//
// LustreBackend is the seed API's `LustreBackend(path, stripe_size,
// stripe_count)`: a directory of segment files on Lustre, NVMe or any POSIX
// file system, usable without a CascadeStore. New segment files get the
// given Lustre striping (a documented no-op on other file systems, or
// without the lfs tool). Unlike a store it never evicts: put fails with
// NoSpace when capacity_bytes is reached (remove() and compact() make room).
// Blocks persist: a backend opened later on the same directory finds every
// block written before a clean close, and after a crash every block written
// before the last flush() (sync_writes: before each put returned). Two
// backends (or stores) cannot open one directory at once: the second gets
// Busy.
//
// inspect_directory() reads a directory without opening it for writing (it
// may run while a store has it open): segments, records, live and dead
// bytes, and with verify a checksum check of every record. Records are
// checked with the directory's key (its KEY file), which it must be able to
// read. It is what `cascade inspect DIR` prints.
//
// Thread-safety: LustreBackend methods are thread-safe.
// Ownership: callers own the backend; it owns its threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/config.h"
#include "cascade/stats.h"
#include "cascade/status.h"

namespace cascade {

struct FileBackendOptions {
  uint64_t capacity_bytes = 0;                 // 0 = bounded only by the file system
  uint64_t segment_size_bytes = 256ULL << 20;  // as CascadeConfig::segment_size_bytes
  bool io_direct = false;                      // O_DIRECT segment I/O
  FileIoEngine io_engine = FileIoEngine::kPsync;
  bool sync_writes = false;                    // fsync before each put returns
  int threads = 0;                             // I/O threads; 0 = one per core
  // Permission bits of the files the backend creates (as CascadeConfig::file_mode);
  // the directory gets the same plus x where r is granted.
  uint32_t file_mode = 0600;
};

class LustreBackend {
 public:
  // Opens (creating if needed) the directory `path`. stripe_size / stripe_count:
  // Lustre layout of new segment files, 0 = inherit the directory's.
  static Result<std::unique_ptr<LustreBackend>> Open(const std::string& path, uint64_t stripe_size = 0,
                                                     int stripe_count = 0,
                                                     const FileBackendOptions& options = {});
  ~LustreBackend();  // seals open segments (a clean close)

  // OK when the id is stored already (blocks are immutable).
  Status put(const BlockId& id, const void* data, uint64_t size, bool is_prefix = false);
  // A miss (also: a record that fails verification) is OK with *found false.
  // Out too small: InvalidArgument, *found true, *size the block's size.
  Status get(const BlockId& id, void* out, uint64_t capacity, bool* found, uint64_t* size);
  bool contains(const BlockId& id) const;
  Status remove(const BlockId& id);
  void clear();
  // Makes every put so far durable.
  Status flush();
  // Reclaims dead space (see FileTier::compact).
  Status compact();
  TierStats stats() const;
  const std::string& path() const;

 private:
  struct Parts;
  explicit LustreBackend(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

struct SegmentInspection {
  uint64_t segment_id = 0;
  std::string file;            // file name inside the directory
  uint64_t file_bytes = 0;
  bool sealed = false;         // has a valid summary
  uint64_t records = 0;        // valid records
  uint64_t live_records = 0;   // newest valid record of its id in the directory
  uint64_t live_bytes = 0;     // record bytes of live records
  uint64_t dead_bytes = 0;     // file_bytes - live_bytes
  uint64_t corrupt_records = 0;
  uint64_t tail_bytes = 0;     // bytes after the last valid record (a torn tail)
  uint64_t aliases = 0;        // alias records among the records
  // Not this directory's (format 1, or written with another key): a store
  // leaves it alone and serves nothing from it.
  bool foreign = false;
  uint16_t format_version = 0; // of its first record (0: none)
};

struct InspectReport {
  std::string dir;
  bool verified = false;       // payload checksums were checked
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
  uint64_t foreign_segments = 0; // segment files a store would not read (see SegmentInspection)
  uint64_t aliases = 0;          // live alias records
  uint64_t other_files = 0;    // names that are not the tier's

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
