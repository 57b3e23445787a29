// BlockLease (a leased block exported through DLPack with no copy) and the
// GPU benchmarks' entry points. GPUBackend, the gpu tier used on its own, is
// a TierHandle (tier_handle_bindings.cc).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench/gpu_bench_cli.h"
#include "common.h"
#include "guarded.h"

#if CASCADE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace cascade::py {

nb::object make_block_lease(BlockView view, nb::object owner, Lifeline* owner_life, int device);

namespace {

// ---- DLPack structures (the ABI of dlpack.h, versions 0.x and 1.x) ----------

struct DLDevice {
  int32_t device_type;  // 1 = CPU, 2 = CUDA
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 1 = unsigned int
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr uint64_t kDlpackReadOnly = 1;  // DLPACK_FLAG_BITMASK_READ_ONLY
constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;

// ---- BlockLease ----------------------------------------------------------------

// Owns a BlockView. release() ends the lease once no DLPack export of it is
// alive; each export holds a reference to the lease object, so a tensor made
// with torch.from_dlpack(lease) keeps the block leased for its lifetime.
class PyBlockLease {
 public:
  PyBlockLease(BlockView view, nb::object owner, Lifeline* owner_life, int device)
      : owner_(std::move(owner)),
        owner_life_(owner_life),
        view_(std::move(view)),
        device_(device) {}
  PyBlockLease(const PyBlockLease&) = delete;
  ~PyBlockLease() { end(); }

  // A lease inherited by a forked child reads as released there: its
  // block's mapping is the parent's alone.
  bool forked() const { return fork_generation() != generation_; }
  bool released() const { return released_ || !view_ || forked(); }
  void check_live() const {
    if (forked())
      raise_status(Status::Unavailable(
          "the lease belongs to the process this one was forked from; lease the block again "
          "through a store opened here"));
    if (released()) raise_status(Status::InvalidArgument("the lease was released"));
  }
  uintptr_t ptr() const {
    check_live();
    return reinterpret_cast<uintptr_t>(view_.data());
  }
  uint64_t size() const {
    check_live();
    return view_.size();
  }
  bool on_device() const { return view_.kind() == MemoryKind::kDevice; }
  int device() const { return on_device() ? device_ : -1; }
  int exports() const { return exports_; }

  void release() {
    released_ = true;
    if (exports_ == 0) end();
  }
  void export_begun() { ++exports_; }
  void export_ended() {
    if (--exports_ == 0 && released_) end();
  }

  std::tuple<int, int> dlpack_device() const {
    return {on_device() ? kDLCUDA : kDLCPU, on_device() ? device_ : 0};
  }

 private:
  // Ends the lease (with the GIL held). The owner's close() refuses while
  // a lease is live, so its tiers are here unless it was closed by a path
  // that did not ask (then the view is dropped without calling into them).
  void end() {
    if (!view_) return;
    if (fork_generation() != generation_) {
      view_.detach();  // a forked child: the lease is the parent's
    } else if (owner_life_->enter(/*during_close=*/true)) {
      view_.reset();
      owner_life_->leave();
    } else {
      view_.detach();
    }
    view_ = BlockView();
  }

  nb::object owner_;      // the backend or store; outlives view_ (declared first)
  Lifeline* owner_life_;  // owner_'s, valid while owner_ is held
  BlockView view_;
  int device_;
  uint64_t generation_ = fork_generation();  // of the process that took the lease
  int exports_ = 0;
  bool released_ = false;
};

// One DLPack export: the shape/strides storage and a strong reference to
// the lease object, dropped by the deleter (with the GIL taken).
struct ExportCtx {
  PyObject* lease = nullptr;
  int64_t shape[1];
  int64_t strides[1];
  DLManagedTensor legacy{};
  DLManagedTensorVersioned versioned{};
};

void finish_export(ExportCtx* ctx) {
  PyGILState_STATE g = PyGILState_Ensure();
  nb::inst_ptr<PyBlockLease>(ctx->lease)->export_ended();
  Py_DECREF(ctx->lease);
  PyGILState_Release(g);
  delete ctx;
}
void legacy_deleter(DLManagedTensor* t) { finish_export(static_cast<ExportCtx*>(t->manager_ctx)); }
void versioned_deleter(DLManagedTensorVersioned* t) {
  finish_export(static_cast<ExportCtx*>(t->manager_ctx));
}

// Capsule destructors: a capsule the consumer took is renamed used_*.
void legacy_capsule_dtor(PyObject* cap) {
  if (!PyCapsule_IsValid(cap, "dltensor")) return;
  auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
  if (t && t->deleter) t->deleter(t);
}
void versioned_capsule_dtor(PyObject* cap) {
  if (!PyCapsule_IsValid(cap, "dltensor_versioned")) return;
  auto* t = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, "dltensor_versioned"));
  if (t && t->deleter) t->deleter(t);
}

