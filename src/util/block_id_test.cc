#include "cascade/block_id.h"

#include <gtest/gtest.h>

namespace cascade {

TEST(BlockIdTest, Sha256KnownVectors) {
  // FIPS 180-2 vectors: first 128 bits of SHA-256.
  EXPECT_EQ(compute_block_id("abc", 3).hex(), "ba7816bf8f01cfea414140de5dae2223");
  EXPECT_EQ(compute_block_id("", 0).hex(), "e3b0c44298fc1c149afbf4c8996fb924");
  const char* m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(compute_block_id(m, strlen(m)).hex(), "248d6a61d20638b8e5c026930c3e6039");
  std::string million(1000000, 'a');
  EXPECT_EQ(compute_block_id(million.data(), million.size()).hex(),
            "cdc76e5c9914fb9281a1c7e284d73e67");
}

TEST(BlockIdTest, HexRoundTrip) {
  BlockId id = compute_block_id("x", 1);
  auto parsed = parse_block_id(id.hex());
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(*parsed, id);
  auto upper = parse_block_id("BA7816BF8F01CFEA414140DE5DAE2223");
  ASSERT_TRUE(upper.ok());
  EXPECT_EQ(upper->hex(), "ba7816bf8f01cfea414140de5dae2223");
}

TEST(BlockIdTest, ParseRejectsBadText) {
  EXPECT_TRUE(parse_block_id("abc").status().is(Code::kInvalidArgument));
  EXPECT_TRUE(parse_block_id(std::string(32, 'g')).status().is(Code::kInvalidArgument));
  EXPECT_TRUE(parse_block_id(std::string(33, 'a')).status().is(Code::kInvalidArgument));
}

TEST(BlockIdTest, KeysMapDeterministically) {
  auto a = block_id_from_key("conversation-1/block-7");
  auto b = block_id_from_key("conversation-1/block-7");
  auto c = block_id_from_key("conversation-1/block-8");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *c);
  // A 32-hex key is the id itself.
  auto hex = block_id_from_key("ba7816bf8f01cfea414140de5dae2223");
  EXPECT_EQ(hex->hex(), "ba7816bf8f01cfea414140de5dae2223");
  EXPECT_TRUE(block_id_from_key("").status().is(Code::kInvalidArgument));
  std::string huge(1 << 20, 'k');
  EXPECT_TRUE(block_id_from_key(huge).ok());
}

}  // namespace cascade
