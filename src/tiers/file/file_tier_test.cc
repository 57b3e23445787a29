// FileTier: round trips, reopen, verification, faults, capacity, two opens.
#include "tiers/file/file_tier.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>

#include "cascade/file_tier.h"
#include "tiers/file/file_test_util.h"
#include "tiers/file/segment_scan.h"

namespace cascade {
namespace {

using file_test::bytes_of;
using file_test::id_of;
using file_test::TempDir;

std::unique_ptr<FileTier> open_tier(const CascadeConfig& c, ThreadPool* pool, Env* env = nullptr) {
  auto t = FileTier::Open(c, pool, env);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t.value()) : nullptr;
}

Status put(Tier* t, uint64_t n, size_t size, bool prefix = false) {
  auto data = bytes_of(n, size);
  PutOptions o;
  o.is_prefix = prefix;
  return t->put(id_of(n), data.data(), size, o);
}

// Reads block n and compares it with bytes_of(n, size). aligned: read into a
// 4 KiB-aligned buffer (the zero-copy O_DIRECT path).
::testing::AssertionResult reads_back(Tier* t, uint64_t n, size_t size, bool aligned = false) {
  auto want = bytes_of(n, size);
  file::AlignedBuffer buf(size + 4096);
  uint8_t* out = aligned ? buf.data() : buf.data() + 8;
  std::memset(out, 0xee, size);
  ReadRequest req;
  req.out = out;
  req.capacity = size;
  ReadResult r;
  Status st = t->read(id_of(n), req, &r);
  if (!st.ok()) return ::testing::AssertionFailure() << "block " << n << ": " << st.ToString();
  if (r.block_size != size || r.copied != size)
    return ::testing::AssertionFailure()
           << "block " << n << " size " << r.block_size << " copied " << r.copied;
  if (size && std::memcmp(out, want.data(), size) != 0)
    return ::testing::AssertionFailure() << "block " << n << " bytes differ";
  return ::testing::AssertionSuccess();
}

bool misses(Tier* t, uint64_t n, size_t size) {
  std::vector<uint8_t> out(size + 1);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ReadResult r;
  return t->read(id_of(n), req, &r).is(Code::kNotFound);
}

const std::vector<size_t> kSizes = {0, 1, 100, 4032, 4033, 4096, 12345, 65536, (1 << 20) + 13};

struct Mode {
  bool direct;
  FileIoEngine engine;
};

class FileTierModeTest : public ::testing::TestWithParam<Mode> {};

TEST_P(FileTierModeTest, RoundTripAndReopen) {
  Mode m = GetParam();
  if (m.engine == FileIoEngine::kIoUring && !file::make_uring_engine(8).ok())
    GTEST_SKIP() << "no io_uring in this build or kernel";
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());
  c.io_direct = m.direct;
  c.file_io_engine = m.engine;
  {
    auto t = open_tier(c, &pool);
    ASSERT_TRUE(t);
    EXPECT_STREQ(t->io_engine_name(), m.engine == FileIoEngine::kIoUring ? "io_uring" : "psync");
    for (size_t i = 0; i < kSizes.size(); ++i)
      ASSERT_TRUE(put(t.get(), i, kSizes[i], i % 3 == 0).ok());
    EXPECT_TRUE(put(t.get(), 0, kSizes[0]).ok());  // again: a no-op
    for (size_t i = 0; i < kSizes.size(); ++i) {
      EXPECT_TRUE(reads_back(t.get(), i, kSizes[i], false));
      EXPECT_TRUE(reads_back(t.get(), i, kSizes[i], true));
    }
    EXPECT_TRUE(misses(t.get(), 999, 10));
    TierStats s = t->stats();
    EXPECT_EQ(s.blocks, kSizes.size());
    EXPECT_EQ(s.corrupt_blocks, 0u);
    EXPECT_EQ(s.misses, 1u);
    EXPECT_EQ(std::string(s.name), "file");
  }
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->recovery_report().segments_scanned, 0u) << "a clean close seals every segment";
  EXPECT_EQ(t->stats().blocks, kSizes.size());
  for (size_t i = 0; i < kSizes.size(); ++i) EXPECT_TRUE(reads_back(t.get(), i, kSizes[i]));
  // is_prefix survives the reopen.
  ReadResult r;
  std::vector<uint8_t> out(200);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ASSERT_TRUE(t->read(id_of(0), req, &r).ok());
  EXPECT_TRUE(r.is_prefix);
  ASSERT_TRUE(t->read(id_of(1), req, &r).ok());
  EXPECT_FALSE(r.is_prefix);
}

