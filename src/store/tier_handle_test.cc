// TierHandle: each tier used on its own. The found rule of get() and
// get_batch() on every tier (gpu where a GPU is usable), a file handle's
// put/get/reopen with inspect_directory, its file modes, and the gpu
// handle's calls.
#include "cascade/tier_handle.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cascade/file_tier.h"
#include "cuda/device_buffer.h"
#include "tiers/file/file_test_util.h"
#include "tiers/file/record_format.h"

namespace cascade {
namespace {

using file_test::bytes_of;
using file_test::id_of;
using file_test::TempDir;

CascadeConfig handle_config(const TempDir& tmp) {
  CascadeConfig c;
  c.num_io_threads = 2;
  c.index_shards = 16;
  c.shm_capacity_bytes = 16 << 20;
  c.shm_path = "/dev/shm/cascade-handle-test-" + std::to_string(::getpid());
  c.gpu_capacity_bytes = 64 << 20;
  c.file_path = tmp.sub("tier");
  c.segment_size_bytes = 1 << 20;
  return c;
}

class TierHandleFoundTest : public ::testing::TestWithParam<TierKind> {
 protected:
  void SetUp() override {
    if (GetParam() == TierKind::kGpu && gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
    auto h = TierHandle::Open(GetParam(), handle_config(tmp_));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handle_ = std::move(h.value());
    ASSERT_EQ(handle_->kind(), GetParam());
  }
  void TearDown() override {
    handle_.reset();
    std::filesystem::remove("/dev/shm/cascade-handle-test-" + std::to_string(::getpid()));
  }
  TempDir tmp_;
  std::unique_ptr<TierHandle> handle_;
};

TEST_P(TierHandleFoundTest, HitMissAndTooSmall) {
  const auto data = bytes_of(1, 10000);
  ASSERT_TRUE(handle_->put(id_of(1), data.data(), data.size()).ok());
  std::vector<uint8_t> out(20000);
  bool found = false;
  uint64_t size = 7;

  // A hit: OK, found, the size, the bytes.
  ASSERT_TRUE(handle_->get(id_of(1), out.data(), out.size(), &found, &size).ok());
  EXPECT_TRUE(found);
  EXPECT_EQ(size, data.size());
  EXPECT_EQ(std::memcmp(out.data(), data.data(), data.size()), 0);

  // A miss: OK, not found, size 0.
  found = true;
  ASSERT_TRUE(handle_->get(id_of(2), out.data(), out.size(), &found, &size).ok());
  EXPECT_FALSE(found);
  EXPECT_EQ(size, 0u);

  // Out too small: InvalidArgument, found, the size; nothing written.
  std::vector<uint8_t> small(100, 0xee);
  Status st = handle_->get(id_of(1), small.data(), small.size(), &found, &size);
  EXPECT_TRUE(st.is(Code::kInvalidArgument)) << st.ToString();
  EXPECT_TRUE(found);
  EXPECT_EQ(size, data.size());
  EXPECT_EQ(small, std::vector<uint8_t>(100, 0xee));
  // Capacity 0 asks for the size alone.
  EXPECT_TRUE(handle_->get(id_of(1), nullptr, 0, &found, &size).is(Code::kInvalidArgument));
  EXPECT_TRUE(found);
  EXPECT_EQ(size, data.size());

  // The same per item in a batch.
  std::vector<BlockId> ids = {id_of(1), id_of(2), id_of(1)};
  std::vector<void*> outs = {out.data(), out.data(), small.data()};
  std::vector<uint64_t> caps = {out.size(), out.size(), small.size()};
  std::vector<bool> founds;
  std::vector<uint64_t> sizes;
  std::vector<Status> statuses;
  handle_->get_batch(ids, outs, caps, &founds, &sizes, &statuses);
  ASSERT_EQ(statuses.size(), 3u);
  EXPECT_TRUE(statuses[0].ok());
  EXPECT_TRUE(founds[0]);
  EXPECT_EQ(sizes[0], data.size());
  EXPECT_TRUE(statuses[1].ok());
  EXPECT_FALSE(founds[1]);
  EXPECT_EQ(sizes[1], 0u);
  EXPECT_TRUE(statuses[2].is(Code::kInvalidArgument));
  EXPECT_TRUE(founds[2]);
  EXPECT_EQ(sizes[2], data.size());

  // remove: NotFound the second time, then a miss.
  EXPECT_TRUE(handle_->remove(id_of(1)).ok());
  EXPECT_TRUE(handle_->remove(id_of(1)).is(Code::kNotFound));
  ASSERT_TRUE(handle_->get(id_of(1), out.data(), out.size(), &found, &size).ok());
  EXPECT_FALSE(found);
  EXPECT_EQ(handle_->stats().name, tier_kind_name(GetParam()));
}

// The found rule itself: an InvalidArgument with the block's size is "out
// too small" only where the request does not fit the block. A request that
// fits and still failed with InvalidArgument is a copy the tier could not
// make (a device copy the driver refused), not a found block.
TEST(BlockFoundTest, InvalidArgumentIsFoundOnlyWhereTheRequestDoesNotFit) {
  std::vector<uint8_t> out(4096);
  ReadResult r;
  r.found = true;
  r.block_size = 4096;
  ReadRequest fits;
  fits.out = out.data();
  fits.capacity = out.size();
  ReadRequest small = fits;
  small.capacity = 100;
  const Status refused = Status::InvalidArgument("copy refused");
  EXPECT_TRUE(block_found(Status::OK(), fits, r));
  EXPECT_TRUE(block_found(refused, small, r));
  EXPECT_FALSE(block_found(refused, fits, r));
  EXPECT_FALSE(block_found(Status::NotFound("miss"), small, r));
  EXPECT_FALSE(block_found(Status::IOError("disk"), small, r));
  r.found = false;
  EXPECT_FALSE(block_found(refused, small, r));
  // An empty block is found like any other: a range past its end does not
  // fit it.
  r.found = true;
  r.block_size = 0;
  ReadRequest past_end = fits;
  past_end.whole = false;
  past_end.offset = 1;
  EXPECT_TRUE(block_found(Status::InvalidArgument("offset past the end"), past_end, r));
}

// A read that fails for another reason (here: a device destination where
// no GPU is usable) is an error with found false. Host and file only: the
// gpu tier opens only where a GPU is usable, and there the copy succeeds.
class TierHandleErrorTest : public TierHandleFoundTest {};

TEST_P(TierHandleErrorTest, OtherErrorsAreNotFound) {
  if (gpu_count() > 0) GTEST_SKIP() << "a GPU is usable: device copies succeed";
  const auto data = bytes_of(3, 10000);
  ASSERT_TRUE(handle_->put(id_of(3), data.data(), data.size()).ok());
  std::vector<uint8_t> out(20000);
  bool found = true;
  uint64_t size = 7;
  Status st = handle_->get(id_of(3), out.data(), out.size(), &found, &size, MemoryKind::kDevice);
  EXPECT_FALSE(st.ok());
  EXPECT_FALSE(st.is(Code::kInvalidArgument)) << st.ToString();
  EXPECT_FALSE(found);
  EXPECT_EQ(size, 0u);
}

INSTANTIATE_TEST_SUITE_P(EveryTier, TierHandleFoundTest,
                         ::testing::Values(TierKind::kHost, TierKind::kFile, TierKind::kGpu),
                         [](const ::testing::TestParamInfo<TierKind>& p) {
                           return std::string(tier_kind_name(p.param));
                         });
INSTANTIATE_TEST_SUITE_P(HostAndFile, TierHandleErrorTest,
                         ::testing::Values(TierKind::kHost, TierKind::kFile),
                         [](const ::testing::TestParamInfo<TierKind>& p) {
                           return std::string(tier_kind_name(p.param));
                         });

TEST(TierHandleTest, CallsOfOneTierOnly) {
  TempDir tmp;
  CascadeConfig c = handle_config(tmp);
  auto host = TierHandle::Open(TierKind::kHost, c);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  EXPECT_EQ((*host)->path(), c.shm_path);
  EXPECT_EQ((*host)->device(), -1);
  EXPECT_TRUE((*host)->flush().ok());
  EXPECT_TRUE((*host)->compact().is(Code::kNotSupported));
  EXPECT_TRUE((*host)->trim().is(Code::kNotSupported));
  host->reset();
  std::filesystem::remove(c.shm_path);

  auto file = TierHandle::Open(TierKind::kFile, c);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->path(), c.file_path);
  EXPECT_TRUE((*file)->compact().ok());
  EXPECT_TRUE((*file)->trim().is(Code::kNotSupported));
  const auto d = bytes_of(1, 100);
  ASSERT_TRUE((*file)->put(id_of(1), d.data(), d.size()).ok());
  EXPECT_TRUE((*file)->acquire(id_of(1)).status().is(Code::kNotSupported));

