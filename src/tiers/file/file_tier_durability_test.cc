// FileTier across reopen: the newest record of an id wins, aliases
// persist, resolve and survive compaction.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>

#include "cascade/env.h"
#include "cascade/file_tier.h"
#include "tiers/file/file_test_util.h"
#include "tiers/file/file_tier.h"
#include "tiers/file/segment_scan.h"
#include "util/thread_pool.h"

namespace cascade {
namespace {

using file_test::bytes_of;
using file_test::id_of;
using file_test::TempDir;

std::vector<uint8_t> read_block(Tier* t, const BlockId& id, size_t cap = 1 << 16) {
  std::vector<uint8_t> out(cap);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ReadResult r;
  if (!t->read(id, req, &r).ok()) return {};
  out.resize(r.block_size);
  return out;
}

Status put_bytes(Tier* t, const BlockId& id, const std::vector<uint8_t>& d) {
  return t->put(id, d.data(), d.size(), PutOptions{});
}

TEST(FileTierReopenOrderTest, NewestRecordOfAnIdWins) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 64 << 10;
  const BlockId x = id_of(5);
  auto v1 = bytes_of(1, 10000), v2 = bytes_of(2, 10000), v3 = bytes_of(3, 7000);
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(put_bytes(t->get(), x, v1).ok());
    ASSERT_TRUE((*t)->remove(x).ok());
    ASSERT_TRUE(put_bytes(t->get(), x, v2).ok());  // same segment, later offset
  }
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(read_block(t->get(), x), v2);
    EXPECT_EQ((*t)->recovery_report().duplicate_records, 1u);
    ASSERT_TRUE((*t)->remove(x).ok());
    for (uint64_t i = 0; i < 20; ++i)
      ASSERT_TRUE(put_bytes(t->get(), id_of(100 + i), bytes_of(i, 5000)).ok());
    ASSERT_TRUE(put_bytes(t->get(), x, v3).ok());  // a later segment, other size
  }
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(read_block(t->get(), x), v3);
  EXPECT_EQ((*t)->stats().blocks, 21u);
  // The older records are dead space that compaction reclaims.
  EXPECT_GT((*t)->dead_bytes(), 0u);
  ASSERT_TRUE((*t)->compact().ok());
  EXPECT_EQ(read_block(t->get(), x), v3);
}

// Two writer lanes each have a segment open; the re-put lands in the
// segment with the smaller id. Only the records' sequence numbers tell
// which write came last.
TEST(FileTierReopenOrderTest, NewestWinsAcrossWriterLanes) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  ThreadPool pool(2);
  const BlockId x = id_of(9);
  auto v1 = bytes_of(1, 3000), v2 = bytes_of(2, 3000);
  {
    auto t = FileTier::Open(c, &pool);
    ASSERT_TRUE(t.ok());
    Tier* tier = t->get();
    // Writer threads take lanes in the order they first write: a, b, a.
    std::thread([&] { ASSERT_TRUE(put_bytes(tier, id_of(1), bytes_of(11, 100)).ok()); }).join();
    std::thread([&] {
      ASSERT_TRUE(put_bytes(tier, id_of(2), bytes_of(12, 100)).ok());
      ASSERT_TRUE(put_bytes(tier, x, v1).ok());
    }).join();
    ASSERT_TRUE(tier->remove(x).ok());
    std::thread([&] { ASSERT_TRUE(put_bytes(tier, x, v2).ok()); }).join();
    EXPECT_EQ(read_block(tier, x), v2);
  }
  // Where the two records of x landed.
  std::vector<std::pair<uint64_t, uint64_t>> found;  // (sequence, segment id)
  auto key = file_test::dir_key(tmp.path());
  for (const auto& path : file_test::segment_files(tmp.path())) {
    uint64_t sid = 0;
    file::classify_dir_entry(path.substr(path.size() - 24), &sid);
    auto f = Env::Default()->open(path, FileOpenOptions{});
    auto scan = file::scan_segment(f->get(), sid, key, true);
    ASSERT_TRUE(scan.ok());
    for (const auto& h : scan->records)
      if (h.id() == x) found.emplace_back(h.sequence, sid);
  }
  ASSERT_EQ(found.size(), 2u);
  std::sort(found.begin(), found.end());
  EXPECT_LT(found[1].second, found[0].second) << "the re-put should land in the older segment";
  auto t = FileTier::Open(c, &pool);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(read_block(t->get(), x), v2);
}

std::set<std::pair<BlockId, BlockId>> alias_set(const Tier& t) {
  auto v = t.aliases();
  return {v.begin(), v.end()};
}