TEST_P(FileTierModeTest, ReadBatchPartialReadsAndSmallBuffers) {
  Mode m = GetParam();
  if (m.engine == FileIoEngine::kIoUring && !file::make_uring_engine(8).ok())
    GTEST_SKIP() << "no io_uring in this build or kernel";
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());
  c.io_direct = m.direct;
  c.file_io_engine = m.engine;
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  const size_t n = 40;
  for (size_t i = 0; i < n; ++i) ASSERT_TRUE(put(t.get(), i, 5000 + i * 1000).ok());
  std::vector<BlockId> ids;
  std::vector<ReadRequest> reqs(n + 1);
  std::vector<ReadResult> results(n + 1);
  std::vector<Status> statuses(n + 1);
  std::vector<file::AlignedBuffer> bufs;
  for (size_t i = 0; i <= n; ++i) {
    ids.push_back(id_of(i));  // the last one is a miss
    bufs.emplace_back(64 << 10);
    reqs[i].out = bufs.back().data();
    reqs[i].capacity = 64 << 10;
  }
  t->read_batch(ids, reqs, results, statuses);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].ToString();
    auto want = bytes_of(i, 5000 + i * 1000);
    ASSERT_EQ(results[i].copied, want.size());
    EXPECT_EQ(std::memcmp(bufs[i].data(), want.data(), want.size()), 0) << i;
  }
  EXPECT_TRUE(statuses[n].is(Code::kNotFound));
  // Partial read.
  auto want = bytes_of(7, 12000);
  std::vector<uint8_t> part(100);
  ReadRequest pr;
  pr.out = part.data();
  pr.capacity = part.size();
  pr.whole = false;
  pr.offset = 11950;
  ReadResult r;
  ASSERT_TRUE(t->read(id_of(7), pr, &r).ok());
  EXPECT_EQ(r.copied, 50u);
  EXPECT_EQ(std::memcmp(part.data(), want.data() + 11950, 50), 0);
  // Buffer too small for a whole read: InvalidArgument with the size.
  ReadRequest small;
  small.out = part.data();
  small.capacity = part.size();
  Status st = t->read(id_of(7), small, &r);
  EXPECT_TRUE(st.is(Code::kInvalidArgument));
  EXPECT_EQ(r.block_size, 12000u);
}

INSTANTIATE_TEST_SUITE_P(FileModes, FileTierModeTest,
                         ::testing::Values(Mode{false, FileIoEngine::kPsync},
                                           Mode{true, FileIoEngine::kPsync},
                                           Mode{false, FileIoEngine::kIoUring},
                                           Mode{true, FileIoEngine::kIoUring}),
                         [](const ::testing::TestParamInfo<Mode>& p) {
                           return std::string(p.param.direct ? "Direct" : "Buffered") +
                                  (p.param.engine == FileIoEngine::kPsync ? "Psync" : "IoUring");
                         });

TEST(FileTierTest, SegmentsRollAndRemoveWorks) {
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 256 << 10;
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i < 100; ++i) ASSERT_TRUE(put(t.get(), i, 20000).ok());
  EXPECT_GT(t->segment_count(), 5u);
  EXPECT_TRUE(t->contains(id_of(5)));
  EXPECT_TRUE(t->remove(id_of(5)).ok());
  EXPECT_TRUE(t->remove(id_of(5)).is(Code::kNotFound));
  EXPECT_FALSE(t->contains(id_of(5)));
  EXPECT_TRUE(misses(t.get(), 5, 20000));
  EXPECT_GT(t->dead_bytes(), 0u);
  for (uint64_t i = 0; i < 100; ++i)
    if (i != 5) {
      EXPECT_TRUE(reads_back(t.get(), i, 20000));
    }
  EXPECT_TRUE(t->flush().ok());
}

TEST(FileTierTest, PayloadBitFlipOnDiskIsAMissAndCounted) {
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  ASSERT_TRUE(put(t.get(), 1, 10000).ok());
  ASSERT_TRUE(put(t.get(), 2, 10000).ok());
  ASSERT_TRUE(put(t.get(), 3, 100).ok());
  ASSERT_TRUE(t->flush().ok());
  auto segs = file_test::segment_files(tmp.path());
  ASSERT_EQ(segs.size(), 1u);
  // Record 2 starts after record 1 (12 KiB + 4 KiB); flip a payload bit of
  // record 2 and a header bit of record 3.
  const uint64_t rec = file::record_size(10000);
  file_test::flip_bit(segs[0], rec + file::kPage + 777, 2);
  file_test::flip_bit(segs[0], 2 * rec + 30, 5);
  EXPECT_TRUE(reads_back(t.get(), 1, 10000));
  EXPECT_TRUE(misses(t.get(), 2, 10000));
  EXPECT_TRUE(misses(t.get(), 3, 100));
  EXPECT_EQ(t->stats().corrupt_blocks, 2u);
  EXPECT_FALSE(t->contains(id_of(2)));  // dropped from the index
  EXPECT_TRUE(misses(t.get(), 2, 10000));
  EXPECT_EQ(t->stats().corrupt_blocks, 2u);  // counted once
}

