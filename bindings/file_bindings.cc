// inspect_directory (what `cascade inspect` prints) and the raw O_DIRECT
// probe the benchmarks compare against. FileBackend (LustreBackend), the
// file tier used on its own, is a TierHandle (tier_handle_bindings.cc).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "bench/file_probe.h"
#include "cascade/file_tier.h"
#include "common.h"

namespace cascade::py {
namespace {

nb::dict inspection_dict(const InspectReport& r) {
  nb::dict d;
  d["dir"] = r.dir;
  d["verified"] = r.verified;
  d["ok"] = r.ok();
  d["records"] = r.records;
  d["live_records"] = r.live_records;
  d["duplicate_records"] = r.duplicate_records;
  d["payload_bytes"] = r.payload_bytes;
  d["live_bytes"] = r.live_bytes;
  d["dead_bytes"] = r.dead_bytes;
  d["file_bytes"] = r.file_bytes;
  d["corrupt_records"] = r.corrupt_records;
  d["tail_bytes"] = r.tail_bytes;
  d["unreadable_segments"] = r.unreadable_segments;
  d["foreign_segments"] = r.foreign_segments;
  d["aliases"] = r.aliases;
  d["removal_records"] = r.removal_records;
  d["needed_removal_records"] = r.needed_removal_records;
  d["other_files"] = r.other_files;
  d["tier_files"] = r.tier_files;
  nb::list segs;
  for (const SegmentInspection& s : r.segments) {
    nb::dict x;
    x["segment_id"] = s.segment_id;
    x["file"] = s.file;
    x["file_bytes"] = s.file_bytes;
    x["sealed"] = s.sealed;
    x["records"] = s.records;
    x["live_records"] = s.live_records;
    x["live_bytes"] = s.live_bytes;
    x["dead_bytes"] = s.dead_bytes;
    x["corrupt_records"] = s.corrupt_records;
    x["tail_bytes"] = s.tail_bytes;
    x["aliases"] = s.aliases;
    x["foreign"] = s.foreign;
    x["format_version"] = s.format_version;
    segs.append(x);
  }
  d["segments"] = segs;
  return d;
}

}  // namespace

void register_file(nb::module_& m) {
  m.def(
      "inspect_directory",
      [](const std::string& dir, bool verify) {
        Result<InspectReport> r = Status::OK();
        {
          ReleaseGil release;
          r = inspect_directory(dir, verify);
        }
        check(r.status());
        return inspection_dict(r.value());
      },
      "dir"_a, "verify"_a = true,
      "Segments, records, live and dead bytes of a file-tier directory; with verify, every "
      "record's checksum (keyed: the directory's KEY file must be readable). Safe while a store "
      "has the directory open.");

  m.def(
      "probe_direct_io",
      [](const std::string& dir, uint64_t bytes, uint64_t block_size, int threads) {
        Result<ProbeResult> r = Status::OK();
        {
          ReleaseGil release;
          r = probe_direct_io(dir, bytes, block_size, threads);
        }
        check(r.status());
        nb::dict d;
        d["bytes"] = r->bytes;
        d["block_size"] = r->block_size;
        d["threads"] = r->threads;
        d["direct"] = r->direct;
        d["write_gbps"] = r->write_gbps;
        d["read_gbps"] = r->read_gbps;
        return d;
      },
      "dir"_a, "bytes"_a, "block_size"_a, "threads"_a,
      "Raw sequential O_DIRECT write and read bandwidth of a directory (the file tier's ceiling).");
}

}  // namespace cascade::py