TEST(FileTierAliasTest, AliasesPersistNewestWinsAndFollowTheirTarget) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  const BlockId t1 = id_of(1), t2 = id_of(2), a1 = id_of(101), a2 = id_of(102);
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    Tier* tier = t->get();
    EXPECT_TRUE(tier->persistent());
    ASSERT_TRUE(put_bytes(tier, t1, bytes_of(1, 20000)).ok());
    ASSERT_TRUE(put_bytes(tier, t2, bytes_of(2, 300)).ok());
    ASSERT_TRUE(tier->put_alias(a1, t1).ok());
    ASSERT_TRUE(tier->put_alias(a2, t1).ok());
    ASSERT_TRUE(tier->put_alias(a2, t1).ok());  // no second record
    EXPECT_TRUE(tier->put_alias(id_of(103), id_of(999)).is(Code::kNotFound));
    EXPECT_TRUE(tier->put_alias(t1, t1).is(Code::kInvalidArgument));
    EXPECT_FALSE(tier->contains(a1));  // an alias is not a block
    EXPECT_EQ(alias_set(*tier), (std::set<std::pair<BlockId, BlockId>>{{a1, t1}, {a2, t1}}));
    ASSERT_TRUE(tier->flush().ok());
  }
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    Tier* tier = t->get();
    EXPECT_EQ((*t)->recovery_report().aliases, 2u);
    EXPECT_EQ(alias_set(*tier), (std::set<std::pair<BlockId, BlockId>>{{a1, t1}, {a2, t1}}));
    std::vector<std::pair<BlockId, uint64_t>> blocks;
    tier->for_each_block([&](const BlockId& id, uint64_t size) { blocks.emplace_back(id, size); });
    std::sort(blocks.begin(), blocks.end());
    std::vector<std::pair<BlockId, uint64_t>> want = {{t1, 20000}, {t2, 300}};
    std::sort(want.begin(), want.end());
    EXPECT_EQ(blocks, want);
    ASSERT_TRUE(tier->put_alias(a1, t2).ok());  // repointed: the newer record wins
  }
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    Tier* tier = t->get();
    EXPECT_EQ(alias_set(*tier), (std::set<std::pair<BlockId, BlockId>>{{a1, t2}, {a2, t1}}));
    ASSERT_TRUE(tier->remove(t1).ok());  // a2's target is gone
    EXPECT_EQ(alias_set(*tier), (std::set<std::pair<BlockId, BlockId>>{{a1, t2}}));
    ASSERT_TRUE(tier->remove(a1).ok());  // dropping an alias
    EXPECT_TRUE(alias_set(*tier).empty());
    ASSERT_TRUE(tier->put_alias(a1, t2).ok());
    tier->clear();
    EXPECT_TRUE(alias_set(*tier).empty());
  }
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(alias_set(**t).empty());
}

// Removals are not written down, so an id removed as an alias and put
// again as a block (or the reverse) has records of both kinds on disk: the
// newer one is what a reopen finds, and a put of a block drops the alias at
// once.
TEST(FileTierAliasTest, AnIdWrittenAsAnAliasAndAsABlockIsTheNewerOneAfterReopen) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  const BlockId t1 = id_of(1), a = id_of(101), b = id_of(102);
  const auto bytes = bytes_of(7, 5000);
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    Tier* tier = t->get();
    ASSERT_TRUE(put_bytes(tier, t1, bytes_of(1, 3000)).ok());
    ASSERT_TRUE(tier->put_alias(a, t1).ok());  // a: alias, then block
    ASSERT_TRUE(put_bytes(tier, b, bytes_of(2, 3000)).ok());
    ASSERT_TRUE(tier->remove(a).ok());
    ASSERT_TRUE(tier->remove(b).ok());
    ASSERT_TRUE(put_bytes(tier, a, bytes).ok());
    ASSERT_TRUE(tier->put_alias(b, t1).ok());  // b: block, then alias
    EXPECT_EQ(alias_set(*tier), (std::set<std::pair<BlockId, BlockId>>{{b, t1}}));
    ASSERT_TRUE(tier->flush().ok());
  }
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(alias_set(**t), (std::set<std::pair<BlockId, BlockId>>{{b, t1}}));
  // The inspection of the directory resolves them as the tier does.
  auto report = inspect_directory(tmp.path(), true);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->aliases, (*t)->recovery_report().aliases);
  EXPECT_EQ(report->duplicate_records, (*t)->recovery_report().duplicate_records);
  EXPECT_EQ(report->live_records, 3u);  // t1, a's block, b's alias
  EXPECT_TRUE((*t)->contains(a));
  EXPECT_EQ(read_block(t->get(), a), bytes);
  EXPECT_FALSE((*t)->contains(b));
  // A put of a block under an alias's id, with no removal between: the
  // block is the newer write.
  ASSERT_TRUE(put_bytes(t->get(), b, bytes).ok());
  EXPECT_TRUE(alias_set(**t).empty());
  t->reset();
  auto again = FileTier::Open(c, nullptr);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(alias_set(**again).empty());
  EXPECT_EQ(read_block(again->get(), b), bytes);
}

