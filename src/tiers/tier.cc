// Shared parts of the Tier interface.
#include "cascade/tier.h"

#include <algorithm>
#include <string>

namespace cascade {

Status ReadRequest::span(uint64_t block_size, uint64_t* from, uint64_t* n) const {
  *from = 0;
  *n = 0;
  if (whole) {
    if (block_size > capacity)
      return Status::InvalidArgument("output buffer holds " + std::to_string(capacity) +
                                     " bytes; the block has " + std::to_string(block_size));
    *n = block_size;
  } else {
    if (offset > block_size)
      return Status::InvalidArgument("offset " + std::to_string(offset) + " is past the end of a " +
                                     std::to_string(block_size) + "-byte block");
    *from = offset;
    *n = std::min(capacity, block_size - offset);
  }
  if (*n && !out) return Status::InvalidArgument("out is null");
  return Status::OK();
}

BlockView& BlockView::operator=(BlockView&& o) noexcept {
  if (this != &o) {
    reset();
    tier_ = o.tier_;
    data_ = o.data_;
    size_ = o.size_;
    kind_ = o.kind_;
    token_ = o.token_;
    is_prefix_ = o.is_prefix_;
    o.tier_ = nullptr;
  }
  return *this;
}

void BlockView::reset() {
  if (tier_) {
    Tier* t = tier_;
    tier_ = nullptr;
    t->release_lease(token_);
  }
}

void Tier::read_batch(std::span<const BlockId> ids, std::span<const ReadRequest> reqs,
                      std::span<ReadResult> results, std::span<Status> statuses) {
  for (size_t i = 0; i < ids.size(); ++i) statuses[i] = read(ids[i], reqs[i], &results[i]);
}

void Tier::put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                     std::span<const uint64_t> sizes, const PutOptions& options,
                     std::span<Status> statuses) {
  for (size_t i = 0; i < ids.size(); ++i) statuses[i] = put(ids[i], data[i], sizes[i], options);
}

Result<BlockView> Tier::acquire(const BlockId&) {
  return Status::NotSupported(std::string(name()) + " tier has no addressable memory");
}

void Tier::reserve_batch(std::span<const BlockId> ids, std::span<const uint64_t> sizes,
                         const PutOptions& options, std::span<Reservation> reservations,
                         std::span<Status> statuses) {
  for (size_t i = 0; i < ids.size(); ++i) {
    auto r = reserve(ids[i], sizes[i], options);
    statuses[i] = r.status();
    reservations[i] = r.ok() ? *r : Reservation{};
  }
}

void Tier::acquire_batch(std::span<const BlockId> ids, std::span<BlockView> views,
                         std::span<Status> statuses) {
  for (size_t i = 0; i < ids.size(); ++i) {
    auto v = acquire(ids[i]);
    statuses[i] = v.status();
    views[i] = v.ok() ? std::move(v.value()) : BlockView();
  }
}

void Tier::contains_batch(std::span<const BlockId> ids, std::span<uint8_t> found) const {
  for (size_t i = 0; i < ids.size(); ++i) found[i] = contains(ids[i]);
}

void Tier::sizes_batch(std::span<const BlockId> ids, std::span<uint8_t> found,
                       std::span<uint64_t> sizes) {
  for (size_t i = 0; i < ids.size(); ++i) {
    found[i] = 0;
    if (!contains(ids[i])) continue;
    auto size = size_of(ids[i]);
    if (!size.ok()) continue;
    found[i] = 1;
    sizes[i] = *size;
  }
}

}  // namespace cascade
