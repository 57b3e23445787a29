// Paged KV description checks, geometry, and the CPU reference transfer.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kv/paged_kv_plan.h"
#include "util/arena_ranges.h"

namespace cascade {
namespace {

constexpr int64_t kMaxSection = std::numeric_limits<int32_t>::max();

struct Strides {
  int64_t block, kv, token, head;  // elements (bytes for kFlatBytes)
};

Strides effective_strides(const PagedKvCache& c) {
  const int64_t d = c.head_size, h = c.num_kv_heads, bs = c.block_size;
  Strides s{};
  switch (c.layout) {
    case PagedKvLayout::kPackedKv:
      s.token = 2 * d;
      s.head = bs * 2 * d;
      s.block = h * bs * 2 * d;
      s.kv = d;
      break;
    case PagedKvLayout::kSplitKv:
      s.head = d;
      s.token = h * d;
      s.block = bs * h * d;
      s.kv = c.num_blocks * bs * h * d;
      break;
    case PagedKvLayout::kFlatBytes: s.block = static_cast<int64_t>(c.bytes_per_block); break;
  }
  if (c.block_stride) s.block = c.block_stride;
  if (c.kv_stride) s.kv = c.kv_stride;
  if (c.token_stride) s.token = c.token_stride;
  if (c.head_stride) s.head = c.head_stride;
  return s;
}

struct Dim {
  const char* name;
  int64_t size;
  __int128 stride;  // bytes
};

// Whether d = sum of j_k * dims[k].stride over k < n with |j_k| < size_k:
// whether an element of a layer lies d bytes from another element of it.
// dims sorted by stride, each step past what the ones before it reach
// (inner[k]), so at most two j_k fit each dimension.
bool is_element_distance(__int128 d, const std::vector<Dim>& dims,
                         const std::vector<__int128>& inner, size_t n) {
  if (n == 0) return d == 0;
  const Dim& dim = dims[n - 1];
  const __int128 r = inner[n - 1];
  auto floor_div = [](__int128 a, __int128 b) { return a / b - ((a % b != 0) && (a < 0)); };
  const __int128 lo = -floor_div(-(d - r), dim.stride);  // ceil((d - r) / stride)
  const __int128 hi = floor_div(d + r, dim.stride);
  for (__int128 j = std::max<__int128>(lo, 1 - dim.size); j <= std::min<__int128>(hi, dim.size - 1);
       ++j)
    if (is_element_distance(d - j * dim.stride, dims, inner, n - 1)) return true;
  return false;
}

// Distinct elements of a layer never share memory: the dimensions of more
// than one element, by stride, each step past all the inner ones reach.
// Nor do two layers, unless they are one (layers that share their KV: the
// same bytes, written twice alike). Then every layer's last byte lies
// within its layer_bytes, when given.
Status check_layer_reach(const PagedKvCache& c) {
  const Strides s = effective_strides(c);
  const int64_t e = c.layout == PagedKvLayout::kFlatBytes ? 1 : c.elem_bytes;
  std::vector<Dim> dims;
  if (c.layout == PagedKvLayout::kFlatBytes) {
    dims = {{"blocks", c.num_blocks, s.block}, {"block bytes", int64_t(c.bytes_per_block), 1}};
  } else {
    dims = {{"blocks", c.num_blocks, __int128(s.block) * e},
            {"K/V", 2, __int128(s.kv) * e},
            {"tokens", c.block_size, __int128(s.token) * e},
            {"heads", c.num_kv_heads, __int128(s.head) * e},
            {"head elements", int64_t(c.head_size) * e, 1}};
  }
  std::erase_if(dims, [](const Dim& d) { return d.size < 2; });
  std::stable_sort(dims.begin(), dims.end(),
                   [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  __int128 reach = 0;  // the last byte the inner dimensions address
  std::vector<__int128> inner;
  for (const Dim& d : dims) {
    if (d.stride <= reach) {
      return Status::InvalidArgument(
          std::string("paged KV: the ") + d.name + " dimension's stride of " +
          std::to_string(int64_t(d.stride)) +
          " bytes puts its elements over others (an expanded or overlapping view): loads "
          "would write blocks over each other");
    }
    inner.push_back(reach);
    reach += (d.size - 1) * d.stride;
  }
  std::vector<std::pair<uintptr_t, size_t>> bases;  // (address, layer)
  for (size_t l = 0; l < c.layers.size(); ++l)
    bases.emplace_back(reinterpret_cast<uintptr_t>(c.layers[l]), l);
  std::sort(bases.begin(), bases.end());
  auto shared = [&](size_t i, size_t j) {
    return Status::InvalidArgument(
        "paged KV: layers " + std::to_string(bases[i].second) + " and " +
        std::to_string(bases[j].second) +
        " share memory (overlapping views): loads would write one over the other");
  };
  // Layers one step apart (one buffer cut in equal parts, or interleaved
  // block by block; a layer given twice aside): a pair's distance is a
  // multiple of the step, so each multiple is checked once, not each pair.
  // This runs for every transfer.
  std::vector<size_t> distinct;  // first index of each address
  for (size_t i = 0; i < bases.size(); ++i)
    if (i == 0 || bases[i].first != bases[i - 1].first) distinct.push_back(i);
  const uintptr_t step =
      distinct.size() > 1 ? bases[distinct[1]].first - bases[distinct[0]].first : 0;
  bool even = true;
  for (size_t k = 1; k < distinct.size() && even; ++k)
    even = bases[distinct[k]].first - bases[distinct[k - 1]].first == step;
  if (even) {
    for (size_t k = 1; k < distinct.size() && __int128(k) * step <= reach; ++k)
      if (is_element_distance(__int128(k) * step, dims, inner, dims.size()))
        return shared(distinct[0], distinct[k]);
  } else {
    for (size_t i = 0; i < bases.size(); ++i) {
      for (size_t j = i + 1; j < bases.size() && bases[j].first - bases[i].first <= reach; ++j) {
        const __int128 d = bases[j].first - bases[i].first;
        if (d != 0 && is_element_distance(d, dims, inner, dims.size())) return shared(i, j);
      }
    }
  }
  if (c.layer_bytes.empty()) return Status::OK();
  if (c.layer_bytes.size() != c.layers.size())
    return Status::InvalidArgument("paged KV: " + std::to_string(c.layer_bytes.size()) +
                                   " layer sizes for " + std::to_string(c.layers.size()) +
                                   " layers");
  for (size_t l = 0; l < c.layer_bytes.size(); ++l) {
    if (reach >= __int128(c.layer_bytes[l])) {
      return Status::InvalidArgument(
          "paged KV: layer " + std::to_string(l) + " reaches " +
          std::to_string(uint64_t(std::min<__int128>(reach + 1, ~uint64_t{0}))) +
          " bytes from its start, but its memory holds " + std::to_string(c.layer_bytes[l]) +
          " (num_blocks or the strides exceed the tensor)");
    }
  }
  return Status::OK();
}

}  // namespace

const char* paged_kv_layout_name(PagedKvLayout layout) {
  switch (layout) {
    case PagedKvLayout::kPackedKv: return "packed_kv";
    case PagedKvLayout::kSplitKv: return "split_kv";
    case PagedKvLayout::kFlatBytes: return "flat_bytes";
  }
  return "?";
}

Status validate_paged_kv(const PagedKvCache& c) {
  if (c.num_layers < 1) return Status::InvalidArgument("paged KV: num_layers must be at least 1");
  if (c.layers.size() != static_cast<size_t>(c.num_layers))
    return Status::InvalidArgument("paged KV: " + std::to_string(c.layers.size()) +
                                   " layer pointers for " + std::to_string(c.num_layers) +
                                   " layers");
  if (c.num_blocks < 1) return Status::InvalidArgument("paged KV: num_blocks must be at least 1");
  for (void* p : c.layers)
    if (!p) return Status::InvalidArgument("paged KV: a layer pointer is null");
  if (c.block_stride < 0 || c.kv_stride < 0 || c.token_stride < 0 || c.head_stride < 0)
    return Status::InvalidArgument("paged KV: strides must not be negative");
  if (c.layout == PagedKvLayout::kFlatBytes) {
    if (c.bytes_per_block == 0 || c.bytes_per_block > uint64_t(kMaxSection))
      return Status::InvalidArgument("paged KV: bytes_per_block must be 1 to 2^31-1");
    return check_layer_reach(c);
  }
  if (c.layout != PagedKvLayout::kPackedKv && c.layout != PagedKvLayout::kSplitKv)
    return Status::InvalidArgument("paged KV: unknown layout");
  if (c.num_kv_heads < 1 || c.block_size < 1 || c.head_size < 1)
    return Status::InvalidArgument(
        "paged KV: num_kv_heads, block_size and head_size must be at least 1");
  if (c.elem_bytes != 1 && c.elem_bytes != 2 && c.elem_bytes != 4 && c.elem_bytes != 8)
    return Status::InvalidArgument("paged KV: elem_bytes must be 1, 2, 4 or 8");
  int64_t section = int64_t(c.block_size) * c.num_kv_heads * c.head_size * c.elem_bytes;
  if (section > kMaxSection)
    return Status::InvalidArgument("paged KV: a block's K or V part exceeds 2 GiB");
  return check_layer_reach(c);
}

uint64_t stored_kv_block_bytes(const PagedKvCache& c) {
  if (c.layout == PagedKvLayout::kFlatBytes) return uint64_t(c.num_layers) * c.bytes_per_block;
  return uint64_t(c.num_layers) * 2 * uint64_t(c.block_size) * c.num_kv_heads * c.head_size *
         c.elem_bytes;
}

Status make_kv_geometry(const PagedKvCache& c, int layer_begin, int layer_end, KvGeometry* g) {
  CASCADE_RETURN_IF_ERROR(validate_paged_kv(c));
  if (layer_end == -1) layer_end = c.num_layers;
  if (layer_begin < 0 || layer_begin >= layer_end || layer_end > c.num_layers)
    return Status::InvalidArgument("paged KV: layer range [" + std::to_string(layer_begin) + ", " +
                                   std::to_string(layer_end) + ") is not within the " +
                                   std::to_string(c.num_layers) + " layers");
  const Strides s = effective_strides(c);
  *g = KvGeometry{};
  g->layer_begin = layer_begin;
  g->layer_count = layer_end - layer_begin;
  if (c.layout == PagedKvLayout::kFlatBytes) {
    g->sections = 1;
    g->run_bytes = static_cast<uint32_t>(c.bytes_per_block);
    g->runs_per_section = 1;
    g->section_bytes = g->run_bytes;
    g->block_stride = s.block;
  } else {
    const int64_t e = c.elem_bytes;
    const int64_t head_run = int64_t(c.head_size) * e;
    g->sections = 2;
    g->block_stride = s.block * e;
    g->kv_stride = s.kv * e;
    g->token_stride = s.token * e;
    g->head_stride = s.head * e;
    const int64_t section = int64_t(c.block_size) * c.num_kv_heads * head_run;
    const bool heads_adjacent = c.num_kv_heads == 1 || g->head_stride == head_run;
    const bool tokens_adjacent = c.block_size == 1 || g->token_stride == c.num_kv_heads * head_run;
    if (heads_adjacent && tokens_adjacent) {  // the section is one run
      g->run_bytes = static_cast<uint32_t>(section);
      g->runs_per_section = 1;
      g->heads_per_run_row = 1;
    } else if (heads_adjacent) {  // a token's heads are one run
      g->run_bytes = static_cast<uint32_t>(c.num_kv_heads * head_run);
      g->runs_per_section = static_cast<uint32_t>(c.block_size);
      g->heads_per_run_row = 1;
    } else {
      g->run_bytes = static_cast<uint32_t>(head_run);
      g->runs_per_section = static_cast<uint32_t>(c.block_size * c.num_kv_heads);
      g->heads_per_run_row = static_cast<uint32_t>(c.num_kv_heads);
    }
    g->section_bytes = static_cast<uint32_t>(section);
  }
  g->layer_bytes = int64_t(g->sections) * g->section_bytes;
  g->block_bytes = g->layer_bytes * c.num_layers;
  return Status::OK();
}

Status check_kv_request(const PagedKvCache& c, std::span<const int64_t> engine_blocks,
                        size_t store_blocks) {
  if (engine_blocks.size() != store_blocks)
    return Status::InvalidArgument("paged KV: " + std::to_string(engine_blocks.size()) +
                                   " engine blocks but " + std::to_string(store_blocks) +
                                   " store blocks");
  for (int64_t b : engine_blocks)
    if (b < 0 || b >= c.num_blocks)
      return Status::InvalidArgument("paged KV: engine block " + std::to_string(b) +
                                     " is outside [0, " + std::to_string(c.num_blocks) + ")");
  return Status::OK();
}

Status check_kv_load_destinations(const PagedKvCache& c, const KvGeometry& g,
                                  std::span<const int64_t> blocks) {
  if (blocks.empty()) return Status::OK();
  const auto [lo, hi] = std::minmax_element(blocks.begin(), blocks.end());
  // The bytes one block's section spans, from its first: strides are not
  // negative, so section s of block b lies in [b * block_stride + s *
  // kv_stride, + span) (K and V apart, as split layouts keep them).
  int64_t span = 0;
  for (uint32_t o = 0; o < g.section_bytes; o += g.run_bytes)
    span = std::max(span, kv_engine_offset(g, 0, 0, o) + int64_t(g.run_bytes));
  const uint64_t bytes = uint64_t(*hi - *lo) * uint64_t(g.block_stride) + uint64_t(span);
  ArenaRangesView held;
  for (int l = g.layer_begin; l < g.layer_begin + g.layer_count; ++l) {
    for (int s = 0; s < g.sections; ++s) {
      const uint8_t* first =
          static_cast<const uint8_t*>(c.layers[l]) + kv_engine_offset(g, *lo, s, 0);
      if (held.overlaps(first, bytes)) {
        return Status::InvalidArgument(
            "paged KV: layer " + std::to_string(l) +
            "'s pages to load into hold stored blocks (a view of a lease or an arena); load into "
            "the engine's own cache");
      }
    }
  }
  return Status::OK();
}

namespace {

template <bool kSave>
Status transfer_cpu(const PagedKvCache& c, std::span<const int64_t> blocks, uint8_t* const* store,
                    int layer_begin, int layer_end) {
  KvGeometry g;
  CASCADE_RETURN_IF_ERROR(make_kv_geometry(c, layer_begin, layer_end, &g));
  CASCADE_RETURN_IF_ERROR(check_kv_request(c, blocks, blocks.size()));
  if (!kSave) CASCADE_RETURN_IF_ERROR(check_kv_load_destinations(c, g, blocks));
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!store[i]) return Status::InvalidArgument("paged KV: a store block pointer is null");
    for (int l = g.layer_begin; l < g.layer_begin + g.layer_count; ++l) {
      uint8_t* layer = static_cast<uint8_t*>(c.layers[l]);
      for (int s = 0; s < g.sections; ++s) {
        for (uint32_t o = 0; o < g.section_bytes; o += g.run_bytes) {
          uint8_t* engine = layer + kv_engine_offset(g, blocks[i], s, o);
          uint8_t* stored = store[i] + kv_store_offset(g, l, s, o);
          if (kSave) std::memcpy(stored, engine, g.run_bytes);
          else std::memcpy(engine, stored, g.run_bytes);
        }
      }
    }
  }
  return Status::OK();
}

}  // namespace

Status save_paged_kv_cpu(const PagedKvCache& c, std::span<const int64_t> engine_blocks,
                         std::span<void* const> store_blocks, int layer_begin, int layer_end) {
  if (store_blocks.size() != engine_blocks.size())
    return check_kv_request(c, engine_blocks, store_blocks.size());
  return transfer_cpu<true>(c, engine_blocks,
                            reinterpret_cast<uint8_t* const*>(store_blocks.data()), layer_begin,
                            layer_end);
}

Status load_paged_kv_cpu(const PagedKvCache& c, std::span<const int64_t> engine_blocks,
                         std::span<const void* const> store_blocks, int layer_begin,
                         int layer_end) {
  if (store_blocks.size() != engine_blocks.size())
    return check_kv_request(c, engine_blocks, store_blocks.size());
  return transfer_cpu<false>(
      c, engine_blocks,
      const_cast<uint8_t* const*>(reinterpret_cast<const uint8_t* const*>(store_blocks.data())),
      layer_begin, layer_end);
}

}  // namespace cascade
