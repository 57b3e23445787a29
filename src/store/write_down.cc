#include "store/write_down.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "store/tier_factory.h"

namespace cascade {
namespace {

// The first failure of a kind of item, and how many failed.
class Failures {
 public:
  void add(const Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    if (count_++ == 0) first_ = st;
  }
  // OK, or the first failure prefixed with "N of M <what>".
  Status summary(size_t total, const std::string& what) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!count_) return Status::OK();
    return Status(first_.code(), std::to_string(count_) + " of " + std::to_string(total) + " " +
                                     what + ": " + first_.message());
  }

 private:
  mutable std::mutex mu_;
  size_t count_ = 0;
  Status first_;
};

// Copies one block down unless the persistent tier has it. A block no
// memory tier holds any more was removed, or moved down meanwhile (a
// demotion stores it below before removing it above): nothing to do.
// A copy below that may be older (replaces_below) is removed and the block
// written again; the memory copy is leased first, so an eviction racing
// this one cannot drop it in favour of the older copy meanwhile.
Status write_one(const std::vector<std::unique_ptr<Tier>>& tiers, size_t persistent,
                 const BlockId& id, const TierPut& put,
                 const std::function<bool(const BlockId&)>& replaces_below,
                 const std::function<bool(const BlockId&)>& may_replace_below,
                 CopyRegistry* copies) {
  // Down already, or on its way: a block kept above whose rewrite below an
  // eviction took on (take_kept_above) may be between the removal of the
  // older copy and the write of its own, and the flush must not end first.
  auto down_already = [&] {
    if (copies) copies->wait_idle(id);
    return Status::OK();
  };
  if (tiers[persistent]->contains(id) && !(may_replace_below && may_replace_below(id)))
    return down_already();
  for (size_t t = 0; t < persistent; ++t) {
    if (!is_memory_tier(tiers[t]->kind())) continue;
    auto view = tiers[t]->acquire_to_copy(id);
    if (!view.ok()) continue;
    // In flight from here; a user's remove that came first is seen now.
    CopyRegistry::Guard in_flight(copies, id);
    if (tiers[t]->removed_by_user(*view)) return Status::OK();
    if (tiers[persistent]->contains(id)) {
      if (!replaces_below || !replaces_below(id)) {
        in_flight = CopyRegistry::Guard();  // not a copy of its own: waits for the others
        return down_already();
      }
      (void)tiers[persistent]->remove(id);  // perhaps older than the copy above
    }
    PutOptions o;
    o.origin = PutOrigin::kDemotion;
    o.src_kind = view->kind();
    bool stored = false;
    o.stored = &stored;
    Status st = put(persistent, id, view->data(), view->size(), o);
    // A user removed the block meanwhile (the lease kept the old bytes
    // readable), perhaps storing the id again in this tier: the copy this
    // call stored would outlive the removal, and a later put or write-down
    // of the id would find it there and skip. It goes; a new block is
    // written down in its turn. A block moved out as a victim meanwhile
    // went down with these bytes, and its copy stays. Other tiers are not
    // looked at: a copy there is at another address whatever it holds.
    if (st.ok() && stored) {
      bool stale = tiers[t]->removed_by_user(*view);
      if (!stale) {
        auto now = tiers[t]->acquire_to_copy(id);
        stale = now.ok() && now->data() != view->data();
      }
      // Undone as the user's removal it lost to is: written down.
      if (stale) (void)tiers[persistent]->remove_lasting(id);
    }
    return st;
  }
  return Status::OK();
}

// Of the blocks a write-down listed (`listed`), how many the persistent
// tier dropped while it ran (`dropped`) and does not hold again now, while a
// memory tier still does: written down, then moved out again to make room
// for later blocks (of this write-down or another writer's).
size_t dropped_again(const std::vector<std::unique_ptr<Tier>>& tiers, size_t persistent,
                     const std::unordered_set<BlockId>& listed, std::vector<BlockId> dropped) {
  std::sort(dropped.begin(), dropped.end());
  dropped.erase(std::unique(dropped.begin(), dropped.end()), dropped.end());
  size_t n = 0;
  for (const BlockId& id : dropped) {
    if (!listed.count(id) || tiers[persistent]->contains(id)) continue;
    for (size_t t = 0; t < persistent; ++t) {
      if (is_memory_tier(tiers[t]->kind()) && tiers[t]->contains(id)) {
        ++n;
        break;
      }
    }
  }
  return n;
}

}  // namespace

uint64_t DropLog::begin() {
  std::lock_guard<std::mutex> lock(mu_);
  recording_.fetch_add(1, std::memory_order_acq_rel);
  return first_ + log_.size();
}

std::vector<BlockId> DropLog::since(uint64_t from) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<BlockId> out(log_.begin() + static_cast<ptrdiff_t>(from - first_), log_.end());
  if (recording_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    first_ += log_.size();
    std::vector<BlockId>().swap(log_);
  }
  return out;
}

