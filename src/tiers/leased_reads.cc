#include "tiers/leased_reads.h"

#include <algorithm>
#include <memory>
#include <utility>
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
  std::vector<Queued> queued;
};

}  // namespace

uint64_t read_leased_in_parts(MemoryKind src_kind, std::span<const ReadRequest> reqs,
                              std::span<ReadResult> results, std::span<Status> statuses,
                              const LeasePart& lease, const ReleasePart& release) {
  std::vector<LeasedBytes> blocks(reqs.size());
  Part parts[2];              // declared before the routes: their pipelines write its statuses
  std::vector<Route> routes;  // usually one: a batch has one destination kind and stream
  uint64_t copied = 0;

  // Leases a part's blocks and queues their copies, each on its route.
  auto start = [&](size_t k, size_t begin, size_t end) {
    Part& p = parts[k % 2];
    p.queued.clear();
    for (size_t i = begin; i < end; ++i) results[i] = ReadResult{};
    lease(begin, end, blocks);
    for (size_t i = begin; i < end; ++i) {
      if (!statuses[i].ok()) continue;
      results[i].found = true;
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
      auto q = std::find_if(p.queued.begin(), p.queued.end(),
                            [&](const Queued& x) { return x.route == route; });
      if (q == p.queued.end()) {
        p.queued.push_back(Queued{});
        q = p.queued.end() - 1;
        q->route = route;
      }
      q->copies.push(i, CopyItem{reqs[i].out, blocks[i].data + from, len});
    }
    for (Queued& q : p.queued) q.copies.queue(*routes[q.route].copies);
  };
  // Waits for a part's copies, then gives its leases back.
  auto finish = [&](size_t k, size_t begin, size_t end) {
    for (Queued& q : parts[k % 2].queued) {
      q.copies.settle(*routes[q.route].copies, statuses);
      for (size_t j = 0; j < q.copies.items.size(); ++j) {
        const size_t i = q.copies.of[j];
        if (!statuses[i].ok()) continue;
        results[i].copied = q.copies.items[j].bytes;
        copied += q.copies.items[j].bytes;
      }
    }
    release(begin, end);
  };
  for_each_part_two_deep(
      reqs.size(), [&](size_t i) { return std::pair<size_t, uint64_t>(1, reqs[i].capacity); },
      start, finish);
  return copied;
}

bool any_device_out(std::span<const ReadRequest> reqs) {
  return std::any_of(reqs.begin(), reqs.end(),
                     [](const ReadRequest& r) { return r.out_kind != MemoryKind::kHost; });
}

}  // namespace cascade
