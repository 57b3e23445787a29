// Python classes over TierHandle, one tier used on its own (no eviction:
// put returns False when the tier is full):
//
//   TierHandle(tier, config)   any tier, from a CascadeConfig
//   HostBackend                the host tier (shared-memory arena)
//   ShmBackend                 HostBackend under its older name
//   FileBackend                the file tier (segment files in a directory)
//   LustreBackend              FileBackend under its older name
//   GPUBackend                 the gpu tier, with get_gpu_ptr
//
// The named classes are subclasses of TierHandle that differ only in their
// constructors (and GPUBackend's argument order: stream before is_prefix).
// Every one answers get() by the rule of cascade/tier_handle.h: (True, size)
// on a hit, (False, 0) on a miss, BufferTooSmallError (an
// InvalidArgumentError, with .needed) when out is too small.
//
// Buffers: host memory for every tier; CUDA memory (DLPack) too for gpu.
// Every call that copies or may block releases the GIL.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cascade/tier_handle.h"
#include "common.h"
#include "guarded.h"

namespace cascade::py {

// A zero-copy lease object (gpu_bindings.cc).
nb::object make_block_lease(BlockView view, nb::object owner, Lifeline* owner_life, int device);

namespace {

class PyTierHandle {
 public:
  // `what` names the handle in the error raised when a gpu tier cannot open.
  PyTierHandle(TierKind kind, const CascadeConfig& config, const std::string& what) : kind_(kind) {
    Result<std::unique_ptr<TierHandle>> h = Status::OK();
    {
      ReleaseGil release;
      h = TierHandle::Open(kind, config);
    }
    if (kind == TierKind::kGpu && h.status().is(Code::kUnavailable)) {
      raise_status(Status::Unavailable(
          what + " needs a usable CUDA GPU: " +
          (CASCADE_HAVE_CUDA
               ? h.status().message()
               : "this build of cascade has no CUDA support (rebuild with CASCADE_WITH_CUDA=ON)")));
    }
    check(h.status());
    h_.open(std::move(h.value()));
  }
  PyTierHandle(const PyTierHandle&) = delete;

  Guarded<TierHandle>::Use use() { return h_.use(); }
  Lifeline* lifeline() { return h_.lifeline(); }

  bool put(nb::handle key, nb::handle data, bool is_prefix, nb::handle stream) {
    BlockId id = parse_key(key);
    BufferRef buf = BufferRef::readable(data, "data");
    host_only(buf.kind(), "stores");
    PutOptions o;
    o.is_prefix = is_prefix;
    o.src_kind = buf.kind();
    o.cuda_stream = stream_arg(stream);
    Status st;
    {
      auto h = use();
      ReleaseGil release;
      st = h->put(id, buf.data(), buf.size(), o);
    }
    if (st.is(Code::kNoSpace)) return false;
    check(st);
    return true;
  }

  std::tuple<bool, uint64_t> get(nb::handle key, nb::handle out, nb::handle stream) {
    BlockId id = parse_key(key);
    BufferRef buf = BufferRef::writable(out, "out");
    host_only(buf.kind(), "reads into");
    void* s = stream_arg(stream);
    bool found = false;
    uint64_t size = 0;
    Status st;
    {
      auto h = use();
      ReleaseGil release;
      st = h->get(id, buf.data(), buf.size(), &found, &size, buf.kind(), s);
    }
    if (st.is(Code::kInvalidArgument) && found && size > buf.size())
      raise_too_small(buf.size(), size);
    check(st);
    return {found, size};
  }

  size_t put_batch(nb::handle keys, nb::handle data, bool is_prefix, nb::handle stream) {
    BatchArgs a = batch_args(keys, data, false);
    host_only(a.kind, "stores");
    PutOptions o;
    o.is_prefix = is_prefix;
    o.src_kind = a.kind;
    o.cuda_stream = stream_arg(stream);
    std::vector<Status> statuses;
    std::vector<void*> mptrs = a.ptrs();
    std::vector<const void*> ptrs(mptrs.begin(), mptrs.end());
    std::vector<uint64_t> lens = a.sizes();
    {
      auto h = use();
      ReleaseGil release;
      h->put_batch(a.ids, ptrs, lens, &statuses, o);
    }
    size_t stored = 0;
    for (auto& st : statuses) {  // a full tier is a per-item "not stored"
      if (st.ok()) ++stored;
      else if (!st.is(Code::kNoSpace)) raise_status(st);
    }
    return stored;
  }