TEST(FileTierTest, DamageFoundOnReopenIsSkippedAndCounted) {
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());
  {
    auto t = open_tier(c, &pool);
    for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(put(t.get(), i, 5000).ok());
  }
  auto segs = file_test::segment_files(tmp.path());
  ASSERT_EQ(segs.size(), 1u);
  // Without its summary the segment is scanned on open.
  std::filesystem::remove(segs[0].substr(0, segs[0].size() - 4) + ".sum");
  const uint64_t rec = file::record_size(5000);
  file_test::flip_bit(segs[0], rec + file::kPage + 10, 0);  // payload of block 1
  file_test::flip_bit(segs[0], 2 * rec + 16, 0);            // header of block 2
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->recovery_report().segments_scanned, 1u);
  EXPECT_EQ(t->recovery_report().corrupt_records, 2u);
  EXPECT_EQ(t->stats().corrupt_blocks, 2u);
  EXPECT_TRUE(reads_back(t.get(), 0, 5000));
  EXPECT_TRUE(misses(t.get(), 1, 5000));
  // The walk never looks for a record past a header it cannot trust (it
  // could be a record image inside a payload): blocks 2 and 3 are lost.
  EXPECT_TRUE(misses(t.get(), 2, 5000));
  EXPECT_TRUE(misses(t.get(), 3, 5000));
}

TEST(FileTierTest, TornTailAtEveryByteOffsetOfTheLastRecord) {
  // The store died while appending its last record: whatever prefix of it
  // reached the file, the reopened tier serves the earlier blocks and never
  // the torn one.
  auto env = NewMemoryEnv();
  CascadeConfig c = file_test::file_config("/m/t");
  {
    auto t = open_tier(c, nullptr, env.get());
    ASSERT_TRUE(put(t.get(), 0, 3000).ok());
    ASSERT_TRUE(put(t.get(), 1, 5000).ok());
    ASSERT_TRUE(put(t.get(), 2, 1000).ok());  // the last record: one 4 KiB page
  }
  std::string seg = "/m/t/" + file::segment_file_name(1);
  ASSERT_TRUE(env->unlink("/m/t/" + file::summary_file_name(1)).ok());
  auto f = env->open(seg, FileOpenOptions{});
  ASSERT_TRUE(f.ok());
  std::vector<uint8_t> image(*(*f)->size());
  ASSERT_EQ(*(*f)->pread(image.data(), image.size(), 0), image.size());
  f->reset();
  const uint64_t last = file::record_size(3000) + file::record_size(5000);
  ASSERT_EQ(image.size(), last + file::kPage);
  for (uint64_t cut = last; cut <= image.size(); ++cut) {
    FileOpenOptions w;
    w.write = w.truncate = true;
    auto g = env->open(seg, w);
    ASSERT_TRUE(g.ok());
    ASSERT_TRUE((*g)->pwrite(image.data(), cut, 0).ok());
    g->reset();
    (void)env->unlink("/m/t/" + file::summary_file_name(1));
    auto t = open_tier(c, nullptr, env.get());
    ASSERT_TRUE(t);
    ASSERT_TRUE(reads_back(t.get(), 0, 3000)) << cut;
    ASSERT_TRUE(reads_back(t.get(), 1, 5000)) << cut;
    bool whole = cut >= last + file::kRecordHeaderSize + 1000;
    if (whole) {
      ASSERT_TRUE(reads_back(t.get(), 2, 1000)) << cut;
    } else {
      ASSERT_FALSE(t->contains(id_of(2))) << cut;
    }
    ASSERT_EQ(t->stats().corrupt_blocks, 0u) << cut;
  }
}

TEST(FileTierTest, TwoOpensOfOneDirectoryAreRefused) {
  TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  auto first = FileTier::Open(c, nullptr);
  ASSERT_TRUE(first.ok());
  auto second = FileTier::Open(c, nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(second.status().is(Code::kBusy));
  EXPECT_NE(second.status().message().find("another store"), std::string::npos)
      << second.status().ToString();
  first->reset();
  EXPECT_TRUE(FileTier::Open(c, nullptr).ok());
}

TEST(FileTierTest, MissingDirectoryIsCreated) {
  TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.sub("a/b/c"));
  auto t = open_tier(c, nullptr);
  ASSERT_TRUE(t);
  ASSERT_TRUE(put(t.get(), 1, 100).ok());
  EXPECT_TRUE(reads_back(t.get(), 1, 100));
}

