// The gpu tier's throughput benchmark. See gpu_bench.h.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "bench/gpu_bench.h"
#include "cascade/paged_kv.h"
#include "cuda/cuda_status.h"
#include "cuda/device_buffer.h"
#include "cuda/device_context.h"
#include "cuda/device_copy.h"
#include "cuda/host_registration.h"
#include "os/shm_arena.h"
#include "tiers/gpu/gpu_tier.h"
#include "util/thread_pool.h"

namespace cascade {
namespace {

using Clock = std::chrono::steady_clock;

struct Runs {
  std::vector<double> seconds;
  double median() const {
    std::vector<double> v = seconds;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
  }
  double best() const {
    return seconds.empty() ? 0 : *std::min_element(seconds.begin(), seconds.end());
  }
};

double gbps(uint64_t bytes, double seconds) {
  return seconds > 0 ? double(bytes) / seconds / 1e9 : 0;
}

// Times `repeats` runs of fn (each preceded by prep, untimed).
Result<Runs> time_runs(int repeats, const std::function<Status()>& fn,
                       const std::function<Status()>& prep = nullptr) {
  Runs r;
  for (int i = 0; i < repeats; ++i) {
    if (prep) CASCADE_RETURN_IF_ERROR(prep());
    auto t0 = Clock::now();
    CASCADE_RETURN_IF_ERROR(fn());
    r.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return r;
}

BlockId bench_id(uint64_t i) {
  BlockId id;
  std::memcpy(id.bytes.data(), &i, 8);
  uint64_t j = i * 0x9e3779b97f4a7c15ULL + 0x1234;
  std::memcpy(id.bytes.data() + 8, &j, 8);
  return id;
}

class JsonList {
 public:
  void add(const std::string& object) {
    if (!body_.empty()) body_ += ",\n    ";
    body_ += object;
  }
  std::string str() const { return "[\n    " + body_ + "\n  ]"; }

 private:
  std::string body_;
};

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

const char* method_name(SmallCopyMethod m) {
  switch (m) {
    case SmallCopyMethod::kAuto: return "auto";
    case SmallCopyMethod::kKernel: return "kernel";
    case SmallCopyMethod::kBatchApi: return "batch_api";
    case SmallCopyMethod::kPerCopy: return "per_copy";
  }
  return "?";
}

struct Ceilings {
  double h2d = 0, d2h = 0, d2d = 0, h2d_shm = 0, d2h_shm = 0;
};

class Bench {
 public:
  explicit Bench(const GpuBenchOptions& o) : o_(o) {}

  Result<std::string> run() {
    CASCADE_RETURN_IF_ERROR(setup());
    CASCADE_RETURN_IF_ERROR(measure_ceilings());
    CASCADE_RETURN_IF_ERROR(host_batches());
    CASCADE_RETURN_IF_ERROR(device_batches());
    CASCADE_RETURN_IF_ERROR(single_puts_and_pointers());
    if (o_.kv_tokens > 0) CASCADE_RETURN_IF_ERROR(paged_kv());
    std::string out = "{\n  \"benchmark\": \"gpu\",\n";
    out += "  \"device\": \"" + device_name_ + "\",\n";
    out +=
        fmt("  \"driver_version\": %d, \"runtime_version\": %d, \"total_bytes\": %llu, "
            "\"repeats\": %d,\n",
            driver_, runtime_, (unsigned long long)o_.total_bytes, o_.repeats);
    out +=
        fmt("  \"ceilings_gbps\": {\"h2d_pinned\": %.2f, \"d2h_pinned\": %.2f, \"d2d\": %.1f, "
            "\"h2d_shm_registered\": %.2f, \"d2h_shm_registered\": %.2f},\n",
            c_.h2d, c_.d2h, c_.d2d, c_.h2d_shm, c_.d2h_shm);
    out += "  \"results\": " + results_.str() + "\n}\n";
    return out;
  }

 private:
  Status setup() {
    if (o_.total_bytes < (64ULL << 20))
      return Status::InvalidArgument("gpu bench: total_bytes must be at least 64 MiB");
    if (o_.repeats < 1) return Status::InvalidArgument("gpu bench: repeats must be at least 1");
    auto ctx = DeviceContext::For(o_.device);
    if (!ctx.ok()) return ctx.status();
    ctx_ = *ctx;
    cudaSetDevice(o_.device);
    cudaDeviceProp prop{};
    CASCADE_CUDA_RETURN(cudaGetDeviceProperties(&prop, o_.device), "query the GPU");
    device_name_ = prop.name;
    cudaDriverGetVersion(&driver_);
    cudaRuntimeGetVersion(&runtime_);
    CASCADE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                        "create a stream");
    const std::string tag = std::to_string(getpid());
    auto src = ShmArena::Create(o_.shm_dir + "/cascade-gpu-bench-src-" + tag, o_.total_bytes, true);
    if (!src.ok()) return src.status();
    src_ = std::move(src.value());
    auto dst = ShmArena::Create(o_.shm_dir + "/cascade-gpu-bench-dst-" + tag, o_.total_bytes, true);
    if (!dst.ok()) return dst.status();
    dst_ = std::move(dst.value());
    CASCADE_RETURN_IF_ERROR(register_host_memory(src_->base(), src_->capacity()));
    CASCADE_RETURN_IF_ERROR(register_host_memory(dst_->base(), dst_->capacity()));
    // Register every chunk now, so ceilings and tier runs see the same memory.
    if (!host_range_device_accessible(src_->base(), src_->capacity()) ||
        !host_range_device_accessible(dst_->base(), dst_->capacity()))
      return Status::IOError("cannot register the benchmark's /dev/shm memory with CUDA");
    std::mt19937_64 rng(42);
    for (uint64_t i = 0; i < o_.total_bytes; i += 8) {
      uint64_t x = rng();
      std::memcpy(src_->base() + i, &x, 8);
    }
    auto p = PinnedBuffer::Allocate(o_.total_bytes);
    if (!p.ok()) return p.status();
    pinned_ = std::move(p.value());
    auto d1 = DeviceBuffer::Allocate(o_.device, o_.total_bytes);
    if (!d1.ok()) return d1.status();
    dev1_ = std::move(d1.value());
    auto d2 = DeviceBuffer::Allocate(o_.device, o_.total_bytes);
    if (!d2.ok()) return d2.status();
    dev2_ = std::move(d2.value());
    std::memcpy(pinned_.data(), src_->base(), o_.total_bytes);
    CASCADE_CUDA_RETURN(cudaMemcpy(dev1_.data(), pinned_.data(), o_.total_bytes, cudaMemcpyDefault),
                        "fill");
    auto pool = ThreadPool::Create(8);
    if (!pool.ok()) return pool.status();
    pool_ = std::move(pool.value());
    return Status::OK();
  }

  // One copy of n bytes, or (piece > 0) copies of `piece` bytes back to
  // back: registered /dev/shm memory is registered by 64 MiB chunk and one
  // DMA copy cannot span two registrations.
  Result<double> copy_gbps(void* dst, const void* src, uint64_t n, uint64_t piece = 0) {
    if (piece == 0) piece = n;
    auto runs = time_runs(o_.repeats, [&]() -> Status {
      for (uint64_t off = 0; off < n; off += piece) {
        CASCADE_CUDA_RETURN(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + off,
                                            static_cast<const uint8_t*>(src) + off,
                                            std::min(piece, n - off), cudaMemcpyDefault, stream_),
                            "copy");
      }
      return cuda_status(cudaStreamSynchronize(stream_), "copy");
    });
    if (!runs.ok()) return runs.status();
    return gbps(n, runs->median());
  }