  std::tuple<size_t, std::vector<uint64_t>> get_batch(nb::handle keys, nb::handle outs,
                                                      nb::handle stream) {
    BatchArgs a = batch_args(keys, outs, true);
    host_only(a.kind, "reads into");
    void* s = stream_arg(stream);
    std::vector<bool> found;
    std::vector<uint64_t> sizes;
    std::vector<Status> statuses;
    std::vector<void*> ptrs = a.ptrs();
    std::vector<uint64_t> caps = a.sizes();
    {
      auto h = use();
      ReleaseGil release;
      h->get_batch(a.ids, ptrs, caps, &found, &sizes, &statuses, a.kind, s);
    }
    size_t n = 0;
    for (size_t i = 0; i < statuses.size(); ++i) {
      // too small (found, size > len(out)): the item not counted; any other
      // failure, a refused copy among them, raises
      const bool too_small = statuses[i].is(Code::kInvalidArgument) && found[i];
      if (!statuses[i].ok() && !too_small) raise_status(statuses[i]);
      if (statuses[i].ok() && found[i]) ++n;
    }
    return {n, sizes};
  }

  bool contains(nb::handle key) {
    BlockId id = parse_key(key);
    auto h = use();
    ReleaseGil release;
    return h->contains(id);
  }

  bool remove(nb::handle key) {
    BlockId id = parse_key(key);
    Status st;
    {
      auto h = use();
      ReleaseGil release;
      st = h->remove(id);
    }
    if (st.is(Code::kNotFound)) return false;
    check(st);
    return true;
  }

  void clear() {
    auto h = use();
    ReleaseGil release;
    h->clear();
  }

  // flush, compact, trim: a status and nothing else.
  template <Status (TierHandle::*Fn)()>
  void call() {
    Status st;
    {
      auto h = use();
      ReleaseGil release;
      st = ((*h).*Fn)();
    }
    check(st);
  }

  nb::dict get_stats() {
    TierStats st;
    int device;
    {
      auto h = use();
      device = h->device();
      ReleaseGil release;
      st = h->stats();
    }
    nb::dict d = tier_stats_dict(st);
    if (kind_ == TierKind::kGpu) d["device"] = device;
    return d;
  }

  std::string kind() const { return tier_kind_name(kind_); }
  std::string path() { return use()->path(); }
  int device() { return use()->device(); }

  // BusyError (the handle stays open) while a lease from acquire() is held.
  void close() {
    h_.close([](TierHandle& h) { return refuse_if_leased(h.stats().leased_blocks); });
  }
  bool closed() const { return h_.closed(); }

 private:
  // Only the gpu tier takes device buffers.
  void host_only(MemoryKind kind, const char* verb) {
    if (kind == MemoryKind::kHost || kind_ == TierKind::kGpu) return;
    std::string name = nb::type_name(nb::find(this).type()).c_str();
    throw nb::value_error((name + " " + verb + " host buffers").c_str());
  }

