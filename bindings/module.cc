// cascade._core: the compiled half of the cascade package.
#include <pthread.h>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bench/index_probe.h"
#include "bench/ipc_probe.h"
#include "bench/memory_probe.h"
#include "bench/transport_probe.h"
#include "cascade/config.h"
#include "common.h"
#include "cuda/device_copy.h"
#include "transport/transport.h"

namespace cascade::py {
void register_store(nb::module_& m);
void register_distributed(nb::module_& m);
void register_file(nb::module_& m);
void register_tier_handles(nb::module_& m);
void register_gpu(nb::module_& m);
void register_kv(nb::module_& m);
void register_stress(nb::module_& m);
void register_serve(nb::module_& m);
}  // namespace cascade::py

using namespace cascade;
using namespace cascade::py;

NB_MODULE(_core, m) {
  m.doc() = "Cascade core (C++). Use the `cascade` package rather than this module.";
  register_exceptions(m);
  // A forked child keeps the objects that its parent's other threads were
  // using at the fork, with no thread left to drop them: at its exit they
  // are not leaks of the bindings, and nanobind is told not to report them.
  (void)::pthread_atfork(nullptr, nullptr, [] { nb::set_leak_warnings(false); });
  // At exit, before the interpreter finalizes: threads finishing a call into
  // the store take the GIL back while they still may (ReleaseGil).
  m.def("_at_exit", [] { at_exit(1000); });
  nb::module_::import_("atexit").attr("register")(m.attr("_at_exit"));

  nb::enum_<EvictionPolicy>(m, "EvictionPolicy")
      .value("LRU", EvictionPolicy::kLru)
      .value("FIFO", EvictionPolicy::kFifo);
  nb::enum_<WritePolicy>(m, "WritePolicy")
      .value("WRITE_BACK", WritePolicy::kWriteBack)
      .value("WRITE_THROUGH", WritePolicy::kWriteThrough);
  nb::enum_<ShmPopulate>(m, "ShmPopulate")
      .value("LAZY", ShmPopulate::kLazy)
      .value("AHEAD", ShmPopulate::kAhead)
      .value("FULL", ShmPopulate::kFull);
  nb::enum_<FileIoEngine>(m, "FileIoEngine")
      .value("PSYNC", FileIoEngine::kPsync)
      .value("IO_URING", FileIoEngine::kIoUring);

  nb::class_<CascadeConfig>(
      m, "CascadeConfig",
      "Every option of a store; see docs/configuration.md for defaults and reasons.")
      .def(nb::init<>())
      .def_rw("pipeline", &CascadeConfig::pipeline)
      .def_rw("gpu_capacity_bytes", &CascadeConfig::gpu_capacity_bytes)
      .def_rw("gpu_device_id", &CascadeConfig::gpu_device_id)
      .def_rw("use_gpu", &CascadeConfig::use_gpu)
      .def_rw("shm_capacity_bytes", &CascadeConfig::shm_capacity_bytes)
      .def_rw("shm_path", &CascadeConfig::shm_path)
      .def_rw("shm_prefault", &CascadeConfig::shm_prefault)
      .def_rw("pool_socket", &CascadeConfig::pool_socket)
      .def_rw("pool_namespace", &CascadeConfig::pool_namespace)
      .def_rw("pool_channels", &CascadeConfig::pool_channels)
      .def_rw("pool_timeout_ms", &CascadeConfig::pool_timeout_ms)
      .def_rw("shm_populate", &CascadeConfig::shm_populate)
      .def_rw("shm_persist", &CascadeConfig::shm_persist)
      .def_rw("shm_table_slots", &CascadeConfig::shm_table_slots)
      .def_rw("file_path", &CascadeConfig::file_path)
      .def_rw("file_stripe_size", &CascadeConfig::file_stripe_size)
      .def_rw("file_stripe_count", &CascadeConfig::file_stripe_count)
      // The file tier's fields under their older names (cascade.config.ALIASES).
      .def_prop_rw(
          "lustre_path", [](const CascadeConfig& c) { return c.file_path; },
          [](CascadeConfig& c, const std::string& v) { c.file_path = v; }, "Alias of file_path.")
      .def_prop_rw(
          "lustre_stripe_size", [](const CascadeConfig& c) { return c.file_stripe_size; },
          [](CascadeConfig& c, uint64_t v) { c.file_stripe_size = v; },
          "Alias of file_stripe_size.")
      .def_prop_rw(
          "lustre_stripe_count", [](const CascadeConfig& c) { return c.file_stripe_count; },
          [](CascadeConfig& c, int v) { c.file_stripe_count = v; }, "Alias of file_stripe_count.")
      .def_rw("file_capacity_bytes", &CascadeConfig::file_capacity_bytes)
      .def_rw("segment_size_bytes", &CascadeConfig::segment_size_bytes)
      .def_rw("io_direct", &CascadeConfig::io_direct)
      .def_rw("file_io_engine", &CascadeConfig::file_io_engine)
      .def_rw("file_read_bytes_per_s", &CascadeConfig::file_read_bytes_per_s)
      .def_rw("file_mode", &CascadeConfig::file_mode)
      .def_rw("sync_writes", &CascadeConfig::sync_writes)
      .def_rw("dedup_enabled", &CascadeConfig::dedup_enabled)
      .def_rw("compression_enabled", &CascadeConfig::compression_enabled)
      .def_rw("num_io_threads", &CascadeConfig::num_io_threads)
      .def_rw("parallel_copy_threshold", &CascadeConfig::parallel_copy_threshold)
      .def_rw("eviction_policy", &CascadeConfig::eviction_policy)
      .def_rw("write_policy", &CascadeConfig::write_policy)
      .def_rw("ephemeral", &CascadeConfig::ephemeral)
      .def_rw("promote_on_hit", &CascadeConfig::promote_on_hit)
      .def_rw("index_shards", &CascadeConfig::index_shards)
      .def(
          "validate", [](const CascadeConfig& c) { check(c.validate()); },
          "Raises when fields are unusable alone or together.");

  m.def(
      "compute_block_id",
      [](nb::handle data) {
        BufferRef buf = BufferRef::readable(data, "data");
        if (buf.kind() != MemoryKind::kHost)
          throw nb::value_error("compute_block_id hashes host memory");
        BlockId id;
        {
          ReleaseGil release;
          id = cascade::compute_block_id(buf.data(), buf.size());
        }
        return id.hex();
      },
      "data"_a, "SHA-256 of the bytes, first 128 bits, as 32 lowercase hex characters.");
  m.def(
      "block_id", [](nb::handle key) { return parse_key(key).hex(); }, "key"_a,
      "The 32-hex id a key maps to (a 32-hex key is itself; other keys are hashed).");
  m.def(
      "memcpy_bandwidth",
      [](size_t bytes, int threads, int repeats) {
        MemcpyCeiling c;
        {
          ReleaseGil release;
          c = measure_memcpy_ceiling(bytes, threads, repeats);
        }
        nb::dict d;
        d["memcpy_gbps"] = c.memcpy_gbps;
        d["stream_gbps"] = c.stream_gbps;
        d["read_gbps"] = c.read_gbps;
        d["gbps"] = c.best();
        return d;
      },
      "bytes"_a, "threads"_a, "repeats"_a = 3,
      "Host copy ceiling with `threads` threads: glibc memcpy, streaming copy, and the better "
      "(GB/s, bytes copied per second).");
  m.def(
      "first_touch_copy_bandwidth",
      [](const std::string& dir, size_t bytes, size_t block, int repeats, int readers) {
        if (readers < 1 || readers > 256) check(Status::InvalidArgument("readers: 1 to 256"));
        FirstTouchCeiling c;
        {
          ReleaseGil release;
          c = measure_first_touch_copy(dir, bytes, block, repeats, readers);
        }
        if (!c.error.empty()) check(Status::IOError(c.error));
        nb::dict d;
        d["first_gbps"] = c.first_gbps;
        d["warm_gbps"] = c.warm_gbps;
        return d;
      },
      "dir"_a, "bytes"_a, "block"_a, "repeats"_a = 3, "readers"_a = 1,
      "Copy rate out of another mapping of a shared-memory file in `dir`, `block` bytes at a "
      "time: through a fresh read-only mapping (first_gbps, every page entered into the page "
      "tables on the way) and through the same mapping again (warm_gbps). With several "
      "`readers`, each a forked process copying `bytes` of a file of its own, all at once. "
      "GB/s, all readers.");
  m.def(
      "index_lookup_rate",
      [](uint64_t blocks, int threads, uint64_t lookups) {
        IndexProbeResult r;
        {
          ReleaseGil release;
          r = measure_index_lookups(blocks, threads, lookups);
        }
        nb::dict d;
        d["threads"] = r.threads;
        d["lookups_per_sec_per_thread"] = r.lookups_per_sec_per_thread;
        d["metadata_bytes_per_block"] = r.metadata_bytes_per_block;
        return d;
      },
      "blocks"_a, "threads"_a, "lookups"_a,
      "Index lookups (lease+release) per second per thread, and metadata bytes per block.");
  m.def(
      "socket_round_trips",
      [](uint64_t count) {
        Result<RoundTrips> r = Status::OK();
        {
          ReleaseGil release;
          r = socket_round_trips(count);
        }
        check(r.status());
        nb::dict d;
        d["count"] = r->count;
        d["median_us"] = r->median_us;
        d["p99_us"] = r->p99_us;
        return d;
      },
      "count"_a, "Round trips of a 64-byte message over a Unix socket to a forked echo process.");
  m.def(
      "pool_round_trips",
      [](const std::string& socket, const std::string& ns, uint64_t count) {
        Result<PoolRoundTrips> r = Status::OK();
        {
          ReleaseGil release;
          r = pool_round_trips(socket, ns, count);
        }
        check(r.status());
        nb::dict d;
        d["count"] = r->lookup.count;
        d["lookup_median_us"] = r->lookup.median_us;
        d["lookup_p99_us"] = r->lookup.p99_us;
        d["put_median_us"] = r->put.median_us;
        d["put_p99_us"] = r->put.p99_us;
        return d;
      },
      "socket"_a, "namespace"_a, "count"_a,
      "Small requests to a pool server, timed one by one in C++: a lookup of one id, and a put "
      "of one 64-byte block (reserve, copy, commit).");
  m.def(
      "pool_lookup_rate",
      [](const std::string& socket, const std::string& ns, uint32_t batch, double seconds,
         int threads) {
        Result<double> r = 0.0;
        {
          ReleaseGil release;
          r = pool_lookup_rate(socket, ns, batch, seconds, threads);
        }
        check(r.status());
        return r.value();
      },
      "socket"_a, "namespace"_a, "batch"_a, "seconds"_a, "threads"_a = 1,
      "Ids looked up per second by one client issuing batches of `batch` ids on `threads` "
      "threads.");
  m.def(
      "transport_probe",
      [](const std::string& fabrics, std::vector<uint64_t> sizes, uint64_t max_iterations,
         uint64_t bytes_per_size, uint64_t batch_block, uint32_t outstanding, double batch_seconds,
         bool require_failure_detection, uint64_t batch_span) {
        TransportProbeOptions o;
        o.fabrics = fabrics;
        o.sizes = std::move(sizes);
        o.max_iterations = max_iterations;
        o.bytes_per_size = bytes_per_size;
        o.batch_block = batch_block;
        o.outstanding = outstanding;
        o.batch_seconds = batch_seconds;
        o.require_failure_detection = require_failure_detection;
        o.batch_span = batch_span;
        Result<TransportProbeResult> r = Status::OK();
        {
          ReleaseGil release;
          r = transport_probe(o);
        }
        check(r.status());
        nb::list latency;
        for (const TransportLatency& l : r->latency) {
          nb::dict d;
          d["bytes"] = l.bytes;
          d["count"] = l.count;
          d["median_us"] = l.median_us;
          d["p99_us"] = l.p99_us;
          latency.append(d);
        }
        nb::dict d;
        d["latency"] = latency;
        d["batch_bytes"] = r->batch_bytes;
        d["batch_gbps"] = r->batch_gbps;
        d["connect_ms"] = r->connect_ms;
        return d;
      },
      "fabrics"_a, "sizes"_a, "max_iterations"_a = 2000, "bytes_per_size"_a = 1ull << 30,
      "batch_block"_a = 1ull << 20, "outstanding"_a = 8, "batch_seconds"_a = 1.0,
      "require_failure_detection"_a = true, "batch_span"_a = 256ull << 20,
      "Gets from a forked process over the transport (`fabrics`: UCX_TLS names, empty for "
      "UCX's choice): median and p99 latency per block size, and GB/s of batches of "
      "`outstanding` gets of `batch_block` bytes, successive batches reading successive "
      "ranges of `batch_span` bytes. Every size's first read and a last pass of batches over "
      "the span are compared byte for byte. Raises Unavailable without UCX.");
  m.def(
      "check_transport",
      [](const std::string& fabrics) {
        TransportOptions o;
        o.fabrics = fabrics;
        Result<std::unique_ptr<Transport>> t = Status::OK();
        {
          ReleaseGil release;
          t = Transport::Open(o);
          if (t.ok()) t.value()->close();
        }
        check(t.status());
      },
      "fabrics"_a,
      "Opens a UCX endpoint on `fabrics` (UCX_TLS names, empty for UCX's choice) and closes "
      "it: raises what opening one for a cluster would, without a cluster.");
  m.def(
      "gpu_usable", [](int device) { return gpu_usable(device); }, "device"_a = 0);
  m.attr("HAVE_CUDA") = bool(CASCADE_HAVE_CUDA);
  m.attr("HAVE_URING") = bool(CASCADE_HAVE_URING);
  m.attr("HAVE_MPI") = bool(CASCADE_HAVE_MPI);
  m.attr("HAVE_UCX") = bool(CASCADE_HAVE_UCX);

  register_store(m);
  register_distributed(m);
  register_file(m);
  register_tier_handles(m);
  register_gpu(m);
  register_kv(m);
  register_stress(m);
  register_serve(m);
}
