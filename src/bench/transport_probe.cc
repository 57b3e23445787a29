#include "bench/transport_probe.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "transport/forked_peer.h"
#include "transport/transport.h"

namespace cascade {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
constexpr uint8_t kSeed = 77;

Status check_pattern(const uint8_t* data, uint64_t n, uint64_t first, const char* what) {
  for (uint64_t i = 0; i < n; ++i)
    if (data[i] != pattern_byte(first + i, kSeed))
      return Status::Corruption(std::string("transport probe: ") + what + ": byte " +
                                std::to_string(i) + " of " + std::to_string(n) + " differs");
  return Status::OK();
}

}  // namespace

Result<TransportProbeResult> transport_probe(const TransportProbeOptions& o) {
  if (o.sizes.empty() || o.outstanding == 0 || o.batch_block == 0)
    return Status::InvalidArgument("transport probe: no sizes, blocks or outstanding gets");
  uint64_t batch_bytes = uint64_t{o.outstanding} * o.batch_block;
  uint64_t batches_in_span = std::max<uint64_t>(1, o.batch_span / batch_bytes);
  uint64_t region = batches_in_span * batch_bytes;
  for (uint64_t s : o.sizes) {
    if (s == 0) return Status::InvalidArgument("transport probe: a block size of 0");
    region = std::max(region, s);
  }
  TransportOptions topt;
  topt.fabrics = o.fabrics;
  topt.require_failure_detection = o.require_failure_detection;
  ForkedPeerOptions fo;
  fo.transport = topt;
  fo.region_bytes = region;
  fo.seed = kSeed;
  Result<std::unique_ptr<ForkedPeer>> child = ForkedPeer::Start(fo, Clock::now() + 60s);
  if (!child.ok()) return child.status();

  Result<std::unique_ptr<Transport>> t = Transport::Open(topt);
  if (!t.ok()) return t.status();
  auto c0 = Clock::now();
  Result<std::shared_ptr<Peer>> peer = (*t)->connect((*child)->address(), Clock::now() + 10s);
  if (!peer.ok()) return peer.status();
  Result<std::shared_ptr<RemoteRegion>> remote = (*peer)->import_key((*child)->key());
  if (!remote.ok()) return remote.status();
  TransportProbeResult out;
  out.connect_ms = std::chrono::duration<double, std::milli>(Clock::now() - c0).count();

  std::vector<uint8_t> local(region);
  Result<std::unique_ptr<MemoryRegion>> mr = (*t)->register_memory(local.data(), local.size());
  if (!mr.ok()) return mr.status();
  uint8_t* dst = (*mr)->data();

  auto get_one = [&](uint64_t n) -> Status {
    Result<std::unique_ptr<Completion>> c = (*peer)->get(**remote, 0, dst, n);
    if (!c.ok()) return c.status();
    return (*c)->wait(Clock::now() + 10s);
  };

  for (uint64_t n : o.sizes) {
    std::memset(dst, 0, n);
    CASCADE_RETURN_IF_ERROR(get_one(n));
    CASCADE_RETURN_IF_ERROR(check_pattern(dst, n, 0, "latency get"));
    uint64_t count = std::clamp<uint64_t>(o.bytes_per_size / n, 20, o.max_iterations);
    for (int i = 0; i < 3; ++i) CASCADE_RETURN_IF_ERROR(get_one(n));
    std::vector<double> us;
    us.reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      auto t0 = Clock::now();
      CASCADE_RETURN_IF_ERROR(get_one(n));
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    TransportLatency l;
    l.bytes = n;
    l.count = us.size();
    l.median_us = us[us.size() / 2];
    l.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
    out.latency.push_back(l);
  }

  // Batch k reads the k-th whole batch of the span (cyclically).
  auto batch_ops = [&](uint64_t k) {
    uint64_t base = (k % batches_in_span) * batch_bytes;
    std::vector<TransferOp> ops;
    for (uint32_t i = 0; i < o.outstanding; ++i)
      ops.push_back({TransferKind::kGet, remote->get(), base + uint64_t{i} * o.batch_block,
                     dst + base + uint64_t{i} * o.batch_block, o.batch_block});
    return ops;
  };
  std::vector<std::vector<TransferOp>> all;
  for (uint64_t k = 0; k < batches_in_span; ++k) all.push_back(batch_ops(k));
  for (const auto& ops : all)  // warm: every page of both sides touched once
    CASCADE_RETURN_IF_ERROR((*peer)->run_batch(ops, Clock::now() + 30s));
  uint64_t batches = 0;
  auto b0 = Clock::now();
  auto until = b0 + std::chrono::duration<double>(o.batch_seconds);
  do {
    CASCADE_RETURN_IF_ERROR((*peer)->run_batch(all[batches % batches_in_span], Clock::now() + 30s));
    ++batches;
  } while (Clock::now() < until);
  double secs = std::chrono::duration<double>(Clock::now() - b0).count();
  out.batch_bytes = batches * batch_bytes;
  out.batch_gbps = static_cast<double>(out.batch_bytes) / secs / 1e9;
  std::memset(dst, 0, region);
  for (const auto& ops : all) CASCADE_RETURN_IF_ERROR((*peer)->run_batch(ops, Clock::now() + 30s));
  CASCADE_RETURN_IF_ERROR(check_pattern(dst, region, 0, "batched gets"));

  peer->reset();
  remote->reset();
  mr->reset();
  (*t)->close();
  return out;
}

}  // namespace cascade