TEST(FileTierTest, UnusableDirectoryGivesAClearError) {
  TempDir tmp;
  // A regular file where the directory should be.
  {
    FILE* f = std::fopen(tmp.sub("plain").c_str(), "w");
    std::fclose(f);
  }
  auto t = FileTier::Open(file_test::file_config(tmp.sub("plain")), nullptr);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("plain"), std::string::npos);
  // A read-only file system (as root, permissions would not stop us).
  FaultInjectingEnv env(Env::Default());
  env.set_read_only(true);
  t = FileTier::Open(file_test::file_config(tmp.sub("ro")), nullptr, &env);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("cannot create"), std::string::npos) << t.status().ToString();
  ASSERT_TRUE(Env::Default()->create_dirs(tmp.sub("ro")).ok());
  t = FileTier::Open(file_test::file_config(tmp.sub("ro")), nullptr, &env);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("not writable"), std::string::npos) << t.status().ToString();
  if (::geteuid() != 0) {
    ::chmod(tmp.sub("ro").c_str(), 0555);
    t = FileTier::Open(file_test::file_config(tmp.sub("ro")), nullptr);
    EXPECT_FALSE(t.ok());
    ::chmod(tmp.sub("ro").c_str(), 0755);
  }
  EXPECT_TRUE(FileTier::Open(CascadeConfig{}, nullptr).status().is(Code::kInvalidArgument));
}

// The directory removed under a running store, then made again: a flush
// fails rather than say OK for records no reopen could read (written under
// the store's key without its KEY file), and no segment is made in the new
// directory.
TEST(FileTierTest, ADirectoryRemovedAndMadeAgainFailsTheFlush) {
  TempDir tmp;
  const CascadeConfig c = file_test::file_config(tmp.path());
  ThreadPool pool(2);
  auto t = open_tier(c, &pool);
  for (uint64_t i = 0; t && i < 4; ++i) ASSERT_TRUE(put(t.get(), i, 30000).ok());
  ASSERT_TRUE(t && t->flush().ok());
  std::filesystem::remove_all(c.file_path);
  ASSERT_TRUE(std::filesystem::create_directory(c.file_path));
  Status st = t->flush();
  EXPECT_TRUE(st.is(Code::kIOError)) << st.ToString();
  EXPECT_NE(st.message().find("lost the LOCK file"), std::string::npos) << st.message();
  // Enough puts to need a new segment: refused, and none made.
  Status put_st;
  for (uint64_t i = 10; i < 80 && put_st.ok(); ++i) put_st = put(t.get(), i, 30000);
  EXPECT_TRUE(put_st.is(Code::kIOError)) << put_st.ToString();
  // Another store opens the new directory (a LOCK file of its own there):
  // still not this store's.
  auto other = open_tier(c, &pool);
  ASSERT_TRUE(other);
  EXPECT_TRUE(t->flush().is(Code::kIOError));
  EXPECT_TRUE(put(other.get(), 200, 30000).ok());
  EXPECT_TRUE(other->flush().ok());
  t.reset();
  other.reset();
  std::string names;  // the other store's one segment, none of this store's
  int segments = 0;
  for (const auto& e : std::filesystem::directory_iterator(c.file_path)) {
    names += e.path().filename().string() + " ";
    segments += e.path().extension() == ".dat";
  }
  EXPECT_EQ(segments, 1) << names;
  other = open_tier(c, &pool);
  ASSERT_TRUE(other);
  EXPECT_TRUE(reads_back(other.get(), 200, 30000));
  EXPECT_FALSE(other->contains(id_of(0)));
}

// A relative file_path names the directory as the working directory was
// at open: a process that changes it later keeps its tier.
TEST(FileTierTest, ARelativeDirectoryOutlivesAChangeOfWorkingDirectory) {
  TempDir tmp;
  const std::filesystem::path before = std::filesystem::current_path();
  std::filesystem::current_path(tmp.path());
  CascadeConfig c = file_test::file_config(tmp.path());
  c.file_path = "kv";
  ThreadPool pool(2);
  auto t = open_tier(c, &pool);
  std::filesystem::current_path("/");
  const bool opened = t != nullptr;
  Status put_st = opened ? put(t.get(), 1, 30000) : Status::OK();
  Status flushed = opened ? t->flush() : Status::OK();
  t.reset();
  std::filesystem::current_path(before);
  ASSERT_TRUE(opened);
  EXPECT_TRUE(put_st.ok()) << put_st.ToString();
  EXPECT_TRUE(flushed.ok()) << flushed.ToString();
  c.file_path = tmp.path() + "/kv";
  t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  EXPECT_TRUE(reads_back(t.get(), 1, 30000));
}

// A tier in a directory of its own, over an Env that injects faults.
struct FaultyTier {
  TempDir tmp;
  ThreadPool pool{2};
  FaultInjectingEnv env{Env::Default()};
  CascadeConfig c = file_test::file_config(tmp.path());
  std::unique_ptr<FileTier> t = open_tier(c, &pool, &env);
};

