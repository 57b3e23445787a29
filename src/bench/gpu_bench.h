// The gpu tier's throughput benchmark: every transfer path of the tier and
// of paged KV transfer, each beside its hardware ceiling measured in the
// same process (cudaMemcpy with pinned memory for PCIe, device-to-device
// cudaMemcpy for HBM), reported as JSON with the ratio measured/ceiling.
//
// Host memory for blocks is what the host tier uses: /dev/shm mappings
// registered with CUDA (lazily, by 64 MiB chunk). Times are wall-clock
// around each call (calls return when their bytes have arrived); a figure
// is the median over `repeats` runs, with the best run beside it. The first
// run of each tier (mapping fresh GPU pages, registering host chunks) is
// reported separately as "cold".
//
// Thread-safety: call from one thread; it uses the whole GPU for a minute.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cascade/status.h"

namespace cascade {

struct GpuBenchOptions {
  int device = 0;
  uint64_t total_bytes = 1ULL << 30;  // bytes moved per measurement
  std::vector<uint64_t> block_sizes = {16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20};
  std::vector<uint64_t> device_block_sizes = {64 << 10, 1 << 20, 4 << 20, 16 << 20};
  int repeats = 5;
  // Paged KV case: a Llama-3-8B-shaped cache (32 layers, 8 KV heads, head
  // 128, bf16, 16-token blocks) holding this many tokens. 0 skips it.
  int kv_tokens = 16384;
  bool compare_methods = true;  // scattered batches through every small-copy method
  std::string shm_dir = "/dev/shm";
};

// JSON text (see docs/benchmarks.md for the fields).
Result<std::string> run_gpu_bench(const GpuBenchOptions& options);

}  // namespace cascade
