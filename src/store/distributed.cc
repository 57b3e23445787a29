// Parts of cascade/distributed.h that need no MPI.
#include <memory>
#include <mutex>
#include <string>

#include "cascade/distributed.h"
#include "tiers/remote/hash_ring.h"

namespace cascade {

Status DistributedOptions::validate() const {
  if (request_timeout_ms == 0)
    return Status::InvalidArgument(
        "request_timeout_ms is 0: a rank must wait some time for an owner's answer");
  if (ring_points_per_rank < 1 || ring_points_per_rank > 4096)
    return Status::InvalidArgument("ring_points_per_rank must be from 1 to 4096");
  if (static_cast<uint8_t>(checksum) > static_cast<uint8_t>(RemoteChecksum::kAlways))
    return Status::InvalidArgument("checksum is not one of off, cross_node, always");
  return Status::OK();
}

int ring_owner(const BlockId& id, int ranks, int points_per_rank) {
  if (ranks < 1 || points_per_rank < 1) return -1;
  // Building a ring sorts ranks * points positions: keep the last one.
  thread_local std::unique_ptr<remote::HashRing> ring;
  thread_local int ring_points = 0;
  if (!ring || ring->ranks() != ranks || ring_points != points_per_rank) {
    ring = std::make_unique<remote::HashRing>(ranks, points_per_rank);
    ring_points = points_per_rank;
  }
  return ring->owner(id);
}

}  // namespace cascade