TEST(FileTierTest, DiskFullFailsThePutCleanlyAndKeepsServing) {
  FaultyTier f;
  auto& [tmp, pool, env, c, t] = f;
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(put(t.get(), i, 30000).ok());
  env.fail_writes_after(100000);  // room for about three more records
  int stored = 0;
  Status st;
  for (uint64_t i = 10; i < 30 && (st = put(t.get(), i, 30000)).ok(); ++i) ++stored;
  EXPECT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
  EXPECT_GE(stored, 2);
  EXPECT_LE(stored, 4);
  EXPECT_EQ(t->stats().file_system_full, 1u);  // counted, for the operator's warning
  for (uint64_t i = 0; i < 10 + static_cast<uint64_t>(stored); ++i)
    EXPECT_TRUE(reads_back(t.get(), i, 30000));
  EXPECT_FALSE(t->contains(id_of(10 + stored)));  // the failed put left nothing visible
  EXPECT_TRUE(put(t.get(), 100, 30000).is(Code::kNoSpace));
  EXPECT_EQ(t->stats().file_system_full, 2u);
  env.clear_faults();
  ASSERT_TRUE(put(t.get(), 100, 30000).ok());
  EXPECT_TRUE(reads_back(t.get(), 100, 30000));
  t.reset();
  // Nothing stored was lost, and the torn attempt is not served after reopen.
  t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i < 10 + static_cast<uint64_t>(stored); ++i)
    EXPECT_TRUE(reads_back(t.get(), i, 30000));
  EXPECT_TRUE(reads_back(t.get(), 100, 30000));
  EXPECT_EQ(t->stats().blocks, 11u + stored);
}

// A removal whose record the disk refused is written by the next flush,
// which fails while it cannot: before, the removal held in memory only, the
// flushes after the disk came back said OK, and a reopen found the id with
// its old bytes. A put of the id after the removal is newer than it: the
// removal is then not written (it would take the new record away).
TEST(FileTierTest, ARemovalTheDiskRefusedIsWrittenByTheNextFlush) {
  FaultyTier f;
  auto& [tmp, pool, env, c, t] = f;
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(put(t.get(), i, 30000).ok());
  ASSERT_TRUE(t->flush().ok());
  env.set_read_only(true);
  ASSERT_TRUE(t->remove_lasting(id_of(0)).ok());
  ASSERT_TRUE(t->remove_lasting(id_of(1)).ok());
  EXPECT_FALSE(t->contains(id_of(0)));
  Status st = t->flush();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("2 of 2 removals could not be written down"), std::string::npos)
      << st.ToString();
  env.clear_faults();
  auto again = bytes_of(1000, 30000);
  ASSERT_TRUE(t->put(id_of(1), again.data(), again.size(), PutOptions{}).ok());
  ASSERT_TRUE(t->flush().ok());
  t.reset();
  t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  EXPECT_FALSE(t->contains(id_of(0))) << "the removal came undone at the reopen";
  std::vector<uint8_t> out(30000);
  ReadRequest rq;
  rq.out = out.data();
  rq.capacity = out.size();
  ReadResult r;
  ASSERT_TRUE(t->read(id_of(1), rq, &r).ok());
  EXPECT_EQ(out, again);
  EXPECT_TRUE(reads_back(t.get(), 2, 30000));
}

// A write refused past a file size limit fails its put, and the tier goes
// on in a new segment instead of failing every later write at that offset.
TEST(FileTierTest, AWriteRefusedForTheFilesSizeMovesOnToANewSegment) {
  FaultyTier f;
  auto& [tmp, pool, env, c, t] = f;
  ASSERT_TRUE(t);
  env.limit_file_size(200000);  // room for six records of a segment
  std::vector<uint64_t> stored;
  int failed = 0;
  for (uint64_t i = 0; i < 40; ++i) {
    Status st = put(t.get(), i, 30000);
    if (st.ok()) {
      stored.push_back(i);
      continue;
    }
    ++failed;
    EXPECT_NE(st.ToString().find("too large"), std::string::npos) << st.ToString();
    EXPECT_FALSE(t->contains(id_of(i)));
  }
  EXPECT_GE(stored.size(), 30u) << failed << " puts failed";
  for (uint64_t i : stored) EXPECT_TRUE(reads_back(t.get(), i, 30000)) << i;
  EXPECT_TRUE(t->flush().ok());
  t.reset();
  env.clear_faults();
  t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  for (uint64_t i : stored) EXPECT_TRUE(reads_back(t.get(), i, 30000)) << i;
  EXPECT_EQ(t->stats().blocks, stored.size());
}

// A disk that refuses every write (a file size limit below one record):
// each put fails, and no segment is made and given up per attempt.
TEST(FileTierTest, WritesRefusedAtTheStartOfASegmentMakeNoNewSegments) {
  FaultyTier f;
  auto& [tmp, pool, env, c, t] = f;
  ASSERT_TRUE(t);
  env.limit_file_size(1000);
  for (uint64_t i = 0; i < 50; ++i) EXPECT_FALSE(put(t.get(), i, 30000).ok());
  env.clear_faults();
  ASSERT_TRUE(put(t.get(), 100, 30000).ok());
  EXPECT_TRUE(reads_back(t.get(), 100, 30000));
  // Segment ids are never reused: the one now written is the count made.
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(c.file_path))
    if (e.path().extension() == ".dat") names.push_back(e.path().filename().string());
  ASSERT_EQ(names.size(), 1u);
  EXPECT_LE(std::stoull(names[0].substr(4, 16), nullptr, 16), 2u) << names[0];
}