  const TierKind kind_;
  Guarded<TierHandle> h_{"the backend"};
};

nb::object acquire(nb::handle self, nb::handle key) {
  PyTierHandle& t = nb::cast<PyTierHandle&>(self);
  BlockId id = parse_key(key);
  Result<BlockView> v = Status::OK();
  int device;
  {
    auto h = t.use();
    device = h->device();
    ReleaseGil release;
    v = h->acquire(id);
  }
  check(v.status());
  return make_block_lease(std::move(v.value()), nb::borrow(self), t.lifeline(), device);
}

TierKind tier_named(const std::string& tier) {
  CascadeConfig c;
  c.pipeline = tier;
  auto kinds = c.resolve_pipeline(true);
  check(kinds.status());
  if (kinds->size() != 1)
    raise_status(
        Status::InvalidArgument("tier: name one tier (host, gpu or file), got '" + tier + "'"));
  return kinds->front();
}

CascadeConfig host_config(uint64_t capacity, const std::string& path, int threads) {
  CascadeConfig c;
  c.shm_capacity_bytes = capacity;
  c.shm_path = path;
  c.num_io_threads = threads;
  return c;
}

CascadeConfig file_config(const std::string& path, uint64_t stripe_size, int stripe_count,
                          uint64_t capacity_bytes, uint64_t segment_size_bytes, bool io_direct,
                          bool sync_writes, int threads, uint32_t file_mode) {
  CascadeConfig c;
  c.file_path = path;
  c.file_stripe_size = stripe_size;
  c.file_stripe_count = stripe_count;
  c.file_capacity_bytes = capacity_bytes;
  c.segment_size_bytes = segment_size_bytes;
  c.io_direct = io_direct;
  c.sync_writes = sync_writes;
  c.num_io_threads = threads;
  c.file_mode = file_mode;
  return c;
}

CascadeConfig gpu_config(uint64_t capacity, int device, int threads) {
  CascadeConfig c;
  c.gpu_capacity_bytes = capacity;
  c.gpu_device_id = device;
  c.num_io_threads = threads;
  return c;
}

struct PyHostBackend : PyTierHandle {
  PyHostBackend(uint64_t capacity, const std::string& path, int threads,
                const char* name = "HostBackend")
      : PyTierHandle(TierKind::kHost, host_config(capacity, path, threads), name) {}
};
struct PyShmBackend : PyHostBackend {
  PyShmBackend(uint64_t capacity, const std::string& path, int threads)
      : PyHostBackend(capacity, path, threads, "ShmBackend") {}
};

struct PyFileBackend : PyTierHandle {
  PyFileBackend(const std::string& path, uint64_t stripe_size, int stripe_count,
                uint64_t capacity_bytes, uint64_t segment_size_bytes, bool io_direct,
                bool sync_writes, int threads, uint32_t file_mode, const char* name = "FileBackend")
      : PyTierHandle(TierKind::kFile,
                     file_config(path, stripe_size, stripe_count, capacity_bytes,
                                 segment_size_bytes, io_direct, sync_writes, threads, file_mode),
                     name) {}
};
struct PyLustreBackend : PyFileBackend {
  PyLustreBackend(const std::string& path, uint64_t stripe_size, int stripe_count,
                  uint64_t capacity_bytes, uint64_t segment_size_bytes, bool io_direct,
                  bool sync_writes, int threads, uint32_t file_mode)
      : PyFileBackend(path, stripe_size, stripe_count, capacity_bytes, segment_size_bytes,
                      io_direct, sync_writes, threads, file_mode, "LustreBackend") {}
};

struct PyGpuBackend : PyTierHandle {
  PyGpuBackend(uint64_t capacity, int device, int threads)
      : PyTierHandle(TierKind::kGpu, gpu_config(capacity, device, threads), "GPUBackend") {}
};

// FileBackend's and LustreBackend's constructor arguments.
template <class C>
void file_init(C& cls) {
  cls.def(
      nb::init<const std::string&, uint64_t, int, uint64_t, uint64_t, bool, bool, int, uint32_t>(),
      "path"_a, "stripe_size"_a = 0, "stripe_count"_a = 0, "capacity_bytes"_a = 0,
      "segment_size_bytes"_a = 256ULL << 20, "io_direct"_a = false, "sync_writes"_a = false,
      "threads"_a = 0, "file_mode"_a = 0600);
}

}  // namespace

void register_tier_handles(nb::module_& m) {
  nb::class_<PyTierHandle>(
      m, "TierHandle",
      "One tier used on its own: TierHandle(tier, config) opens tier 'host', 'gpu' or 'file' from "
      "the fields of a CascadeConfig that describe it (host: shm_*; gpu: gpu_*; file: file_*, "
      "segment_size_bytes, io_direct, file_io_engine, file_mode, sync_writes) with num_io_threads "
      "threads. No eviction: put returns False when the tier is full. HostBackend, FileBackend and "
      "GPUBackend (and the older names ShmBackend, LustreBackend) are its subclasses with their "
      "own constructors.")
      .def(
          "__init__",
          [](PyTierHandle* self, const std::string& tier, const CascadeConfig& config) {
            TierKind kind = tier_named(tier);
            new (self) PyTierHandle(kind, config, "TierHandle('" + tier + "')");
          },
          "tier"_a, "config"_a)
      .def("put", &PyTierHandle::put, "block_id"_a, "data"_a, "is_prefix"_a = false,
           "stream"_a = nb::none(),
           "Stores a copy of data. True when stored (or already present); False when the tier is "
           "full.")
      .def("get", &PyTierHandle::get, "block_id"_a, "out"_a, "stream"_a = nb::none(),
           "Copies the block into out; returns (found, size): (True, size) on a hit, (False, 0) on "
           "a miss. Raises BufferTooSmallError (with .needed) when out is too small, writing "
           "nothing.")
      .def("put_batch", &PyTierHandle::put_batch, "block_ids"_a, "data_list"_a,
           "is_prefix"_a = false, "stream"_a = nb::none(),
           "Stores many blocks; returns how many were stored. data_list is a sequence of buffers "
           "or one contiguous buffer with a row per block.")
      .def("get_batch", &PyTierHandle::get_batch, "block_ids"_a, "out_list"_a,
           "stream"_a = nb::none(),
           "Reads many blocks; returns (count_found, sizes), size 0 for a miss and the block's "
           "size (more than len(out)) for an out too small.")
      .def("acquire", &acquire, "block_id"_a,
           "The block in place under a lease (BlockLease), no copy: device memory for gpu, the "
           "arena for host. NotFoundError on a miss; NotSupportedError for file.")
      .def("contains", &PyTierHandle::contains, "block_id"_a)
      .def("__contains__", &PyTierHandle::contains)
      .def("remove", &PyTierHandle::remove, "block_id"_a,
           "Removes the block; False when it was not stored.")
      .def("clear", &PyTierHandle::clear)
      .def("flush", &PyTierHandle::call<&TierHandle::flush>,
           "Makes every put so far durable (file).")
      .def("compact", &PyTierHandle::call<&TierHandle::compact>,
           "Reclaims the file tier's dead space now; NotSupportedError for other tiers.")
      .def("trim", &PyTierHandle::call<&TierHandle::trim>,
           "Gives unused device pages back to the driver now (gpu); NotSupportedError for other "
           "tiers.")
      .def("get_stats", &PyTierHandle::get_stats)
      .def_prop_ro("kind", &PyTierHandle::kind, "'host', 'gpu' or 'file'.")
      .def_prop_ro("path", &PyTierHandle::path,
                   "The file tier's directory or the host arena's file; '' for gpu.")
      .def_prop_ro("device", &PyTierHandle::device,
                   "The gpu tier's CUDA device; -1 for other tiers.")
      .def(
          "close", &PyTierHandle::close,
          "Waits for calls in progress in other threads, then releases the tier. Later calls raise "
          "UnavailableError. BusyError (the handle stays open) while a BlockLease is held. "
          "Idempotent.")
      .def_prop_ro("closed", &PyTierHandle::closed)
      .def("__enter__", [](nb::handle self) { return self; })
      .def(
          "__exit__",
          [](PyTierHandle& h, nb::handle exc_type, nb::handle, nb::handle) {
            exit_with(exc_type, [&] { h.close(); });
          },
          "exc_type"_a.none(), "exc"_a.none(), "tb"_a.none());

  nb::class_<PyHostBackend, PyTierHandle>(
      m, "HostBackend", "The host tier (a shared-memory arena file) used on its own.")
      .def(nb::init<uint64_t, const std::string&, int>(), "capacity_bytes"_a,
           "path"_a = default_shm_path(), "threads"_a = 0);
  nb::class_<PyShmBackend, PyHostBackend>(m, "ShmBackend", "HostBackend under its older name.")
      .def(nb::init<uint64_t, const std::string&, int>(), "capacity_bytes"_a,
           "path"_a = default_shm_path(), "threads"_a = 0);

  nb::class_<PyFileBackend, PyTierHandle> file(
      m, "FileBackend",
      "The file tier used on its own: segment files in one directory, persistent across restarts. "
      "stripe_size/stripe_count: Lustre striping of new segment files (0: the directory's).");
  file_init(file);
  nb::class_<PyLustreBackend, PyFileBackend> lustre(m, "LustreBackend",
                                                    "FileBackend under its older name.");
  file_init(lustre);

  nb::class_<PyGpuBackend, PyTierHandle>(m, "GPUBackend",
                                         "The gpu tier used on its own: blocks in one GPU's "
                                         "memory. Buffers may be host memory or CUDA tensors; "
                                         "`stream` (int handle or torch.cuda.Stream) orders a copy "
                                         "after work queued there. Raises UnavailableError without "
                                         "a usable GPU.")
      .def(nb::init<uint64_t, int, int>(), "capacity_bytes"_a, "device_id"_a = 0, "threads"_a = 0)
      .def(
          "put",
          [](PyTierHandle& h, nb::handle key, nb::handle data, nb::handle stream, bool is_prefix) {
            return h.put(key, data, is_prefix, stream);
          },
          "block_id"_a, "data"_a, "stream"_a = nb::none(), "is_prefix"_a = false,
          "Stores a copy of data (host or device memory). False when the arena is full.")
      .def(
          "put_batch",
          [](PyTierHandle& h, nb::handle keys, nb::handle data, nb::handle stream, bool is_prefix) {
            return h.put_batch(keys, data, is_prefix, stream);
          },
          "block_ids"_a, "data_list"_a, "stream"_a = nb::none(), "is_prefix"_a = false,
          "Stores many blocks with one wait; returns how many were stored.")
      .def("get_gpu_ptr", &acquire, "block_id"_a,
           "The block's device pointer under a lease (BlockLease), no copy. NotFoundError on a "
           "miss.");
}

}  // namespace cascade::py
