// BlockIndex implementation. See block_index.h for the design.
#include "index/block_index.h"

#include <algorithm>

#include <mutex>

namespace cascade {
namespace {

constexpr uint32_t kNil = 0xffffffffu;
// Entry::state bits. Lease count in the low 24 bits.
constexpr uint32_t kLeaseMask = (1u << 24) - 1;
constexpr uint32_t kDoomed = 1u << 24;  // removed; reclaim when leases reach 0
static_assert(BlockIndex::kMaxLeases < kLeaseMask);
constexpr uint32_t kEvicting = 1u << 25;    // claimed by an evictor; not in a list
constexpr uint32_t kReferenced = 1u << 26;  // read since it was (re)queued
constexpr uint32_t kPrefix = 1u << 27;
constexpr uint32_t kRemovedByName = 1u << 28;  // removed by id or clear(), not as a victim
constexpr uint32_t kChunkBits = 8;             // 256 entries a slab chunk
constexpr uint32_t kChunk = 1u << kChunkBits;
constexpr size_t kInitialSlots = 16;

}  // namespace

// 44 bytes, 4-byte aligned: 16 id + 12 location + 4 state + 8 list links + 4 tick.
struct BlockIndex::Entry {
  BlockId id;
  uint32_t loc[3];  // offset (48 bits) and size (48 bits), packed
  std::atomic<uint32_t> state{0};
  uint32_t prev = kNil, next = kNil;
  uint32_t tick = 0;  // low bits of the clock when queued

  void set_loc(const Location& l) {
    loc[0] = static_cast<uint32_t>(l.offset);
    loc[1] = static_cast<uint32_t>((l.offset >> 32) & 0xffff) |
             static_cast<uint32_t>((l.size & 0xffff) << 16);
    loc[2] = static_cast<uint32_t>(l.size >> 16);
  }
  Location get_loc() const {
    Location l;
    l.offset = loc[0] | (static_cast<uint64_t>(loc[1] & 0xffff) << 32);
    l.size = (loc[1] >> 16) | (static_cast<uint64_t>(loc[2]) << 16);
    return l;
  }
};
static_assert(sizeof(BlockIndex::Entry) == 44, "index entry must stay 44 bytes");

namespace {
using Entry = BlockIndex::Entry;

// A lease token: shard number in the top 16 bits, the entry's address in
// the low 48 (user-space addresses fit), so release() touches no table.
uint64_t make_token(uint32_t shard, const Entry* e) {
  return (uint64_t{shard} << 48) | reinterpret_cast<uintptr_t>(e);
}
uint32_t token_shard(uint64_t token) { return static_cast<uint32_t>(token >> 48); }
Entry* token_entry(uint64_t token) {
  return reinterpret_cast<Entry*>(static_cast<uintptr_t>(token & ((uint64_t{1} << 48) - 1)));
}

uint32_t fingerprint(uint64_t h) {
  return static_cast<uint32_t>((h * 0x9e3779b97f4a7c15ULL) >> 32);
}

}  // namespace

struct BlockIndex::Shard {
  mutable std::shared_mutex mu;
  // Table slot: fingerprint << 32 | (entry + 1); 0 = empty. Linear probing
  // from fingerprint & mask, backward-shift deletion, load <= 0.8.
  std::vector<uint64_t> table = std::vector<uint64_t>(kInitialSlots, 0);
  size_t in_table = 0;
  std::vector<std::unique_ptr<Entry[]>> chunks;
  uint32_t free_head = kNil;  // free entries linked through Entry::next
  uint32_t allocated = 0;     // entries handed out from chunks so far
  uint32_t head[2] = {kNil, kNil}, tail[2] = {kNil, kNil};  // [0] ordinary, [1] prefix
  // 1 << 32 | tick of the tail entry, 0 when the list is empty.
  std::atomic<uint64_t> tail_key[2] = {0, 0};
  std::atomic<size_t> live{0};
  std::atomic<size_t> empty{0};  // live entries of size 0
  std::atomic<uint64_t> bytes{0};
  std::atomic<size_t> leased{0};