  Status measure_ceilings() {
    const uint64_t n = o_.total_bytes;
    auto a = copy_gbps(dev1_.data(), pinned_.data(), n);
    auto b = copy_gbps(pinned_.data(), dev1_.data(), n);
    auto c = copy_gbps(dev2_.data(), dev1_.data(), n);
    auto d = copy_gbps(dev2_.data(), src_->base(), n, kHostRegistrationChunk);
    auto e = copy_gbps(dst_->base(), dev2_.data(), n, kHostRegistrationChunk);
    for (auto* r : {&a, &b, &c, &d, &e})
      if (!r->ok()) return r->status();
    c_ = Ceilings{*a, *b, *c, *d, *e};
    std::fprintf(stderr,
                 "ceilings: h2d %.2f, d2h %.2f (pinned); h2d %.2f, d2h %.2f (registered shm); d2d "
                 "%.1f GB/s\n",
                 c_.h2d, c_.d2h, c_.h2d_shm, c_.d2h_shm, c_.d2d);
    return Status::OK();
  }

  Result<std::unique_ptr<GpuTier>> open_tier(uint64_t capacity, SmallCopyMethod m) {
    CascadeConfig c;
    c.pipeline = "gpu";
    c.gpu_device_id = o_.device;
    c.gpu_capacity_bytes = capacity;
    GpuTierOptions opts;
    opts.transfers.small_method = m;
    opts.arena.trim_threshold_bytes = ~0ULL;  // keep pages mapped between runs (steady state)
    return GpuTier::Open(c, pool_.get(), opts);
  }