  EXPECT_TRUE(TierHandle::Open(TierKind::kRemote, c).status().is(Code::kInvalidArgument));
  c.num_io_threads = -1;
  auto bad = TierHandle::Open(TierKind::kFile, c);
  EXPECT_TRUE(bad.status().is(Code::kInvalidArgument));
  EXPECT_NE(bad.status().message().find("threads must be 0 (one per core) or 1 to 1024"),
            std::string::npos);
}

TEST(TierHandleTest, FileHandlePutGetReopenInspect) {
  TempDir tmp;
  CascadeConfig c;
  c.file_path = tmp.path();
  c.file_stripe_size = 1 << 20;
  c.file_stripe_count = 2;
  c.segment_size_bytes = 256 << 10;
  c.num_io_threads = 2;
  {
    auto b = TierHandle::Open(TierKind::kFile, c);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    for (uint64_t i = 0; i < 30; ++i) {
      auto d = bytes_of(i, 10000 + i);
      PutOptions o;
      o.is_prefix = i == 0;
      ASSERT_TRUE((*b)->put(id_of(i), d.data(), d.size(), o).ok());
    }
    bool found = false;
    uint64_t size = 0;
    std::vector<uint8_t> out(20000);
    ASSERT_TRUE((*b)->get(id_of(3), out.data(), out.size(), &found, &size).ok());
    EXPECT_TRUE(found);
    EXPECT_EQ(size, 10003u);
    out.resize(size);
    EXPECT_EQ(out, bytes_of(3, 10003));
    ASSERT_TRUE((*b)->get(id_of(99), out.data(), out.size(), &found, &size).ok());
    EXPECT_FALSE(found);
    EXPECT_TRUE((*b)->get(id_of(3), out.data(), 10, &found, &size).is(Code::kInvalidArgument));
    EXPECT_TRUE(found);
    EXPECT_TRUE((*b)->remove(id_of(29)).ok());
    EXPECT_FALSE((*b)->contains(id_of(29)));
    EXPECT_TRUE((*b)->flush().ok());
    EXPECT_EQ((*b)->stats().blocks, 29u);
    EXPECT_EQ((*b)->path(), tmp.path());
    // While open, a second handle is refused.
    EXPECT_TRUE(TierHandle::Open(TierKind::kFile, c).status().is(Code::kBusy));
    // Inspection works alongside the open handle.
    auto rep = inspect_directory(tmp.path(), true);
    ASSERT_TRUE(rep.ok());
    EXPECT_EQ(rep->records, 31u);
  }
  auto rep = inspect_directory(tmp.path(), false);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_TRUE(rep->ok());
  // 30 blocks and the removal record of block 29, which is not live.
  EXPECT_EQ(rep->records, 31u);
  EXPECT_EQ(rep->removal_records, 1u);
  EXPECT_EQ(rep->live_records, 29u);
  EXPECT_GT(rep->segments.size(), 1u);
  for (auto& s : rep->segments) EXPECT_TRUE(s.sealed);
  EXPECT_EQ(rep->file_bytes, rep->live_bytes + rep->dead_bytes);
  // Damage one payload: only a verifying inspection sees it.
  auto segs = file_test::segment_files(tmp.path());
  file_test::flip_bit(segs[0], file::kPage + 5, 0);
  rep = inspect_directory(tmp.path(), false);
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE(rep->ok());
  rep = inspect_directory(tmp.path(), true);
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE(rep->verified);
  EXPECT_FALSE(rep->ok());
  EXPECT_EQ(rep->corrupt_records, 1u);
  EXPECT_EQ(rep->records, 30u);  // 29 blocks (one damaged) and the removal record
  EXPECT_TRUE(inspect_directory(tmp.sub("nope"), false).status().is(Code::kNotFound));
  // Reopen: the damaged block is a miss, the rest are there.
  auto b = TierHandle::Open(TierKind::kFile, c);
  ASSERT_TRUE(b.ok());
  bool found = true;
  uint64_t size = 0;
  std::vector<uint8_t> out(20000);
  ASSERT_TRUE((*b)->get(id_of(0), out.data(), out.size(), &found, &size).ok());
  EXPECT_FALSE(found);
  EXPECT_EQ((*b)->stats().corrupt_blocks, 1u);
  ASSERT_TRUE((*b)->get(id_of(29), out.data(), out.size(), &found, &size).ok());
  EXPECT_FALSE(found);  // a user's removal is written down (a removal record)
}

uint32_t mode_of(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

TEST(TierHandleTest, FileHandleCreatesFilesWithFileMode) {
  TempDir tmp;
  const mode_t old = ::umask(022);
  CascadeConfig c;
  c.file_path = tmp.sub("handle");
  c.file_mode = 0640;
  c.segment_size_bytes = 64 << 10;  // below the store's 1 MiB floor: a handle takes it
  c.num_io_threads = 1;
  {
    auto b = TierHandle::Open(TierKind::kFile, c);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    auto d = bytes_of(1, 100);
    for (uint64_t i = 0; i < 40; ++i) ASSERT_TRUE((*b)->put(id_of(i), d.data(), d.size()).ok());
  }
  ::umask(old);
  EXPECT_EQ(mode_of(c.file_path), 0750u);
  size_t files = 0;
  for (auto& e : std::filesystem::directory_iterator(c.file_path)) {
    EXPECT_EQ(mode_of(e.path().string()), 0640u) << e.path();
    ++files;
  }
  EXPECT_GE(files, 4u);  // LOCK, KEY, a segment and its summary at least
}

TEST(TierHandleTest, GpuUnavailableWithoutAGpu) {
  if (gpu_count() > 0) GTEST_SKIP() << "a GPU is present";
  TempDir tmp;
  auto b = TierHandle::Open(TierKind::kGpu, handle_config(tmp));
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(b.status().is(Code::kUnavailable));
}

TEST(TierHandleTest, GpuHandleCalls) {
  if (gpu_count() == 0) GTEST_SKIP() << "no usable GPU";
  TempDir tmp;
  auto gpu = TierHandle::Open(TierKind::kGpu, handle_config(tmp));
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  EXPECT_EQ((*gpu)->device(), 0);
  std::vector<uint8_t> data = bytes_of(5, 123457);
  BlockId id = compute_block_id(data.data(), data.size());
  ASSERT_TRUE((*gpu)->put(id, data.data(), data.size()).ok());
  EXPECT_TRUE((*gpu)->contains(id));
  std::vector<uint8_t> out(data.size());
  bool found = false;
  uint64_t size = 0;
  ASSERT_TRUE((*gpu)->get(id, out.data(), out.size(), &found, &size).ok());
  EXPECT_TRUE(found);
  EXPECT_EQ(size, data.size());
  EXPECT_EQ(out, data);
  auto ptr = (*gpu)->acquire(id);
  ASSERT_TRUE(ptr.ok());
  EXPECT_EQ(ptr->kind(), MemoryKind::kDevice);
  std::vector<uint8_t> via_ptr(data.size());
  ASSERT_TRUE(copy_to_host(via_ptr.data(), ptr->data(), via_ptr.size()).ok());
  EXPECT_EQ(via_ptr, data);
  ptr->reset();
  std::vector<BlockId> ids = {id, id_of(77)};
  std::vector<const void*> in = {data.data(), data.data()};
  std::vector<uint64_t> lens = {data.size(), data.size()};
  std::vector<Status> put_statuses;
  (*gpu)->put_batch(ids, in, lens, &put_statuses);
  EXPECT_TRUE(put_statuses[0].ok() && put_statuses[1].ok());
  ASSERT_TRUE((*gpu)->remove(id).ok());
  ASSERT_TRUE((*gpu)->get(id, out.data(), out.size(), &found, &size).ok());
  EXPECT_FALSE(found);
  EXPECT_TRUE((*gpu)->trim().ok());
  EXPECT_TRUE((*gpu)->compact().is(Code::kNotSupported));
}

}  // namespace
}  // namespace cascade