TEST(FileTierTest, TornWriteIsNotPublished) {
  TempDir tmp;
  FaultInjectingEnv env(Env::Default());
  CascadeConfig c = file_test::file_config(tmp.path());
  auto t = open_tier(c, nullptr, &env);
  ASSERT_TRUE(put(t.get(), 1, 9000).ok());
  env.tear_next_write(5000);
  EXPECT_FALSE(put(t.get(), 2, 9000).ok());
  EXPECT_FALSE(t->contains(id_of(2)));
  ASSERT_TRUE(put(t.get(), 3, 9000).ok());
  EXPECT_TRUE(reads_back(t.get(), 1, 9000));
  EXPECT_TRUE(reads_back(t.get(), 3, 9000));
}

TEST(FileTierTest, ReadErrorIsAMissNotDamage) {
  TempDir tmp;
  FaultInjectingEnv env(Env::Default());
  CascadeConfig c = file_test::file_config(tmp.path());
  auto t = open_tier(c, nullptr, &env);
  ASSERT_TRUE(put(t.get(), 1, 9000).ok());
  ASSERT_TRUE(put(t.get(), 2, 9000).ok());
  const uint64_t rec = file::record_size(9000);
  env.fail_reads("seg-", rec + 100, rec + 101);  // inside block 2
  EXPECT_TRUE(reads_back(t.get(), 1, 9000));
  std::vector<uint8_t> out(9000);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ReadResult r;
  Status st = t->read(id_of(2), req, &r);
  EXPECT_TRUE(st.is(Code::kIOError)) << st.ToString();
  EXPECT_EQ(r.copied, 0u);
  EXPECT_EQ(t->stats().corrupt_blocks, 0u);
  EXPECT_EQ(t->stats().read_errors, 1u);
  env.clear_faults();
  EXPECT_TRUE(reads_back(t.get(), 2, 9000));  // the device answers again
}

TEST(FileTierTest, SegmentTruncatedOrDeletedUnderARunningStore) {
  TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 128 << 10;
  auto t = open_tier(c, nullptr);
  for (uint64_t i = 0; i < 20; ++i) ASSERT_TRUE(put(t.get(), i, 20000).ok());
  ASSERT_TRUE(t->flush().ok());
  auto segs = file_test::segment_files(tmp.path());
  ASSERT_GE(segs.size(), 3u);
  std::filesystem::resize_file(segs[0], 10000);  // first segment cut short
  std::filesystem::remove(segs[1]);              // second deleted
  int hits = 0, missed = 0;
  for (uint64_t i = 0; i < 20; ++i) {
    if (reads_back(t.get(), i, 20000)) ++hits;
    else ++missed;
  }
  EXPECT_GT(missed, 0);  // the truncated segment's blocks
  EXPECT_GT(hits, 0);
  // The store keeps working.
  ASSERT_TRUE(put(t.get(), 100, 20000).ok());
  EXPECT_TRUE(reads_back(t.get(), 100, 20000));
  t.reset();
  t = open_tier(c, nullptr);
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i < 20; ++i) {
    ReadResult r;
    std::vector<uint8_t> out(20000);
    ReadRequest req;
    req.out = out.data();
    req.capacity = out.size();
    Status st = t->read(id_of(i), req, &r);
    if (st.ok()) {
      EXPECT_EQ(out, bytes_of(i, 20000)) << i;
    }
  }
  EXPECT_TRUE(reads_back(t.get(), 100, 20000));
}

// Flushes, which must succeed within the capacity, and opens the tier again.
void flush_and_reopen(std::unique_ptr<FileTier>& t, const CascadeConfig& c, ThreadPool* pool) {
  Status st = t->flush();
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_LE(t->disk_bytes(), c.file_capacity_bytes);
  t.reset();
  t = open_tier(c, pool);
}

// A tier filled to its bound of blocks still writes removal records: they
// may use the compaction reserve. Before, each was refused as the tier
// being full, and every flush failed until the store happened to evict.
TEST(FileTierTest, AFullTierStillWritesRemovalRecords) {
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());  // segments of 1 MiB
  c.file_capacity_bytes = 2 << 20;  // segments sealed at 512 KiB, a quarter of it
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  uint64_t n = 0;
  while (put(t.get(), n, 30000).ok()) ++n;
  ASSERT_GT(n, 3u);
  for (uint64_t k = n; put(t.get(), k, 100).ok(); ++k) {
  }  // records of a page, as a removal's, until none fits
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(t->remove_lasting(id_of(i)).ok());
  flush_and_reopen(t, c, &pool);
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i < 3; ++i) EXPECT_FALSE(t->contains(id_of(i)));
  EXPECT_TRUE(reads_back(t.get(), 3, 30000));
}

