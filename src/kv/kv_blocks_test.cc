#include "cascade/kv_blocks.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <random>

#include "cuda/device_buffer.h"
#include "cuda/device_copy.h"

namespace cascade {
namespace {

std::string shm_path() {
  static std::atomic<int> n{0};
  return "/dev/shm/cascade-kvunit-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

std::unique_ptr<CascadeStore> open_store(uint64_t host_bytes, const std::string& file_dir = "") {
  CascadeConfig c;
  c.pipeline = file_dir.empty() ? "host" : "host|file";
  c.shm_capacity_bytes = host_bytes;
  c.shm_path = shm_path();
  c.num_io_threads = 2;
  c.index_shards = 16;
  if (!file_dir.empty()) {
    c.file_path = file_dir;
    c.file_capacity_bytes = 256ULL << 20;
    c.segment_size_bytes = 16ULL << 20;
    c.io_direct = false;
  }
  auto s = CascadeStore::Open(c);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s.value()) : nullptr;
}

// A host paged KV cache in vLLM's packed layout, filled with random bytes.
struct HostCache {
  static constexpr int kLayers = 3, kBlocks = 8, kHeads = 2, kBlockSize = 4, kHead = 8, kElem = 2;
  static constexpr size_t kLayerBytes = size_t(kBlocks) * kHeads * kBlockSize * 2 * kHead * kElem;
  std::vector<std::vector<uint8_t>> layers;
  PagedKvCache desc;

  explicit HostCache(uint64_t seed) {
    std::mt19937_64 rng(seed);
    layers.assign(kLayers, std::vector<uint8_t>(kLayerBytes));
    for (auto& l : layers)
      for (auto& b : l) b = static_cast<uint8_t>(rng());
    desc.layout = PagedKvLayout::kPackedKv;
    desc.memory = MemoryKind::kHost;
    desc.num_layers = kLayers;
    desc.num_blocks = kBlocks;
    desc.num_kv_heads = kHeads;
    desc.block_size = kBlockSize;
    desc.head_size = kHead;
    desc.elem_bytes = kElem;
    for (auto& l : layers) desc.layers.push_back(l.data());
  }
  // The bytes of engine block b of layer l (contiguous in this layout).
  const uint8_t* block(int l, int64_t b) const {
    return layers[l].data() + b * (kLayerBytes / kBlocks);
  }
  bool same_block(const HostCache& o, int64_t b, int64_t ob, int layer_begin = 0,
                  int layer_end = kLayers) const {
    for (int l = layer_begin; l < layer_end; ++l)
      if (std::memcmp(block(l, b), o.block(l, ob), kLayerBytes / kBlocks) != 0) return false;
    return true;
  }
};

BlockId id_of(int i) {
  std::string key = "kv-block-" + std::to_string(i);
  return block_id_from_key(key).value();
}

TEST(KvBlockMoverTest, SaveThenLoadIsByteExactIntoOtherPages) {
  auto store = open_store(16 << 20);
  HostCache src(1), dst(2);
  HostCache untouched = dst;
  auto saver = KvBlockMover::Create(store.get(), src.desc);
  ASSERT_TRUE(saver.ok()) << saver.status().ToString();
  std::vector<int64_t> from = {5, 0, 7};
  std::vector<BlockId> ids = {id_of(0), id_of(1), id_of(2)};
  std::vector<Status> st;
  auto n = (*saver)->save(from, ids, {}, &st);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 3u);
  EXPECT_EQ(store->stats().tiers[0].blocks, 3u);
  EXPECT_EQ((*saver)->block_bytes(), stored_kv_block_bytes(src.desc));

  auto loader = KvBlockMover::Create(store.get(), dst.desc);
  ASSERT_TRUE(loader.ok());
  std::vector<int64_t> to = {1, 2, 3};
  n = (*loader)->load(to, ids, {}, &st);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(dst.same_block(src, to[i], from[i])) << i;
  for (int64_t b : {0, 4, 5, 6, 7}) EXPECT_TRUE(dst.same_block(untouched, b, b)) << b;
  // A second save of the same ids is a no-op that succeeds.
  n = (*saver)->save(from, ids, {}, &st);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 3u);
}

