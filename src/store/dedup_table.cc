#include "store/dedup_table.h"

#include <xxhash.h>

#include <algorithm>

namespace cascade {

BlockId content_fingerprint(const void* data, uint64_t size) {
  XXH128_hash_t h = XXH3_128bits(size ? data : "", size);
  BlockId id;
  std::memcpy(id.bytes.data(), &h.high64, 8);
  std::memcpy(id.bytes.data() + 8, &h.low64, 8);
  id.bytes[15] = 0xdd;  // marker: a dedup physical id
  return id;
}

std::optional<BlockId> DedupTable::resolve(const BlockId& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = alias_.find(id);
  if (it == alias_.end()) return std::nullopt;
  return it->second.physical;
}

bool DedupTable::link(const BlockId& id, const BlockId& p, uint64_t size, bool* shared) {
  std::lock_guard<std::mutex> lock(mu_);
  return link_locked(id, p, size, false, shared);
}

bool DedupTable::load(const BlockId& id, const BlockId& p, uint64_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  bool shared = false;
  return link_locked(id, p, size, true, &shared);
}

bool DedupTable::link_locked(const BlockId& id, const BlockId& p, uint64_t size, bool written,
                             bool* shared) {
  if (!alias_.emplace(id, Alias{p, written}).second) return false;
  Record& r = records_[p];
  *shared = !r.aliases.empty();
  if (!*shared) unique_bytes_ += size;
  r.size = size;
  r.aliases.insert(id);
  logical_bytes_ += size;
  return true;
}

std::optional<std::pair<BlockId, bool>> DedupTable::unlink(const BlockId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = alias_.find(id);
  if (it == alias_.end()) return std::nullopt;
  BlockId p = it->second.physical;
  alias_.erase(it);
  bool last = true;
  auto rit = records_.find(p);
  if (rit != records_.end()) {
    auto& v = rit->second.aliases;
    v.erase(id);
    logical_bytes_ -= rit->second.size;
    last = v.empty();
    if (last) {
      unique_bytes_ -= rit->second.size;
      records_.erase(rit);
    }
  }
  return std::make_pair(p, last);
}

void DedupTable::drop(const BlockId& p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto rit = records_.find(p);
  if (rit == records_.end()) return;
  for (const BlockId& a : rit->second.aliases) {
    alias_.erase(a);
    logical_bytes_ -= rit->second.size;
  }
  unique_bytes_ -= rit->second.size;
  records_.erase(rit);
}

void DedupTable::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  alias_.clear();
  records_.clear();
  logical_bytes_ = 0;
  unique_bytes_ = 0;
}

bool DedupTable::is_target(const BlockId& p) const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_.count(p) != 0;
}

std::vector<std::pair<BlockId, BlockId>> DedupTable::unwritten() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<BlockId, BlockId>> out;
  for (const auto& [id, a] : alias_)
    if (!a.written) out.emplace_back(id, a.physical);
  return out;
}

uint64_t DedupTable::epoch_of(const BlockId& p) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = records_.find(p);
  return r == records_.end() ? 0 : r->second.epoch;
}

void DedupTable::mark_written(const BlockId& id, const BlockId& p, uint64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = alias_.find(id);
  auto r = records_.find(p);
  if (it != alias_.end() && it->second.physical == p && r != records_.end() &&
      r->second.epoch == epoch)
    it->second.written = true;
}

void DedupTable::mark_unwritten(const BlockId& p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = records_.find(p);
  if (r == records_.end()) return;
  ++r->second.epoch;
  for (const BlockId& id : r->second.aliases) {
    auto it = alias_.find(id);
    if (it != alias_.end()) it->second.written = false;
  }
}

uint64_t DedupTable::aliases() const {
  std::lock_guard<std::mutex> lock(mu_);
  return alias_.size();
}

uint64_t DedupTable::logical_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return logical_bytes_;
}

uint64_t DedupTable::unique_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unique_bytes_;
}

}  // namespace cascade
