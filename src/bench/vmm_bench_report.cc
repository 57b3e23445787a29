// Statistics and reports of the map-parallelism benchmark (any build).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "bench/vmm_bench.h"

namespace cascade {
namespace {

std::string table(const char* title, const VmmCase& c, int iters) {
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "\n========== %s ==========\n"
                "Processes           : %d\n"
                "Iterations          : %d\n"
                "Pages total / iter  : %d\n"
                "Pages per proc / iter: %d \n\n"
                "+-----------------+-------------+\n"
                "| Metric          | ms          |\n"
                "+-----------------+-------------+\n"
                "| mean wall       | %11.3f |\n"
                "| p95 wall        | %11.3f |\n"
                "| max wall        | %11.3f |\n"
                "| min wall        | %11.3f |\n"
                "+-----------------+-------------+\n",
                title, c.procs, iters, c.pages_total, c.pages_per_proc, c.mean_ms, c.p95_ms,
                c.max_ms, c.min_ms);
  return buf;
}

std::string case_json(const VmmCase& c) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "{\"name\": \"%s\", \"procs\": %d, \"pages_per_proc\": %d, \"pages_total\": %d, "
                "\"mean_ms\": %.4f, \"p95_ms\": %.4f, \"max_ms\": %.4f, \"min_ms\": %.4f, "
                "\"mean_ms_per_page\": %.5f}",
                c.name.c_str(), c.procs, c.pages_per_proc, c.pages_total, c.mean_ms, c.p95_ms,
                c.max_ms, c.min_ms, c.pages_total ? c.mean_ms / c.pages_total : 0.0);
  return buf;
}

}  // namespace

void summarize_vmm_case(VmmCase* c) {
  if (c->wall_ms.empty()) return;
  std::vector<double> v = c->wall_ms;
  std::sort(v.begin(), v.end());
  c->mean_ms = std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
  c->min_ms = v.front();
  c->max_ms = v.back();
  size_t rank = static_cast<size_t>(std::ceil(0.95 * double(v.size())));
  c->p95_ms = v[std::min(v.size(), std::max<size_t>(rank, 1)) - 1];
}

std::string format_vmm_report(const VmmBenchResult& r) {
  const VmmBenchOptions& o = r.options;
  std::string out =
      std::string("Using layout contiguous=") + (o.contiguous ? "True" : "False") + "\n";
  char line[512];
  std::snprintf(line, sizeof line,
                "Device: %s (%d visible), page %llu MiB, %d layers: one KV page = %d x %llu MiB\n",
                r.device_name.c_str(), r.gpus, (unsigned long long)(r.page_bytes >> 20), o.layers,
                2 * o.layers, (unsigned long long)(r.page_bytes >> 20));
  out += line;
  out += table("Single Process case (1 proc maps N/P pages)", r.single, o.iters);
  out += table("Serial case (1 proc maps N pages)", r.serial, o.iters);
  char title[128];
  std::snprintf(title, sizeof title, "Parallel case (%d procs map N/P each)", o.procs);
  out += table(title, r.parallel, o.iters);
  std::snprintf(line, sizeof line,
                "\nSpeedup (parallel vs serial): mean x%.2f   (ideal being approximately %.2f if "
                "perfect overlap)\n",
                r.speedup_mean, double(o.procs));
  out += line;
  if (!r.arena.wall_ms.empty()) {
    std::snprintf(title, sizeof title,
                  "Arena case (1 proc maps N pages as %d MiB pages created ahead, one access call)",
                  o.arena_page_mib);
    out += table(title, r.arena, o.iters);
  }
  std::snprintf(line, sizeof line, "\nPer KV page (serial): %.3f ms",
                r.serial.pages_total ? r.serial.mean_ms / r.serial.pages_total : 0.0);
  out += line;
  if (!r.arena.wall_ms.empty() && r.arena.pages_total) {
    std::snprintf(line, sizeof line, "; arena: %.3f ms", r.arena.mean_ms / r.arena.pages_total);
    out += line;
  }
  out += "\n";
  return out;
}

std::string vmm_report_json(const VmmBenchResult& r) {
  const VmmBenchOptions& o = r.options;
  char head[512];
  std::snprintf(
      head, sizeof head,
      "{\"benchmark\": \"vmm\", \"device\": \"%s\", \"gpus\": %d, \"page_bytes\": %llu, "
      "\"layers\": %d, \"contiguous\": %s, \"pages_total\": %d, \"procs\": %d, \"iters\": %d, "
      "\"warmup\": %d, \"arena_page_mib\": %d, \"speedup_mean\": %.3f, \"cases\": [",
      r.device_name.c_str(), r.gpus, (unsigned long long)r.page_bytes, o.layers,
      o.contiguous ? "true" : "false", o.pages_total, o.procs, o.iters, o.warmup, o.arena_page_mib,
      r.speedup_mean);
  std::string out = head;
  out += case_json(r.single) + ", " + case_json(r.serial) + ", " + case_json(r.parallel);
  if (!r.arena.wall_ms.empty()) out += ", " + case_json(r.arena);
  out += "]}";
  return out;
}

}  // namespace cascade