TEST(KvBlockMoverTest, PerItemErrorsNeverLoadWrongBytes) {
  auto store = open_store(16 << 20);
  HostCache src(3), dst(4);
  HostCache before = dst;
  auto saver = KvBlockMover::Create(store.get(), src.desc).value();
  std::vector<Status> st;
  ASSERT_EQ(*saver->save(std::vector<int64_t>{2}, std::vector<BlockId>{id_of(10)}, {}, &st), 1u);
  // A block of another size under an id the cache asks for.
  std::vector<uint8_t> other(100, 7);
  ASSERT_TRUE(store->put(id_of(11), other.data(), other.size()).ok());

  auto loader = KvBlockMover::Create(store.get(), dst.desc).value();
  std::vector<int64_t> to = {0, 1, 2, 99};
  std::vector<BlockId> ids = {id_of(10), id_of(11), id_of(12), id_of(10)};
  auto n = loader->load(to, ids, {}, &st);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1u);
  EXPECT_TRUE(st[0].ok());
  EXPECT_TRUE(st[1].is(Code::kInvalidArgument)) << st[1].ToString();
  EXPECT_TRUE(st[2].is(Code::kNotFound)) << st[2].ToString();
  EXPECT_TRUE(st[3].is(Code::kInvalidArgument)) << st[3].ToString();
  EXPECT_TRUE(dst.same_block(src, 0, 2));
  EXPECT_TRUE(dst.same_block(before, 1, 1));
  EXPECT_TRUE(dst.same_block(before, 2, 2));
  EXPECT_EQ(store->stats().tiers[0].leased_blocks, 0u);

  // Whole-call errors.
  EXPECT_FALSE(
      loader->load(std::vector<int64_t>{0, 1}, std::vector<BlockId>{id_of(10)}, {}, &st).ok());
  KvMoveOptions bad;
  bad.layer_begin = 2;
  bad.layer_end = 1;
  EXPECT_FALSE(
      loader->load(std::vector<int64_t>{0}, std::vector<BlockId>{id_of(10)}, bad, &st).ok());
  KvMoveOptions some_layers;
  some_layers.layer_end = 1;
  EXPECT_FALSE(
      saver->save(std::vector<int64_t>{0}, std::vector<BlockId>{id_of(13)}, some_layers, &st).ok());
  // Out-of-range engine block on save: that item fails, nothing stored.
  n = saver->save(std::vector<int64_t>{-1}, std::vector<BlockId>{id_of(14)}, {}, &st);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 0u);
  EXPECT_FALSE(store->contains(id_of(14)));
}

TEST(KvBlockMoverTest, LayerRangeLoadsOnlyThoseLayers) {
  auto store = open_store(16 << 20);
  HostCache src(5), dst(6);
  HostCache before = dst;
  auto saver = KvBlockMover::Create(store.get(), src.desc).value();
  std::vector<Status> st;
  ASSERT_EQ(*saver->save(std::vector<int64_t>{4}, std::vector<BlockId>{id_of(20)}, {}, &st), 1u);
  auto loader = KvBlockMover::Create(store.get(), dst.desc).value();
  KvMoveOptions o;
  o.layer_begin = 1;
  o.layer_end = 2;
  ASSERT_EQ(*loader->load(std::vector<int64_t>{6}, std::vector<BlockId>{id_of(20)}, o, &st), 1u);
  EXPECT_TRUE(dst.same_block(src, 6, 4, 1, 2));
  EXPECT_TRUE(dst.same_block(before, 6, 6, 0, 1));
  EXPECT_TRUE(dst.same_block(before, 6, 6, 2, 3));
}