// Each open of a directory is a new identity, and the next open knows the
// last one. A damaged EPOCH file leaves the previous identity unknown (0).
TEST(FileTierIdentityTest, EachOpenIsANewIdentityThatTheNextOpenKnows) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  uint64_t first = 0;
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    first = (*t)->identity();
    EXPECT_NE(first, 0u);
    EXPECT_EQ((*t)->previous_identity(), 0u);  // a new directory
  }
  uint64_t second = 0;
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ((*t)->previous_identity(), first);
    second = (*t)->identity();
    EXPECT_NE(second, first);
  }
  {  // a torn or foreign EPOCH file: unknown
    auto f = Env::Default()->open(tmp.path() + "/EPOCH", FileOpenOptions{.write = true});
    ASSERT_TRUE(f.ok());
    const uint8_t junk = 0x5a;
    ASSERT_TRUE((*f)->pwrite(&junk, 1, 3).ok());
  }
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->previous_identity(), 0u);
  EXPECT_NE((*t)->identity(), 0u);
}

TEST(FileTierAliasTest, CompactionKeepsLiveAliasesAndDropsStaleOnes) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 64 << 10;
  std::set<std::pair<BlockId, BlockId>> want;
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    Tier* tier = t->get();
    for (uint64_t i = 0; i < 60; ++i) {
      ASSERT_TRUE(put_bytes(tier, id_of(i), bytes_of(i, 6000)).ok());
      ASSERT_TRUE(tier->put_alias(id_of(1000 + i), id_of(i)).ok());
    }
    for (uint64_t i = 0; i < 60; ++i) {
      if (i % 3) {
        ASSERT_TRUE(tier->remove(id_of(i)).ok());
      } else {
        want.insert({id_of(1000 + i), id_of(i)});
      }
    }
    ASSERT_TRUE((*t)->compact().ok());
    EXPECT_EQ((*t)->dead_bytes(), 0u);  // stale alias records went with the dead blocks
    EXPECT_EQ(alias_set(*tier), want);
    EXPECT_GT((*t)->compactions(), 0u);
  }
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(alias_set(**t), want);
  EXPECT_EQ((*t)->recovery_report().corrupt_records, 0u);
  for (uint64_t i = 0; i < 60; i += 3) EXPECT_EQ(read_block(t->get(), id_of(i)), bytes_of(i, 6000));
}

// An I/O error while reading a record says nothing about the record: the
// block stays indexed (a miss for that read only), compaction leaves its
// segment alone, and once the device answers again the block is served, also
// after a reopen.
TEST(FileTierReadErrorTest, ReadErrorsAreNotDamage) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  c.segment_size_bytes = 64 << 10;
  FaultInjectingEnv env(Env::Default());
  {
    auto t = FileTier::Open(c, nullptr, &env);
    ASSERT_TRUE(t.ok());
    Tier* tier = t->get();
    for (uint64_t i = 0; i < 40; ++i)
      ASSERT_TRUE(put_bytes(tier, id_of(i), bytes_of(i, 6000)).ok());
    for (uint64_t i = 0; i < 40; i += 2) ASSERT_TRUE(tier->remove(id_of(i)).ok());
    ASSERT_TRUE(tier->flush().ok());

    env.fail_reads("seg-", 0, UINT64_MAX);
    EXPECT_TRUE(read_block(tier, id_of(1)).empty());  // the read failed
    EXPECT_FALSE((*t)->compact().ok());               // cannot copy what it cannot read
    env.clear_faults();

    EXPECT_TRUE(tier->contains(id_of(1)));
    EXPECT_EQ(tier->stats().corrupt_blocks, 0u);
    EXPECT_EQ(tier->stats().read_errors, 1u);
    for (uint64_t i = 1; i < 40; i += 2)
      EXPECT_EQ(read_block(tier, id_of(i)), bytes_of(i, 6000)) << i;
  }
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  for (uint64_t i = 1; i < 40; i += 2)
    EXPECT_EQ(read_block(t->get(), id_of(i)), bytes_of(i, 6000)) << i;
}

}  // namespace
}  // namespace cascade
