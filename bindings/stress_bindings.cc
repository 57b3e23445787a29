// The compiled half of `cascade stress`: the file tier's fault-injection
// campaign (stress/fault_campaign.h), and the record-header forger the
// corruption mode uses to plant a record image where a scan could find it.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "common.h"
#include "stress/fault_campaign.h"
#include "tiers/file/record_format.h"

namespace cascade::py {
namespace {

stress::FaultCampaignOptions campaign_options(const std::string& dir, uint64_t seed, int puts,
                                              uint64_t key_space, uint64_t max_block_bytes,
                                              uint64_t segment_bytes, uint64_t capacity_bytes,
                                              const std::string& progress_path) {
  stress::FaultCampaignOptions o;
  o.dir = dir;
  o.seed = seed;
  o.puts = puts;
  o.key_space = key_space;
  o.max_block_bytes = max_block_bytes;
  o.segment_bytes = segment_bytes;
  o.capacity_bytes = capacity_bytes;
  o.progress_path = progress_path;
  return o;
}

stress::FaultKind parse_kind(const std::string& s) {
  for (auto k : {stress::FaultKind::kEio, stress::FaultKind::kTorn, stress::FaultKind::kEnospc})
    if (s == stress::fault_kind_name(k)) return k;
  raise_status(Status::InvalidArgument("unknown fault kind '" + s + "' (eio, torn, enospc)"));
}

}  // namespace

void register_stress(nb::module_& m) {
  m.def(
      "stress_fault_points",
      [](const std::string& dir, uint64_t seed, int puts, uint64_t key_space,
         uint64_t max_block_bytes, uint64_t segment_bytes, uint64_t capacity_bytes,
         const std::vector<std::string>& kinds) {
        auto o = campaign_options(dir, seed, puts, key_space, max_block_bytes, segment_bytes,
                                  capacity_bytes, "");
        std::vector<stress::FaultKind> ks;
        for (const auto& k : kinds) ks.push_back(parse_kind(k));
        Result<std::vector<stress::EnvCall>> trace = Status::OK();
        {
          ReleaseGil release;
          trace = stress::trace_fault_workload(o);
        }
        check(trace.status());
        std::vector<std::tuple<std::string, uint64_t, std::string>> out;
        for (const auto& p : stress::all_fault_points(trace.value(), ks))
          out.emplace_back(stress::fault_kind_name(p.kind), p.index, stress::env_call_name(p.call));
        return std::make_tuple(trace.value().size(), out);
      },
      "dir"_a, "seed"_a, "puts"_a, "key_space"_a, "max_block_bytes"_a, "segment_bytes"_a,
      "capacity_bytes"_a, "kinds"_a,
      "Runs the fault workload cleanly; returns (env_calls, [(kind, call_index, call_name)]).");

  m.def(
      "stress_fault_run",
      [](const std::string& dir, uint64_t seed, int puts, uint64_t key_space,
         uint64_t max_block_bytes, uint64_t segment_bytes, uint64_t capacity_bytes,
         const std::vector<std::tuple<std::string, uint64_t>>& points,
         const std::string& progress_path) {
        auto o = campaign_options(dir, seed, puts, key_space, max_block_bytes, segment_bytes,
                                  capacity_bytes, progress_path);
        std::vector<stress::FaultPoint> ps;
        for (const auto& [kind, index] : points)
          ps.push_back({parse_kind(kind), index, stress::EnvCall::kOpenRead});
        stress::FaultCampaignResult r;
        {
          ReleaseGil release;
          r = stress::run_fault_points(o, ps);
        }
        nb::dict d;
        d["points"] = r.points;
        d["fired"] = r.fired;
        d["injected"] = r.injected;
        d["failed_ops"] = r.failed_ops;
        d["open_failures"] = r.open_failures;
        d["reopen_failures"] = r.reopen_failures;
        d["acked"] = r.acked;
        d["reads"] = r.reads;
        d["hits"] = r.hits;
        d["misses"] = r.misses;
        d["wrong"] = r.wrong;
        d["lost"] = r.lost;
        nb::list failures;
        for (const auto& f : r.failures) failures.append(f);
        d["failures"] = failures;
        return d;
      },
      "dir"_a, "seed"_a, "puts"_a, "key_space"_a, "max_block_bytes"_a, "segment_bytes"_a,
      "capacity_bytes"_a, "points"_a, "progress_path"_a = "",
      "Runs the fault workload once per (kind, call_index) point, reopens cleanly and checks; "
      "returns the counts.");

  m.def(
      "stress_forge_record_header",
      [](nb::handle key, nb::bytes payload, uint64_t segment_id, uint64_t record_offset) {
        // What a client that controls a block's bytes can compute: the record
        // format is public, the directory's key is not, so it has to guess one.
        BlockId id = parse_key(key);
        const file::RecordKey guess;
        uint64_t sum = file::payload_checksum(guess, payload.c_str(), payload.size());
        file::RecordHeader h = file::make_record_header(guess, id, payload.size(), sum, /*flags=*/0,
                                                        /*sequence=*/1, segment_id, record_offset);
        return nb::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
      },
      "block_id"_a, "payload"_a, "segment_id"_a, "record_offset"_a,
      "A record header for block_id with this payload at (segment_id, record_offset), as the "
      "documented format builds it under a guessed key (for the corruption mode's planted "
      "records).");
}

}  // namespace cascade::py
