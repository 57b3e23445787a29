// Paged KV transfer: the CPU reference against an element-by-element model
// (every build), and the GPU paths against the CPU reference (GPU only).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cascade/paged_kv.h"
#include "cuda/device_buffer.h"
#include "util/arena_ranges.h"

namespace cascade {
namespace {

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return v;
}

// A cache description plus the host memory of its layers (one buffer per
// layer, with optional padding so views are strided).
struct TestCache {
  PagedKvCache desc;
  std::vector<std::vector<uint8_t>> layer_bytes;  // host copies
  size_t layer_size = 0;

  void point_at_host() {
    desc.memory = MemoryKind::kHost;
    for (int l = 0; l < desc.num_layers; ++l) desc.layers[l] = layer_bytes[l].data();
  }
};

// Shapes under test. `pad` adds elements to strides so views are not
// contiguous (vLLM's packed view of a shared buffer).
TestCache make_cache(PagedKvLayout layout, int layers, int blocks, int heads, int block_size,
                     int head_size, int elem, int pad, uint64_t seed) {
  TestCache t;
  PagedKvCache& c = t.desc;
  c.layout = layout;
  c.num_layers = layers;
  c.num_blocks = blocks;
  c.num_kv_heads = heads;
  c.block_size = block_size;
  c.head_size = head_size;
  c.elem_bytes = elem;
  int64_t elems = 0;
  if (layout == PagedKvLayout::kPackedKv) {
    c.token_stride = 2 * head_size + pad;
    c.head_stride = block_size * c.token_stride + pad;
    c.block_stride = heads * c.head_stride + pad;
    c.kv_stride = head_size;
    elems = blocks * c.block_stride;
  } else if (layout == PagedKvLayout::kSplitKv) {
    c.head_stride = head_size + pad;
    c.token_stride = heads * c.head_stride + pad;
    c.block_stride = block_size * c.token_stride + pad;
    c.kv_stride = blocks * c.block_stride + pad;
    elems = 2 * c.kv_stride;
  } else {
    c.bytes_per_block = uint64_t(heads) * block_size * head_size * elem;
    c.block_stride = int64_t(c.bytes_per_block) + pad;
    c.elem_bytes = 1;
    elems = blocks * c.block_stride;
  }
  t.layer_size = size_t(elems) * (layout == PagedKvLayout::kFlatBytes ? 1 : elem);
  c.layers.assign(layers, nullptr);
  for (int l = 0; l < layers; ++l) t.layer_bytes.push_back(random_bytes(t.layer_size, seed + l));
  t.point_at_host();
  return t;
}

// The model: where element (kv, token, head, d) of engine block b in layer
// l lives, from the strides alone; and where the stored block keeps it.
void check_stored_block(const TestCache& t, int64_t b, const uint8_t* stored) {
  const PagedKvCache& c = t.desc;
  if (c.layout == PagedKvLayout::kFlatBytes) {
    for (int l = 0; l < c.num_layers; ++l)
      ASSERT_EQ(0, std::memcmp(stored + l * c.bytes_per_block,
                               t.layer_bytes[l].data() + b * c.block_stride, c.bytes_per_block))
          << "layer " << l;
    return;
  }
  const int e = c.elem_bytes;
  const uint64_t section = uint64_t(c.block_size) * c.num_kv_heads * c.head_size * e;
  for (int l = 0; l < c.num_layers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int tok = 0; tok < c.block_size; ++tok)
        for (int h = 0; h < c.num_kv_heads; ++h)
          for (int d = 0; d < c.head_size; ++d) {
            int64_t src_elem = b * c.block_stride + kv * c.kv_stride + tok * c.token_stride +
                               h * c.head_stride + d;
            uint64_t dst = l * 2 * section + kv * section +
                           ((uint64_t(tok) * c.num_kv_heads + h) * c.head_size + d) * e;
            ASSERT_EQ(0, std::memcmp(stored + dst, t.layer_bytes[l].data() + src_elem * e, e))
                << "layer " << l << " kv " << kv << " token " << tok << " head " << h << " d " << d;
          }
}

struct Shape {
  PagedKvLayout layout;
  int heads, block_size, head_size, elem, pad;
};

const Shape kShapes[] = {
    {PagedKvLayout::kPackedKv, 4, 16, 64, 2, 0},   // vLLM 0.33, contiguous
    {PagedKvLayout::kPackedKv, 2, 8, 32, 2, 8},    // strided view
    {PagedKvLayout::kPackedKv, 3, 5, 3, 2, 1},     // odd sizes: narrow accesses only
    {PagedKvLayout::kSplitKv, 4, 16, 64, 2, 0},    // vLLM < 0.26
    {PagedKvLayout::kSplitKv, 2, 4, 16, 1, 4},     // fp8, strided
    {PagedKvLayout::kFlatBytes, 4, 16, 64, 2, 0},  // opaque per-layer blocks
    {PagedKvLayout::kFlatBytes, 1, 3, 7, 1, 5},
};

TestCache make_cache(const Shape& sh, int layers, int blocks, uint64_t seed) {
  return make_cache(sh.layout, layers, blocks, sh.heads, sh.block_size, sh.head_size, sh.elem,
                    sh.pad, seed);
}

std::vector<void*> store_ptrs(std::vector<std::vector<uint8_t>>& blocks) {
  std::vector<void*> p;
  for (auto& b : blocks) p.push_back(b.data());
  return p;
}

TEST(PagedKvCpu, StoredLayoutMatchesModel) {
  for (const Shape& sh : kShapes) {
    SCOPED_TRACE(paged_kv_layout_name(sh.layout));
    TestCache t = make_cache(sh, 3, 10, 7);
    const uint64_t bytes = stored_kv_block_bytes(t.desc);
    std::vector<int64_t> engine = {7, 0, 9, 3};
    std::vector<std::vector<uint8_t>> stored(engine.size(), std::vector<uint8_t>(bytes, 0xee));
    auto ptrs = store_ptrs(stored);
    ASSERT_TRUE(save_paged_kv_cpu(t.desc, engine, ptrs).ok());
    for (size_t i = 0; i < engine.size(); ++i) check_stored_block(t, engine[i], stored[i].data());
  }
}

TEST(PagedKvCpu, RoundTripRestoresOnlyThoseBlocks) {
  for (const Shape& sh : kShapes) {
    SCOPED_TRACE(paged_kv_layout_name(sh.layout));
    TestCache t = make_cache(sh, 2, 12, 11);
    auto original = t.layer_bytes;
    std::vector<int64_t> engine = {1, 5, 11};
    std::vector<std::vector<uint8_t>> stored(engine.size(),
                                             std::vector<uint8_t>(stored_kv_block_bytes(t.desc)));
    auto ptrs = store_ptrs(stored);
    ASSERT_TRUE(save_paged_kv_cpu(t.desc, engine, ptrs).ok());
    // Scribble over the cache, then load: the three blocks come back, the
    // rest keeps the scribble.
    TestCache s = t;
    for (auto& layer : s.layer_bytes) std::fill(layer.begin(), layer.end(), 0x5a);
    s.point_at_host();
    std::vector<const void*> cptrs(ptrs.begin(), ptrs.end());
    ASSERT_TRUE(load_paged_kv_cpu(s.desc, engine, cptrs).ok());
    std::vector<std::vector<uint8_t>> again(engine.size(), std::vector<uint8_t>(stored[0].size()));
    auto aptrs = store_ptrs(again);
    ASSERT_TRUE(save_paged_kv_cpu(s.desc, engine, aptrs).ok());
    EXPECT_EQ(again, stored);
    std::vector<std::vector<uint8_t>> other(1, std::vector<uint8_t>(stored[0].size()));
    auto optrs = store_ptrs(other);
    std::vector<int64_t> untouched = {2};
    ASSERT_TRUE(save_paged_kv_cpu(s.desc, untouched, optrs).ok());
    // Block 2 was not loaded: every byte of it (outside padding) is the scribble.
    size_t scribble = 0;
    for (uint8_t x : other[0]) scribble += (x == 0x5a);
    EXPECT_EQ(scribble, other[0].size());
  }
}

TEST(PagedKvCpu, BlocksMoveBetweenLayoutsOfOneShape) {
  TestCache packed = make_cache(PagedKvLayout::kPackedKv, 2, 6, 4, 8, 16, 2, 3, 21);
  TestCache split = make_cache(PagedKvLayout::kSplitKv, 2, 6, 4, 8, 16, 2, 0, 99);
  ASSERT_EQ(stored_kv_block_bytes(packed.desc), stored_kv_block_bytes(split.desc));
  std::vector<int64_t> from = {4, 2}, to = {0, 5};
  std::vector<std::vector<uint8_t>> stored(
      2, std::vector<uint8_t>(stored_kv_block_bytes(packed.desc)));
  auto ptrs = store_ptrs(stored);
  ASSERT_TRUE(save_paged_kv_cpu(packed.desc, from, ptrs).ok());
  std::vector<const void*> cptrs(ptrs.begin(), ptrs.end());
  ASSERT_TRUE(load_paged_kv_cpu(split.desc, to, cptrs).ok());
  // Element by element: packed block from[i] equals split block to[i].
  const PagedKvCache &p = packed.desc, &s = split.desc;
  for (int i = 0; i < 2; ++i)
    for (int l = 0; l < 2; ++l)
      for (int kv = 0; kv < 2; ++kv)
        for (int tok = 0; tok < 8; ++tok)
          for (int h = 0; h < 4; ++h)
            for (int d = 0; d < 16; ++d) {
              int64_t a = from[i] * p.block_stride + kv * p.kv_stride + tok * p.token_stride +
                          h * p.head_stride + d;
              int64_t b = to[i] * s.block_stride + kv * s.kv_stride + tok * s.token_stride +
                          h * s.head_stride + d;
              ASSERT_EQ(0, std::memcmp(packed.layer_bytes[l].data() + a * 2,
                                       split.layer_bytes[l].data() + b * 2, 2));
            }
}

TEST(PagedKvCpu, LayerRangeWritesOnlyThoseLayers) {
  TestCache t = make_cache(PagedKvLayout::kPackedKv, 5, 4, 2, 4, 8, 2, 0, 5);
  const uint64_t bytes = stored_kv_block_bytes(t.desc), per_layer = bytes / 5;
  std::vector<int64_t> engine = {3};
  std::vector<std::vector<uint8_t>> full(1, std::vector<uint8_t>(bytes)),
      part(1, std::vector<uint8_t>(bytes, 0x77));
  auto fp = store_ptrs(full), pp = store_ptrs(part);
  ASSERT_TRUE(save_paged_kv_cpu(t.desc, engine, fp).ok());
  ASSERT_TRUE(save_paged_kv_cpu(t.desc, engine, pp, 1, 3).ok());
  for (uint64_t i = 0; i < bytes; ++i) {
    bool inside = i >= per_layer && i < 3 * per_layer;
    ASSERT_EQ(part[0][i], inside ? full[0][i] : 0x77) << i;
  }
}

TEST(PagedKvCpu, RejectsBadRequests) {
  TestCache t = make_cache(PagedKvLayout::kPackedKv, 2, 4, 2, 4, 8, 2, 0, 1);
  std::vector<uint8_t> buf(stored_kv_block_bytes(t.desc));
  std::vector<void*> one = {buf.data()};
  std::vector<int64_t> bad = {4}, two = {0, 1}, ok = {0};
  EXPECT_TRUE(save_paged_kv_cpu(t.desc, bad, one).is(Code::kInvalidArgument));
  EXPECT_TRUE(save_paged_kv_cpu(t.desc, two, one).is(Code::kInvalidArgument));
  EXPECT_TRUE(save_paged_kv_cpu(t.desc, ok, one, 2, 1).is(Code::kInvalidArgument));
  PagedKvCache c = t.desc;
  c.elem_bytes = 3;
  EXPECT_TRUE(validate_paged_kv(c).is(Code::kInvalidArgument));
  c = t.desc;
  c.layers[1] = nullptr;
  EXPECT_TRUE(validate_paged_kv(c).is(Code::kInvalidArgument));
  c = t.desc;
  c.layers.pop_back();
  EXPECT_TRUE(validate_paged_kv(c).is(Code::kInvalidArgument));
  std::vector<void*> null_store = {nullptr};
  EXPECT_TRUE(save_paged_kv_cpu(t.desc, ok, null_store).is(Code::kInvalidArgument));
}

// A cache whose pages hold stored blocks (a view of a lease or an arena)
// is never loaded into: the load would overwrite other blocks' bytes. Saves
// from it, and loads into the pages beside it, go on.
TEST(PagedKvCpu, LoadsNeverWriteIntoStoredBlocks) {
  for (const Shape& sh : kShapes) {
    SCOPED_TRACE(paged_kv_layout_name(sh.layout));
    TestCache t = make_cache(sh, 2, 6, 7);
    const uint64_t bytes = stored_kv_block_bytes(t.desc);
    std::vector<std::vector<uint8_t>> stored(1, std::vector<uint8_t>(bytes));
    auto ptrs = store_ptrs(stored);
    std::vector<const void*> cptrs(ptrs.begin(), ptrs.end());
    const std::vector<int64_t> held = {3};
    ASSERT_TRUE(save_paged_kv_cpu(t.desc, held, ptrs).ok());
    // One byte of layer 1, inside block 3's pages, is an arena's.
    const int64_t elem = sh.layout == PagedKvLayout::kFlatBytes ? 1 : sh.elem;
    const uint8_t* in_block = t.layer_bytes[1].data() + 3 * t.desc.block_stride * elem;
    add_arena_range(in_block, 1);
    const auto before = t.layer_bytes;
    Status st = load_paged_kv_cpu(t.desc, held, cptrs);
    EXPECT_TRUE(st.is(Code::kInvalidArgument)) << st.ToString();
    EXPECT_NE(st.message().find("layer 1"), std::string::npos) << st.message();
    EXPECT_TRUE(load_paged_kv(t.desc, held, cptrs, MemoryKind::kHost).is(Code::kInvalidArgument));
    // Blocks 2 and 4 together span block 3 as well.
    EXPECT_TRUE(load_paged_kv_cpu(t.desc, std::vector<int64_t>{2, 4},
                                  std::vector<const void*>{cptrs[0], cptrs[0]})
                    .is(Code::kInvalidArgument));
    EXPECT_EQ(t.layer_bytes, before);  // nothing written
    EXPECT_TRUE(save_paged_kv_cpu(t.desc, held, ptrs).ok());
    EXPECT_TRUE(load_paged_kv_cpu(t.desc, std::vector<int64_t>{1}, cptrs).ok());
    EXPECT_TRUE(load_paged_kv_cpu(t.desc, std::vector<int64_t>{4}, cptrs).ok());
    // A layer range without layer 1 goes on.
    EXPECT_TRUE(load_paged_kv_cpu(t.desc, held, cptrs, 0, 1).ok());
    remove_arena_range(in_block);
    EXPECT_TRUE(load_paged_kv_cpu(t.desc, held, cptrs).ok());
  }
}

// Descriptions whose elements share memory, or that reach past the memory
// their layers lie in, are refused before any byte moves.
TEST(PagedKvCpu, RejectsOverlappingOrOversizedDescriptions) {
  for (const Shape& sh : kShapes) {
    SCOPED_TRACE(paged_kv_layout_name(sh.layout));
    TestCache t = make_cache(sh, 2, 6, 3);
    EXPECT_TRUE(validate_paged_kv(t.desc).ok());
    PagedKvCache c = t.desc;
    c.layer_bytes = {t.layer_size, t.layer_size};
    EXPECT_TRUE(validate_paged_kv(c).ok()) << validate_paged_kv(c).ToString();
    // Unpadded, the last block's last byte is the layer's last.
    const uint64_t shorter = sh.pad == 0 ? t.layer_size - 1 : t.layer_size / 2;
    c.layer_bytes = {t.layer_size, shorter};
    Status st = validate_paged_kv(c);
    EXPECT_TRUE(st.is(Code::kInvalidArgument));
    EXPECT_NE(st.message().find("layer 1 reaches"), std::string::npos) << st.message();
    c.layer_bytes = {t.layer_size};
    EXPECT_TRUE(validate_paged_kv(c).is(Code::kInvalidArgument));
    // Blocks one element apart overlap.
    c = t.desc;
    c.block_stride = 1;
    st = validate_paged_kv(c);
    EXPECT_TRUE(st.is(Code::kInvalidArgument)) << st.ToString();
    EXPECT_NE(st.message().find("over others"), std::string::npos) << st.message();
    if (sh.layout == PagedKvLayout::kFlatBytes) continue;
    // Heads that lie on each other's tokens.
    c = t.desc;
    c.head_stride = c.token_stride;
    EXPECT_TRUE(validate_paged_kv(c).is(Code::kInvalidArgument));
    // V on K.
    c = t.desc;
    c.kv_stride = 1;
    EXPECT_TRUE(validate_paged_kv(c).is(Code::kInvalidArgument));
  }
  // One head, one token, one block: their strides never matter.
  TestCache one = make_cache(PagedKvLayout::kPackedKv, 1, 1, 1, 1, 8, 2, 0, 9);
  PagedKvCache c = one.desc;
  c.head_stride = 1;
  c.token_stride = 1;
  c.block_stride = 1;
  EXPECT_TRUE(validate_paged_kv(c).ok()) << validate_paged_kv(c).ToString();
}

// Layers are checked against each other too: views of one buffer that
// overlap are refused; layers interleaved block by block (a buffer of
// [blocks, layers, ...]) or one layer given twice (layers that share their
// KV) are not, and move their bytes right.
TEST(PagedKvCpu, LayersThatShareMemoryAreRefusedButInterleavedOnesAreNot) {
  const int blocks = 6, heads = 2, bs = 4, d = 8, elem = 2;
  const int64_t block_elems = int64_t(heads) * bs * 2 * d;
  PagedKvCache c;
  c.layout = PagedKvLayout::kPackedKv;
  c.memory = MemoryKind::kHost;
  c.num_layers = 2;
  c.num_blocks = blocks;
  c.num_kv_heads = heads;
  c.block_size = bs;
  c.head_size = d;
  c.elem_bytes = elem;
  std::vector<uint8_t> buf = random_bytes(size_t(blocks + 2) * 2 * block_elems * elem, 4);
  // Layer 1 starts one block into layer 0.
  c.layers = {buf.data(), buf.data() + block_elems * elem};
  Status st = validate_paged_kv(c);
  EXPECT_TRUE(st.is(Code::kInvalidArgument)) << st.ToString();
  EXPECT_NE(st.message().find("layers 0 and 1 share memory"), std::string::npos) << st.message();
  // Half a head apart: elements collide too.
  c.layers = {buf.data(), buf.data() + d * elem};
  EXPECT_TRUE(validate_paged_kv(c).is(Code::kInvalidArgument));
  // One layer twice.
  c.layers = {buf.data(), buf.data()};
  EXPECT_TRUE(validate_paged_kv(c).ok()) << validate_paged_kv(c).ToString();
  // Three layers at uneven steps (each pair checked): apart, then two that
  // overlap by most of a layer. Only their addresses are looked at.
  uint8_t* const far = reinterpret_cast<uint8_t*>(uintptr_t{1} << 44);
  const int64_t layer_bytes = blocks * block_elems * elem;
  c.num_layers = 3;
  c.layers = {far, far + layer_bytes, far + 2 * layer_bytes + block_elems * elem};
  EXPECT_TRUE(validate_paged_kv(c).ok()) << validate_paged_kv(c).ToString();
  c.layers = {far, far + layer_bytes, far + layer_bytes + 2 * block_elems * elem};
  st = validate_paged_kv(c);
  EXPECT_NE(st.message().find("layers 1 and 2 share memory"), std::string::npos) << st.ToString();
  c.num_layers = 2;
  // Interleaved: [blocks][layers][heads][tokens][2d], layer l at l blocks'
  // worth of elements, blocks two apart.
  PagedKvCache i = c;
  i.block_stride = 2 * block_elems;
  i.head_stride = int64_t(bs) * 2 * d;
  i.token_stride = 2 * d;
  i.kv_stride = d;
  i.layers = {buf.data(), buf.data() + block_elems * elem};
  i.layer_bytes = {buf.size(), buf.size() - block_elems * elem};
  ASSERT_TRUE(validate_paged_kv(i).ok()) << validate_paged_kv(i).ToString();
  std::vector<std::vector<uint8_t>> stored(2, std::vector<uint8_t>(stored_kv_block_bytes(i)));
  auto ptrs = store_ptrs(stored);
  ASSERT_TRUE(save_paged_kv_cpu(i, std::vector<int64_t>{1, 4}, ptrs).ok());
  const std::vector<uint8_t> before = buf;
  std::fill(buf.begin(), buf.end(), 0);
  std::vector<const void*> cptrs(ptrs.begin(), ptrs.end());
  ASSERT_TRUE(load_paged_kv_cpu(i, std::vector<int64_t>{1, 4}, cptrs).ok());
  for (int b : {1, 4})
    for (int l = 0; l < 2; ++l) {
      const size_t at = size_t((int64_t(b) * 2 + l) * block_elems * elem);
      EXPECT_TRUE(
          std::equal(buf.begin() + at, buf.begin() + at + block_elems * elem, before.begin() + at))
          << "block " << b << " layer " << l;
    }
}

TEST(PagedKvCpu, DispatcherRunsHostCachesOnTheCpu) {
  TestCache t = make_cache(PagedKvLayout::kSplitKv, 2, 4, 2, 4, 8, 2, 0, 3);
  std::vector<int64_t> engine = {2};
  std::vector<std::vector<uint8_t>> stored(1, std::vector<uint8_t>(stored_kv_block_bytes(t.desc)));
  auto ptrs = store_ptrs(stored);
  ASSERT_TRUE(save_paged_kv(t.desc, engine, ptrs, MemoryKind::kHost).ok());
  check_stored_block(t, 2, stored[0].data());
}

// ---- GPU ---------------------------------------------------------------------

#define SKIP_WITHOUT_GPU() \
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU"

// The test cache copied to device memory.
struct DeviceCache {
  std::vector<DeviceBuffer> layers;
  PagedKvCache desc;
};

DeviceCache to_device(const TestCache& t) {
  DeviceCache d;
  d.desc = t.desc;
  d.desc.memory = MemoryKind::kDevice;
  for (int l = 0; l < t.desc.num_layers; ++l) {
    auto b = DeviceBuffer::Allocate(0, t.layer_size);
    EXPECT_TRUE(b.ok());
    EXPECT_TRUE(copy_to_device(b->data(), t.layer_bytes[l].data(), t.layer_size).ok());
    d.desc.layers[l] = b->data();
    d.layers.push_back(std::move(b.value()));
  }
  return d;
}

enum class StoreKind { kDevice, kPinnedDirect, kPinnedStaged, kPageable };
const char* store_kind_name(StoreKind k) {
  switch (k) {
    case StoreKind::kDevice: return "device";
    case StoreKind::kPinnedDirect: return "pinned-direct";
    case StoreKind::kPinnedStaged: return "pinned-staged";
    case StoreKind::kPageable: return "pageable";
  }
  return "?";
}

// Store blocks of one kind: n blocks of `bytes`, readable back into host vectors.
struct Stores {
  StoreKind kind;
  uint64_t bytes;
  std::vector<DeviceBuffer> dev;
  PinnedBuffer pinned;
  std::vector<std::vector<uint8_t>> pageable;
  std::vector<void*> ptrs;

