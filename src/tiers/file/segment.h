// Segment and WriterLane: the in-memory state of the file tier's segment
// files.
//
// A Segment is one open segment file with its space accounting. It is shared
// (std::shared_ptr) between the tier's segment table and readers in flight:
// a segment deleted by compaction stays readable, through its open file,
// until the last reader lets go.
//
// A WriterLane owns at most one open (unsealed) segment and the staging
// buffer used to write records to it. Only the holder of the lane's mutex
// appends to that segment, so records land one after another.
//
// Thread-safety: Segment's atomics may be read and updated by any thread;
// the fields under "writer only" belong to the holder of the lane that has
// the segment open. WriterLane: hold mu.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cascade/env.h"
#include "tiers/file/aligned_buffer.h"
#include "tiers/file/record_format.h"

namespace cascade::file {

inline constexpr uint64_t kSlotBits = 20;
inline constexpr uint64_t kSlotMask = (uint64_t{1} << kSlotBits) - 1;
inline constexpr uint64_t kPageNumberBits = 28;  // 2^28 pages of 4 KiB = 1 TiB per segment

inline uint64_t slot_of_segment(uint64_t segment_id) { return segment_id & kSlotMask; }
inline uint64_t encode_location(uint64_t slot, uint64_t record_offset) {
  return slot << kPageNumberBits | record_offset / kPage;
}
inline uint64_t location_slot(uint64_t encoded) { return encoded >> kPageNumberBits; }
inline uint64_t location_record_offset(uint64_t encoded) {
  return (encoded & ((uint64_t{1} << kPageNumberBits) - 1)) * kPage;
}

struct Segment {
  Segment(uint64_t id, std::string path, std::unique_ptr<File> file)
      : id(id), slot(slot_of_segment(id)), path(std::move(path)), file(std::move(file)) {}

  const uint64_t id;
  const uint64_t slot;
  const std::string path;
  const std::unique_ptr<File> file;

  std::atomic<uint64_t> bytes{0};       // bytes appended (records, incl. dead ones)
  std::atomic<uint64_t> live_bytes{0};  // record bytes of blocks the index points here
  std::atomic<bool> sealed{false};      // never written again
  std::atomic<bool> unsynced{false};    // written since the last fdatasync
  std::atomic<bool> retired{false};     // removed from the table (deleted or being deleted)
  // An fsync of it failed: what was dirty then may never reach the disk,
  // whatever a later fsync says, until its live records are rewritten.
  std::atomic<bool> sync_failed{false};
  std::atomic<uint64_t> punched_dead{0};  // dead bytes when holes were last punched

  // Writer only:
  std::vector<RecordHeader> headers;   // records written so far, for the summary
  std::vector<BlockId> alias_targets;  // payloads of the alias records among them
};

// Dead bytes of a segment: appended bytes not holding a live record.
inline uint64_t dead_of(const Segment& s) {
  uint64_t bytes = s.bytes.load(), live = s.live_bytes.load();
  return bytes > live ? bytes - live : 0;
}

// Orders segments most dead first. Dead bytes change while the sort runs
// (removals, evictions), so each segment's count is read once and the
// snapshot sorted: std::sort must never see a comparator change its mind.
void sort_most_dead_first(std::vector<std::shared_ptr<Segment>>* segments);

struct WriterLane {
  std::mutex mu;
  std::shared_ptr<Segment> active;  // guarded by mu; null until the first write
  AlignedBuffer staging;            // guarded by mu
};

}  // namespace cascade::file
