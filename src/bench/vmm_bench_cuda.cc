// The map-parallelism benchmark: forked processes map KV pages with the CUDA
// driver's virtual-memory calls. See vmm_bench.h.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "bench/vmm_bench.h"
#include "cuda/cuda_driver.h"
#include "cuda/cuda_status.h"

namespace cascade {
namespace {

enum class Mode { kCompound, kPerTensor, kArena };

// Lives in memory shared by the parent and its children; the per-iteration
// start and end times follow it.
struct Shared {
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  std::atomic<int> failed{0};
  int gpus = 0;
  uint64_t page_bytes = 0;
  char device_name[128] = {};
  char error[512] = {};
};

double now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) * 1e-6;
}

// Every process of the case arrives before any leaves. false when another
// process failed (it will never arrive).
bool barrier(Shared* s, int n) {
  const int gen = s->generation.load(std::memory_order_acquire);
  if (s->arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
    s->arrived.store(0, std::memory_order_relaxed);
    s->generation.fetch_add(1, std::memory_order_release);
    return true;
  }
  while (s->generation.load(std::memory_order_acquire) == gen) {
    if (s->failed.load(std::memory_order_relaxed)) return false;
    sched_yield();
  }
  return true;
}

class Worker {
 public:
  Worker(Shared* sh, double* start, double* end, int rank, int procs, int pages, Mode mode,
         int layers, int iters, uint64_t arena_page)
      : sh_(sh),
        start_(start),
        end_(end),
        rank_(rank),
        procs_(procs),
        pages_(pages),
        mode_(mode),
        layers_(layers),
        iters_(iters),
        arena_page_(arena_page) {}

  int run() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return fail("no usable GPU");
    const int dev = rank_ % count;
    if (cudaSetDevice(dev) != cudaSuccess || cudaFree(nullptr) != cudaSuccess)
      return fail("cannot initialize the GPU");
    if (rank_ == 0) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, dev) == cudaSuccess)
        std::snprintf(sh_->device_name, sizeof sh_->device_name, "%.127s", prop.name);
      sh_->gpus = count;
    }
    api_ = driver_api();
    if (!api_) return fail("the CUDA driver lacks the virtual memory calls");
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = dev;
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t gran = 0;
    if (!ok(api_->cuMemGetAllocationGranularity(&gran, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "granularity"))
      return 1;
    page_ = std::max<uint64_t>(2ULL << 20, gran);
    if (rank_ == 0) sh_->page_bytes = page_;
    const int per_kv_page = 2 * layers_;
    // Mappings per iteration and their size.
    const uint64_t kv_bytes = uint64_t(pages_) * per_kv_page * page_;
    if (mode_ == Mode::kCompound) {
      unit_ = page_ * per_kv_page;
      maps_ = size_t(pages_);
    } else if (mode_ == Mode::kPerTensor) {
      unit_ = page_;
      maps_ = size_t(pages_) * per_kv_page;
    } else {
      unit_ = std::max<uint64_t>(page_, (arena_page_ + gran - 1) / gran * gran);
      maps_ = size_t((kv_bytes + unit_ - 1) / unit_);
    }
    if (!ok(api_->cuMemAddressReserve(&va_, unit_ * maps_, page_, 0, 0), "reserve address space"))
      return 1;
    handles_.assign(maps_, 0);
    int rc = 0;
    for (int it = 0; it < iters_ && rc == 0; ++it) rc = iteration(it);
    (void)api_->cuMemAddressFree(va_, unit_ * maps_);
    return rc;
  }

 private:
  int fail(const std::string& msg) {
    if (sh_->failed.exchange(1) == 0)
      std::snprintf(sh_->error, sizeof sh_->error, "process %d: %s", rank_, msg.c_str());
    return 1;
  }
  bool ok(CUresult r, const char* what) {
    if (r == CUDA_SUCCESS) return true;
    fail(cu_status(r, what).ToString());
    return false;
  }

  // Where mapping k goes: per-tensor layout keeps each K/V tensor of a layer
  // in its own stretch of the reservation, like one range per tensor.
  CUdeviceptr where(size_t k) const {
    if (mode_ != Mode::kPerTensor) return va_ + k * unit_;
    const size_t tensor = k % (2 * size_t(layers_)), page = k / (2 * size_t(layers_));
    return va_ + (tensor * pages_ + page) * unit_;
  }

  int iteration(int it) {
    if (mode_ == Mode::kArena) {  // created ahead, as the arena's pool does
      for (size_t k = 0; k < maps_; ++k)
        if (!ok(api_->cuMemCreate(&handles_[k], unit_, &prop_, 0), "create a page")) return 1;
    }
    if (!barrier(sh_, procs_)) return 1;
    const double t0 = now_ms();
    if (mode_ == Mode::kArena) {
      for (size_t k = 0; k < maps_; ++k)
        if (!ok(api_->cuMemMap(where(k), unit_, 0, handles_[k], 0), "map a page")) return 1;
      if (!ok(api_->cuMemSetAccess(va_, unit_ * maps_, &access_, 1), "set access")) return 1;
    } else {
      for (size_t k = 0; k < maps_; ++k) {
        if (!ok(api_->cuMemCreate(&handles_[k], unit_, &prop_, 0), "create a page")) return 1;
        if (!ok(api_->cuMemMap(where(k), unit_, 0, handles_[k], 0), "map a page")) return 1;
        if (!ok(api_->cuMemSetAccess(where(k), unit_, &access_, 1), "set access")) return 1;
      }
    }
    const double t1 = now_ms();
    start_[size_t(it) * procs_ + rank_] = t0;
    end_[size_t(it) * procs_ + rank_] = t1;
    for (size_t k = 0; k < maps_; ++k) {
      if (!ok(api_->cuMemUnmap(where(k), unit_), "unmap a page")) return 1;
      if (!ok(api_->cuMemRelease(handles_[k]), "release a page")) return 1;
    }
    return barrier(sh_, procs_) ? 0 : 1;
  }

  Shared* sh_;
  double* start_;
  double* end_;
  const int rank_, procs_, pages_;
  const Mode mode_;
  const int layers_, iters_;
  const uint64_t arena_page_;
  const DriverApi* api_ = nullptr;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  uint64_t page_ = 0, unit_ = 0;
  size_t maps_ = 0;
  CUdeviceptr va_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;
};