  Stores(StoreKind k, size_t n, uint64_t b) : kind(k), bytes(b) {
    if (k == StoreKind::kDevice) {
      for (size_t i = 0; i < n; ++i) {
        dev.push_back(std::move(DeviceBuffer::Allocate(0, b).value()));
        ptrs.push_back(dev.back().data());
      }
    } else if (k == StoreKind::kPageable) {
      pageable.assign(n, std::vector<uint8_t>(b, 0));
      for (auto& v : pageable) ptrs.push_back(v.data());
    } else {
      // Every other block in one pinned buffer, reversed: no two neighbours.
      pinned = std::move(PinnedBuffer::Allocate(2 * n * b).value());
      for (size_t i = 0; i < n; ++i) ptrs.push_back(pinned.data() + (2 * (n - 1 - i)) * b);
    }
  }
  MemoryKind memory() const {
    return kind == StoreKind::kDevice ? MemoryKind::kDevice : MemoryKind::kHost;
  }
  PagedKvPath path() const {
    return kind == StoreKind::kPinnedStaged ? PagedKvPath::kStaged : PagedKvPath::kDirect;
  }
  std::vector<uint8_t> read(size_t i) const {
    std::vector<uint8_t> out(bytes);
    if (kind == StoreKind::kDevice) EXPECT_TRUE(copy_to_host(out.data(), ptrs[i], bytes).ok());
    else std::memcpy(out.data(), ptrs[i], bytes);
    return out;
  }
};

void gpu_round_trip(const TestCache& t, std::vector<int64_t> engine, StoreKind kind) {
  SCOPED_TRACE(std::string(paged_kv_layout_name(t.desc.layout)) + " / " + store_kind_name(kind));
  const uint64_t bytes = stored_kv_block_bytes(t.desc);
  DeviceCache d = to_device(t);
  Stores stores(kind, engine.size(), bytes);
  PagedKvOptions o;
  o.path = stores.path();
  ASSERT_TRUE(save_paged_kv(d.desc, engine, stores.ptrs, stores.memory(), o).ok());
  // Same bytes as the CPU reference.
  std::vector<std::vector<uint8_t>> ref(engine.size(), std::vector<uint8_t>(bytes));
  auto rptrs = store_ptrs(ref);
  ASSERT_TRUE(save_paged_kv_cpu(t.desc, engine, rptrs).ok());
  for (size_t i = 0; i < engine.size(); ++i)
    ASSERT_EQ(stores.read(i), ref[i]) << "store block " << i;
  // Load into a zeroed device cache: those blocks come back byte for byte.
  TestCache zero = t;
  for (auto& layer : zero.layer_bytes) std::fill(layer.begin(), layer.end(), 0);
  zero.point_at_host();
  DeviceCache z = to_device(zero);
  std::vector<const void*> cptrs(stores.ptrs.begin(), stores.ptrs.end());
  ASSERT_TRUE(load_paged_kv(z.desc, engine, cptrs, stores.memory(), o).ok());
  TestCache back = zero;
  for (int l = 0; l < t.desc.num_layers; ++l)
    ASSERT_TRUE(copy_to_host(back.layer_bytes[l].data(), z.layers[l].data(), t.layer_size).ok());
  back.point_at_host();
  std::vector<std::vector<uint8_t>> again(engine.size(), std::vector<uint8_t>(bytes));
  auto aptrs = store_ptrs(again);
  ASSERT_TRUE(save_paged_kv_cpu(back.desc, engine, aptrs).ok());
  EXPECT_EQ(again, ref);
}

TEST(PagedKvGpu, EveryLayoutAndStoreKindMatchesTheCpuReference) {
  SKIP_WITHOUT_GPU();
  for (const Shape& sh : kShapes) {
    TestCache t = make_cache(sh, 3, 24, 31);
    for (StoreKind k : {StoreKind::kDevice, StoreKind::kPinnedDirect, StoreKind::kPinnedStaged,
                        StoreKind::kPageable})
      gpu_round_trip(t, {23, 0, 7, 8, 9, 15}, k);
  }
}

TEST(PagedKvGpu, StagedPathWithSeveralChunks) {
  SKIP_WITHOUT_GPU();
  // 512 KiB stored blocks; 140 of them span more than one 64 MiB bounce chunk.
  TestCache t = make_cache(PagedKvLayout::kPackedKv, 8, 150, 8, 16, 128, 2, 0, 41);
  std::vector<int64_t> engine;
  for (int64_t b = 149; b >= 10; --b) engine.push_back(b);
  gpu_round_trip(t, engine, StoreKind::kPinnedStaged);
}

TEST(PagedKvGpu, SaveIsOrderedAfterWorkOnTheCallersStream) {
  SKIP_WITHOUT_GPU();
  TestCache t = make_cache(PagedKvLayout::kPackedKv, 2, 8, 2, 16, 64, 2, 0, 51);
  DeviceCache d = to_device(t);
  auto stream = GpuStream::Create(0);
  ASSERT_TRUE(stream.ok());
  std::vector<int64_t> engine = {3, 6};
  uint64_t seed = 77;
  for (StoreKind k : {StoreKind::kDevice, StoreKind::kPinnedDirect, StoreKind::kPinnedStaged}) {
    // A slow kernel rewrites layer 0 on the stream; the save must see its bytes.
    ++seed;
    ASSERT_TRUE(
        fill_device_pattern(d.layers[0].data(), t.layer_size, seed, stream->handle(), 20000).ok());
    for (size_t i = 0; i < t.layer_size; ++i) t.layer_bytes[0][i] = pattern_byte(seed, i);
    t.point_at_host();
    Stores stores(k, engine.size(), stored_kv_block_bytes(t.desc));
    PagedKvOptions o;
    o.cuda_stream = stream->handle();
    o.path = stores.path();
    o.wait = false;
    ASSERT_TRUE(save_paged_kv(d.desc, engine, stores.ptrs, stores.memory(), o).ok());
    ASSERT_TRUE(stream->synchronize().ok());
    for (size_t i = 0; i < engine.size(); ++i) {
      std::vector<uint8_t> ref(stores.bytes);
      void* rp = ref.data();
      ASSERT_TRUE(save_paged_kv_cpu(t.desc, {&engine[i], 1}, {&rp, 1}).ok());
      ASSERT_EQ(stores.read(i), ref) << store_kind_name(k);
    }
  }
}

TEST(PagedKvGpu, LayerRangeOnTheStagedPathMovesOnlyThoseLayers) {
  SKIP_WITHOUT_GPU();
  // Layers [1, 3) of 4, packed with padding, through host store blocks on
  // the staged path: the load writes those layers of the device cache and
  // no other; the save writes those layers' part of each store block and
  // leaves the rest of the block as it was.
  TestCache t = make_cache(PagedKvLayout::kPackedKv, 4, 12, 2, 16, 64, 2, 3, 61);
  const uint64_t bytes = stored_kv_block_bytes(t.desc);
  std::vector<int64_t> engine = {9, 2, 5};
  Stores stores(StoreKind::kPinnedStaged, engine.size(), bytes);
  std::vector<std::vector<uint8_t>> ref(engine.size(), std::vector<uint8_t>(bytes));
  auto rptrs = store_ptrs(ref);
  ASSERT_TRUE(save_paged_kv_cpu(t.desc, engine, rptrs).ok());
  for (size_t i = 0; i < engine.size(); ++i) std::memcpy(stores.ptrs[i], ref[i].data(), bytes);
  TestCache zero = t;
  for (auto& layer : zero.layer_bytes) std::fill(layer.begin(), layer.end(), 0);
  zero.point_at_host();
  DeviceCache z = to_device(zero);
  PagedKvOptions o;
  o.path = PagedKvPath::kStaged;
  o.layer_begin = 1;
  o.layer_end = 3;
  std::vector<const void*> cptrs(stores.ptrs.begin(), stores.ptrs.end());
  ASSERT_TRUE(load_paged_kv(z.desc, engine, cptrs, MemoryKind::kHost, o).ok());
  TestCache want = zero;
  want.point_at_host();
  ASSERT_TRUE(load_paged_kv_cpu(want.desc, engine,
                                std::span<const void* const>(cptrs.data(), cptrs.size()), 1, 3)
                  .ok());
  for (int l = 0; l < t.desc.num_layers; ++l) {
    std::vector<uint8_t> got(t.layer_size);
    ASSERT_TRUE(copy_to_host(got.data(), z.layers[l].data(), t.layer_size).ok());
    EXPECT_EQ(got, want.layer_bytes[l]) << "layer " << l;
  }
  // Save layers [1, 3) from the source cache over store blocks of 0xEE.
  DeviceCache d = to_device(t);
  for (void* p : stores.ptrs) std::memset(p, 0xEE, bytes);
  ASSERT_TRUE(save_paged_kv(d.desc, engine, stores.ptrs, MemoryKind::kHost, o).ok());
  std::vector<std::vector<uint8_t>> expect(engine.size(), std::vector<uint8_t>(bytes, 0xEE));
  auto eptrs = store_ptrs(expect);
  ASSERT_TRUE(save_paged_kv_cpu(t.desc, engine, eptrs, 1, 3).ok());
  for (size_t i = 0; i < engine.size(); ++i)
    EXPECT_EQ(stores.read(i), expect[i]) << "store block " << i;
}

}  // namespace
}  // namespace cascade
