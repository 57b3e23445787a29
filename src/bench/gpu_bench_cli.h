// The command line of the GPU benchmarks, as a function so any executable
// (cmake/gpu.cmake builds cascade-gpu-bench from it) or binding can run it:
//
//   vmm --pages-total N --procs P --iters K [--not-contiguous] [--layers L]
//       [--warmup W] [--no-arena] [--arena-page-mib M] [--json]
//       the map-parallelism benchmark (text report, or JSON)
//   transfers [--device D] [--total-mib M] [--repeats R] [--kv-tokens T]
//       [--no-methods] [--shm-dir DIR]
//       tier and paged-KV throughput with ceilings (JSON on stdout,
//       a summary on stderr)
//
// Returns the process exit code (0 ok, 1 failure, 2 usage).
// Thread-safety: call from the main thread of a process that has not
// initialized CUDA (the vmm benchmark forks).
#pragma once

namespace cascade {

int gpu_bench_main(int argc, char** argv);

}  // namespace cascade