  // One batch measurement: put n blocks of `block` bytes from src slots
  // order[k], read them back into dst slots order[k].
  Status batch_case(GpuTier* tier, const char* placement, const char* source, const char* method,
                    uint64_t block, uint8_t* src, uint8_t* dst, MemoryKind kind,
                    const std::vector<size_t>& order, double ceil_put, double ceil_get) {
    const size_t n = order.size();
    std::vector<BlockId> ids(n);
    std::vector<const void*> data(n);
    std::vector<uint64_t> sizes(n, block);
    std::vector<ReadRequest> reqs(n);
    for (size_t k = 0; k < n; ++k) {
      ids[k] = bench_id(k);
      data[k] = src + order[k] * block;
      reqs[k].out = dst + order[k] * block;
      reqs[k].capacity = block;
      reqs[k].out_kind = kind;
    }
    std::vector<Status> st(n);
    std::vector<ReadResult> rr(n);
    PutOptions po;
    po.src_kind = kind;
    auto put = [&]() -> Status {
      tier->put_batch(ids, data, sizes, po, st);
      for (auto& s : st) CASCADE_RETURN_IF_ERROR(s);
      return Status::OK();
    };
    auto get = [&]() -> Status {
      tier->read_batch(ids, reqs, rr, st);
      for (auto& s : st) CASCADE_RETURN_IF_ERROR(s);
      return Status::OK();
    };
    auto clear = [&]() -> Status {
      tier->clear();
      return Status::OK();
    };
    tier->clear();
    auto cold = time_runs(1, put);
    if (!cold.ok()) return cold.status();
    auto puts = time_runs(o_.repeats, put, clear);
    if (!puts.ok()) return puts.status();
    // The reads must write what they report: the destination starts cleared
    // (an earlier case wrote the same bytes there), and sampled blocks are
    // compared with their sources afterwards, in device memory too.
    for (size_t k = 0; k < n; ++k) {
      uint8_t* d = dst + order[k] * block;
      if (kind == MemoryKind::kHost) std::memset(d, 0, block);
      else CASCADE_RETURN_IF_ERROR(cuda_status(cudaMemset(d, 0, block), "clear the destination"));
    }
    auto gets = time_runs(o_.repeats, get);
    if (!gets.ok()) return gets.status();
    bool verified = true;
    std::vector<uint8_t> want(kind == MemoryKind::kHost ? 0 : block);
    std::vector<uint8_t> got(want.size());
    for (size_t k = 0; k < n && verified; k += std::max<size_t>(1, n / 64)) {
      const uint8_t* s = src + order[k] * block;
      const uint8_t* d = dst + order[k] * block;
      if (kind == MemoryKind::kHost) {
        verified = std::memcmp(d, s, block) == 0;
        continue;
      }
      CASCADE_RETURN_IF_ERROR(cuda_status(cudaMemcpy(want.data(), s, block, cudaMemcpyDeviceToHost),
                                          "copy a source back"));
      CASCADE_RETURN_IF_ERROR(cuda_status(cudaMemcpy(got.data(), d, block, cudaMemcpyDeviceToHost),
                                          "copy a result back"));
      verified = want == got;
    }
    if (!verified) {
      return Status::Corruption(std::string("gpu bench: ") + method + " " + placement +
                                " reads from " + source + " memory gave other bytes than were put");
    }
    const uint64_t bytes = n * block;
    auto record = [&](const char* op, const char* dir, const Runs& r, double ceiling,
                      double cold_gbps) {
      double g = gbps(bytes, r.median());
      results_.add(
          fmt("{\"op\": \"%s\", \"direction\": \"%s\", \"memory\": \"%s\", \"placement\": \"%s\", "
              "\"method\": \"%s\", \"block_bytes\": %llu, \"blocks\": %zu, \"gbps\": %.2f, "
              "\"gbps_best\": %.2f, \"ceiling_gbps\": %.2f, \"ratio\": %.3f%s, \"verified\": %s}",
              op, dir, source, placement, method, (unsigned long long)block, n, g,
              gbps(bytes, r.best()), ceiling, ceiling > 0 ? g / ceiling : 0,
              cold_gbps > 0 ? fmt(", \"cold_gbps\": %.2f", cold_gbps).c_str() : "",
              verified ? "true" : "false"));
      std::fprintf(stderr, "  %-9s %-4s %-14s %-10s %-9s %8llu KiB  %7.2f GB/s  (%.0f%% of %.1f)\n",
                   op, dir, source, placement, method, (unsigned long long)(block >> 10), g,
                   ceiling > 0 ? 100 * g / ceiling : 0, ceiling);
    };
    const bool d2d = kind == MemoryKind::kDevice;
    record("put_batch", d2d ? "d2d" : "h2d", *puts, ceil_put, gbps(bytes, cold->median()));
    record("get_batch", d2d ? "d2d" : "d2h", *gets, ceil_get, 0);
    tier->clear();
    return Status::OK();
  }