// Removal records in a full tier whose segments hold dead records: the
// space is reclaimed for them first, and the compaction reserve is left for
// compaction. Taken first, the reserve filled with removal records, no
// segment could be compacted any more, and every flush failed.
TEST(FileTierTest, RemovalRecordsLeaveTheCompactionReserveToCompaction) {
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());  // segments of 1 MiB
  c.file_capacity_bytes = 8 << 20;
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  uint64_t n = 0;
  while (put(t.get(), n, 100).ok()) ++n;  // records of a page, as a removal's
  for (uint64_t i = 0; i < n; i += 2) ASSERT_TRUE(t->remove_lasting(id_of(i)).ok());
  flush_and_reopen(t, c, &pool);
  ASSERT_TRUE(t);
  for (uint64_t i = 0; i < n; ++i) EXPECT_EQ(t->contains(id_of(i)), i % 2 == 1) << i;
}

TEST(FileTierTest, CapacityBoundEvictionAndReuse) {
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 256 << 10;
  c.file_capacity_bytes = 2 << 20;
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->capacity_bytes(), 2u << 20);
  const size_t size = 30000;  // 36 KiB records
  uint64_t n = 0;
  Status st;
  while ((st = put(t.get(), n, size, n % 10 == 0)).ok()) ++n;
  EXPECT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
  EXPECT_GT(n, 30u);
  EXPECT_LE(t->disk_bytes(), c.file_capacity_bytes);
  // Drive eviction as the store does, then keep writing: compaction reclaims
  // the dead space and the disk never exceeds the bound.
  for (uint64_t k = n; k < n + 200; ++k) {
    Status s;
    for (int round = 0; round < 64 && !(s = put(t.get(), k, size, k % 10 == 0)).ok(); ++round) {
      ASSERT_TRUE(s.is(Code::kNoSpace)) << s.ToString();
      auto victims = t->claim_victims(size);
      ASSERT_FALSE(victims.empty());
      for (auto& v : victims) {
        EXPECT_EQ(v.size, size);
        EXPECT_TRUE(t->remove(v.id).ok());
      }
    }
    ASSERT_TRUE(s.ok()) << "put " << k << ": " << s.ToString();
    ASSERT_LE(t->disk_bytes(), c.file_capacity_bytes);
  }
  EXPECT_GT(t->compactions(), 0u);
  TierStats s = t->stats();
  EXPECT_GT(s.evictions, 0u);
  EXPECT_EQ(s.leased_blocks, 0u);
  // Whatever is still indexed reads back intact; prefix blocks outlived others.
  uint64_t present = 0, prefix_present = 0;
  for (uint64_t k = 0; k < n + 200; ++k) {
    if (!t->contains(id_of(k))) continue;
    ++present;
    if (k % 10 == 0) ++prefix_present;
    EXPECT_TRUE(reads_back(t.get(), k, size));
  }
  EXPECT_EQ(present, s.blocks);
  EXPECT_GT(prefix_present * 10, present);  // prefix blocks are over-represented
  // Unclaim puts a victim back.
  auto victims = t->claim_victims(1);
  ASSERT_EQ(victims.size(), 1u);
  BlockId vid = victims[0].id;
  t->unclaim(std::move(victims[0]));
  EXPECT_TRUE(t->contains(vid));
  EXPECT_EQ(t->stats().leased_blocks, 0u);
  // Too large to ever fit.
  EXPECT_TRUE(put(t.get(), 99999, 3 << 20).is(Code::kInvalidArgument));
}

TEST(FileTierTest, ClearDropsEverythingDurably) {
  TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  auto t = open_tier(c, nullptr);
  for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(put(t.get(), i, 5000).ok());
  t->clear();
  EXPECT_EQ(t->stats().blocks, 0u);
  EXPECT_EQ(t->disk_bytes(), 0u);
  ASSERT_TRUE(put(t.get(), 50, 5000).ok());
  t.reset();
  t = open_tier(c, nullptr);
  EXPECT_EQ(t->stats().blocks, 1u);
  EXPECT_TRUE(reads_back(t.get(), 50, 5000));
}

