// SimulatedDiskTier: a persistent tier held in memory, for store tests.
//
// Its SimulatedDisk outlives the tier, so a store opened again on the same
// disk finds what an earlier store left there, as with the file tier. Puts
// and aliases are "written" at once (pending) and become durable at
// flush(). kill() ends the writer as a crash would: with power_loss the
// pending writes are gone too, and every later call on the disk fails until
// a new tier is opened on it. Removals are not written down (as in the file
// tier), and as there an id written as a block and as an alias is, on
// reopen, what was written last. Failures can be injected per id, for
// aliases and for flush.
//
// Thread-safety: one mutex per disk; every method is thread-safe.
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "cascade/tier.h"
#include "cuda/device_copy.h"

namespace cascade {

struct SimulatedDisk {
  std::mutex mu;
  std::map<BlockId, std::vector<uint8_t>> durable, pending;
  struct AliasRecord {
    BlockId alias, target;
    uint64_t sequence = 0;
  };
  std::vector<AliasRecord> durable_aliases, pending_aliases;  // oldest first
  std::map<BlockId, uint64_t> block_sequence;                 // of each id's last block write
  uint64_t next_sequence = 1;
  bool dead = false;
  uint64_t capacity = 0;        // 0: unbounded
  std::set<BlockId> fail_puts;  // put fails with IOError for these ids
  bool fail_every_put = false;  // put of a block not stored fails with IOError
  // read of these ids fails with InvalidArgument although the request fits,
  // as a device copy the driver refuses does
  std::set<BlockId> refuse_copies;
  bool fail_aliases = false;  // put_alias fails with IOError
  bool fail_flush = false;    // flush fails with IOError
  uint64_t flushes = 0;
  uint64_t opens = 0;  // tiers opened on it: each open is a new identity
  // Called around each put, before each remove and after each read
  // (outside the lock), to hold a copy in flight.
  std::function<void(const BlockId&)> before_put, after_put, before_remove, after_read;
  uint64_t reads = 0;  // read() calls, hits and misses

  void kill(bool power_loss) {
    std::lock_guard<std::mutex> lock(mu);
    if (power_loss) {
      pending.clear();
      pending_aliases.clear();
    }
    dead = true;
  }
};

class SimulatedDiskTier final : public Tier {
 public:
  explicit SimulatedDiskTier(std::shared_ptr<SimulatedDisk> disk) : disk_(std::move(disk)) {
    std::lock_guard<std::mutex> lock(disk_->mu);
    disk_->dead = false;  // a new writer
    open_ = ++disk_->opens;
    for (auto* m : {&disk_->durable, &disk_->pending})
      for (auto& [id, bytes] : *m) {
        if (!live_.emplace(id, bytes).second) continue;
        order_.push_back(id);
        used_ += bytes.size();
      }
    for (auto* v : {&disk_->durable_aliases, &disk_->pending_aliases})
      for (auto& r : *v) {
        auto block = live_.find(r.alias);
        if (block != live_.end()) {
          auto seq = disk_->block_sequence.find(r.alias);
          if (seq != disk_->block_sequence.end() && seq->second > r.sequence) continue;
          used_ -= block->second.size();
          live_.erase(block);
        }
        aliases_[r.alias] = r.target;
      }
  }

  TierKind kind() const override { return TierKind::kFile; }
  bool persistent() const override { return true; }
  uint64_t identity() const override { return identity_of(open_); }
  uint64_t previous_identity() const override { return identity_of(open_ - 1); }

  Status put(const BlockId& id, const void* data, uint64_t size, const PutOptions& o) override {
    if (disk_->before_put) disk_->before_put(id);
    Status st = put_locked(id, data, size, o);
    if (disk_->after_put) disk_->after_put(id);
    return st;
  }

  Status put_locked(const BlockId& id, const void* data, uint64_t size, const PutOptions& o) {
    std::lock_guard<std::mutex> lock(disk_->mu);
    if (disk_->dead) return Status::IOError("disk is gone");
    if (disk_->fail_puts.count(id)) return Status::IOError("injected write error");
    if (o.stored) *o.stored = false;
    if (live_.count(id)) return Status::OK();
    if (disk_->fail_every_put) return Status::IOError("injected write error");
    if (disk_->capacity && size > disk_->capacity) return Status::InvalidArgument("too large");
    if (disk_->capacity && used_ + size > disk_->capacity) return Status::NoSpace("disk full");
    std::vector<uint8_t> bytes(size);
    if (size && o.src_kind == MemoryKind::kHost) {
      std::memcpy(bytes.data(), data, size);
    } else if (size) {  // staged out of device memory, as the file tier does
      Status st =
          device_copy(bytes.data(), MemoryKind::kHost, data, o.src_kind, size, o.cuda_stream);
      if (!st.ok()) return st;
    }
    disk_->pending[id] = bytes;
    disk_->block_sequence[id] = disk_->next_sequence++;
    aliases_.erase(id);  // the block is newer
    live_.emplace(id, std::move(bytes));
    order_.push_back(id);
    used_ += size;
    if (o.origin == PutOrigin::kDemotion) ++demotions_in_;
    if (o.stored) *o.stored = true;
    return Status::OK();
  }

