// Python classes over the file tier used on its own: LustreBackend (the
// seeds' class), inspect_directory (what `cascade inspect` prints) and the
// raw O_DIRECT probe the benchmarks compare against.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <memory>

#include "cascade/file_tier.h"
#include "common.h"
#include "guarded.h"
#include "bench/file_probe.h"

namespace cascade::py {
namespace {

class PyLustreBackend {
 public:
  PyLustreBackend(const std::string& path, uint64_t stripe_size, int stripe_count, uint64_t capacity_bytes,
                  uint64_t segment_size_bytes, bool io_direct, bool sync_writes, int threads,
                  uint32_t file_mode) {
    FileBackendOptions o;
    o.file_mode = file_mode;
    o.capacity_bytes = capacity_bytes;
    o.segment_size_bytes = segment_size_bytes;
    o.io_direct = io_direct;
    o.sync_writes = sync_writes;
    o.threads = threads;
    Result<std::unique_ptr<LustreBackend>> b = Status::OK();
    {
      nb::gil_scoped_release release;
      b = LustreBackend::Open(path, stripe_size, stripe_count, o);
    }
    check(b.status());
    b_.open(std::move(b.value()));
  }
  PyLustreBackend(const PyLustreBackend&) = delete;

  bool put(nb::handle key, nb::handle data, bool is_prefix) {
    BlockId id = parse_key(key);
    BufferRef buf = BufferRef::readable(data, "data");
    if (buf.kind() != MemoryKind::kHost) throw nb::value_error("LustreBackend stores host buffers");
    Status st;
    {
      auto b = b_.use();
      nb::gil_scoped_release release;
      st = b->put(id, buf.data(), buf.size(), is_prefix);
    }
    if (st.is(Code::kNoSpace)) return false;
    check(st);
    return true;
  }

  std::tuple<bool, uint64_t> get(nb::handle key, nb::handle out) {
    BlockId id = parse_key(key);
    BufferRef buf = BufferRef::writable(out, "out");
    if (buf.kind() != MemoryKind::kHost) throw nb::value_error("LustreBackend reads into host buffers");
    bool found = false;
    uint64_t size = 0;
    Status st;
    {
      auto b = b_.use();
      nb::gil_scoped_release release;
      st = b->get(id, buf.data(), buf.size(), &found, &size);
    }
    if (st.is(Code::kInvalidArgument) && found)
      raise_status(Status::InvalidArgument("out holds " + std::to_string(buf.size()) +
                                           " bytes; the block has " + std::to_string(size)));
    check(st);
    return {found, found ? size : 0};
  }

  bool contains(nb::handle key) {
    BlockId id = parse_key(key);
    return b_.use()->contains(id);
  }
  bool remove(nb::handle key) {
    BlockId id = parse_key(key);
    Status st;
    {
      auto b = b_.use();
      nb::gil_scoped_release release;
      st = b->remove(id);
    }
    if (st.is(Code::kNotFound)) return false;
    check(st);
    return true;
  }
  void clear() {
    auto b = b_.use();
    nb::gil_scoped_release release;
    b->clear();
  }
  void flush() {
    Status st;
    {
      auto b = b_.use();
      nb::gil_scoped_release release;
      st = b->flush();
    }
    check(st);
  }
  void compact() {
    Status st;
    {
      auto b = b_.use();
      nb::gil_scoped_release release;
      st = b->compact();
    }
    check(st);
  }
  nb::dict get_stats() {
    TierStats st;
    {
      auto b = b_.use();
      nb::gil_scoped_release release;
      st = b->stats();
    }
    return tier_stats_dict(st);
  }
  std::string path() { return b_.use()->path(); }
  void close() { b_.close(); }
  bool closed() const { return b_.closed(); }

 private:
  Guarded<LustreBackend> b_{"the backend"};
};

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
  d["other_files"] = r.other_files;
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
  nb::class_<PyLustreBackend>(m, "LustreBackend",
                              "The file tier used directly (the seeds' class): segment files in one "
                              "directory, persistent across restarts, no eviction (put returns False "
                              "when capacity_bytes is reached).")
      .def(nb::init<const std::string&, uint64_t, int, uint64_t, uint64_t, bool, bool, int, uint32_t>(),
           "path"_a,
           "stripe_size"_a = 0, "stripe_count"_a = 0, "capacity_bytes"_a = 0,
           "segment_size_bytes"_a = 256ULL << 20, "io_direct"_a = false, "sync_writes"_a = false,
           "threads"_a = 0, "file_mode"_a = 0600)
      .def("put", &PyLustreBackend::put, "block_id"_a, "data"_a, "is_prefix"_a = false)
      .def("get", &PyLustreBackend::get, "block_id"_a, "out"_a)
      .def("contains", &PyLustreBackend::contains, "block_id"_a)
      .def("remove", &PyLustreBackend::remove, "block_id"_a)
      .def("clear", &PyLustreBackend::clear)
      .def("flush", &PyLustreBackend::flush)
      .def("compact", &PyLustreBackend::compact)
      .def("get_stats", &PyLustreBackend::get_stats)
      .def_prop_ro("path", &PyLustreBackend::path)
      .def("close", &PyLustreBackend::close,
           "Waits for calls in progress in other threads, then closes the directory. Later calls raise "
           "UnavailableError. Idempotent.")
      .def_prop_ro("closed", &PyLustreBackend::closed)
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyLustreBackend& b, nb::args) { b.close(); });

  m.def("inspect_directory", [](const std::string& dir, bool verify) {
    Result<InspectReport> r = Status::OK();
    {
      nb::gil_scoped_release release;
      r = inspect_directory(dir, verify);
    }
    check(r.status());
    return inspection_dict(r.value());
  }, "dir"_a, "verify"_a = true,
        "Segments, records, live and dead bytes of a file-tier directory; with verify, every "
        "record's checksum (keyed: the directory's KEY file must be readable). Safe while a store "
        "has the directory open.");

  m.def("probe_direct_io", [](const std::string& dir, uint64_t bytes, uint64_t block_size, int threads) {
    Result<ProbeResult> r = Status::OK();
    {
      nb::gil_scoped_release release;
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
  }, "dir"_a, "bytes"_a, "block_size"_a, "threads"_a,
        "Raw sequential O_DIRECT write and read bandwidth of a directory (the file tier's ceiling).");
}

}  // namespace cascade::py