  Entry& at(uint32_t e) { return chunks[e >> kChunkBits][e & (kChunk - 1)]; }
  // Entry number of an entry address. REQUIRES: mu held. Rare path (the
  // last lease of a removed block), so a scan of the chunks is fine.
  uint32_t number_of(const Entry* x) const {
    for (uint32_t c = 0; c < chunks.size(); ++c) {
      const Entry* base = chunks[c].get();
      if (x >= base && x < base + kChunk)
        return (c << kChunkBits) | static_cast<uint32_t>(x - base);
    }
    return kNil;
  }
  const Entry& at(uint32_t e) const { return chunks[e >> kChunkBits][e & (kChunk - 1)]; }
  size_t mask() const { return table.size() - 1; }

  // Position in table of id, or -1.
  long find(const BlockId& id, uint32_t fp) const {
    size_t m = mask();
    for (size_t pos = fp & m;; pos = (pos + 1) & m) {
      uint64_t s = table[pos];
      if (s == 0) return -1;
      if (static_cast<uint32_t>(s >> 32) == fp && at(static_cast<uint32_t>(s) - 1).id == id)
        return static_cast<long>(pos);
    }
  }

  void place(uint64_t slot) {
    size_t m = mask();
    size_t pos = static_cast<uint32_t>(slot >> 32) & m;
    while (table[pos] != 0) pos = (pos + 1) & m;
    table[pos] = slot;
  }

  void grow_if_needed() {
    if ((in_table + 1) * 5 <= table.size() * 4) return;
    std::vector<uint64_t> old;
    old.swap(table);
    table.assign(old.size() * 2, 0);
    for (uint64_t s : old)
      if (s) place(s);
  }

  void erase_at(size_t i) {
    size_t m = mask();
    table[i] = 0;
    for (size_t j = (i + 1) & m; table[j] != 0; j = (j + 1) & m) {
      size_t k = static_cast<uint32_t>(table[j] >> 32) & m;  // home of the slot at j
      bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
      if (stays) continue;
      table[i] = table[j];
      table[j] = 0;
      i = j;
    }
    --in_table;
  }

  uint32_t alloc_entry() {
    if (free_head != kNil) {
      uint32_t e = free_head;
      free_head = at(e).next;
      return e;
    }
    if ((allocated >> kChunkBits) == chunks.size()) chunks.emplace_back(new Entry[kChunk]);
    return allocated++;
  }

  void free_entry(uint32_t e) {
    Entry& x = at(e);
    x.state.store(0, std::memory_order_relaxed);
    x.prev = kNil;
    x.next = free_head;
    free_head = e;
  }

  void publish_tail(int l) {
    tail_key[l].store(tail[l] == kNil ? 0 : (uint64_t{1} << 32) | at(tail[l]).tick,
                      std::memory_order_relaxed);
  }

  void push_head(int l, uint32_t e, uint32_t tick) {
    Entry& x = at(e);
    x.tick = tick;
    x.prev = kNil;
    x.next = head[l];
    if (head[l] != kNil) at(head[l]).prev = e;
    head[l] = e;
    if (tail[l] == kNil) {
      tail[l] = e;
      publish_tail(l);
    }
  }

