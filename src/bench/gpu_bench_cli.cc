// Command line of the GPU benchmarks. See gpu_bench_cli.h.
#include "bench/gpu_bench_cli.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bench/gpu_bench.h"
#include "bench/vmm_bench.h"

namespace cascade {
namespace {

int usage() {
  std::fprintf(
      stderr,
      "usage: cascade-gpu-bench vmm --pages-total N --procs P --iters K [--not-contiguous]\n"
      "                             [--layers L] [--warmup W] [--no-arena] [--arena-page-mib M] "
      "[--json]\n"
      "       cascade-gpu-bench transfers [--device D] [--total-mib M] [--repeats R]\n"
      "                             [--kv-tokens T] [--no-methods] [--shm-dir DIR]\n");
  return 2;
}

// Value of an option taking one argument, advancing i. nullptr when missing.
const char* value(int argc, char** argv, int* i) {
  if (*i + 1 >= argc) return nullptr;
  return argv[++*i];
}

bool to_int(const char* s, long long* out) {
  if (!s || !*s) return false;
  char* end = nullptr;
  *out = std::strtoll(s, &end, 10);
  return *end == '\0';
}

int run_vmm(int argc, char** argv) {
  VmmBenchOptions o;
  bool json = false;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    long long v = 0;
    if (a == "--not-contiguous") o.contiguous = false;
    else if (a == "--json") json = true;
    else if (a == "--no-arena") o.arena_case = false;
    else if (a == "--pages-total" && to_int(value(argc, argv, &i), &v)) o.pages_total = int(v);
    else if (a == "--procs" && to_int(value(argc, argv, &i), &v)) o.procs = int(v);
    else if (a == "--iters" && to_int(value(argc, argv, &i), &v)) o.iters = int(v);
    else if (a == "--layers" && to_int(value(argc, argv, &i), &v)) o.layers = int(v);
    else if (a == "--warmup" && to_int(value(argc, argv, &i), &v)) o.warmup = int(v);
    else if (a == "--arena-page-mib" && to_int(value(argc, argv, &i), &v))
      o.arena_page_mib = int(v);
    else return usage();
  }
  auto r = run_vmm_bench(o);
  if (!r.ok()) {
    std::fprintf(stderr, "vmm benchmark: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::string out = json ? vmm_report_json(*r) + "\n" : format_vmm_report(*r);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int run_transfers(int argc, char** argv) {
  GpuBenchOptions o;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    long long v = 0;
    if (a == "--no-methods") o.compare_methods = false;
    else if (a == "--device" && to_int(value(argc, argv, &i), &v)) o.device = int(v);
    else if (a == "--total-mib" && to_int(value(argc, argv, &i), &v))
      o.total_bytes = uint64_t(v) << 20;
    else if (a == "--repeats" && to_int(value(argc, argv, &i), &v)) o.repeats = int(v);
    else if (a == "--kv-tokens" && to_int(value(argc, argv, &i), &v)) o.kv_tokens = int(v);
    else if (a == "--shm-dir") {
      const char* d = value(argc, argv, &i);
      if (!d) return usage();
      o.shm_dir = d;
    } else {
      return usage();
    }
  }
  auto r = run_gpu_bench(o);
  if (!r.ok()) {
    std::fprintf(stderr, "gpu benchmark: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::fwrite(r->data(), 1, r->size(), stdout);
  return 0;
}

}  // namespace

int gpu_bench_main(int argc, char** argv) {
  if (argc < 2) return usage();
  if (std::strcmp(argv[1], "vmm") == 0) return run_vmm(argc, argv);
  if (std::strcmp(argv[1], "transfers") == 0) return run_transfers(argc, argv);
  return usage();
}

}  // namespace cascade