  Status host_batches() {
    std::fprintf(stderr, "host <-> gpu tier batches (registered /dev/shm memory)\n");
    auto tk = open_tier(o_.total_bytes + (64 << 20), SmallCopyMethod::kAuto);
    if (!tk.ok()) return tk.status();
    std::unique_ptr<GpuTier> by_method[4];
    by_method[0] = std::move(tk.value());
    if (o_.compare_methods) {
      for (int m = 1; m < 4; ++m) {
        auto t = open_tier(o_.total_bytes + (64 << 20), SmallCopyMethod(m));
        if (!t.ok()) return t.status();
        by_method[m] = std::move(t.value());
      }
    }
    for (uint64_t block : o_.block_sizes) {
      const size_t n = o_.total_bytes / block;
      std::vector<size_t> seq(n), perm(n);
      std::iota(seq.begin(), seq.end(), 0);
      perm = seq;
      std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
      CASCADE_RETURN_IF_ERROR(batch_case(by_method[0].get(), "sequential", "shm_registered", "auto",
                                         block, src_->base(), dst_->base(), MemoryKind::kHost, seq,
                                         c_.h2d, c_.d2h));
      for (int m = 0; m < (o_.compare_methods ? 4 : 1); ++m) {
        if (block >= (16 << 20) && m > 0) continue;  // large blocks use one DMA copy each anyway
        CASCADE_RETURN_IF_ERROR(batch_case(by_method[m].get(), "scattered", "shm_registered",
                                           method_name(SmallCopyMethod(m)), block, src_->base(),
                                           dst_->base(), MemoryKind::kHost, perm, c_.h2d, c_.d2h));
      }
    }
    // Pageable user memory goes through the staging ring.
    std::vector<uint8_t> pg_src(src_->base(), src_->base() + o_.total_bytes),
        pg_dst(o_.total_bytes);
    for (uint64_t block : {uint64_t(64 << 10), uint64_t(1 << 20)}) {
      const size_t n = o_.total_bytes / block;
      std::vector<size_t> seq(n);
      std::iota(seq.begin(), seq.end(), 0);
      CASCADE_RETURN_IF_ERROR(batch_case(by_method[0].get(), "sequential", "pageable", "staged",
                                         block, pg_src.data(), pg_dst.data(), MemoryKind::kHost,
                                         seq, c_.h2d, c_.d2h));
    }
    return Status::OK();
  }