nb::object dlpack_export(nb::handle self, nb::handle stream, nb::handle max_version,
                         nb::handle dl_device, nb::handle copy) {
  PyBlockLease& lease = nb::cast<PyBlockLease&>(self);
  if (lease.forked())
    throw nb::buffer_error(
        "the lease belongs to the process this one was forked from: its block is not mapped "
        "here; lease it again through a store opened in this process");
  if (lease.released()) throw nb::buffer_error("the lease was released; nothing to export");
  if (copy.is_valid() && !copy.is_none() && nb::cast<bool>(copy))
    throw nb::buffer_error("a BlockLease exports its block in place; copy=True is not supported");
  auto [dev_type, dev_id] = lease.dlpack_device();
  if (dl_device.is_valid() && !dl_device.is_none()) {
    auto want = nb::cast<std::tuple<int, int>>(dl_device);
    if (std::get<0>(want) != dev_type || std::get<1>(want) != dev_id)
      throw nb::buffer_error("the block cannot be exported to another device without a copy");
  }
  // The block's bytes are complete when put returns: no stream to wait on.
  (void)stream;
  bool versioned = false;
  if (max_version.is_valid() && !max_version.is_none()) {
    auto mv = nb::cast<std::tuple<int, int>>(max_version);
    versioned = std::get<0>(mv) >= 1;
  }
  auto* ctx = new ExportCtx;
  ctx->shape[0] = static_cast<int64_t>(lease.size());
  ctx->strides[0] = 1;
  DLTensor t{};
  t.data = reinterpret_cast<void*>(lease.ptr());
  t.device = {dev_type, dev_id};
  t.ndim = 1;
  t.dtype = {1, 8, 1};  // uint8
  t.shape = ctx->shape;
  t.strides = ctx->strides;
  t.byte_offset = 0;
  PyObject* cap;
  if (versioned) {
    ctx->versioned.version = {1, 0};
    ctx->versioned.manager_ctx = ctx;
    ctx->versioned.deleter = versioned_deleter;
    // Blocks are immutable: a consumer that honours the flag (numpy) makes a
    // read-only array, which a get then refuses as its destination.
    ctx->versioned.flags = kDlpackReadOnly;
    ctx->versioned.dl_tensor = t;
    cap = PyCapsule_New(&ctx->versioned, "dltensor_versioned", versioned_capsule_dtor);
  } else {
    ctx->legacy.dl_tensor = t;
    ctx->legacy.manager_ctx = ctx;
    ctx->legacy.deleter = legacy_deleter;
    cap = PyCapsule_New(&ctx->legacy, "dltensor", legacy_capsule_dtor);
  }
  if (!cap) {
    delete ctx;
    throw nb::python_error();
  }
  ctx->lease = self.ptr();
  Py_INCREF(ctx->lease);
  lease.export_begun();
  return nb::steal(cap);
}

// ---- benchmarks ------------------------------------------------------------------

