// Protocol pieces of the remote tier that need no MPI: message encoding,
// reservations, reply routing with deadlines.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "tiers/remote/pending_calls.h"
#include "tiers/remote/reservation_table.h"
#include "tiers/remote/wire_format.h"

namespace cascade::remote {
namespace {

BlockId id_of(uint8_t v) {
  BlockId id;
  id.bytes.fill(v);
  return id;
}

TEST(WireFormat, RoundTrip) {
  Message m;
  m.kind = MessageKind::kLookup;
  m.call_id = 0x0102030405060708ULL;
  for (uint8_t i = 0; i < 5; ++i) {
    Item it;
    it.id = id_of(i);
    it.offset = 1000 + i;
    it.size = 2000 + i;
    it.checksum = ~uint64_t{i};
    it.lease_token = uint64_t{1} << (40 + i);
    it.flags = kItemLease | (i & 1);
    it.outcome = static_cast<Outcome>(i);
    m.items.push_back(it);
  }
  auto bytes = encode_message(m);
  ASSERT_EQ(bytes.size(), kHeaderBytes + 5 * kItemBytes);
  auto back = decode_message(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->kind, m.kind);
  EXPECT_EQ(back->call_id, m.call_id);
  ASSERT_EQ(back->items.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(back->items[i].id, m.items[i].id);
    EXPECT_EQ(back->items[i].offset, m.items[i].offset);
    EXPECT_EQ(back->items[i].size, m.items[i].size);
    EXPECT_EQ(back->items[i].checksum, m.items[i].checksum);
    EXPECT_EQ(back->items[i].lease_token, m.items[i].lease_token);
    EXPECT_EQ(back->items[i].flags, m.items[i].flags);
    EXPECT_EQ(back->items[i].outcome, m.items[i].outcome);
  }
}

// The bytes of one message of each kind that carries fields, spelled out from
// the layout in wire_format.h: a change that moves a field fails here.
std::string hex_of(const std::vector<uint8_t>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

BlockId counting_id() {
  BlockId id;
  for (uint8_t i = 0; i < 16; ++i) id.bytes[i] = static_cast<uint8_t>(0xa0 + i);
  return id;
}

const std::string kHeaderTail =
    "000000"
    "01000000"
    "00000000"
    "0807060504030201";
const std::string kIdHex = "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf";

Message one_item(MessageKind kind, const Item& it) {
  return Message{kind, 0x0102030405060708ULL, {it}};
}

TEST(WireFormat, BytesOfEachKindAreFixed) {
  const uint64_t offset = 0x0000000000400000ULL, size = 0x0000000000012345ULL;
  const uint64_t checksum = 0xfedcba9876543210ULL, token = 0x0000000000000007ULL;
  const std::string offset_hex = "0000400000000000", size_hex = "4523010000000000";
  const std::string checksum_hex = "1032547698badcfe", token_hex = "0700000000000000";
  const std::string zero8 = "0000000000000000", zero6 = "000000000000";

  Item begin;  // PutBegin: id, size, prefix flag
  begin.id = counting_id();
  begin.size = size;
  begin.flags = kItemPrefix;
  EXPECT_EQ(hex_of(encode_message(one_item(MessageKind::kPutBegin, begin))),
            "434d5231"
            "01" +
                kHeaderTail + kIdHex + zero8 + size_hex + zero8 + zero8 +
                "01"
                "00" +
                zero6);

  Item granted;  // its reply: the offset to write at
  granted.offset = offset;
  granted.outcome = Outcome::kGranted;
  EXPECT_EQ(hex_of(encode_message(one_item(MessageKind::kReply, granted))),
            "434d5231"
            "80" +
                kHeaderTail + std::string(32, '0') + offset_hex + zero8 + zero8 + zero8 +
                "00"
                "01" +
                zero6);

  Item commit;  // PutCommit: id, offset, size, checksum, prefix flag
  commit.id = counting_id();
  commit.offset = offset;
  commit.size = size;
  commit.checksum = checksum;
  commit.flags = kItemPrefix;
  EXPECT_EQ(hex_of(encode_message(one_item(MessageKind::kPutCommit, commit))),
            "434d5231"
            "02" +
                kHeaderTail + kIdHex + offset_hex + size_hex + checksum_hex + zero8 +
                "01"
                "00" +
                zero6);

  Item lookup;  // Lookup: id, lease flag
  lookup.id = counting_id();
  lookup.flags = kItemLease;
  EXPECT_EQ(hex_of(encode_message(one_item(MessageKind::kLookup, lookup))),
            "434d5231"
            "04" +
                kHeaderTail + kIdHex + zero8 + zero8 + zero8 + zero8 +
                "02"
                "00" +
                zero6);

  Item found;  // its reply: where the block is, its size, checksum and lease token
  found.id = counting_id();
  found.offset = offset;
  found.size = size;
  found.checksum = checksum;
  found.lease_token = token;
  found.flags = kItemPrefix;
  found.outcome = Outcome::kFound;
  EXPECT_EQ(hex_of(encode_message(one_item(MessageKind::kReply, found))),
            "434d5231"
            "80" +
                kHeaderTail + kIdHex + offset_hex + size_hex + checksum_hex + token_hex +
                "01"
                "04" +
                zero6);

  Item release;  // Release: the lease token only, in the word where others carry the offset
  release.lease_token = token;
  EXPECT_EQ(hex_of(encode_message(one_item(MessageKind::kRelease, release))),
            "434d5231"
            "05" +
                kHeaderTail + std::string(32, '0') + token_hex + zero8 + zero8 + zero8 +
                "00"
                "00" +
                zero6);

  // Decoding the same bytes gives the same fields back.
  auto back = decode_message(encode_message(one_item(MessageKind::kReply, found)));
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->items.size(), 1u);
  EXPECT_EQ(back->items[0].offset, offset);
  EXPECT_EQ(back->items[0].size, size);
  EXPECT_EQ(back->items[0].checksum, checksum);
  EXPECT_EQ(back->items[0].lease_token, token);
  auto released = decode_message(encode_message(one_item(MessageKind::kRelease, release)));
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(released->items.at(0).lease_token, token);
}

TEST(WireFormat, EmptyMessage) {
  Message m;
  m.kind = MessageKind::kLeave;
  auto back = decode_message(encode_message(m));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->kind, MessageKind::kLeave);
  EXPECT_TRUE(back->items.empty());
}

TEST(WireFormat, RejectsDamagedBytes) {
  Message m;
  m.kind = MessageKind::kPutBegin;
  m.items.resize(2);
  auto good = encode_message(m);
  // Every truncation fails.
  for (size_t n = 0; n < good.size(); ++n) {
    auto r = decode_message(std::span<const uint8_t>(good.data(), n));
    EXPECT_FALSE(r.ok()) << n;
    if (!r.ok()) {
      EXPECT_TRUE(r.status().is(Code::kCorruption));
    }
  }
  auto bad = good;
  bad[0] ^= 1;  // magic
  EXPECT_FALSE(decode_message(bad).ok());
  bad = good;
  bad[4] = 42;  // kind
  EXPECT_FALSE(decode_message(bad).ok());
  bad = good;
  bad[8] = 3;  // count disagrees with the length
  EXPECT_FALSE(decode_message(bad).ok());
  bad = good;
  bad[kHeaderBytes + 49] = 200;  // outcome
  EXPECT_FALSE(decode_message(bad).ok());
  bad = good;
  bad.push_back(0);  // trailing byte
  EXPECT_FALSE(decode_message(bad).ok());
}

TEST(ReservationTable, TakeMatchesWriterAndOffset) {
  using Clock = ReservationTable::Clock;
  ReservationTable t;
  auto far = Clock::now() + std::chrono::hours(1);
  t.add({id_of(1), {4096, 100}, 2, false, far});
  EXPECT_TRUE(t.holds(id_of(1)));
  EXPECT_FALSE(t.take(id_of(1), 3, 4096));  // another writer
  EXPECT_FALSE(t.take(id_of(1), 2, 8192));  // another range
  auto r = t.take(id_of(1), 2, 4096);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->extent.size, 100u);
  EXPECT_FALSE(t.holds(id_of(1)));
  EXPECT_EQ(t.live(), 0u);
}

