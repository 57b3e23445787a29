// ShmBackend: the host shared-memory tier used on its own, as the seed API's
// `ShmBackend(capacity_bytes, path)`.
//
// Unlike a CascadeStore it never evicts: put fails with NoSpace when the
// arena is full. Use CascadeStore for a cache; use this to measure or to
// manage placement yourself.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cascade/block_id.h"
#include "cascade/stats.h"
#include "cascade/status.h"

namespace cascade {

class ShmBackend {
 public:
  // threads: copy threads for large blocks (0 = one per core).
  static Result<std::unique_ptr<ShmBackend>> Open(uint64_t capacity_bytes, const std::string& path,
                                                  int threads = 0);
  ~ShmBackend();

  Status put(const BlockId& id, const void* data, uint64_t size);
  // A miss is OK with *found false. Out too small: InvalidArgument, *found
  // true, *size the block's size, nothing written.
  Status get(const BlockId& id, void* out, uint64_t capacity, bool* found, uint64_t* size);
  bool contains(const BlockId& id) const;
  Status remove(const BlockId& id);
  void clear();
  TierStats stats() const;

 private:
  struct Parts;
  explicit ShmBackend(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace cascade
