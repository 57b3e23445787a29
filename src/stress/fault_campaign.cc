// Fault-injection campaign over the file tier. See fault_campaign.h.
#include "stress/fault_campaign.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include "tiers/file/file_tier.h"

namespace cascade::stress {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr uint64_t kContentMagic = 0x7373657274736163ull;  // "cstress" tag

BlockId id_of(uint64_t seed, uint64_t n) {
  BlockId id;
  for (int i = 0; i < 8; ++i) {
    id.bytes[i] = static_cast<uint8_t>(seed >> (56 - 8 * i));
    id.bytes[8 + i] = static_cast<uint8_t>(n >> (56 - 8 * i));
  }
  return id;
}

uint64_t size_of(const FaultCampaignOptions& o, uint64_t n) {
  uint64_t span = o.max_block_bytes > 512 ? o.max_block_bytes - 256 : 256;
  return 256 + mix(o.seed * 31 + n) % span;
}

// Block n: [magic][n][seed][size] then a splitmix64 stream of (seed, n).
std::vector<uint8_t> bytes_of(const FaultCampaignOptions& o, uint64_t n) {
  const uint64_t size = size_of(o, n);
  std::vector<uint8_t> v(size);
  uint64_t head[4] = {kContentMagic, n, o.seed, size};
  std::memcpy(v.data(), head, std::min<uint64_t>(size, sizeof(head)));
  uint64_t s = mix(o.seed ^ mix(n));
  for (uint64_t i = sizeof(head); i < size; i += 8) {
    s = mix(s);
    std::memcpy(v.data() + i, &s, std::min<uint64_t>(8, size - i));
  }
  return v;
}

CascadeConfig tier_config(const FaultCampaignOptions& o) {
  CascadeConfig c;
  c.pipeline = "file";
  c.file_path = o.dir;
  c.segment_size_bytes = o.segment_bytes;
  c.file_capacity_bytes = o.capacity_bytes;
  c.index_shards = 16;
  return c;
}

struct RunTally {
  std::set<uint64_t> acked;  // put OK, then flush OK, not removed since
  uint64_t failed_ops = 0, reads = 0, hits = 0, misses = 0, wrong = 0, lost = 0;
  bool open_failed = false;
  std::string first_wrong;
};

// Reads block n from t: a miss, or the exact bytes; counts into tally.
// Returns true on a hit.
bool check_read(FileTier* t, const FaultCampaignOptions& o, uint64_t n, RunTally* tally,
                const char* when) {
  std::vector<uint8_t> out(o.max_block_bytes + 4096);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ReadResult r;
  Status st = t->read(id_of(o.seed, n), req, &r);
  ++tally->reads;
  if (!st.ok()) {
    ++tally->misses;
    return false;
  }
  ++tally->hits;
  auto want = bytes_of(o, n);
  if (r.copied != want.size() || std::memcmp(out.data(), want.data(), want.size()) != 0) {
    ++tally->wrong;
    if (tally->first_wrong.empty())
      tally->first_wrong = std::string(when) + " read of block " + std::to_string(n) +
                           " returned " + std::to_string(r.copied) +
                           " bytes that are not the block's";
  }
  return true;
}

// The workload. env: the (faulting) Env. Returns the tally; a faulted run
// may stop early only when the open fails.
void run_workload(const FaultCampaignOptions& o, Env* env, RunTally* tally) {
  CascadeConfig c = tier_config(o);
  auto opened = FileTier::Open(c, nullptr, env);
  if (!opened.ok()) {
    tally->open_failed = true;
    return;
  }
  std::unique_ptr<FileTier> t = std::move(opened.value());
  std::set<uint64_t> stored;
  uint64_t rng = mix(o.seed ^ 0x5a5a);
  auto next = [&] { return rng = mix(rng); };
  auto flush = [&] {
    if (t->flush().ok()) {
      tally->acked = stored;
    } else {
      ++tally->failed_ops;
    }
  };
  for (int i = 0; i < o.puts; ++i) {
    uint64_t n = next() % o.key_space;
    auto data = bytes_of(o, n);
    PutOptions po;
    if (t->put(id_of(o.seed, n), data.data(), data.size(), po).ok()) {
      stored.insert(n);
    } else {
      ++tally->failed_ops;
    }
    if (i % 3 == 2) check_read(t.get(), o, next() % o.key_space, tally, "in-run");
    if (i % 4 == 3) {
      uint64_t m = next() % o.key_space;
      // Whatever remove returns, the block is no longer owed after reopen.
      stored.erase(m);
      tally->acked.erase(m);
      Status st = t->remove(id_of(o.seed, m));
      if (!st.ok() && !st.is(Code::kNotFound)) ++tally->failed_ops;
    }
    if (i % 7 == 6) flush();
    if (i == o.puts / 2 && !t->compact().ok()) ++tally->failed_ops;
  }
  flush();
  t.reset();  // close: seals the open segments
}

// Reopens o.dir with a clean Env and reads every id of the key space.
Status reopen_and_check(const FaultCampaignOptions& o, RunTally* tally) {
  CascadeConfig c = tier_config(o);
  auto opened = FileTier::Open(c, nullptr, Env::Default());
  if (!opened.ok()) return opened.status();
  for (uint64_t n = 0; n < o.key_space; ++n) {
    bool hit = check_read(opened.value().get(), o, n, tally, "after-reopen");
    if (!hit && tally->acked.count(n)) ++tally->lost;
  }
  return Status::OK();
}

void empty_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir, ec);
}

}  // namespace

