#include "util/arena_ranges.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace cascade {
namespace {

TEST(ArenaRangesTest, ARangeOverlapsWhatSharesAByteWithItUntilRemoved) {
  std::vector<uint8_t> arena(4096), outside(64);
  add_arena_range(arena.data(), arena.size());
  EXPECT_TRUE(overlaps_arena(arena.data(), 1));
  EXPECT_TRUE(overlaps_arena(arena.data() + 4095, 1));
  EXPECT_TRUE(overlaps_arena(arena.data() - 16, 17));  // its last byte is the arena's first
  EXPECT_FALSE(overlaps_arena(arena.data() - 16, 16));
  EXPECT_FALSE(overlaps_arena(arena.data() + 4096, 16));
  EXPECT_FALSE(overlaps_arena(arena.data(), 0));  // no bytes: nothing written
  EXPECT_FALSE(overlaps_arena(outside.data(), outside.size()));
  EXPECT_TRUE(check_read_destination(arena.data() + 100, 8, "out[3]").is(Code::kInvalidArgument));
  EXPECT_TRUE(check_read_destination(outside.data(), outside.size()).ok());
  remove_arena_range(arena.data());
  EXPECT_FALSE(overlaps_arena(arena.data(), arena.size()));
  add_arena_range(nullptr, 100);  // nothing to add
  add_arena_range(outside.data(), 0);
  EXPECT_FALSE(overlaps_arena(outside.data(), outside.size()));
}

}  // namespace
}  // namespace cascade
