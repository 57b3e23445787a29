#include "tiers/host/block_table.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace cascade {

namespace {

// Orders the plain stores before it against the stores after it (compiler
// and CPU): a crash shows the slot's bytes in program order.
inline void store_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

}  // namespace

BlockTable::BlockTable(void* slots, uint32_t count, const uint8_t* key, size_t key_bytes)
    : table_(static_cast<Slot*>(slots)), count_(count), mem_(count) {
  static_assert(sizeof(secret_) >= XXH3_SECRET_SIZE_MIN, "XXH3 secret too small");
  (void)XXH3_generateSecret(secret_, sizeof(secret_), key, key_bytes);
  check_seed_ = XXH3_64bits_withSecret("slot", 4, secret_, sizeof(secret_));
  free_.reserve(count);
  for (uint32_t i = count; i-- > 0;) free_.push_back(i);  // lowest slot first
}

uint64_t BlockTable::checksum(const void* data, uint64_t n) const {
  return XXH3_64bits_withSecret(n ? data : "", n, secret_, sizeof(secret_));
}

uint64_t BlockTable::slot_check(uint32_t i, const Slot& s) const {
  return XXH3_64bits_withSecretandSeed(&s, offsetof(Slot, check), secret_, sizeof(secret_),
                                       check_seed_ ^ (uint64_t(i) * 0x9E3779B97F4A7C15ull));
}

void BlockTable::write_slot(uint32_t i, const Slot& s) {
  Slot* dst = &table_[i];
  std::memcpy(dst, &s, offsetof(Slot, check));
  store_fence();
  std::atomic_ref<uint64_t>(dst->check).store(slot_check(i, s), std::memory_order_release);
}

void BlockTable::clear_slot(uint32_t i) {
  Slot* dst = &table_[i];
  std::atomic_ref<uint64_t>(dst->check).store(0, std::memory_order_relaxed);
  store_fence();
  std::memset(dst, 0, offsetof(Slot, check));
  store_fence();
}

bool BlockTable::add(const BlockId& id, const Location& loc, bool is_prefix, Pending* pending) {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) return false;
  const uint32_t i = free_.back();
  free_.pop_back();
  Slot s{};
  std::memcpy(s.block_id, id.bytes.data(), 16);
  s.offset = loc.offset;
  s.size = loc.size;
  s.flags = is_prefix ? kFlagPrefix : 0;
  s.state = kWritten;
  s.sequence = next_sequence_++;
  write_slot(i, s);
  Mem& m = mem_[i];
  ++m.gen;
  m.state = kWritten;
  by_offset_[loc.offset] = i;
  *pending = Pending{i, m.gen, s};
  return true;
}

void BlockTable::drop(uint64_t offset) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = by_offset_.find(offset);
  if (it == by_offset_.end()) return;
  const uint32_t i = it->second;
  by_offset_.erase(it);
  Mem& m = mem_[i];
  sealed_cv_.wait(lock, [&] { return !m.sealing; });
  clear_slot(i);
  ++m.gen;  // a pending seal of the old block finds the slot changed
  m.state = kEmpty;
  free_.push_back(i);
}

void BlockTable::seal(const Pending& p, const uint8_t* base) {
  Slot s = p.written;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Mem& m = mem_[p.slot];
    if (m.gen != p.gen || m.state != kWritten) return;  // dropped, or sealed already
    m.sealing = true;
  }
  // The range cannot be freed meanwhile: drop() waits for sealing to end.
  s.checksum = checksum(base + s.offset, s.size);
  s.state = kSealed;
  std::lock_guard<std::mutex> lock(mu_);
  Mem& m = mem_[p.slot];
  write_slot(p.slot, s);
  m.state = kSealed;
  m.sealing = false;
  sealed_cv_.notify_all();
}

std::vector<BlockTable::Found> BlockTable::scan(uint64_t capacity, uint64_t unit,
                                                uint64_t* dropped) {
  std::vector<Found> out;
  uint64_t bad = 0;
  for (uint32_t i = 0; i < count_; ++i) {
    Slot s;
    std::memcpy(&s, &table_[i], sizeof s);
    bool zero = s.check == 0;
    if (zero) {
      const auto* b = reinterpret_cast<const uint8_t*>(&s);
      zero = std::all_of(b, b + sizeof s, [](uint8_t x) { return x == 0; });
    }
    if (zero) continue;
    const bool ok = s.check == slot_check(i, s) && s.state == kSealed &&
                    (s.flags & ~kFlagPrefix) == 0 && s.size > 0 && s.size <= capacity &&
                    s.offset <= capacity - s.size && (s.offset & (unit - 1)) == 0;
    if (!ok) {
      clear_slot(i);
      ++bad;
      continue;
    }
    Found f;
    f.slot = i;
    std::memcpy(f.id.bytes.data(), s.block_id, 16);
    f.loc = Location{s.offset, s.size};
    f.is_prefix = (s.flags & kFlagPrefix) != 0;
    f.checksum = s.checksum;
    f.sequence = s.sequence;
    out.push_back(f);
  }
  // Ranges that overlap cannot all be right: none of them is trusted. Two
  // slots of one id: the later publication is kept.
  std::sort(out.begin(), out.end(),
            [](const Found& a, const Found& b) { return a.loc.offset < b.loc.offset; });
  std::vector<bool> keep(out.size(), true);
  uint64_t reach = 0;  // end of the furthest range so far
  size_t reach_from = SIZE_MAX;
  for (size_t k = 0; k < out.size(); ++k) {
    const uint64_t end = out[k].loc.offset + ((out[k].loc.size + unit - 1) & ~(unit - 1));
    if (reach_from != SIZE_MAX && out[k].loc.offset < reach) {
      keep[k] = false;
      keep[reach_from] = false;
    }
    if (end > reach) {
      reach = end;
      reach_from = k;
    }
  }
  std::unordered_map<BlockId, size_t> by_id;
  for (size_t k = 0; k < out.size(); ++k) {
    if (!keep[k]) continue;
    auto [it, fresh] = by_id.emplace(out[k].id, k);
    if (fresh) continue;
    size_t& best = it->second;
    if (out[k].sequence > out[best].sequence) {
      keep[best] = false;
      best = k;
    } else {
      keep[k] = false;
    }
  }
  std::vector<Found> kept;
  kept.reserve(out.size());
  for (size_t k = 0; k < out.size(); ++k) {
    if (keep[k]) {
      kept.push_back(out[k]);
    } else {
      clear_slot(out[k].slot);
      ++bad;
    }
  }
  *dropped += bad;
  return kept;
}

void BlockTable::adopt(const std::vector<Found>& verified) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Found& f : verified) {
    Mem& m = mem_[f.slot];
    ++m.gen;
    m.state = kSealed;
    by_offset_[f.loc.offset] = f.slot;
    next_sequence_ = std::max(next_sequence_, f.sequence + 1);
  }
  free_.clear();
  for (uint32_t i = count_; i-- > 0;)
    if (mem_[i].state == kEmpty) free_.push_back(i);
}

void BlockTable::discard(uint32_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mem_[slot].state == kEmpty) clear_slot(slot);
}

}  // namespace cascade
