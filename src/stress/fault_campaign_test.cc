// The fault campaign on a small workload: the clean run is traced, points
// cover every call, every armed fault fires, and a campaign over the file
// tier serves no wrong byte.
#include "stress/fault_campaign.h"

#include <gtest/gtest.h>

#include "tiers/file/file_test_util.h"

namespace cascade::stress {
namespace {

FaultCampaignOptions small(const std::string& dir) {
  FaultCampaignOptions o;
  o.dir = dir;
  o.seed = 7;
  o.puts = 16;
  o.key_space = 10;
  o.max_block_bytes = 9000;
  return o;
}

TEST(FaultCampaignTest, TraceNumbersEveryCallAndPointsCoverThem) {
  file_test::TempDir tmp;
  auto o = small(tmp.sub("w"));
  auto trace = trace_fault_workload(o);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_GT(trace->size(), 20u);
  uint64_t writes = 0;
  for (EnvCall c : *trace) writes += is_write_call(c) ? 1 : 0;
  EXPECT_GT(writes, 0u);
  auto points = all_fault_points(*trace, {FaultKind::kEio, FaultKind::kTorn});
  EXPECT_EQ(points.size(), trace->size() + writes);
  // The trace is reproducible: a second clean run makes the same calls.
  auto again = trace_fault_workload(o);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *trace);
}

TEST(FaultCampaignTest, EveryArmedFaultFiresAndNothingWrongIsServed) {
  file_test::TempDir tmp;
  auto o = small(tmp.sub("w"));
  auto trace = trace_fault_workload(o);
  ASSERT_TRUE(trace.ok());
  auto points = all_fault_points(*trace, {FaultKind::kEio, FaultKind::kTorn, FaultKind::kEnospc});
  FaultCampaignResult r = run_fault_points(o, points);
  EXPECT_EQ(r.points, points.size());
  EXPECT_EQ(r.fired, points.size());
  EXPECT_GE(r.injected, points.size());
  EXPECT_GT(r.failed_ops + r.open_failures, 0u);
  EXPECT_GT(r.hits, 0u);
  EXPECT_EQ(r.wrong, 0u) << (r.failures.empty() ? "" : r.failures[0]);
}

}  // namespace
}  // namespace cascade::stress