  Status device_batches() {
    std::fprintf(stderr, "device <-> gpu tier batches\n");
    auto t = open_tier(o_.total_bytes + (64 << 20), SmallCopyMethod::kAuto);
    if (!t.ok()) return t.status();
    for (uint64_t block : o_.device_block_sizes) {
      const size_t n = o_.total_bytes / block;
      std::vector<size_t> seq(n), perm(n);
      std::iota(seq.begin(), seq.end(), 0);
      perm = seq;
      std::shuffle(perm.begin(), perm.end(), std::mt19937(9));
      CASCADE_RETURN_IF_ERROR(batch_case(t->get(), "sequential", "device", "auto", block,
                                         dev1_.data(), dev2_.data(), MemoryKind::kDevice, seq,
                                         c_.d2d, c_.d2d));
      CASCADE_RETURN_IF_ERROR(batch_case(t->get(), "scattered", "device", "auto", block,
                                         dev1_.data(), dev2_.data(), MemoryKind::kDevice, perm,
                                         c_.d2d, c_.d2d));
    }
    return Status::OK();
  }

  // The store's pattern (one put per block, many threads) and zero-copy access.
  Status single_puts_and_pointers() {
    std::fprintf(stderr, "single puts from %d threads; get_gpu_ptr\n", pool_->size());
    auto t = open_tier(o_.total_bytes + (64 << 20), SmallCopyMethod::kAuto);
    if (!t.ok()) return t.status();
    GpuTier* tier = t->get();
    for (uint64_t block : {uint64_t(64 << 10), uint64_t(1 << 20)}) {
      const size_t n = o_.total_bytes / block;
      std::atomic<int> failures{0};
      auto put_all = [&]() -> Status {
        pool_->parallel_for(
            n,
            [&](size_t k) {
              if (!tier->put(bench_id(k), src_->base() + k * block, block, PutOptions{}).ok())
                failures.fetch_add(1);
            },
            pool_->size());
        return failures.load() ? Status::IOError("single puts failed") : Status::OK();
      };
      auto get_all = [&]() -> Status {
        pool_->parallel_for(
            n,
            [&](size_t k) {
              ReadRequest rq;
              rq.out = dst_->base() + k * block;
              rq.capacity = block;
              ReadResult rr;
              if (!tier->read(bench_id(k), rq, &rr).ok()) failures.fetch_add(1);
            },
            pool_->size());
        return failures.load() ? Status::IOError("single reads failed") : Status::OK();
      };
      tier->clear();
      auto puts = time_runs(o_.repeats, put_all, [&] {
        tier->clear();
        return Status::OK();
      });
      if (!puts.ok()) return puts.status();
      auto gets = time_runs(o_.repeats, get_all);
      if (!gets.ok()) return gets.status();
      for (auto [op, dir, runs, ceil] :
           {std::tuple{"put", "h2d", *puts, c_.h2d}, std::tuple{"get", "d2h", *gets, c_.d2h}}) {
        double g = gbps(n * block, runs.median());
        results_.add(
            fmt("{\"op\": \"%s\", \"direction\": \"%s\", \"memory\": \"shm_registered\", "
                "\"placement\": "
                "\"sequential\", \"method\": \"single_calls_%d_threads\", \"block_bytes\": %llu, "
                "\"blocks\": %zu, "
                "\"gbps\": %.2f, \"gbps_best\": %.2f, \"ceiling_gbps\": %.2f, \"ratio\": %.3f}",
                op, dir, pool_->size(), (unsigned long long)block, n, g,
                gbps(n * block, runs.best()), ceil, g / ceil));
        std::fprintf(stderr, "  %-9s %-4s single calls %8llu KiB  %7.2f GB/s  (%.0f%% of %.1f)\n",
                     op, dir, (unsigned long long)(block >> 10), g, 100 * g / ceil, ceil);
      }
    }
    // get_gpu_ptr: a lease and a pointer, no bytes moved.
    const size_t n = 16384;
    auto lookups = time_runs(o_.repeats, [&]() -> Status {
      for (size_t k = 0; k < n; ++k) {
        auto v = tier->acquire(bench_id(k % (o_.total_bytes / (1 << 20))));
        if (!v.ok()) return v.status();
      }
      return Status::OK();
    });
    if (!lookups.ok()) return lookups.status();
    double us = lookups->median() / n * 1e6;
    results_.add(
        fmt("{\"op\": \"get_gpu_ptr\", \"calls\": %zu, \"us_per_call\": %.3f, \"bytes_copied\": 0}",
            n, us));
    std::fprintf(stderr, "  get_gpu_ptr: %.3f us per call, no bytes copied\n", us);
    return Status::OK();
  }