void DropLog::note(const BlockId& id) {
  if (recording_.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (recording_.load(std::memory_order_relaxed) > 0) log_.push_back(id);
}

size_t persistent_tier_index(const std::vector<std::unique_ptr<Tier>>& tiers) {
  for (size_t t = 0; t < tiers.size(); ++t)
    if (tiers[t]->persistent()) return t;
  return SIZE_MAX;
}

Status write_down(const std::vector<std::unique_ptr<Tier>>& tiers, size_t persistent,
                  ThreadPool* pool, DedupTable* dedup, const TierPut& put,
                  const AliasPut& put_alias, const WriteDownOptions& options) {
  Failures block_failures, alias_failures;
  size_t blocks = 0, aliases = 0, dropped = 0;
  std::string below = persistent < tiers.size() ? tiers[persistent]->name() : "";
  if (persistent < tiers.size() && options.blocks) {
    // Top-down, so a block moving down between two memory tiers meanwhile
    // is seen in at least one of them.
    std::vector<BlockId> ids;
    std::unordered_set<BlockId> seen;
    if (options.only_these) {
      for (const BlockId& id : options.only)
        if (seen.insert(id).second) ids.push_back(id);
    } else {
      for (size_t t = 0; t < persistent; ++t) {
        if (!is_memory_tier(tiers[t]->kind())) continue;
        tiers[t]->for_each_block([&](const BlockId& id, uint64_t) {
          if (seen.insert(id).second) ids.push_back(id);
        });
      }
    }
    blocks = ids.size();
    const uint64_t drops_from = options.drops ? options.drops->begin() : 0;
    pool->parallel_for(ids.size(), [&](size_t i) {
      Status st = write_one(tiers, persistent, ids[i], put, options.replaces_below,
                            options.may_replace_below, options.copies);
      if (!st.ok()) block_failures.add(st);
    });
    if (options.drops)
      dropped = dropped_again(tiers, persistent, seen, options.drops->since(drops_from));
  }
  if (persistent < tiers.size() && dedup && options.aliases) {
    Tier& p = *tiers[persistent];
    std::vector<std::pair<BlockId, BlockId>> pending = dedup->unwritten();
    aliases = pending.size();
    // An alias whose block is not down (its write-down failed, counted
    // above) waits for a later flush.
    pool->parallel_for(pending.size(), [&](size_t i) {
      const auto& [alias, target] = pending[i];
      if (!p.contains(target)) return;
      Status st = put_alias(persistent, alias, target);  // marks it written
      if (!st.ok() && !st.is(Code::kNotFound)) alias_failures.add(st);
      // NotFound: the alias was removed meanwhile, or the target left the
      // tier (evicted to make room), taking its aliases with it unless a
      // tier above still holds it; then the alias stays unwritten and the
      // next flush writes both down.
    });
  }
  Status flushed;
  for (const auto& t : tiers) {
    Status st = t->flush();
    if (!st.ok() && flushed.ok())
      flushed = Status(st.code(),
                       std::string("the ") + t->name() + " tier could not flush: " + st.message());
  }
  // Every kind of failure is said (the first one's code): a tier's flush
  // fails for what it could not write itself (removals), which the blocks'
  // failures would otherwise hide.
  Status st;
  Status gone;
  if (dropped)
    gone = Status::NoSpace(std::to_string(dropped) + " of " + std::to_string(blocks) +
                           " blocks written down were moved out of the " + below +
                           " tier again to make room for others (it cannot hold them all): "
                           "they are held in memory only");
  for (const Status& part :
       {block_failures.summary(blocks,
                               "blocks could not be written down to the " + below + " tier"),
        gone,
        alias_failures.summary(aliases,
                               "dedup aliases could not be written to the " + below + " tier"),
        flushed}) {
    if (part.ok()) continue;
    st = st.ok() ? part : Status(st.code(), st.message() + "; " + part.message());
  }
  return st;
}

size_t load_aliases(Tier& tier, DedupTable* table,
                    const std::function<bool(const BlockId&)>& held_above) {
  std::vector<std::pair<BlockId, BlockId>> pairs = tier.aliases();
  if (pairs.empty()) return 0;
  std::unordered_map<BlockId, uint64_t> sizes;
  for (const auto& pr : pairs) sizes.emplace(pr.second, UINT64_MAX);
  tier.for_each_block([&](const BlockId& id, uint64_t size) {
    auto it = sizes.find(id);
    if (it != sizes.end()) it->second = size;
  });
  size_t loaded = 0;
  for (const auto& [alias, target] : pairs) {
    uint64_t size = sizes[target];
    if (size == UINT64_MAX) continue;
    if (held_above(alias)) {
      (void)tier.remove(alias);
      continue;
    }
    loaded += table->load(alias, target, size);
  }
  return loaded;
}

}  // namespace cascade
