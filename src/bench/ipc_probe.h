// Round trips between processes, for `cascade bench pool`: the node pool's
// metadata requests against a Unix socket ping-pong, the alternative they
// were chosen over (docs/design.md, "Node pool").
#pragma once

#include <cstdint>
#include <string>

#include "cascade/status.h"

namespace cascade {

struct RoundTrips {
  uint64_t count = 0;
  double median_us = 0;
  double p99_us = 0;
};

// A SOCK_SEQPACKET socket pair between this process and a forked child that
// echoes 64-byte messages back.
Result<RoundTrips> socket_round_trips(uint64_t count);

struct PoolRoundTrips {
  RoundTrips lookup;  // contains() of one id
  RoundTrips put;     // a put of one 64-byte block: reserve, copy, commit
};
// Small requests of a client of the pool server at `socket`, in `name_space`.
Result<PoolRoundTrips> pool_round_trips(const std::string& socket, const std::string& name_space,
                                        uint64_t count);

// Batched lookups of `batch` ids for `seconds`, on `threads` threads of one
// client: ids looked up per second.
Result<double> pool_lookup_rate(const std::string& socket, const std::string& name_space,
                                uint32_t batch, double seconds, int threads);

}  // namespace cascade
