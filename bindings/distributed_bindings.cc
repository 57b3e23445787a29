// Python entry points of distributed stores (cascade.distributed wraps
// them): open_distributed, DistributedOptions, ring_owner.
//
// The communicator arrives as an mpi4py communicator (anything with
// .py2f()), a Fortran handle (int), or None for MPI_COMM_WORLD; no mpi4py or
// MPI header is needed to build this file. In a build without MPI the
// functions exist and open_distributed raises UnavailableError saying so.
#include <nanobind/stl/string.h>

#include "cascade/distributed.h"
#include "common.h"
#include "store_wrap.h"

namespace cascade::py {

void register_distributed(nb::module_& m) {
  nb::enum_<RemoteChecksum>(m, "RemoteChecksum")
      .value("OFF", RemoteChecksum::kOff)
      .value("CROSS_NODE", RemoteChecksum::kCrossNode)
      .value("ALWAYS", RemoteChecksum::kAlways);

  nb::class_<DistributedOptions>(m, "DistributedOptions",
                                 "Options of a distributed store (see cascade/distributed.h).")
      .def(nb::init<>())
      .def_rw("request_timeout_ms", &DistributedOptions::request_timeout_ms)
      .def_rw("ring_points_per_rank", &DistributedOptions::ring_points_per_rank)
      .def_rw("node_local_loads", &DistributedOptions::node_local_loads)
      .def_rw("checksum", &DistributedOptions::checksum)
      .def_rw("announce_departure", &DistributedOptions::announce_departure)
      .def_rw("file_dir_per_rank", &DistributedOptions::file_dir_per_rank)
      .def("validate", [](const DistributedOptions& o) { check(o.validate()); });

  m.def(
      "open_distributed",
      [](const CascadeConfig& config, nb::handle comm,
         const DistributedOptions& options) -> nb::object {
        MpiCommunicator c = MpiCommunicator::World();
        nb::object handle = nb::borrow(comm);
        if (nb::hasattr(comm, "py2f")) handle = comm.attr("py2f")();
        if (!handle.is_none()) {
          int64_t fortran = 0;
          if (!nb::isinstance<nb::int_>(handle) || nb::isinstance<nb::bool_>(handle) ||
              !nb::try_cast(handle, fortran))
            throw nb::type_error(
                ("comm must be an mpi4py communicator, a Fortran communicator handle (int) or "
                 "None, not " +
                 std::string(nb::type_name(comm.type()).c_str()))
                    .c_str());
          c = MpiCommunicator::FromFortran(fortran);
        }
        Result<std::unique_ptr<CascadeStore>> store = Status::OK();
        {
          ReleaseGil release;  // collective: waits for the other ranks
          store = OpenDistributed(config, options, c);
        }
        check(store.status());
        return wrap_store(std::move(store.value()));
      },
      "config"_a, "comm"_a = nb::none(), "options"_a = DistributedOptions(),
      "Opens this rank's part of a distributed store. Collective over comm (an mpi4py "
      "communicator, "
      "a Fortran handle, or None for MPI_COMM_WORLD).");

  m.def(
      "ring_owner",
      [](nb::handle key, int ranks, int points_per_rank) {
        BlockId id = parse_key(key);
        return ring_owner(id, ranks, points_per_rank);
      },
      "block_id"_a, "ranks"_a, "points_per_rank"_a = DistributedOptions{}.ring_points_per_rank,
      "The rank that owns block_id in a group of `ranks` ranks (all present).");

  m.attr("HAVE_DISTRIBUTED") = distributed_available();
}

}  // namespace cascade::py