TEST(KvBlockMoverTest, LoadsBlocksFromTheFileTier) {
  const char* base = std::getenv("CASCADE_TEST_TMP");
  std::filesystem::path dir =
      std::filesystem::path(base ? base : "/tmp") / ("kvblocks-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  HostCache src(7), dst(8);
  std::vector<int64_t> all = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<BlockId> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(id_of(100 + i));
  std::vector<Status> st;
  {
    // Host tier holds about two blocks: the rest moves down to files.
    auto store = open_store(2 * stored_kv_block_bytes(src.desc) + 4096, dir.string());
    ASSERT_TRUE(store);
    auto saver = KvBlockMover::Create(store.get(), src.desc).value();
    ASSERT_EQ(*saver->save(all, ids, {}, &st), 8u);
    ASSERT_TRUE(store->flush().ok());
    auto loader = KvBlockMover::Create(store.get(), dst.desc).value();
    ASSERT_EQ(*loader->load(all, ids, {}, &st), 8u) << st[0].ToString();
    for (int64_t b : all) EXPECT_TRUE(dst.same_block(src, b, b)) << b;
  }
  {
    // Reopened: every block comes from the file tier.
    HostCache again(9);
    auto store = open_store(2 * stored_kv_block_bytes(src.desc) + 4096, dir.string());
    ASSERT_TRUE(store);
    auto loader = KvBlockMover::Create(store.get(), again.desc).value();
    ASSERT_EQ(*loader->load(all, ids, {}, &st), 8u);
    for (int64_t b : all) EXPECT_TRUE(again.same_block(src, b, b)) << b;
  }
  std::filesystem::remove_all(dir);
}

TEST(KvBlockMoverTest, LayeredLoadOfAHostCacheLoadsEveryLayerAtOnce) {
  auto store = open_store(16 << 20);
  HostCache src(11), dst(12), ref(12);
  auto saver = KvBlockMover::Create(store.get(), src.desc).value();
  std::vector<Status> st;
  ASSERT_EQ(
      *saver->save(std::vector<int64_t>{1, 3}, std::vector<BlockId>{id_of(30), id_of(31)}, {}, &st),
      2u);
  auto loader = KvBlockMover::Create(store.get(), dst.desc).value();
  auto reference = KvBlockMover::Create(store.get(), ref.desc).value();
  std::vector<int64_t> to = {0, 5, 6, 99};
  std::vector<BlockId> ids = {id_of(30), id_of(31), id_of(32), id_of(30)};
  auto load = loader->load_layers(to, ids, {});
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  // Loaded before the call returned: the waits return at once.
  for (int l = 0; l < HostCache::kLayers; ++l) EXPECT_TRUE((*load)->wait_layer(l, nullptr).ok());
  EXPECT_TRUE((*load)->wait_layer(HostCache::kLayers, nullptr).is(Code::kInvalidArgument));
  EXPECT_TRUE((*load)->wait_layer(-1, nullptr).is(Code::kInvalidArgument));
  std::vector<Status> want;
  ASSERT_EQ(*reference->load(to, ids, {}, &want), 2u);
  const std::vector<Status>& got = (*load)->finish();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].code(), want[i].code()) << i;
  EXPECT_EQ((*load)->loaded(), 2u);
  EXPECT_TRUE(dst.same_block(src, 0, 1));
  EXPECT_TRUE(dst.same_block(src, 5, 3));
  EXPECT_EQ(store->stats().tiers[0].leased_blocks, 0u);
  // A layer range is not a layer-ordered load; spans of two lengths are refused.
  KvMoveOptions some;
  some.layer_end = 1;
  EXPECT_TRUE(loader->load_layers(to, ids, some).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(
      loader->load_layers(std::vector<int64_t>{0}, ids, {}).status().is(Code::kInvalidArgument));
}

TEST(KvBlockMoverTest, LayeredLoadIntoDeviceMemoryOrdersEachLayerBeforeItsWait) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  auto store = open_store(16 << 20);
  HostCache src(13);
  auto saver = KvBlockMover::Create(store.get(), src.desc).value();
  std::vector<int64_t> from = {7, 2, 4};
  std::vector<BlockId> ids = {id_of(40), id_of(41), id_of(42)};
  std::vector<Status> st;
  ASSERT_EQ(*saver->save(from, ids, {}, &st), 3u);
  // The same cache shape in device memory.
  std::vector<DeviceBuffer> layers;
  PagedKvCache dev = src.desc;
  dev.memory = MemoryKind::kDevice;
  for (int l = 0; l < HostCache::kLayers; ++l) {
    layers.push_back(std::move(DeviceBuffer::Allocate(0, HostCache::kLayerBytes).value()));
    dev.layers[l] = layers.back().data();
  }
  auto loads = GpuStream::Create(0).value();
  auto reads = GpuStream::Create(0).value();
  // A slow kernel first rewrites every layer on the load stream: a read
  // not ordered after the load would see its bytes (or the ones before).
  for (int l = 0; l < HostCache::kLayers; ++l)
    ASSERT_TRUE(
        fill_device_pattern(layers[l].data(), HostCache::kLayerBytes, 90 + l, loads.handle(), 20000)
            .ok());
  auto loader = KvBlockMover::Create(store.get(), dev, 0).value();
  std::vector<int64_t> to = {0, 3, 5};
  KvMoveOptions o;
  o.cuda_stream = loads.handle();
  auto load = loader->load_layers(to, ids, o);
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  const size_t block = HostCache::kLayerBytes / HostCache::kBlocks;
  for (int l = HostCache::kLayers - 1; l >= 0; --l) {  // the last layer first
    ASSERT_TRUE((*load)->wait_layer(l, reads.handle()).ok());
    std::vector<uint8_t> got(HostCache::kLayerBytes);
    ASSERT_TRUE(device_copy(got.data(), MemoryKind::kHost, layers[l].data(), MemoryKind::kDevice,
                            got.size(), reads.handle())
                    .ok());
    for (size_t i = 0; i < to.size(); ++i)
      EXPECT_EQ(0, std::memcmp(got.data() + to[i] * block, src.block(l, from[i]), block))
          << "layer " << l << " block " << to[i];
  }
  const std::vector<Status>& done = (*load)->finish();
  for (const Status& s : done) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(store->stats().tiers[0].leased_blocks, 0u);
}

}  // namespace
}  // namespace cascade