  Status paged_kv() {
    const int layers = 32, heads = 8, head = 128, bs = 16, elem = 2;
    const int64_t blocks = (o_.kv_tokens + bs - 1) / bs;
    const uint64_t per_block_layer =
        uint64_t(heads) * bs * 2 * head * elem;  // K and V of one layer
    const uint64_t layer_bytes = per_block_layer * blocks;
    std::fprintf(stderr, "paged KV: %d tokens, %lld blocks, %.2f GiB\n", o_.kv_tokens,
                 (long long)blocks, double(layer_bytes * layers) / (1 << 30));
    auto cache = DeviceBuffer::Allocate(o_.device, layer_bytes * layers);
    if (!cache.ok()) return cache.status();
    CASCADE_RETURN_IF_ERROR(fill_device_pattern(cache->data(), layer_bytes * layers, 5, nullptr));
    PagedKvCache c;
    c.layout = PagedKvLayout::kPackedKv;
    c.num_layers = layers;
    c.num_blocks = blocks;
    c.num_kv_heads = heads;
    c.block_size = bs;
    c.head_size = head;
    c.elem_bytes = elem;
    for (int l = 0; l < layers; ++l) c.layers.push_back(cache->data() + l * layer_bytes);
    const uint64_t block_bytes = stored_kv_block_bytes(c);
    const uint64_t total = block_bytes * blocks;
    auto host = ShmArena::Create(o_.shm_dir + "/cascade-gpu-bench-kv-" + std::to_string(getpid()),
                                 total, true);
    if (!host.ok()) return host.status();
    CASCADE_RETURN_IF_ERROR(register_host_memory((*host)->base(), total));
    if (!host_range_device_accessible((*host)->base(), total))
      return Status::IOError("cannot register the KV benchmark's /dev/shm memory with CUDA");
    auto dev_store = DeviceBuffer::Allocate(o_.device, total);
    if (!dev_store.ok()) return dev_store.status();
    std::vector<int64_t> engine(blocks);
    std::iota(engine.begin(), engine.end(), 0);
    std::shuffle(engine.begin(), engine.end(), std::mt19937(3));
    std::vector<size_t> slot(blocks);
    std::iota(slot.begin(), slot.end(), 0);
    std::vector<size_t> reversed(slot.rbegin(), slot.rend());
    auto ptrs = [&](uint8_t* base, const std::vector<size_t>& order) {
      std::vector<void*> p(blocks);
      for (int64_t i = 0; i < blocks; ++i) p[i] = base + order[i] * block_bytes;
      return p;
    };
    struct Case {
      const char* store;
      const char* placement;
      PagedKvPath path;
      MemoryKind kind;
      std::vector<void*> ptrs;
    };
    std::vector<Case> cases = {
        {"shm_registered", "in_order", PagedKvPath::kDirect, MemoryKind::kHost,
         ptrs((*host)->base(), slot)},
        {"shm_registered", "in_order", PagedKvPath::kStaged, MemoryKind::kHost,
         ptrs((*host)->base(), slot)},
        {"shm_registered", "reversed", PagedKvPath::kDirect, MemoryKind::kHost,
         ptrs((*host)->base(), reversed)},
        {"shm_registered", "reversed", PagedKvPath::kStaged, MemoryKind::kHost,
         ptrs((*host)->base(), reversed)},
        {"shm_registered", "in_order", PagedKvPath::kAuto, MemoryKind::kHost,
         ptrs((*host)->base(), slot)},
        {"device", "in_order", PagedKvPath::kAuto, MemoryKind::kDevice,
         ptrs(dev_store->data(), slot)},
    };
    bool checked = false;
    for (Case& k : cases) {
      PagedKvOptions po;
      po.path = k.path;
      po.cuda_stream = stream_;
      std::vector<const void*> cptrs(k.ptrs.begin(), k.ptrs.end());
      auto save =
          time_runs(o_.repeats, [&] { return save_paged_kv(c, engine, k.ptrs, k.kind, po); });
      if (!save.ok()) return save.status();
      auto load =
          time_runs(o_.repeats, [&] { return load_paged_kv(c, engine, cptrs, k.kind, po); });
      if (!load.ok()) return load.status();
      if (!checked && k.kind == MemoryKind::kHost) {
        // Spot check against the CPU reference on a host copy of one block's layers.
        PagedKvCache hc = c;
        hc.memory = MemoryKind::kHost;
        hc.num_blocks = 1;
        std::vector<std::vector<uint8_t>> hl(layers, std::vector<uint8_t>(per_block_layer));
        for (int l = 0; l < layers; ++l) {
          CASCADE_RETURN_IF_ERROR(copy_to_host(
              hl[l].data(), cache->data() + l * layer_bytes + engine[0] * per_block_layer,
              per_block_layer));
          hc.layers[l] = hl[l].data();
        }
        std::vector<uint8_t> ref(block_bytes);
        int64_t zero = 0;
        void* rp = ref.data();
        CASCADE_RETURN_IF_ERROR(save_paged_kv_cpu(hc, {&zero, 1}, {&rp, 1}));
        if (std::memcmp(ref.data(), k.ptrs[0], block_bytes) != 0)
          return Status::Corruption(
              "paged KV benchmark: saved bytes differ from the CPU reference");
        checked = true;
      }
      const bool dev = k.kind == MemoryKind::kDevice;
      const char* path = k.path == PagedKvPath::kDirect   ? "direct"
                         : k.path == PagedKvPath::kStaged ? "staged"
                                                          : "auto";
      for (auto [op, runs, ceil] : {std::tuple{"save", *save, dev ? c_.d2d : c_.d2h},
                                    std::tuple{"load", *load, dev ? c_.d2d : c_.h2d}}) {
        double g = gbps(total, runs.median());
        results_.add(fmt(
            "{\"op\": \"paged_kv_%s\", \"layout\": \"packed_kv\", \"tokens\": %d, \"layers\": %d, "
            "\"store\": \"%s\", \"placement\": \"%s\", \"path\": \"%s\", \"bytes\": %llu, \"ms\": "
            "%.3f, "
            "\"gbps\": %.2f, \"gbps_best\": %.2f, \"ceiling_gbps\": %.2f, \"ratio\": %.3f}",
            op, o_.kv_tokens, layers, k.store, k.placement, path, (unsigned long long)total,
            runs.median() * 1e3, g, gbps(total, runs.best()), ceil, g / ceil));
        std::fprintf(stderr,
                     "  paged_kv_%s %-14s %-8s %-6s %8.3f ms  %7.2f GB/s  (%.0f%% of %.1f)\n", op,
                     k.store, k.placement, path, runs.median() * 1e3, g, 100 * g / ceil, ceil);
      }
    }
    unregister_host_memory((*host)->base());
    return Status::OK();
  }

  const GpuBenchOptions o_;
  DeviceContext* ctx_ = nullptr;
  std::string device_name_;
  int driver_ = 0, runtime_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<ShmArena> src_, dst_;
  PinnedBuffer pinned_;
  DeviceBuffer dev1_, dev2_;
  std::unique_ptr<ThreadPool> pool_;
  Ceilings c_;
  JsonList results_;

 public:
  ~Bench() {
    if (src_) unregister_host_memory(src_->base());
    if (dst_) unregister_host_memory(dst_->base());
    if (stream_) cudaStreamDestroy(stream_);
  }
};

}  // namespace

Result<std::string> run_gpu_bench(const GpuBenchOptions& options) {
  Bench b(options);
  return b.run();
}

}  // namespace cascade