Status run_case(const VmmBenchOptions& o, const char* name, int procs, int pages_per_proc,
                Mode mode, VmmCase* out, VmmBenchResult* r) {
  const int iters = o.warmup + o.iters;
  const size_t times = size_t(iters) * procs;
  const size_t bytes = sizeof(Shared) + 2 * times * sizeof(double);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return Status::IOError("map shared memory for the benchmark");
  Shared* sh = new (mem) Shared();
  double* start = reinterpret_cast<double*>(static_cast<uint8_t*>(mem) + sizeof(Shared));
  double* end = start + times;
  std::vector<pid_t> children;
  Status st;
  for (int rank = 0; rank < procs; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      Worker w(sh, start, end, rank, procs, pages_per_proc, mode, o.layers, iters,
               uint64_t(o.arena_page_mib) << 20);
      _exit(w.run());
    }
    if (pid < 0) {
      sh->failed.store(1);
      st = Status::IOError("fork failed");
      break;
    }
    children.push_back(pid);
  }
  bool all_ok = st.ok();
  for (pid_t pid : children) {
    int wstatus = 0;
    if (waitpid(pid, &wstatus, 0) < 0 || !WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0)
      all_ok = false;
  }
  if (st.ok() && !all_ok)
    st = Status::IOError(std::string("vmm benchmark case '") + name +
                         "' failed: " + (sh->error[0] ? sh->error : "a process died"));
  if (st.ok()) {
    out->name = name;
    out->procs = procs;
    out->pages_per_proc = pages_per_proc;
    out->pages_total = procs * pages_per_proc;
    out->wall_ms.clear();
    for (int it = o.warmup; it < iters; ++it) {
      double lo = start[size_t(it) * procs], hi = end[size_t(it) * procs];
      for (int p = 1; p < procs; ++p) {
        lo = std::min(lo, start[size_t(it) * procs + p]);
        hi = std::max(hi, end[size_t(it) * procs + p]);
      }
      out->wall_ms.push_back(hi - lo);
    }
    summarize_vmm_case(out);
    if (r->device_name.empty()) r->device_name = sh->device_name;
    if (!r->gpus) r->gpus = sh->gpus;
    if (!r->page_bytes) r->page_bytes = sh->page_bytes;
  }
  sh->~Shared();
  munmap(mem, bytes);
  return st;
}

}  // namespace

Result<VmmBenchResult> run_vmm_bench(const VmmBenchOptions& o) {
  if (o.pages_total < 1 || o.procs < 1 || o.procs > 256 || o.iters < 1 || o.warmup < 0 ||
      o.layers < 1 || o.arena_page_mib < 2)
    return Status::InvalidArgument(
        "vmm bench: pages_total, procs (1-256), iters and layers must be positive");
  if (o.pages_total % o.procs != 0)
    return Status::InvalidArgument("vmm bench: pages_total must be a multiple of procs");
  VmmBenchResult r;
  r.options = o;
  const int per = o.pages_total / o.procs;
  const Mode mode = o.contiguous ? Mode::kCompound : Mode::kPerTensor;
  CASCADE_RETURN_IF_ERROR(run_case(o, "single", 1, per, mode, &r.single, &r));
  CASCADE_RETURN_IF_ERROR(run_case(o, "serial", 1, o.pages_total, mode, &r.serial, &r));
  CASCADE_RETURN_IF_ERROR(run_case(o, "parallel", o.procs, per, mode, &r.parallel, &r));
  if (o.arena_case)
    CASCADE_RETURN_IF_ERROR(run_case(o, "arena", 1, o.pages_total, Mode::kArena, &r.arena, &r));
  r.speedup_mean = r.parallel.mean_ms > 0 ? r.serial.mean_ms / r.parallel.mean_ms : 0;
  return r;
}

}  // namespace cascade