  Status read(const BlockId& id, const ReadRequest& rq, ReadResult* rr) override {
    Status st = read_locked(id, rq, rr);
    if (disk_->after_read) disk_->after_read(id);
    return st;
  }

  Status read_locked(const BlockId& id, const ReadRequest& rq, ReadResult* rr) {
    std::lock_guard<std::mutex> lock(disk_->mu);
    ++disk_->reads;
    auto it = live_.find(id);
    if (it == live_.end()) return Status::NotFound("not on disk");
    const auto& b = it->second;
    rr->found = true;
    rr->block_size = b.size();
    if (rq.whole && b.size() > rq.capacity) return Status::InvalidArgument("too small");
    if (!rq.whole && rq.offset > b.size()) return Status::InvalidArgument("bad offset");
    if (disk_->refuse_copies.count(id)) return Status::InvalidArgument("injected copy refusal");
    uint64_t n = rq.whole ? b.size() : std::min<uint64_t>(rq.capacity, b.size() - rq.offset);
    if (n) std::memcpy(rq.out, b.data() + (rq.whole ? 0 : rq.offset), n);
    rr->copied = n;
    return Status::OK();
  }

  Result<uint64_t> size_of(const BlockId& id) override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    auto it = live_.find(id);
    if (it == live_.end()) return Status::NotFound("not on disk");
    return uint64_t(it->second.size());
  }

  bool contains(const BlockId& id) const override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    return live_.count(id) != 0;
  }

  Status remove(const BlockId& id) override {
    if (disk_->before_remove) disk_->before_remove(id);
    std::lock_guard<std::mutex> lock(disk_->mu);
    bool alias = aliases_.erase(id) != 0;
    return erase_locked(id) || alias ? Status::OK() : Status::NotFound("not on disk");
  }

  std::vector<Victim> claim_victims(uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    std::vector<Victim> out;
    uint64_t got = 0;
    bytes = std::max<uint64_t>(bytes, 1);  // 0: room for an empty block
    for (const BlockId& id : order_) {
      if (got >= bytes) break;
      auto it = live_.find(id);
      if (it == live_.end() || claimed_.count(id)) continue;
      claimed_.insert(id);
      Victim v;
      v.id = id;
      v.size = it->second.size();
      got += v.size;
      out.push_back(std::move(v));
    }
    return out;
  }

  void unclaim(Victim victim) override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    claimed_.erase(victim.id);
  }

  uint64_t capacity_bytes() const override { return disk_->capacity; }

  TierStats stats() const override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    TierStats s;
    s.name = name();
    s.capacity_bytes = disk_->capacity;
    s.used_bytes = used_;
    s.blocks = live_.size();
    s.demotions_in = demotions_in_;
    return s;
  }

  void clear() override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    live_.clear();
    order_.clear();
    claimed_.clear();
    aliases_.clear();
    used_ = 0;
  }

  Status flush() override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    if (disk_->dead) return Status::IOError("disk is gone");
    if (disk_->fail_flush) return Status::IOError("injected flush error");
    for (auto& [id, bytes] : disk_->pending) disk_->durable[id] = std::move(bytes);
    disk_->pending.clear();
    for (auto& r : disk_->pending_aliases) disk_->durable_aliases.push_back(r);
    disk_->pending_aliases.clear();
    ++disk_->flushes;
    return Status::OK();
  }

  void for_each_block(const std::function<void(const BlockId&, uint64_t)>& fn) const override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    for (auto& [id, bytes] : live_) fn(id, bytes.size());
  }

  Status put_alias(const BlockId& alias, const BlockId& target) override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    if (disk_->dead) return Status::IOError("disk is gone");
    if (disk_->fail_aliases) return Status::IOError("injected alias write error");
    if (!live_.count(target)) return Status::NotFound("alias target not on disk");
    disk_->pending_aliases.push_back({alias, target, disk_->next_sequence++});
    aliases_[alias] = target;
    return Status::OK();
  }

  std::vector<std::pair<BlockId, BlockId>> aliases() const override {
    std::lock_guard<std::mutex> lock(disk_->mu);
    std::vector<std::pair<BlockId, BlockId>> out;
    for (auto& [a, t] : aliases_)
      if (live_.count(t)) out.emplace_back(a, t);
    return out;
  }

 protected:
  void release_lease(uint64_t) override {}

 private:
  bool erase_locked(const BlockId& id) {
    auto it = live_.find(id);
    if (it == live_.end()) return false;
    used_ -= it->second.size();
    live_.erase(it);
    claimed_.erase(id);
    return true;
  }

  uint64_t identity_of(uint64_t open) const {
    return (reinterpret_cast<uintptr_t>(disk_.get()) * 1000003 + open) | 1;
  }

  std::shared_ptr<SimulatedDisk> disk_;
  uint64_t open_ = 0;
  std::map<BlockId, std::vector<uint8_t>> live_;  // guarded by disk_->mu
  std::vector<BlockId> order_;                    // insertion order (may hold removed ids)
  std::set<BlockId> claimed_;
  std::map<BlockId, BlockId> aliases_;
  uint64_t used_ = 0;
  uint64_t demotions_in_ = 0;
};

}  // namespace cascade
