// Victims of a memory tier whose blocks live in one arena (host, gpu): each
// claimed index entry becomes a Victim whose view leases the block's bytes
// in place, so the store can copy it down before removing it.
#pragma once

#include <vector>

#include "cascade/tier.h"
#include "index/block_index.h"

namespace cascade {

inline std::vector<Victim> arena_victims(Tier* tier, std::vector<BlockIndex::Claimed> claims,
                                         const uint8_t* base, MemoryKind kind) {
  std::vector<Victim> out;
  out.reserve(claims.size());
  for (auto& c : claims) {
    Victim v;
    v.id = c.id;
    v.size = c.lease.loc.size;
    v.is_prefix = c.lease.is_prefix;
    v.view = BlockView(tier, base + c.lease.loc.offset, v.size, kind, c.lease.token);
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace cascade
