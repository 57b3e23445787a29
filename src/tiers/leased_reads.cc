#include "tiers/leased_reads.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "cuda/device_copy.h"

namespace cascade {
namespace {

// The copies of one destination kind and stream.
struct Route {
  MemoryKind kind;
  void* stream;
  std::unique_ptr<DeviceCopyPipeline> copies;
};

// One part's copies on one route, kept until they are waited for.
struct Queued {
  size_t route = 0;
  PipelinePart copies;
};

struct Part {
  size_t begin = 0, end = 0;
  std::vector<Queued> queued;
};

}  // namespace

uint64_t read_leased_in_parts(MemoryKind src_kind, std::span<const ReadRequest> reqs,
                              std::span<ReadResult> results, std::span<Status> statuses,
                              const LeasePart& lease, const ReleasePart& release) {
  const size_t n = reqs.size();
  std::vector<LeasedBytes> blocks(n);
  std::unique_ptr<Part> prev;  // declared before the routes: their pipelines write its statuses
  std::vector<Route> routes;   // usually one: a batch has one destination kind and stream
  uint64_t copied = 0;

  auto queue = [&](Part* p) {
    for (size_t i = p->begin; i < p->end; ++i) {
      if (!statuses[i].ok()) continue;
      results[i].block_size = blocks[i].size;
      results[i].copied = 0;
      uint64_t from = 0, len = 0;
      statuses[i] = reqs[i].span(blocks[i].size, &from, &len);
      if (!statuses[i].ok() || len == 0) continue;
      auto r = std::find_if(routes.begin(), routes.end(), [&](const Route& x) {
        return x.kind == reqs[i].out_kind && x.stream == reqs[i].cuda_stream;
      });
      if (r == routes.end()) {
        routes.push_back(Route{
            reqs[i].out_kind, reqs[i].cuda_stream,
            std::make_unique<DeviceCopyPipeline>(reqs[i].out_kind, src_kind, reqs[i].cuda_stream)});
        r = routes.end() - 1;
      }
      const size_t route = static_cast<size_t>(r - routes.begin());
      auto q = std::find_if(p->queued.begin(), p->queued.end(),
                            [&](const Queued& x) { return x.route == route; });
      if (q == p->queued.end()) {
        p->queued.push_back(Queued{});
        q = p->queued.end() - 1;
        q->route = route;
      }
      q->copies.push(i, CopyItem{reqs[i].out, blocks[i].data + from, len});
    }
    for (Queued& q : p->queued) q.copies.queue(*routes[q.route].copies);
  };
  auto finish = [&](Part* p) {
    for (Queued& q : p->queued) {
      q.copies.settle(*routes[q.route].copies, statuses);
      for (size_t k = 0; k < q.copies.items.size(); ++k) {
        const size_t i = q.copies.of[k];
        if (!statuses[i].ok()) continue;
        results[i].copied = q.copies.items[k].bytes;
        copied += q.copies.items[k].bytes;
      }
    }
    release(p->begin, p->end);
  };

  PipelineParts bounds;
  auto part_end = [&](size_t begin) {
    uint64_t bytes = 0;
    size_t end = begin;
    while (end < n && !bounds.full(end - begin, bytes)) bytes += reqs[end++].capacity;
    bounds.next();
    for (size_t i = begin; i < end; ++i) results[i] = ReadResult{};
    return end;
  };
  size_t begin = 0, end = part_end(0);
  if (n) lease(begin, end, blocks);
  while (begin < n) {
    auto cur = std::make_unique<Part>();
    cur->begin = begin;
    cur->end = end;
    const size_t next = end, next_end = next < n ? part_end(next) : next;
    queue(cur.get());
    if (prev) finish(prev.get());  // its copies ran while this part was leased
    if (next < n) lease(next, next_end, blocks);
    prev = std::move(cur);
    begin = next;
    end = next_end;
  }
  if (prev) finish(prev.get());
  return copied;
}

bool any_device_out(std::span<const ReadRequest> reqs) {
  return std::any_of(reqs.begin(), reqs.end(),
                     [](const ReadRequest& r) { return r.out_kind != MemoryKind::kHost; });
}

}  // namespace cascade
