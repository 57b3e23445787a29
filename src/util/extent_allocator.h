// ExtentAllocator: hands out byte ranges of a fixed-size arena.
//
// Best fit over free extents kept two ways (by offset, for coalescing on
// free; by size, for the fit), lowest offset among equal fits so the arena's
// high-water mark, and so its committed memory, stays low. Sizes round up to
// the unit (4 KiB for the host arena: page, DMA and O_DIRECT friendly). No
// system call: the arena's memory is committed separately.
//
// Thread-safety: one mutex; each call is a few map operations.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <utility>

namespace cascade {

class ExtentAllocator {
 public:
  // REQUIRES: unit is a power of two.
  ExtentAllocator(uint64_t capacity, uint64_t unit);

  // Offset of a free range of at least `size` bytes, or nullopt. size 0 is
  // never passed (callers store empty blocks without space).
  std::optional<uint64_t> allocate(uint64_t size);
  // allocate() of every size under one lock: out[i] (out.size() ==
  // sizes.size()) as allocate(sizes[i]) called in order. Returns how many
  // were placed.
  size_t allocate_batch(std::span<const uint64_t> sizes, std::span<std::optional<uint64_t>> out);
  // REQUIRES: (offset, size) came from allocate() and was not freed since.
  void free(uint64_t offset, uint64_t size);
  // Marks [offset, offset + round_up(size)) used (a range adopted from an
  // earlier run). false, and nothing changes, when size is 0, offset is not
  // a multiple of the unit, or any byte of the range is not free. The range
  // is given back with free() like an allocated one.
  bool take(uint64_t offset, uint64_t size);
  void reset();  // everything free again

  uint64_t round_up(uint64_t size) const { return (size + unit_ - 1) & ~(unit_ - 1); }
  uint64_t capacity() const { return capacity_; }
  uint64_t used() const;        // bytes handed out (rounded)
  uint64_t high_water() const;  // end of the highest range ever handed out
  uint64_t largest_free() const;
  size_t free_extents() const;
  // 1 - largest_free / total_free: 0 when free space is one extent.
  double fragmentation() const;

 private:
  void insert_free(uint64_t off, uint64_t len);            // REQUIRES: mu_ held
  std::optional<uint64_t> allocate_locked(uint64_t size);  // REQUIRES: mu_ held
  const uint64_t capacity_;
  const uint64_t unit_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> by_offset_;           // offset -> length
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (length, offset)
  uint64_t used_ = 0;
  uint64_t high_water_ = 0;
};

}  // namespace cascade