Result<std::vector<EnvCall>> trace_fault_workload(const FaultCampaignOptions& o) {
  if (o.dir.empty() || o.key_space == 0 || o.puts <= 0)
    return Status::InvalidArgument("fault campaign: dir, puts and key_space must be set");
  empty_dir(o.dir);
  PointFaultEnv env(Env::Default());
  env.set_trace(true);
  RunTally tally;
  run_workload(o, &env, &tally);
  if (tally.open_failed)
    return Status::IOError("fault campaign: the clean run could not open " + o.dir);
  Status st = reopen_and_check(o, &tally);
  if (!st.ok()) return st;
  if (tally.wrong || tally.lost || tally.failed_ops)
    return Status::Corruption("fault campaign: the clean run failed (" +
                              std::to_string(tally.wrong) + " wrong, " +
                              std::to_string(tally.lost) + " lost, " +
                              std::to_string(tally.failed_ops) + " failed operations)");
  return env.trace();
}

std::vector<FaultPoint> all_fault_points(const std::vector<EnvCall>& trace,
                                         const std::vector<FaultKind>& kinds) {
  std::vector<FaultPoint> out;
  for (FaultKind k : kinds) {
    for (uint64_t i = 0; i < trace.size(); ++i) {
      if (k != FaultKind::kEio && !is_write_call(trace[i])) continue;
      out.push_back({k, i, trace[i]});
    }
  }
  return out;
}

FaultCampaignResult run_fault_points(const FaultCampaignOptions& o,
                                     const std::vector<FaultPoint>& points) {
  FaultCampaignResult res;
  for (const FaultPoint& p : points) {
    std::string where = std::string(fault_kind_name(p.kind)) + "@" + std::to_string(p.index);
    if (!o.progress_path.empty()) {
      std::ofstream(o.progress_path, std::ios::trunc) << where << "\n";
    }
    empty_dir(o.dir);
    PointFaultEnv env(Env::Default());
    env.arm(p.index, p.kind, o.seed ^ (p.index * 0x9e3779b97f4a7c15ull));
    RunTally tally;
    run_workload(o, &env, &tally);
    ++res.points;
    res.fired += env.fired() ? 1 : 0;
    where +=
        std::string(" (") + (env.fired() ? env_call_name(env.fired_call()) : "not reached") + ")";
    res.injected += env.injected();
    env.disarm();
    Status st = reopen_and_check(o, &tally);
    res.failed_ops += tally.failed_ops;
    res.open_failures += tally.open_failed ? 1 : 0;
    res.acked += tally.acked.size();
    res.reads += tally.reads;
    res.hits += tally.hits;
    res.misses += tally.misses;
    res.wrong += tally.wrong;
    res.lost += tally.lost;
    std::string problem;
    if (!st.ok()) {
      ++res.reopen_failures;
      problem = "reopen failed: " + st.ToString();
    }
    if (tally.wrong) problem += (problem.empty() ? "" : "; ") + tally.first_wrong;
    if (tally.lost)
      problem += (problem.empty() ? "" : "; ") + std::to_string(tally.lost) + " of " +
                 std::to_string(tally.acked.size()) + " flushed blocks missing after reopen";
    if (!problem.empty() && res.failures.size() < 20)
      res.failures.push_back(where + ": " + problem);
  }
  return res;
}

}  // namespace cascade::stress
