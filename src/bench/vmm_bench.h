// The map-parallelism benchmark: how fast CUDA virtual-memory mapping of KV
// pages is, in one process and spread over several.
//
// A "page" is one KV page: for every layer a 2 MiB physical page for K and
// one for V. Layouts:
//   - contiguous: all layers in one virtual range; a page is one compound
//     allocation of 2 * layers * 2 MiB (cuMemCreate, cuMemMap, cuMemSetAccess
//     once each);
//   - not contiguous: one virtual range per layer and K/V tensor; a page is
//     2 * layers separate 2 MiB pages, each created, mapped and made
//     accessible on its own;
//   - arena (Cascade's gpu tier): the same bytes in the arena's physical
//     pages (arena_page_mib), created ahead of time as its pool does,
//     mapped into one range, access set once for the whole range.
// Cases, each in freshly forked processes that start every iteration
// together (a barrier in shared memory): single (1 process maps N/P pages),
// serial (1 process maps N), parallel (P processes map N/P each; process r
// uses GPU r mod the GPU count). An iteration's wall time runs from the
// earliest start to the latest end over the processes; pages are unmapped
// and released outside the timed part.
//
// REQUIRES for run_vmm_bench: this process has not initialized CUDA (the
// children are forked and CUDA does not survive fork). A fresh process, or
// the cascade-gpu-bench program, satisfies it.
//
// Thread-safety: run_vmm_bench forks; call it from one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cascade/status.h"

namespace cascade {

struct VmmBenchOptions {
  int pages_total = 100;  // N: KV pages mapped per iteration
  int procs = 4;          // P
  int iters = 20;         // K timed iterations per case
  int warmup = 1;         // untimed iterations first
  bool contiguous = true;
  int layers = 32;          // layers of the modelled KV cache (Llama-3-8B)
  bool arena_case = true;   // also time the gpu tier's way of mapping
  int arena_page_mib = 32;  // its physical page size (GpuArenaOptions::page_bytes)
};

struct VmmCase {
  std::string name;  // "single", "serial", "parallel", "arena"
  int procs = 0;
  int pages_per_proc = 0;
  int pages_total = 0;
  std::vector<double> wall_ms;  // per iteration
  double mean_ms = 0, p95_ms = 0, max_ms = 0, min_ms = 0;
};

struct VmmBenchResult {
  VmmBenchOptions options;
  std::string device_name;
  int gpus = 0;
  uint64_t page_bytes = 0;  // physical page size used (2 MiB)
  VmmCase single, serial, parallel, arena;
  double speedup_mean = 0;  // serial mean / parallel mean
};

Result<VmmBenchResult> run_vmm_bench(const VmmBenchOptions& options);

// Fills mean/p95/max/min from wall_ms (p95: nearest rank).
void summarize_vmm_case(VmmCase* c);
// The text report: three tables and the speedup line (plus the arena table).
std::string format_vmm_report(const VmmBenchResult& r);
std::string vmm_report_json(const VmmBenchResult& r);

}  // namespace cascade