TEST(FileTierTest, ConcurrentPutsAndReads) {
  TempDir tmp;
  ThreadPool pool(4);
  CascadeConfig c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 512 << 10;
  auto t = open_tier(c, &pool);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (uint64_t i = 0; i < 50; ++i) {
        uint64_t n = w * 1000 + i;
        if (!put(t.get(), n, 3000 + (n % 7) * 5000).ok()) ++failures;
        if (!put(t.get(), i, 3000 + (i % 7) * 5000).ok()) ++failures;  // same ids from every thread
        if (!reads_back(t.get(), n, 3000 + (n % 7) * 5000)) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(t->stats().blocks, 4u * 50);  // thread 0 ids coincide with the shared ones
  t.reset();
  t = open_tier(c, &pool);
  for (int w = 0; w < 4; ++w)
    for (uint64_t i = 0; i < 50; ++i)
      EXPECT_TRUE(reads_back(t.get(), w * 1000 + i, 3000 + ((w * 1000 + i) % 7) * 5000));
}

TEST(FileTierTest, SyncWritesAndFlush) {
  TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  c.sync_writes = true;
  auto t = open_tier(c, nullptr);
  ASSERT_TRUE(put(t.get(), 1, 70000).ok());
  EXPECT_TRUE(t->flush().ok());
  EXPECT_TRUE(reads_back(t.get(), 1, 70000));
  FaultInjectingEnv env(Env::Default());
  TempDir tmp2;
  c.file_path = tmp2.path();
  auto u = open_tier(c, nullptr, &env);
  env.fail_syncs(true);
  EXPECT_FALSE(put(u.get(), 2, 100).ok());  // not durable: not published
  EXPECT_FALSE(u->contains(id_of(2)));
  env.fail_syncs(false);
  EXPECT_TRUE(put(u.get(), 2, 100).ok());
}

TEST(FileTierTest, StripingIsANoOpOffLustre) {
  TempDir tmp;
  CascadeConfig c = file_test::file_config(tmp.path());
  c.file_stripe_size = 1 << 20;
  c.file_stripe_count = 4;
  auto t = open_tier(c, nullptr);
  ASSERT_TRUE(t);
  ASSERT_TRUE(put(t.get(), 1, 100).ok());
  EXPECT_TRUE(reads_back(t.get(), 1, 100));
  EXPECT_TRUE(Env::Default()->create_striped(tmp.sub("x"), 1 << 20, 2).is(Code::kNotSupported));
}

TEST(FileTierTest, MemoryEnvWorks) {
  auto env = NewMemoryEnv();
  CascadeConfig c = file_test::file_config("/mem/tier");
  {
    auto t = open_tier(c, nullptr, env.get());
    ASSERT_TRUE(t);
    for (uint64_t i = 0; i < 20; ++i) ASSERT_TRUE(put(t.get(), i, 10000 + i).ok());
  }
  auto t = open_tier(c, nullptr, env.get());
  for (uint64_t i = 0; i < 20; ++i) EXPECT_TRUE(reads_back(t.get(), i, 10000 + i));
}

TEST(FileTierTest, ReadBandwidthCapPacesReadsAndBatches) {
  TempDir tmp;
  ThreadPool pool(2);
  CascadeConfig c = file_test::file_config(tmp.path());
  c.file_read_bytes_per_s = 4 << 20;  // 4 MiB/s
  auto t = open_tier(c, &pool);
  ASSERT_TRUE(t);
  const size_t size = 256 << 10;  // 62.5 ms each at the cap
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(put(t.get(), i, size).ok());
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(reads_back(t.get(), 0, size));
  EXPECT_TRUE(reads_back(t.get(), 1, size));
  auto one_by_one = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(one_by_one, std::chrono::milliseconds(124));
  // A batch read in parallel shares the one budget: 2 blocks, 125 ms.
  std::vector<BlockId> ids = {id_of(2), id_of(3)};
  std::vector<std::vector<uint8_t>> outs(2, std::vector<uint8_t>(size));
  std::vector<ReadRequest> reqs(2);
  for (int i = 0; i < 2; ++i) {
    reqs[i].out = outs[i].data();
    reqs[i].capacity = size;
  }
  std::vector<ReadResult> results(2);
  std::vector<Status> statuses(2);
  t0 = std::chrono::steady_clock::now();
  t->read_batch(ids, reqs, results, statuses);
  auto batch = std::chrono::steady_clock::now() - t0;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].ToString();
    EXPECT_EQ(outs[i], bytes_of(2 + i, size));
  }
  EXPECT_GE(batch, std::chrono::milliseconds(124));
  // A miss reads nothing and waits for nothing.
  t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(misses(t.get(), 99, size));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(50));
}

TEST(FileTierTest, ReadBandwidthCapBelowTheFloorIsRefused) {
  CascadeConfig c = file_test::file_config("/unused");
  c.file_read_bytes_per_s = 1000;
  EXPECT_TRUE(c.validate().is(Code::kInvalidArgument));
  c.file_read_bytes_per_s = 64 << 10;
  EXPECT_TRUE(c.validate().ok()) << c.validate().ToString();
}

TEST(FileTierTest, FactoryReturnsATier) {
  TempDir tmp;
  auto t = open_file_tier(file_test::file_config(tmp.path()), nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->kind(), TierKind::kFile);
  EXPECT_EQ((*t)->capacity_bytes(), 0u);
}

}  // namespace
}  // namespace cascade
