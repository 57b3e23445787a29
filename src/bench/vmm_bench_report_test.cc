// The map-parallelism benchmark's statistics and report format (any build).
#include <gtest/gtest.h>

#include "bench/vmm_bench.h"

namespace cascade {
namespace {

TEST(GpuVmmBenchReport, StatisticsAndSeedFormat) {
  VmmCase c;
  for (int i = 1; i <= 20; ++i) c.wall_ms.push_back(double(i));
  summarize_vmm_case(&c);
  EXPECT_DOUBLE_EQ(c.mean_ms, 10.5);
  EXPECT_DOUBLE_EQ(c.min_ms, 1);
  EXPECT_DOUBLE_EQ(c.max_ms, 20);
  EXPECT_DOUBLE_EQ(c.p95_ms, 19);  // nearest rank: ceil(0.95 * 20) = 19th value
  VmmBenchResult r;
  r.options.pages_total = 100;
  r.options.procs = 4;
  r.options.iters = 20;
  r.device_name = "Test GPU";
  r.page_bytes = 2 << 20;
  r.single = c;
  r.single.procs = 1;
  r.single.pages_per_proc = r.single.pages_total = 25;
  r.serial = r.single;
  r.parallel = r.single;
  r.parallel.procs = 4;
  r.speedup_mean = 1.94;
  std::string text = format_vmm_report(r);
  EXPECT_NE(text.find("Using layout contiguous=True"), std::string::npos);
  EXPECT_NE(text.find("========== Single Process case (1 proc maps N/P pages) =========="),
            std::string::npos);
  EXPECT_NE(text.find("========== Serial case (1 proc maps N pages) =========="),
            std::string::npos);
  EXPECT_NE(text.find("========== Parallel case (4 procs map N/P each) =========="),
            std::string::npos);
  EXPECT_NE(text.find("| mean wall       |      10.500 |"), std::string::npos) << text;
  EXPECT_NE(text.find("Speedup (parallel vs serial): mean x1.94   (ideal being approximately 4.00"),
            std::string::npos);
  std::string json = vmm_report_json(r);
  EXPECT_NE(json.find("\"speedup_mean\": 1.940"), std::string::npos) << json;
}

TEST(GpuVmmBenchReport, RejectsBadOptions) {
  VmmBenchOptions o;
  o.pages_total = 10;
  o.procs = 4;  // not a divisor
  auto r = run_vmm_bench(o);
  ASSERT_FALSE(r.ok());
#if CASCADE_HAVE_CUDA
  EXPECT_TRUE(r.status().is(Code::kInvalidArgument));
#endif
}

}  // namespace
}  // namespace cascade