TEST(ReservationTable, ExpiredRangeIsQuarantinedUntilTheWriterAnswers) {
  using Clock = ReservationTable::Clock;
  ReservationTable t;
  auto now = Clock::now();
  t.add({id_of(1), {0, 10}, 1, false, now - std::chrono::seconds(1)});
  t.add({id_of(2), {4096, 10}, 1, false, now + std::chrono::hours(1)});
  ASSERT_TRUE(t.next_deadline());
  EXPECT_EQ(t.expire(now), 1u);
  EXPECT_FALSE(t.holds(id_of(1)));  // the id is free for other writers
  EXPECT_TRUE(t.holds(id_of(2)));
  EXPECT_EQ(t.quarantined(), 1u);  // but its range is not reused yet
  EXPECT_FALSE(t.take(id_of(1), 1, 0));
  EXPECT_FALSE(t.take_quarantined(2, 0));
  auto e = t.take_quarantined(1, 0);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->size, 10u);
  EXPECT_EQ(t.quarantined(), 0u);
}

TEST(ReservationTable, DropWriterReturnsEverythingItHeld) {
  using Clock = ReservationTable::Clock;
  ReservationTable t;
  auto now = Clock::now();
  t.add({id_of(1), {0, 1}, 5, false, now - std::chrono::seconds(1)});
  t.expire(now);
  t.add({id_of(2), {4096, 1}, 5, false, now + std::chrono::hours(1)});
  t.add({id_of(3), {8192, 1}, 6, false, now + std::chrono::hours(1)});
  auto gone = t.drop_writer(5);
  EXPECT_EQ(gone.size(), 2u);
  EXPECT_EQ(t.live(), 1u);
  EXPECT_EQ(t.quarantined(), 0u);
  EXPECT_EQ(t.drop_all().size(), 1u);
  EXPECT_EQ(t.live(), 0u);
}

