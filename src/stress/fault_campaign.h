// Fault-injection campaign over the file tier (`cascade stress faults`).
//
// A fixed, single-threaded workload (puts, reads, removes, flushes, a
// compaction, close) runs on a FileTier whose Env is a PointFaultEnv. A
// clean run numbers the Env calls it makes; then, for each chosen call k
// and fault kind, the workload runs again in a fresh directory with call k
// failing, and the directory is reopened with a clean Env and read back:
//   - every read, during the faulted run and after reopen, is a miss or the
//     exact bytes of the block (contents derive from id and seed, so every
//     byte is checked): anything else counts in `wrong`;
//   - every block whose put and a later flush() both returned OK (and that
//     was not removed afterwards) is found after reopen: else `lost`;
//   - the reopen itself succeeds: else `reopen_failures`.
// Crashes and hangs are caught by the caller, which runs campaigns in a
// child process and watches `progress_path`.
//
// Thread-safety: independent campaigns may run in parallel on different
// directories.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cascade/status.h"
#include "stress/fault_env.h"

namespace cascade::stress {

struct FaultCampaignOptions {
  std::string dir;          // scratch directory; emptied before each run
  uint64_t seed = 1;        // block contents, workload choices, torn prefixes
  int puts = 40;            // puts in the workload
  uint64_t key_space = 24;  // ids drawn from [0, key_space): re-puts and removes collide
  uint64_t max_block_bytes = 20 << 10;  // block sizes in [256, max_block_bytes)
  uint64_t segment_bytes = 64 << 10;    // small: segments seal (summaries) during the run
  uint64_t capacity_bytes = 0;          // file_capacity_bytes (0: unbounded)
  std::string progress_path;            // rewritten with "kind@index" before each point (optional)
};

struct FaultPoint {
  FaultKind kind = FaultKind::kEio;
  uint64_t index = 0;                 // Env call number in the clean run
  EnvCall call = EnvCall::kOpenRead;  // what the clean run made there (informative)
};

struct FaultCampaignResult {
  uint64_t env_calls = 0;        // calls of the clean run
  uint64_t points = 0;           // faulted runs made
  uint64_t fired = 0;            // runs where the armed call was reached
  uint64_t injected = 0;         // calls that failed because of a fault (a full disk fails many)
  uint64_t failed_ops = 0;       // workload operations that returned an error
  uint64_t open_failures = 0;    // faulted runs whose open failed (the workload then stops)
  uint64_t reopen_failures = 0;  // clean reopens that failed: a failure
  uint64_t acked = 0;            // blocks put and flushed, summed over runs
  uint64_t reads = 0, hits = 0, misses = 0;
  uint64_t wrong = 0;                 // reads that returned bytes other than the block's
  uint64_t lost = 0;                  // acknowledged blocks missing after reopen
  std::vector<std::string> failures;  // the first few, described
};

// The clean run: the Env calls the workload makes, in order (index = call
// number). Fails when the clean run itself loses or corrupts a block.
Result<std::vector<EnvCall>> trace_fault_workload(const FaultCampaignOptions& options);

// Every point of the given kinds for a trace: eio at every call, torn and
// enospc at every write.
std::vector<FaultPoint> all_fault_points(const std::vector<EnvCall>& trace,
                                         const std::vector<FaultKind>& kinds);

// Runs the workload once per point (see above) and adds up what it found.
FaultCampaignResult run_fault_points(const FaultCampaignOptions& options,
                                     const std::vector<FaultPoint>& points);

}  // namespace cascade::stress
