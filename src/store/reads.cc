// The get side of CascadeStore: reads down the tiers (one item, or a batch
// tier by tier), promotion of a block found below tier 0 (on a hit, or by
// acquire and prefetch), and the resolution of an id to the id its bytes are
// stored under.
#include "store/store_impl.h"

#include "cascade/tier_handle.h"

namespace cascade {

// The id a block's bytes are stored under: its alias target, or the id
// itself (stored under its own id, or not at all).
BlockId CascadeStore::Impl::physical(const BlockId& id) const {
  if (!dedup) return id;
  auto p = dedup->resolve(id);
  return p ? *p : id;
}

// Outcome of reading one tier: true when the item is settled (hit, or an
// answer such as "buffer too small" that another tier would repeat). A
// failed copy (block_found false: a device copy the driver refused, say) is
// not found here.
bool CascadeStore::Impl::settle(size_t t, const ReadRequest& rq, const Status& st,
                                const ReadResult& rr, GetResult* r, Status* out_st) {
  if (st.ok()) {
    r->found = true;
    r->size = rr.block_size;
    r->copied = rr.copied;
    r->tier = static_cast<int>(t);
    *out_st = Status::OK();
    return true;
  }
  if (block_found(st, rq, rr)) {  // too small, or a bad offset
    r->found = true;
    r->size = rr.block_size;
    r->tier = static_cast<int>(t);
    *out_st = st;
    return true;
  }
  return false;  // NotFound, or a failed/corrupt copy: try below
}

void CascadeStore::Impl::maybe_promote(size_t t, const BlockId& phys, const void* data,
                                       uint64_t size, bool prefix, MemoryKind kind,
                                       void* cuda_stream) {
  if (t == 0 || !config.promote_on_hit) return;
  PutOptions o;
  o.is_prefix = prefix;
  o.origin = PutOrigin::kPromotion;
  o.src_kind = kind;
  // The read's stream, if it had one: its copies are complete, and the
  // promotion keeps the read's order.
  o.cuda_stream = cuda_stream;
  bool stored = false;
  o.stored = &stored;
  // The caller entered the copy before its read (CopyRegistry): a remove
  // that came first left nothing to read, and one that comes later waits.
  if (!tiers[t]->contains(phys)) return;
  // Best effort: the read already succeeded.
  if (put_into(0, phys, data, size, o).ok() && stored) undo_if_gone_below(t, phys);
}

// A promotion copied phys up from tier `from`; a user removed it meanwhile
// (it is no longer there): the copy goes too, or it would outlive the
// removal and make a later put of the id a no-op.
void CascadeStore::Impl::undo_if_gone_below(size_t from, const BlockId& phys) {
  if (!tiers[from]->contains(phys)) (void)tiers[0]->remove(phys);
}

// Reads the whole block from tier t into *buf, sized by the tier's
// size_of. A block stored again with another size between the two calls
// is asked for again.
Status CascadeStore::Impl::read_whole(size_t t, const BlockId& phys, std::vector<uint8_t>* buf,
                                      ReadRequest* rq, ReadResult* rr) {
  Status st;
  for (int attempt = 0; attempt < 4; ++attempt) {
    auto size = tiers[t]->size_of(phys);
    if (!size.ok()) return size.status();
    buf->resize(*size);
    rq->out = buf->data();
    rq->capacity = buf->size();
    *rr = ReadResult{};
    st = tiers[t]->read(phys, *rq, rr);
    if (!(st.is(Code::kInvalidArgument) && rr->block_size != buf->size())) break;
  }
  // The id stored again meanwhile with a smaller block: it fit, and the
  // buffer is cut to it (its tail holds nothing of the block).
  if (st.ok() && rr->copied < buf->size()) buf->resize(rr->copied);
  return st;
}

// With `whole` set, rq's buffer is ignored: the block goes into *whole,
// resized to fit.
Status CascadeStore::Impl::get_impl(const BlockId& id, ReadRequest rq, GetResult* r,
                                    std::vector<uint8_t>* whole) {
  gets.fetch_add(1, std::memory_order_relaxed);
  *r = GetResult{};
  const BlockId phys = physical(id);
  Status out_st;
  for (size_t t = 0; t < tiers.size(); ++t) {
    ReadResult rr;
    // A read that may be promoted is a copy in flight from before the read.
    CopyRegistry::Guard in_flight;
    if (t > 0 && rq.whole && config.promote_on_hit) in_flight = copies.enter(phys);
    Status st = whole ? read_whole(t, phys, whole, &rq, &rr) : tiers[t]->read(phys, rq, &rr);
    if (!settle(t, rq, st, rr, r, &out_st)) continue;
    if (out_st.ok()) {
      hits.fetch_add(1, std::memory_order_relaxed);
      bytes_got.fetch_add(rr.copied, std::memory_order_relaxed);
      if (rq.whole) maybe_promote(t, phys, rq.out, rr.block_size, rr.is_prefix, rq.out_kind);
    }
    return out_st;
  }
  misses.fetch_add(1, std::memory_order_relaxed);
  if (whole) whole->clear();
  return Status::OK();
}

size_t CascadeStore::Impl::get_batch_impl(std::span<const BlockId> ids,
                                          std::span<const MutableBuffer> out,
                                          std::vector<GetResult>* results,
                                          std::vector<Status>* statuses, MemoryKind out_kind,
                                          void* cuda_stream) {
  size_t n = ids.size();
  results->assign(n, GetResult{});
  statuses->assign(n, Status::OK());
  std::vector<BlockId> phys(n);
  std::vector<size_t> pending(n);
  for (size_t i = 0; i < n; ++i) {
    phys[i] = physical(ids[i]);
    pending[i] = i;
  }
  gets.fetch_add(n, std::memory_order_relaxed);
  for (size_t t = 0; t < tiers.size() && !pending.empty(); ++t) {
    size_t m = pending.size();
    std::vector<BlockId> pid(m);
    std::vector<ReadRequest> rqs(m);
    std::vector<ReadResult> rrs(m);
    std::vector<Status> sts(m);
    for (size_t k = 0; k < m; ++k) {
      pid[k] = phys[pending[k]];
      rqs[k].out = out[pending[k]].data;
      rqs[k].capacity = out[pending[k]].size;
      rqs[k].out_kind = out_kind;
      rqs[k].cuda_stream = cuda_stream;
    }
    // Reads that may be promoted are copies in flight from before the read.
    std::vector<CopyRegistry::Guard> in_flight;
    if (t > 0 && config.promote_on_hit) {
      in_flight.reserve(m);
      for (size_t k = 0; k < m; ++k) in_flight.push_back(copies.enter(pid[k]));
    }
    // A memory tier's reads go one per item over the I/O threads unless it
    // prefers batches for these destinations (device memory, where a batch
    // copies in batched GPU operations).
    if (is_memory_tier(tiers[t]->kind()) && !tiers[t]->prefers_batches(out_kind)) {
      pool->parallel_for(m, [&](size_t k) { sts[k] = tiers[t]->read(pid[k], rqs[k], &rrs[k]); });
    } else {
      tiers[t]->read_batch(pid, rqs, rrs, sts);
    }
    std::vector<size_t> still;
    std::vector<size_t> promote;
    for (size_t k = 0; k < m; ++k) {
      size_t i = pending[k];
      if (!settle(t, rqs[k], sts[k], rrs[k], &(*results)[i], &(*statuses)[i])) {
        still.push_back(i);
      } else if ((*statuses)[i].ok()) {
        bytes_got.fetch_add(rrs[k].copied, std::memory_order_relaxed);
        if (t > 0) promote.push_back(k);
      }
    }
    if (!promote.empty() && config.promote_on_hit) {
      pool->parallel_for(promote.size(), [&](size_t j) {
        size_t k = promote[j];
        maybe_promote(t, pid[k], rqs[k].out, rrs[k].block_size, rrs[k].is_prefix, out_kind,
                      cuda_stream);
      });
    }
    pending.swap(still);
  }
  size_t found = 0, absent = 0;
  for (size_t i = 0; i < n; ++i) {
    if ((*results)[i].found && (*statuses)[i].ok()) ++found;
    if (!(*results)[i].found) ++absent;
  }
  hits.fetch_add(found, std::memory_order_relaxed);
  misses.fetch_add(absent, std::memory_order_relaxed);
  return found;
}

// Brings phys into tier 0 from below. OK when it ends up there.
Status CascadeStore::Impl::promote(const BlockId& phys) {
  if (tiers[0]->contains(phys)) return Status::OK();
  for (size_t t = 1; t < tiers.size(); ++t) {
    PutOptions o;
    o.origin = PutOrigin::kPromotion;
    if (is_memory_tier(tiers[t]->kind())) {
      if (!tiers[t]->contains(phys)) continue;
      auto view = tiers[t]->acquire(phys);
      if (!view.ok()) continue;
      CopyRegistry::Guard in_flight = copies.enter(phys);
      if (tiers[t]->removed_by_user(*view)) return Status::NotFound("block was removed");
      o.src_kind = view->kind();
      o.is_prefix = view->is_prefix();
      bool stored = false;
      o.stored = &stored;
      Status st = put_into(0, phys, view->data(), view->size(), o);
      if (st.ok() && stored) undo_if_gone_below(t, phys);
      return st;
    }
    std::vector<uint8_t> buf;
    ReadRequest rq;
    ReadResult rr;
    CopyRegistry::Guard in_flight = copies.enter(phys);       // from before the read
    if (!read_whole(t, phys, &buf, &rq, &rr).ok()) continue;  // a miss is counted as a get's
    if (!tiers[t]->contains(phys)) return Status::NotFound("block was removed");
    o.is_prefix = rr.is_prefix;
    bool stored = false;
    o.stored = &stored;
    Status st = put_into(0, phys, buf.data(), buf.size(), o);
    if (st.ok() && stored) undo_if_gone_below(t, phys);
    return st;
  }
  return Status::NotFound("block is in no tier");
}

}  // namespace cascade
