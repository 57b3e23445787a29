#include "tiers/file/read_pacer.h"

#include <gtest/gtest.h>

#include <chrono>

namespace cascade::file {
namespace {

using std::chrono::milliseconds;

TEST(ReadPacer, NoCapNeverWaits) {
  ReadPacer p(0);
  auto now = ReadPacer::Clock::now();
  EXPECT_FALSE(p.enabled());
  EXPECT_EQ(p.reserve(1 << 30, now), now);
}

TEST(ReadPacer, ReadsQueueBehindEachOther) {
  ReadPacer p(1000000);  // 1 MB/s: 1,000 bytes per millisecond
  auto t0 = ReadPacer::Clock::now();
  EXPECT_EQ(p.reserve(100000, t0), t0 + milliseconds(100));
  // Issued at the same instant: it ends after the first one.
  EXPECT_EQ(p.reserve(50000, t0), t0 + milliseconds(150));
  // Issued later but before the timeline is free: still behind it.
  EXPECT_EQ(p.reserve(10000, t0 + milliseconds(20)), t0 + milliseconds(160));
}

TEST(ReadPacer, IdleTimeIsNotSavedUp) {
  ReadPacer p(1000000);
  auto t0 = ReadPacer::Clock::now();
  p.reserve(1000, t0);
  auto later = t0 + std::chrono::seconds(60);
  EXPECT_EQ(p.reserve(20000, later), later + milliseconds(20));
}

TEST(ReadPacer, PaceSleepsForTheBudget) {
  ReadPacer p(1 << 20);  // 1 MiB/s
  auto t0 = ReadPacer::Clock::now();
  p.pace(64 << 10, t0);  // 62.5 ms
  p.pace(64 << 10, ReadPacer::Clock::now());
  EXPECT_GE(ReadPacer::Clock::now() - t0, milliseconds(124));
}

}  // namespace
}  // namespace cascade::file