TEST(PendingCalls, ReplyWakesItsWaiter) {
  PendingCalls calls;
  auto call = calls.open(3);
  EXPECT_EQ(calls.open_calls(), 1u);
  std::thread replier([&] {
    Message r;
    r.call_id = call->id;
    r.items.resize(1);
    r.items[0].outcome = Outcome::kFound;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_FALSE(calls.deliver(2, Message{MessageKind::kReply, call->id, {}}));  // wrong peer
    EXPECT_TRUE(calls.deliver(3, std::move(r)));
  });
  auto got = calls.wait(call, PendingCalls::Clock::now() + std::chrono::seconds(10));
  replier.join();
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->items.at(0).outcome, Outcome::kFound);
  EXPECT_EQ(calls.open_calls(), 0u);
}

TEST(PendingCalls, TimeoutThenLateReplyIsStale) {
  PendingCalls calls;
  auto call = calls.open(1);
  auto t0 = PendingCalls::Clock::now();
  auto got = calls.wait(call, t0 + std::chrono::milliseconds(20));
  EXPECT_TRUE(got.status().is(Code::kUnavailable));
  EXPECT_LT(PendingCalls::Clock::now() - t0, std::chrono::seconds(5));
  EXPECT_FALSE(calls.deliver(1, Message{MessageKind::kReply, call->id, {}}));
}

TEST(PendingCalls, PeerFailureEndsOnlyItsWaits) {
  PendingCalls calls;
  auto a = calls.open(1), b = calls.open(2);
  calls.fail_peer(1, Status::Unavailable("rank 1 left"));
  auto ra = calls.wait(a, PendingCalls::Clock::now() + std::chrono::hours(1));  // returns at once
  EXPECT_TRUE(ra.status().is(Code::kUnavailable));
  EXPECT_EQ(ra.status().message(), "rank 1 left");
  EXPECT_TRUE(calls.deliver(2, Message{MessageKind::kReply, b->id, {}}));
  EXPECT_TRUE(calls.wait(b, PendingCalls::Clock::now()).ok());
}

}  // namespace
}  // namespace cascade::remote
