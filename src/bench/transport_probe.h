// Transfers between two processes over the Transport, for
// `cascade bench transport`: the latency of one get by block size, and the
// bandwidth of batched gets with several outstanding.
//
// The probe forks a child that serves a registered region (ForkedPeer), then
// reads it from this process into registered memory. Every block size's
// first read and the last batch are compared byte for byte with what the
// child wrote; a mismatch fails the probe.
//
// REQUIRES: no Transport is open in this process (the child is forked first).
// Thread-safety: one probe at a time per process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cascade/status.h"

namespace cascade {

struct TransportProbeOptions {
  std::string fabrics;  // UCX_TLS names; empty: UCX's choice
  bool require_failure_detection = true;
  std::vector<uint64_t> sizes;           // block sizes of the latency table
  uint64_t max_iterations = 2000;        // gets timed per size, at most...
  uint64_t bytes_per_size = 1ull << 30;  // ...and about this many bytes per size
  uint64_t batch_block = 1ull << 20;
  uint32_t outstanding = 8;  // gets in flight per batch
  // Successive batches read successive ranges of a region this large (rounded
  // down to whole batches), so that they come from memory, not caches.
  uint64_t batch_span = 256ull << 20;
  double batch_seconds = 1.0;
};

struct TransportLatency {
  uint64_t bytes = 0;
  uint64_t count = 0;
  double median_us = 0;
  double p99_us = 0;
};

struct TransportProbeResult {
  std::vector<TransportLatency> latency;
  uint64_t batch_bytes = 0;  // bytes read by the batches
  double batch_gbps = 0;     // 1e9 bytes per second
  double connect_ms = 0;
};

Result<TransportProbeResult> transport_probe(const TransportProbeOptions& options);

}  // namespace cascade
