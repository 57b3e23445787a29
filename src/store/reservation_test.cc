// Reserved puts (the node pool server's path): reserve_batch answers every
// item as reserve() would, making room by eviction when the top tier is
// full, and commit_batch makes the written blocks visible.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>

#include "cascade/store.h"

namespace cascade {
namespace {

CascadeConfig host_config(uint64_t capacity) {
  static std::atomic<int> n{0};
  CascadeConfig c;
  c.pipeline = "host";
  c.shm_capacity_bytes = capacity;
  c.shm_path =
      "/dev/shm/cascade-reservation-" + std::to_string(getpid()) + "-" + std::to_string(n++);
  c.num_io_threads = 2;
  c.index_shards = 16;
  return c;
}

std::unique_ptr<CascadeStore> open(const CascadeConfig& c) {
  auto s = CascadeStore::Open(c);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s.value()) : nullptr;
}

BlockId id_of(uint64_t i) { return compute_block_id(&i, sizeof(i)); }

// Writes a reserved block's bytes into the shared arena and commits it.
void fill(CascadeStore* s, const Reservation& r, uint8_t byte) {
  std::memset(s->shared_arena().base + r.offset, byte, r.size);
}

}  // namespace

TEST(ReservationTest, BatchAnswersEachItemAsOneReserveWould) {
  // Two stores with the same contents; one answers a batch, the other the
  // same items one reserve() at a time.
  auto a = open(host_config(1 << 20));
  auto b = open(host_config(1 << 20));
  ASSERT_TRUE(a && b);
  std::vector<uint8_t> bytes(8192, 3);
  for (auto* s : {a.get(), b.get()}) ASSERT_TRUE(s->put(id_of(1), bytes.data(), 8192).ok());
  const std::vector<BlockId> ids = {id_of(1), id_of(2), id_of(3), id_of(4), id_of(5)};
  const std::vector<uint64_t> sizes = {8192, 0, 2 << 20, 65536, 4096};
  std::vector<Reservation> got;
  std::vector<Status> st;
  a->reserve_batch(ids, sizes, PutOptions{}, &got, &st);
  ASSERT_EQ(got.size(), ids.size());
  ASSERT_EQ(st.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    auto want = b->reserve(ids[i], sizes[i]);
    ASSERT_EQ(st[i].code(), want.status().code()) << "item " << i << ": " << st[i].ToString();
    if (!want.ok()) continue;
    EXPECT_EQ(got[i].present, want->present) << "item " << i;
    EXPECT_EQ(got[i].size, want->size);
    EXPECT_EQ(got[i].offset, want->offset) << "item " << i;
  }
  EXPECT_TRUE(got[0].present);                     // stored already
  EXPECT_TRUE(st[1].ok());                         // an empty block takes no range
  EXPECT_TRUE(st[2].is(Code::kInvalidArgument));   // can never fit
  EXPECT_FALSE(got[3].present || got[4].present);  // ranges to write
  EXPECT_NE(got[3].offset, got[4].offset);
}

TEST(ReservationTest, BatchMakesRoomByEvictionAndCommitsWhatWasWritten) {
  auto s = open(host_config(256 << 10));
  ASSERT_TRUE(s);
  // Fill the tier with committed blocks.
  std::vector<uint8_t> old(65536, 9);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(s->put(id_of(100 + i), old.data(), 65536).ok());
  // A batch larger than the free space: the store evicts for the items the
  // tier could not place at once, as a single reserve() does.
  std::vector<BlockId> ids;
  std::vector<uint64_t> sizes;
  for (uint64_t i = 0; i < 3; ++i) {
    ids.push_back(id_of(200 + i));
    sizes.push_back(65536);
  }
  std::vector<Reservation> res;
  std::vector<Status> st;
  s->reserve_batch(ids, sizes, PutOptions{}, &res, &st);
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(st[i].ok()) << st[i].ToString();
    ASSERT_FALSE(res[i].present);
    fill(s.get(), res[i], static_cast<uint8_t>(0x40 + i));
  }
  // The reserved ranges are distinct and invisible until committed.
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_FALSE(s->contains(ids[i]));
    for (size_t j = i + 1; j < ids.size(); ++j) EXPECT_NE(res[i].offset, res[j].offset);
  }
  std::vector<Status> committed;
  s->commit_batch(res, PutOptions{}, &committed);
  ASSERT_EQ(committed.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(committed[i].ok()) << committed[i].ToString();
    std::vector<uint8_t> out(65536);
    GetResult r;
    ASSERT_TRUE(s->get(ids[i], out.data(), out.size(), &r).ok());
    EXPECT_EQ(r.size, 65536u);
    EXPECT_EQ(out, std::vector<uint8_t>(65536, static_cast<uint8_t>(0x40 + i)));
  }
  int kept = 0;
  for (uint64_t i = 0; i < 4; ++i) kept += s->contains(id_of(100 + i));
  EXPECT_LE(kept, 1);  // room was made by evicting the older blocks
}

TEST(ReservationTest, BatchOnAClosedStoreOrWithMismatchedSpansIsAnErrorPerItem) {
  auto s = open(host_config(1 << 20));
  ASSERT_TRUE(s);
  std::vector<BlockId> ids = {id_of(1), id_of(2)};
  std::vector<uint64_t> one = {4096};
  std::vector<Reservation> res;
  std::vector<Status> st;
  s->reserve_batch(ids, one, PutOptions{}, &res, &st);
  ASSERT_EQ(st.size(), 2u);
  EXPECT_TRUE(st[0].is(Code::kInvalidArgument) && st[1].is(Code::kInvalidArgument));
  s->close();
  std::vector<uint64_t> two = {4096, 4096};
  s->reserve_batch(ids, two, PutOptions{}, &res, &st);
  EXPECT_TRUE(st[0].is(Code::kUnavailable) && st[1].is(Code::kUnavailable));
  std::vector<Status> cst;
  s->commit_batch(res, PutOptions{}, &cst);
  EXPECT_TRUE(cst[0].is(Code::kUnavailable) && cst[1].is(Code::kUnavailable));
}

}  // namespace cascade