int bench_main(const std::vector<std::string>& args) {
  std::vector<std::string> a;
  a.push_back("cascade-gpu-bench");
  a.insert(a.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  int rc;
  {
    ReleaseGil release;
    std::fflush(stdout);
    rc = gpu_bench_main(int(a.size()), argv.data());
    std::fflush(stdout);
    std::fflush(stderr);
  }
  return rc;
}

// Pinned host <-> device cudaMemcpy bandwidth: the PCIe ceiling.
nb::dict copy_bandwidth(uint64_t bytes, int device, int repeats) {
#if CASCADE_HAVE_CUDA
  double h2d = 0, d2h = 0;
  std::string err;
  {
    ReleaseGil release;
    void* host = nullptr;
    void* dev = nullptr;
    cudaStream_t s = nullptr;
    auto fail = [&](cudaError_t e, const char* what) {
      if (e == cudaSuccess) return false;
      err = std::string(what) + ": " + cudaGetErrorString(e);
      (void)cudaGetLastError();
      return true;
    };
    auto time_copy = [&](void* dst, const void* src) {
      double best = 0;
      for (int r = 0; r < repeats + 1; ++r) {  // the first run warms up
        auto t0 = std::chrono::steady_clock::now();
        if (fail(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "copy") ||
            fail(cudaStreamSynchronize(s), "copy"))
          return 0.0;
        double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) best = std::max(best, double(bytes) / sec / 1e9);
      }
      return best;
    };
    if (!fail(cudaSetDevice(device), "select the GPU") &&
        !fail(cudaMallocHost(&host, bytes), "pinned allocation") &&
        !fail(cudaMalloc(&dev, bytes), "device allocation") &&
        !fail(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream")) {
      std::memset(host, 1, bytes);
      h2d = time_copy(dev, host);
      d2h = err.empty() ? time_copy(host, dev) : 0;
    }
    if (s) cudaStreamDestroy(s);
    if (dev) cudaFree(dev);
    if (host) cudaFreeHost(host);
  }
  if (!err.empty()) raise_status(Status::Unavailable("gpu_copy_bandwidth: " + err));
  nb::dict d;
  d["h2d_gbps"] = h2d;
  d["d2h_gbps"] = d2h;
  d["bytes"] = bytes;
  d["device"] = device;
  return d;
#else
  (void)bytes, (void)device, (void)repeats;
  raise_status(Status::Unavailable("this build of cascade has no CUDA support"));
#endif
}

}  // namespace

nb::object make_block_lease(BlockView view, nb::object owner, Lifeline* owner_life, int device) {
  return nb::cast(new PyBlockLease(std::move(view), std::move(owner), owner_life, device),
                  nb::rv_policy::take_ownership);
}

void register_gpu(nb::module_& m) {
  nb::class_<PyBlockLease>(
      m, "BlockLease",
      "A block leased in place (no copy): while the lease is held the block is neither "
      "evicted nor its memory reused. `ptr` is its address (device memory when `device` "
      ">= 0). torch.from_dlpack(lease) gives a 1-D uint8 view that keeps the lease alive; "
      "release() ends it once no such view remains. Never write through it. A caller "
      "launching kernels on `ptr` must finish them before releasing.")
      .def_prop_ro("ptr", &PyBlockLease::ptr, "The block's address (int).")
      .def_prop_ro("size", &PyBlockLease::size, "The block's size in bytes.")
      .def_prop_ro("device", &PyBlockLease::device, "CUDA device of the block; -1 for host memory.")
      .def_prop_ro("released", &PyBlockLease::released)
      .def("__len__", &PyBlockLease::size)
      .def("release", &PyBlockLease::release,
           "Ends the lease (deferred while DLPack views of it are alive). Idempotent.")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyBlockLease& l, nb::args) { l.release(); })
      .def("__dlpack__", &dlpack_export, "stream"_a = nb::none(), "max_version"_a = nb::none(),
           "dl_device"_a = nb::none(), "copy"_a = nb::none(),
           "DLPack capsule of a 1-D uint8 tensor over the block, no copy.")
      .def("__dlpack_device__", &PyBlockLease::dlpack_device)
      .def("__repr__", [](const PyBlockLease& l) {
        if (l.released()) return std::string("<cascade.BlockLease released>");
        char buf[128];
        std::snprintf(buf, sizeof buf, "<cascade.BlockLease ptr=0x%llx size=%llu device=%d>",
                      (unsigned long long)l.ptr(), (unsigned long long)l.size(), l.device());
        return std::string(buf);
      });

  m.def("gpu_bench_main", &bench_main, "args"_a,
        "Runs the GPU benchmark command line (`vmm ...` or `transfers ...`, as cascade-gpu-bench) "
        "in this "
        "process, writing to its stdout/stderr; returns the exit code. The vmm benchmark forks: "
        "call it "
        "only from a process that has not used CUDA.");
  m.def("gpu_copy_bandwidth", &copy_bandwidth, "bytes"_a = 256ULL << 20, "device"_a = 0,
        "repeats"_a = 3,
        "Pinned host <-> device cudaMemcpy bandwidth (the PCIe ceiling), best of `repeats`, GB/s.");
}

}  // namespace cascade::py
