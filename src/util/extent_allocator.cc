#include "util/extent_allocator.h"

#include <algorithm>

namespace cascade {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t unit)
    : capacity_(capacity & ~(unit - 1)), unit_(unit) {
  reset();
}

void ExtentAllocator::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  by_offset_.clear();
  by_size_.clear();
  if (capacity_) insert_free(0, capacity_);
  used_ = 0;
}

void ExtentAllocator::insert_free(uint64_t off, uint64_t len) {
  by_offset_.emplace(off, len);
  by_size_.emplace(len, off);
}

std::optional<uint64_t> ExtentAllocator::allocate(uint64_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  return allocate_locked(size);
}

size_t ExtentAllocator::allocate_batch(std::span<const uint64_t> sizes,
                                       std::span<std::optional<uint64_t>> out) {
  size_t placed = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < sizes.size() && i < out.size(); ++i) {
    out[i] = allocate_locked(sizes[i]);
    placed += out[i].has_value();
  }
  return placed;
}

std::optional<uint64_t> ExtentAllocator::allocate_locked(uint64_t size) {
  const uint64_t need = round_up(size);
  if (need == 0 || need > capacity_) return std::nullopt;
  auto it = by_size_.lower_bound({need, 0});
  if (it == by_size_.end()) return std::nullopt;
  auto [len, off] = *it;
  by_size_.erase(it);
  by_offset_.erase(off);
  if (len > need) insert_free(off + need, len - need);
  used_ += need;
  high_water_ = std::max(high_water_, off + need);
  return off;
}

bool ExtentAllocator::take(uint64_t offset, uint64_t size) {
  const uint64_t need = round_up(size);
  if (need == 0 || (offset & (unit_ - 1)) != 0 || offset > capacity_ || need > capacity_ - offset)
    return false;
  std::lock_guard<std::mutex> lock(mu_);
  // The free extent that starts at or before offset must cover the range.
  auto it = by_offset_.upper_bound(offset);
  if (it == by_offset_.begin()) return false;
  --it;
  const auto [off, len] = *it;
  if (off + len < offset + need) return false;
  by_size_.erase({len, off});
  by_offset_.erase(it);
  if (offset > off) insert_free(off, offset - off);
  if (off + len > offset + need) insert_free(offset + need, off + len - (offset + need));
  used_ += need;
  high_water_ = std::max(high_water_, offset + need);
  return true;
}

void ExtentAllocator::free(uint64_t offset, uint64_t size) {
  uint64_t len = round_up(size);
  if (len == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  used_ -= len;
  uint64_t off = offset;
  auto next = by_offset_.lower_bound(off);
  if (next != by_offset_.end() && next->first == off + len) {  // merge right
    len += next->second;
    by_size_.erase({next->second, next->first});
    next = by_offset_.erase(next);
  }
  if (next != by_offset_.begin()) {  // merge left
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      by_size_.erase({prev->second, prev->first});
      by_offset_.erase(prev);
    }
  }
  insert_free(off, len);
}

uint64_t ExtentAllocator::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

uint64_t ExtentAllocator::high_water() const {
  std::lock_guard<std::mutex> lock(mu_);
  return high_water_;
}

uint64_t ExtentAllocator::largest_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

size_t ExtentAllocator::free_extents() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_offset_.size();
}

double ExtentAllocator::fragmentation() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t total = capacity_ - used_;
  if (total == 0 || by_size_.empty()) return 0.0;
  return 1.0 - static_cast<double>(by_size_.rbegin()->first) / static_cast<double>(total);
}

}  // namespace cascade
