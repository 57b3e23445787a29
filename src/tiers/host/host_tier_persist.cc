// HostTier's warm restart: the block table's sealer, flush, and reattach.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include "tiers/host/host_tier.h"
#include "util/thread_name.h"

namespace cascade {

void HostTier::on_publish(const BlockId& id, const Location& loc, bool is_prefix) {
  if (!table_) return;
  // An empty block holds no range and has no slot; a block the full table
  // has none for is not kept either. A restart loses them: the next start
  // must not find the mark that says every block was kept.
  BlockTable::Pending p;
  if (loc.size == 0 || !table_->add(id, loc, is_prefix, &p)) {
    {
      std::lock_guard<std::mutex> lock(unslotted_mu_);
      unslotted_.insert(id);
    }
    if (!kept_mark_unset_.exchange(true)) arena_->set_kept_mark(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(seal_mu_);
    queue_.push_back(p);
  }
  seal_cv_.notify_one();
}

// A removed block's slot is cleared when the removal happens, not when the
// last lease on it ends: a crash in between must not bring it back.
void HostTier::on_unpublish(const BlockId& id, const Location& loc) {
  if (!table_) return;
  {
    std::lock_guard<std::mutex> lock(unslotted_mu_);
    if (unslotted_.erase(id)) return;  // it had no slot
  }
  if (loc.size) table_->drop(loc.offset);
}

void HostTier::note_all_below(uint64_t below) {
  if (table_) arena_->set_below_mark(below);
}

void HostTier::adopt_place(uint64_t place) {
  if (!table_) return;
  // A store without a persistent tier has a place of its own: the blocks
  // it puts are copies of no directory's. Places of persistent tiers have
  // their low bit set; this one has not.
  constexpr uint64_t kNoPersistentTier = 2;
  const uint64_t mine = place ? place : kNoPersistentTier;
  const uint64_t kept = arena_->place_mark();
  // An arena made before the mark existed (0) is adopted.
  if (reattached_blocks_ > 0 && kept != 0 && kept != mine) {
    // Another configuration's blocks (one shm_path, two of them): served,
    // or moved down as the newer copies of their ids, they would stand in
    // for this store's own blocks (replacing them below) and bring another
    // configuration's namespaces in.
    arena_->set_kept_mark(0);  // unknown while the blocks go
    clear();
    below_mark_ = 0;
    dropped_for_place_ = true;
    kept_since_ = new_kept_since();
    if (!kept_mark_unset_.load()) arena_->set_kept_mark(kept_since_);
  }
  if (kept != mine) arena_->set_place_mark(mine);
}

void HostTier::start_sealer() {
  sealer_ = std::thread([this] { seal_loop(); });
}

void HostTier::stop_sealer() {
  if (!sealer_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(seal_mu_);
    stop_ = true;
  }
  seal_cv_.notify_all();
  sealer_.join();
}

void HostTier::seal_loop() {
  name_this_thread("cascade-seal");
  std::unique_lock<std::mutex> lock(seal_mu_);
  for (;;) {
    seal_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything queued is sealed
    BlockTable::Pending p = queue_.front();
    queue_.pop_front();
    sealer_busy_ = true;
    lock.unlock();
    table_->seal(p, arena_base());
    lock.lock();
    sealer_busy_ = false;
    ++sealer_done_;
    done_cv_.notify_all();
  }
}

uint64_t HostTier::unkept(std::span<const BlockId> ids) const {
  if (!table_) return 0;
  std::lock_guard<std::mutex> lock(unslotted_mu_);
  if (ids.empty()) return unslotted_.size();
  uint64_t n = 0;
  for (const BlockId& id : ids) n += unslotted_.count(id);
  return n;
}

Status HostTier::flush() {
  if (!table_) return Status::OK();
  std::vector<BlockTable::Pending> mine;
  uint64_t wait_for = 0;
  {
    std::lock_guard<std::mutex> lock(seal_mu_);
    mine.assign(queue_.begin(), queue_.end());
    queue_.clear();
    // The item the sealer holds now was published before this call too.
    wait_for = sealer_done_ + (sealer_busy_ ? 1 : 0);
  }
  auto seal = [&](size_t i) { table_->seal(mine[i], arena_base()); };
  if (pool_) {
    pool_->parallel_for(mine.size(), seal);
  } else {
    for (size_t i = 0; i < mine.size(); ++i) seal(i);
  }
  std::unique_lock<std::mutex> lock(seal_mu_);
  done_cv_.wait(lock, [&] { return sealer_done_ >= wait_for; });
  return Status::OK();
}

void HostTier::reattach() {
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t dropped = 0;
  std::vector<BlockTable::Found> found = table_->scan(capacity(), kUnit, &dropped);
  // Verify every candidate's bytes on all the pool's threads: a page that
  // changed since the seal (damage, a write after a crash) is a miss.
  std::vector<uint8_t> good(found.size(), 0);
  std::atomic<uint64_t> bytes{0};
  const uint8_t* base = arena_base();
  auto verify = [&](size_t k) {
    const BlockTable::Found& f = found[k];
    good[k] = table_->checksum(base + f.loc.offset, f.loc.size) == f.checksum;
    bytes.fetch_add(f.loc.size, std::memory_order_relaxed);
  };
  if (pool_) {
    pool_->parallel_for(found.size(), verify, pool_->size());
  } else {
    for (size_t k = 0; k < found.size(); ++k) verify(k);
  }
  std::vector<BlockTable::Found> adopted;
  adopted.reserve(found.size());
  for (size_t k = 0; k < found.size(); ++k) {
    if (good[k]) {
      adopted.push_back(found[k]);
    } else {
      table_->discard(found[k].slot);
      ++dropped;
      ++reattach_corrupt_;
    }
  }
  // Oldest publication first: the eviction order resumes where it was.
  std::sort(adopted.begin(), adopted.end(),
            [](const BlockTable::Found& a, const BlockTable::Found& b) {
              return a.sequence < b.sequence;
            });
  std::vector<BlockTable::Found> kept;
  kept.reserve(adopted.size());
  for (const BlockTable::Found& f : adopted) {
    // scan() left no overlapping ranges and one slot per id, so both hold.
    if (!alloc_.take(f.loc.offset, f.loc.size)) {
      table_->discard(f.slot);
      ++dropped;
      continue;
    }
    if (!index().insert(f.id, f.loc, f.is_prefix)) {
      alloc_.free(f.loc.offset, f.loc.size);
      table_->discard(f.slot);
      ++dropped;
      continue;
    }
    kept.push_back(f);
  }
  table_->adopt(kept);
  reattached_blocks_ = kept.size();
  reattach_dropped_ = dropped;
  reattach_bytes_ = bytes.load();
  reattach_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace cascade