  void unlink(int l, uint32_t e) {
    Entry& x = at(e);
    if (x.prev != kNil) at(x.prev).next = x.next;
    else head[l] = x.next;
    if (x.next != kNil) {
      at(x.next).prev = x.prev;
    } else {
      tail[l] = x.prev;
      publish_tail(l);
    }
    x.prev = x.next = kNil;
  }
};

BlockIndex::BlockIndex(int shards, EvictionPolicy policy, Reclaim reclaim, Unlist unlist)
    : policy_(policy), reclaim_(std::move(reclaim)), unlist_(std::move(unlist)) {
  uint32_t n = 1;
  while (n < static_cast<uint32_t>(shards > 0 ? shards : 1)) n <<= 1;
  shards_.reset(new Shard[n]);
  shard_mask_ = n - 1;
}

BlockIndex::~BlockIndex() = default;

BlockIndex::Shard& BlockIndex::shard_for(const BlockId& id) const {
  return shards_[id.hash64() & shard_mask_];
}

bool BlockIndex::insert(const BlockId& id, const Location& loc, bool is_prefix) {
  uint64_t h = id.hash64();
  uint32_t si = static_cast<uint32_t>(h & shard_mask_);
  Shard& s = shards_[si];
  uint32_t fp = fingerprint(h);
  std::unique_lock<std::shared_mutex> lock(s.mu);
  if (s.find(id, fp) >= 0) return false;
  s.grow_if_needed();
  uint32_t e = s.alloc_entry();
  Entry& x = s.at(e);
  x.id = id;
  x.set_loc(loc);
  x.state.store(is_prefix ? kPrefix : 0, std::memory_order_relaxed);
  s.push_head(is_prefix ? 1 : 0, e,
              static_cast<uint32_t>(clock_.fetch_add(1, std::memory_order_relaxed)));
  s.place((uint64_t{fp} << 32) | (e + 1));
  ++s.in_table;
  s.live.fetch_add(1, std::memory_order_relaxed);
  if (loc.size == 0) s.empty.fetch_add(1, std::memory_order_relaxed);
  s.bytes.fetch_add(loc.size, std::memory_order_relaxed);
  return true;
}

std::optional<BlockIndex::Lease> BlockIndex::acquire(const BlockId& id, bool touch) {
  uint64_t h = id.hash64();
  uint32_t si = static_cast<uint32_t>(h & shard_mask_);
  Shard& s = shards_[si];
  std::shared_lock<std::shared_mutex> lock(s.mu);
  long pos = s.find(id, fingerprint(h));
  if (pos < 0) return std::nullopt;
  uint32_t e = static_cast<uint32_t>(s.table[pos]) - 1;
  Entry& x = s.at(e);
  uint32_t old = x.state.fetch_add(1, std::memory_order_acq_rel);
  if ((old & kLeaseMask) >= kMaxLeases) {
    // Taken back: the count stays far below its bits' limit however many
    // threads race here (each adds one before it looks). Where every real
    // lease was released meanwhile, their last release saw this one and
    // left the count of leased entries to it. The entry cannot be doomed
    // here: removing it takes the shard's lock, which this holds shared.
    if ((x.state.fetch_sub(1, std::memory_order_acq_rel) & kLeaseMask) == 1)
      s.leased.fetch_sub(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  if ((old & kLeaseMask) == 0) s.leased.fetch_add(1, std::memory_order_relaxed);
  if (touch && !(old & kReferenced)) x.state.fetch_or(kReferenced, std::memory_order_relaxed);
  Lease lease;
  lease.token = make_token(si, &x);
  lease.loc = x.get_loc();
  lease.is_prefix = (old & kPrefix) != 0;
  return lease;
}

void BlockIndex::release(uint64_t token) {
  // The entry's memory is stable (slab chunks are never freed while the index
  // lives) and cannot be recycled while we hold a lease: no lock needed.
  uint32_t si = token_shard(token);
  Entry* x = token_entry(token);
  uint32_t old = x->state.fetch_sub(1, std::memory_order_acq_rel);
  if ((old & kLeaseMask) == 1) {
    shards_[si].leased.fetch_sub(1, std::memory_order_relaxed);
    if (old & kDoomed) reclaim_entry(si, x);
  }
}

void BlockIndex::reclaim_entry(uint32_t si, Entry* x) {
  Shard& s = shards_[si];
  BlockId id;
  Location loc;
  {
    std::unique_lock<std::shared_mutex> lock(s.mu);
    id = x->id;
    loc = x->get_loc();
    s.free_entry(s.number_of(x));
  }
  if (reclaim_) reclaim_(id, loc);
}

std::optional<Location> BlockIndex::peek(const BlockId& id) const {
  uint64_t h = id.hash64();
  const Shard& s = shards_[h & shard_mask_];
  std::shared_lock<std::shared_mutex> lock(s.mu);
  long pos = s.find(id, fingerprint(h));
  if (pos < 0) return std::nullopt;
  return s.at(static_cast<uint32_t>(s.table[pos]) - 1).get_loc();
}

bool BlockIndex::contains(const BlockId& id) const {
  uint64_t h = id.hash64();
  const Shard& s = shards_[h & shard_mask_];
  std::shared_lock<std::shared_mutex> lock(s.mu);
  return s.find(id, fingerprint(h)) >= 0;
}

bool BlockIndex::remove(const BlockId& id) {
  uint64_t h = id.hash64();
  uint32_t si = static_cast<uint32_t>(h & shard_mask_);
  Shard& s = shards_[si];
  std::unique_lock<std::shared_mutex> lock(s.mu);
  long pos = s.find(id, fingerprint(h));
  if (pos < 0) return false;
  remove_at(si, pos, &lock, kRemovedByName);
  return true;
}

bool BlockIndex::removed_by_name(uint64_t token) const {
  // The caller's lease keeps the entry from being recycled.
  return (token_entry(token)->state.load(std::memory_order_acquire) & kRemovedByName) != 0;
}

bool BlockIndex::remove_leased(uint64_t token) {
  // The entry cannot be recycled while the caller's lease holds it.
  uint32_t si = token_shard(token);
  Entry* x = token_entry(token);
  Shard& s = shards_[si];
  std::unique_lock<std::shared_mutex> lock(s.mu);
  if (x->state.load(std::memory_order_acquire) & kDoomed) return false;
  long pos = s.find(x->id, fingerprint(x->id.hash64()));
  if (pos < 0 || &s.at(static_cast<uint32_t>(s.table[pos]) - 1) != x) return false;
  remove_at(si, pos, &lock, 0);
  return true;
}

// Takes the entry at table position pos out of shard si, whose lock *lock
// holds; releases the lock before the reclaim callback. how: state bits
// set with kDoomed.
void BlockIndex::remove_at(uint32_t si, long pos, std::unique_lock<std::shared_mutex>* lock,
                           uint32_t how) {
  Shard& s = shards_[si];
  uint32_t e = static_cast<uint32_t>(s.table[pos]) - 1;
  Entry& x = s.at(e);
  s.erase_at(static_cast<size_t>(pos));
  uint32_t st = x.state.load(std::memory_order_relaxed);
  if (!(st & kEvicting)) s.unlink((st & kPrefix) ? 1 : 0, e);
  const Location loc = x.get_loc();
  const BlockId rid = x.id;
  s.live.fetch_sub(1, std::memory_order_relaxed);
  if (loc.size == 0) s.empty.fetch_sub(1, std::memory_order_relaxed);
  s.bytes.fetch_sub(loc.size, std::memory_order_relaxed);
  if (unlist_) unlist_(rid, loc);  // not doomed yet: no release can reclaim it
  uint32_t old = x.state.fetch_or(kDoomed | how, std::memory_order_acq_rel);
  if ((old & kLeaseMask) != 0) return;  // the last lease reclaims
  s.free_entry(e);
  lock->unlock();
  if (reclaim_) reclaim_(rid, loc);
}

bool BlockIndex::relocate(const BlockId& id, const Location& from, const Location& to) {
  uint64_t h = id.hash64();
  Shard& s = shards_[h & shard_mask_];
  std::unique_lock<std::shared_mutex> lock(s.mu);
  long pos = s.find(id, fingerprint(h));
  if (pos < 0) return false;
  Entry& x = s.at(static_cast<uint32_t>(s.table[pos]) - 1);
  Location cur = x.get_loc();
  if (cur.offset != from.offset || cur.size != from.size) return false;
  x.set_loc(to);
  if (to.size != from.size) {
    s.bytes.fetch_add(to.size, std::memory_order_relaxed);
    s.bytes.fetch_sub(from.size, std::memory_order_relaxed);
    if ((from.size == 0) != (to.size == 0)) {
      if (to.size == 0) s.empty.fetch_add(1, std::memory_order_relaxed);
      else s.empty.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  return true;
}

// Takes entry e of list l out of the eviction order as a victim, leased
// (state: its state as read). REQUIRES: shard si's lock held exclusively.
BlockIndex::Claimed BlockIndex::claim_at(uint32_t si, int l, uint32_t e, uint32_t state) {
  Shard& s = shards_[si];
  Entry& x = s.at(e);
  s.unlink(l, e);
  x.state.fetch_add(1 | kEvicting, std::memory_order_acq_rel);
  s.leased.fetch_add(1, std::memory_order_relaxed);
  Claimed c;
  c.id = x.id;
  c.lease.token = make_token(si, &x);
  c.lease.loc = x.get_loc();
  c.lease.is_prefix = (state & kPrefix) != 0;
  return c;
}

std::vector<BlockIndex::Claimed> BlockIndex::claim_empty(size_t n) {
  std::vector<Claimed> out;
  // Ordinary blocks before prefix blocks; within a list, shard by shard
  // from a rotating start, each from its oldest end: an approximation of
  // age order, enough to make room for another empty block.
  const size_t nshards = shard_mask_ + 1;
  const size_t start = static_cast<size_t>(clock_.load(std::memory_order_relaxed)) % nshards;
  for (int l = 0; l < 2 && out.size() < n; ++l) {
    for (size_t k = 0; k < nshards && out.size() < n; ++k) {
      const uint32_t si = static_cast<uint32_t>((start + k) % nshards);
      Shard& s = shards_[si];
      if (s.empty.load(std::memory_order_relaxed) == 0) continue;
      std::unique_lock<std::shared_mutex> lock(s.mu);
      int steps = 0;
      for (uint32_t e = s.tail[l]; e != kNil && out.size() < n && steps < 4096; ++steps) {
        Entry& x = s.at(e);
        const uint32_t prev = x.prev;  // read before an unlink clears it
        const uint32_t st = x.state.load(std::memory_order_acquire);
        if (x.get_loc().size == 0 && (st & kLeaseMask) == 0) out.push_back(claim_at(si, l, e, st));
        e = prev;
      }
    }
  }
  return out;
}

std::vector<BlockIndex::Claimed> BlockIndex::claim_victims(uint64_t bytes) {
  std::vector<Claimed> out;
  uint64_t got = 0;
  size_t nshards = shard_mask_ + 1;
  // Ages are counted back from one reading of the clock, signed: an entry
  // requeued during this claim (a tick after it) is younger than all others.
  const uint32_t now = static_cast<uint32_t>(clock_.load(std::memory_order_relaxed));
  auto age_of = [now](uint32_t tick) { return static_cast<int32_t>(now - tick); };
  for (int l = 0; l < 2 && got < bytes; ++l) {
    // Every live entry may be passed over twice (leased, then referenced).
    long budget = static_cast<long>(2 * size() + nshards + 64);
    // The shards by the age of their tails, oldest on top, read once and
    // kept up to date as the claim goes: one heap step per shard visited
    // instead of a scan of every shard's tail per victim. A shard's tail
    // may change meanwhile (other claims, requeues, a first insert), so a
    // popped shard's tail is read again before it is used.
    std::vector<std::pair<int32_t, uint32_t>> heap;  // (age, shard)
    heap.reserve(nshards);
    auto tail_age = [&](size_t i, int32_t* age) {
      uint64_t k = shards_[i].tail_key[l].load(std::memory_order_relaxed);
      if (k == 0) return false;
      *age = age_of(static_cast<uint32_t>(k));
      return true;
    };
    for (size_t i = 0; i < nshards; ++i) {
      int32_t age;
      if (tail_age(i, &age)) heap.emplace_back(age, static_cast<uint32_t>(i));
    }
    std::make_heap(heap.begin(), heap.end());
    while (got < bytes && budget > 0 && !heap.empty()) {
      std::pop_heap(heap.begin(), heap.end());
      const uint32_t best = heap.back().second;
      heap.pop_back();
      --budget;
      int32_t best_age;
      if (!tail_age(best, &best_age)) continue;  // emptied meanwhile
      if (!heap.empty() && best_age < heap.front().first) {
        heap.emplace_back(best_age, best);  // no longer the oldest: back in its place
        std::push_heap(heap.begin(), heap.end());
        continue;
      }
      // The walk below claims only blocks older than every other shard's
      // tail, so victims leave in global age order.
      const bool have_second = !heap.empty();
      const int32_t second_age = have_second ? heap.front().first : 0;
      Shard& s = shards_[best];
      {
        std::unique_lock<std::shared_mutex> lock(s.mu);
        for (int steps = 0; steps < 64 && got < bytes && s.tail[l] != kNil && budget > 0; ++steps) {
          uint32_t e = s.tail[l];
          Entry& x = s.at(e);
          if (steps > 0 && have_second && age_of(x.tick) < second_age) break;
          uint32_t st = x.state.load(std::memory_order_acquire);
          uint32_t tick = static_cast<uint32_t>(clock_.fetch_add(1, std::memory_order_relaxed));
          if ((st & kLeaseMask) != 0 || (policy_ == EvictionPolicy::kLru && (st & kReferenced))) {
            // Being read, or read since queued: it is recently used. Requeue.
            x.state.fetch_and(~kReferenced, std::memory_order_relaxed);
            s.unlink(l, e);
            s.push_head(l, e, tick);
            --budget;
            continue;
          }
          Claimed c = claim_at(best, l, e, st);
          got += c.lease.loc.size;
          out.push_back(c);
        }
      }
      int32_t next_age;
      if (tail_age(best, &next_age)) {
        heap.emplace_back(next_age, best);
        std::push_heap(heap.begin(), heap.end());
      }
    }
  }
  return out;
}

void BlockIndex::unclaim(const BlockId& id, uint64_t token) {
  Shard& s = shards_[token_shard(token)];
  {
    std::unique_lock<std::shared_mutex> lock(s.mu);
    Entry& x = *token_entry(token);
    uint32_t e = s.number_of(&x);
    uint32_t st = x.state.load(std::memory_order_acquire);
    if ((st & kEvicting) && !(st & kDoomed) && x.id == id) {
      x.state.fetch_and(~kEvicting, std::memory_order_relaxed);
      s.push_head((st & kPrefix) ? 1 : 0, e,
                  static_cast<uint32_t>(clock_.fetch_add(1, std::memory_order_relaxed)));
    }
  }
  release(token);
}

void BlockIndex::clear() {
  for (size_t i = 0; i <= shard_mask_; ++i) {
    Shard& s = shards_[i];
    std::vector<std::pair<BlockId, Location>> freed;
    {
      std::unique_lock<std::shared_mutex> lock(s.mu);
      for (uint64_t slot : s.table) {
        if (!slot) continue;
        uint32_t e = static_cast<uint32_t>(slot) - 1;
        Entry& x = s.at(e);
        if (unlist_) unlist_(x.id, x.get_loc());
        uint32_t old = x.state.fetch_or(kDoomed | kRemovedByName, std::memory_order_acq_rel);
        if ((old & kLeaseMask) == 0) {
          freed.emplace_back(x.id, x.get_loc());
          s.free_entry(e);
        }
      }
      std::fill(s.table.begin(), s.table.end(), 0);
      s.in_table = 0;
      for (int l = 0; l < 2; ++l) {
        s.head[l] = s.tail[l] = kNil;
        s.publish_tail(l);
      }
      s.live.store(0, std::memory_order_relaxed);
      s.empty.store(0, std::memory_order_relaxed);
      s.bytes.store(0, std::memory_order_relaxed);
    }
    if (reclaim_)
      for (auto& [id, loc] : freed) reclaim_(id, loc);
  }
}

void BlockIndex::for_each(
    const std::function<void(const BlockId&, const Location&, bool)>& fn) const {
  for (size_t i = 0; i <= shard_mask_; ++i) {
    const Shard& s = shards_[i];
    std::shared_lock<std::shared_mutex> lock(s.mu);
    for (uint64_t slot : s.table) {
      if (!slot) continue;
      const Entry& x = s.at(static_cast<uint32_t>(slot) - 1);
      fn(x.id, x.get_loc(), (x.state.load(std::memory_order_relaxed) & kPrefix) != 0);
    }
  }
}

size_t BlockIndex::empty_entries() const {
  size_t n = 0;
  for (size_t i = 0; i <= shard_mask_; ++i) n += shards_[i].empty.load(std::memory_order_relaxed);
  return n;
}

size_t BlockIndex::size() const {
  size_t n = 0;
  for (size_t i = 0; i <= shard_mask_; ++i) n += shards_[i].live.load(std::memory_order_relaxed);
  return n;
}

uint64_t BlockIndex::payload_bytes() const {
  uint64_t n = 0;
  for (size_t i = 0; i <= shard_mask_; ++i) n += shards_[i].bytes.load(std::memory_order_relaxed);
  return n;
}

size_t BlockIndex::leased() const {
  size_t n = 0;
  for (size_t i = 0; i <= shard_mask_; ++i) n += shards_[i].leased.load(std::memory_order_relaxed);
  return n;
}

size_t BlockIndex::metadata_bytes() const {
  size_t n = sizeof(Shard) * (shard_mask_ + 1);
  for (size_t i = 0; i <= shard_mask_; ++i) {
    const Shard& s = shards_[i];
    std::shared_lock<std::shared_mutex> lock(s.mu);
    n += s.table.capacity() * sizeof(uint64_t) + s.chunks.size() * kChunk * sizeof(Entry);
  }
  return n;
}

}  // namespace cascade
