#include "tiers/leased_reads.h"

#include <algorithm>
#include <vector>

#include "cuda/device_copy.h"

namespace cascade {

uint64_t copy_leased_blocks(std::span<const LeasedBytes> blocks, MemoryKind src_kind,
                            std::span<const ReadRequest> reqs, std::span<ReadResult> results,
                            std::span<Status> statuses) {
  struct Group {
    MemoryKind kind;
    void* stream;
    std::vector<size_t> members;
    std::vector<CopyItem> items;
  };
  std::vector<Group> groups;  // usually one: a batch has one destination kind and stream
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!statuses[i].ok()) continue;
    results[i].block_size = blocks[i].size;
    results[i].copied = 0;
    uint64_t from = 0, n = 0;
    statuses[i] = reqs[i].span(blocks[i].size, &from, &n);
    if (!statuses[i].ok() || n == 0) continue;
    auto g = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
      return x.kind == reqs[i].out_kind && x.stream == reqs[i].cuda_stream;
    });
    if (g == groups.end()) {
      groups.push_back(Group{reqs[i].out_kind, reqs[i].cuda_stream, {}, {}});
      g = groups.end() - 1;
    }
    g->members.push_back(i);
    g->items.push_back(CopyItem{reqs[i].out, blocks[i].data + from, n});
  }
  uint64_t copied = 0;
  for (const Group& g : groups) {
    std::vector<Status> st(g.items.size());
    device_copy_each(g.items, g.kind, src_kind, g.stream, st);
    for (size_t k = 0; k < g.members.size(); ++k) {
      const size_t i = g.members[k];
      statuses[i] = st[k];
      if (!statuses[i].ok()) continue;
      results[i].copied = g.items[k].bytes;
      copied += g.items[k].bytes;
    }
  }
  return copied;
}

bool any_device_out(std::span<const ReadRequest> reqs) {
  return std::any_of(reqs.begin(), reqs.end(),
                     [](const ReadRequest& r) { return r.out_kind != MemoryKind::kHost; });
}

}  // namespace cascade
