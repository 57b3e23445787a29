// cascade._core.PoolServer: the node pool server (`cascade serve`).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "common.h"
#include "guarded.h"
#include "serve/pool_server.h"
#include "store_wrap.h"
#include "tiers/pool/pool_wire.h"

namespace cascade::py {

namespace {

class PyPoolServer {
 public:
  PyPoolServer(const CascadeConfig& config, const std::string& socket_path, uint32_t socket_mode,
               int64_t allowed_gid, int max_clients, bool share_across_users, int workers) {
    PoolServerOptions o;
    o.socket_path = socket_path;
    o.socket_mode = socket_mode;
    o.allowed_gid = allowed_gid;
    o.max_clients = max_clients;
    o.share_across_users = share_across_users;
    o.workers = workers;
    Result<std::unique_ptr<PoolServer>> server = Status::OK();
    {
      ReleaseGil release;
      server = PoolServer::Start(config, o);
    }
    check(server.status());
    server_.open(std::move(server.value()));
  }

  nb::dict stats() {
    auto use = server_.use();
    PoolServer::Stats s;
    {
      ReleaseGil release;
      s = use->stats();
    }
    nb::dict d;
    d["clients"] = s.clients;
    d["leases"] = s.leases;
    d["reservations"] = s.reservations;
    d["connections"] = s.connections;
    d["refused"] = s.refused;
    d["disconnects"] = s.disconnects;
    d["requests"] = s.requests;
    d["malformed"] = s.malformed;
    d["doorbell_repairs"] = s.doorbell_repairs;
    d["reclaimed_leases"] = s.reclaimed_leases;
    d["reclaimed_reservations"] = s.reclaimed_reservations;
    d["lookups"] = s.lookups;
    d["lookup_hits"] = s.lookup_hits;
    d["commits"] = s.commits;
    d["bytes_committed"] = s.bytes_committed;
    d["leases_granted"] = s.leases_granted;
    d["bytes_leased"] = s.bytes_leased;
    d["open_seconds"] = s.open_seconds;
    d["store"] = store_stats_dict(s.store);
    return d;
  }

  nb::list clients() {
    auto use = server_.use();
    std::vector<PoolServer::ClientInfo> cs;
    {
      ReleaseGil release;
      cs = use->clients();
    }
    nb::list out;
    for (const auto& c : cs) {
      nb::dict d;
      d["id"] = c.id;
      d["pid"] = c.pid;
      d["uid"] = c.uid;
      // A client names its namespace in bytes: shown as text, with any
      // bytes that are not UTF-8 escaped (never an exception here).
      PyObject* ns = PyUnicode_DecodeUTF8(
          c.name_space.data(), static_cast<Py_ssize_t>(c.name_space.size()), "backslashreplace");
      if (!ns) throw nb::python_error();
      d["namespace"] = nb::steal<nb::str>(ns);
      d["channels"] = c.channels;
      d["leases"] = c.leases;
      d["reservations"] = c.reservations;
      d["requests"] = c.requests;
      out.append(d);
    }
    return out;
  }

  // Starts this server's cluster member; returns its transport address.
  nb::bytes start_cluster(const std::string& node_id, uint64_t generation,
                          const std::string& fabrics, bool allow_undetected_failures,
                          uint32_t request_timeout_ms, uint32_t lease_expiry_ms,
                          uint32_t retry_after_ms, bool verify, uint32_t service_threads,
                          uint32_t lanes, bool map_same_host, const std::string& transport,
                          int64_t mpi_comm, uint32_t request_budget_ms) {
    ClusterNodeOptions o;
    if (transport == "mpi") o.transport = TransportBackend::kMpi;
    else if (transport != "ucx")
      check(Status::InvalidArgument("transport: 'ucx' or 'mpi', not '" + transport + "'"));
    o.mpi_communicator = mpi_comm;
    o.node_id = node_id;
    o.generation = generation;
    o.fabrics = fabrics;
    o.allow_undetected_failures = allow_undetected_failures;
    o.request_timeout_ms = request_timeout_ms;
    o.request_budget_ms = request_budget_ms;
    o.lease_expiry_ms = lease_expiry_ms;
    o.retry_after_ms = retry_after_ms;
    o.verify = verify;
    o.service_threads = service_threads;
    o.lanes = lanes;
    o.map_same_host = map_same_host;
    auto use = server_.use();
    Result<ClusterNode*> cn = Status::OK();
    {
      ReleaseGil release;
      cn = use->start_cluster(o);
    }
    check(cn.status());
    const std::vector<uint8_t>& a = (*cn)->address();
    return nb::bytes(reinterpret_cast<const char*>(a.data()), a.size());
  }

  // members: (node id, generation, transport address) per member; positions
  // ascending, owners[i] the member index of point i.
  void set_cluster_view(uint64_t version,
                        const std::vector<std::tuple<std::string, uint64_t, nb::bytes>>& members,
                        const std::vector<uint64_t>& positions, const std::vector<uint32_t>& owners,
                        uint32_t replicas, bool partial) {
    ClusterView v;
    v.version = version;
    v.partial = partial;
    for (const auto& [id, gen, addr] : members) {
      ClusterMember m;
      m.node_id = id;
      m.generation = gen;
      const auto* p = static_cast<const uint8_t*>(addr.data());
      m.address.assign(p, p + addr.size());
      v.members.push_back(std::move(m));
    }
    v.positions = positions;
    v.owners = owners;
    v.replicas = replicas;
    auto use = server_.use();
    ClusterNode* cn = use->cluster();
    if (!cn) check(Status::Unavailable("this server is not a cluster member"));
    Status st;
    {
      ReleaseGil release;
      st = cn->set_view(std::move(v));
    }
    check(st);
  }

  // Waits until what clients committed so far was pushed to its owners.
  bool cluster_drain(uint32_t timeout_ms) {
    auto use = server_.use();
    ClusterNode* cn = use->cluster();
    if (!cn) return true;
    ReleaseGil release;
    return cn->drain(timeout_ms);
  }

  nb::object cluster_stats() {
    auto use = server_.use();
    ClusterNode* cn = use->cluster();
    if (!cn) return nb::none();
    ClusterStats s;
    {
      ReleaseGil release;
      s = cn->stats();
    }
    nb::dict d;
    d["backend"] = cn->backend();
    d["members"] = s.members;
    d["view_version"] = s.view_version;
    d["connected"] = s.connected;
    d["mapped"] = s.mapped;
    d["pushed"] = s.pushed;
    d["pushed_bytes"] = s.pushed_bytes;
    d["push_dropped"] = s.push_dropped;
    d["fetched"] = s.fetched;
    d["fetched_bytes"] = s.fetched_bytes;
    d["fetched_mapped"] = s.fetched_mapped;
    d["mapped_leases"] = s.mapped_leases;
    d["map_failures"] = s.map_failures;
    d["remote_lookups"] = s.remote_lookups;
    d["remote_hits"] = s.remote_hits;
    d["remote_removes"] = s.remote_removes;
    d["remote_removed"] = s.remote_removed;
    d["remove_incomplete"] = s.remove_incomplete;
    d["served_removes"] = s.served_removes;
    d["served_leases"] = s.served_leases;
    d["served_lease_bytes"] = s.served_lease_bytes;
    d["lease_hashes"] = s.lease_hashes;
    d["served_commits"] = s.served_commits;
    d["served_commit_bytes"] = s.served_commit_bytes;
    d["checksum_failures"] = s.checksum_failures;
    d["timeouts"] = s.timeouts;
    d["expired"] = s.expired;
    d["bad_messages"] = s.bad_messages;
    d["late_replies"] = s.late_replies;
    d["budget_cuts"] = s.budget_cuts;
    d["peer_leases"] = s.peer_leases;
    d["peer_reservations"] = s.peer_reservations;
    d["quarantined"] = s.quarantined;
    d["quarantined_bytes"] = s.quarantined_bytes;
    return d;
  }

  std::string socket_path() {
    auto use = server_.use();
    return use->socket_path();
  }

  void close() {
    Status st;
    server_.close([&](PoolServer& s) {
      st = s.close();
      return Status::OK();
    });
    check(st);
  }

  bool closed() const { return server_.closed(); }

 private:
  Guarded<PoolServer> server_{"the pool server"};
};

}  // namespace

void register_serve(nb::module_& m) {
  // The node pool's protocol version, as a client's hello carries it.
  m.attr("POOL_PROTOCOL_VERSION") = pool::kVersion;
  nb::class_<PyPoolServer>(m, "PoolServer",
                           "The node pool server: one store shared by the node's processes "
                           "(docs/node-pool.md). Clients connect with pool_socket set.")
      .def(nb::init<const CascadeConfig&, const std::string&, uint32_t, int64_t, int, bool, int>(),
           "config"_a, "socket_path"_a, "socket_mode"_a = 0600, "allowed_gid"_a = -1,
           "max_clients"_a = 256, "share_across_users"_a = false, "workers"_a = 0)
      .def("stats", &PyPoolServer::stats, "Counters of the server and its store.")
      .def("clients", &PyPoolServer::clients, "The connected clients.")
      .def("start_cluster", &PyPoolServer::start_cluster, "node_id"_a, "generation"_a,
           "fabrics"_a = "", "allow_undetected_failures"_a = false, "request_timeout_ms"_a = 2000,
           "lease_expiry_ms"_a = 60000, "retry_after_ms"_a = 1000, "verify"_a = true,
           "service_threads"_a = 2, "lanes"_a = 4, "map_same_host"_a = true, "transport"_a = "ucx",
           "mpi_comm"_a = TransportOptions::kMpiWorld, "request_budget_ms"_a = 0,
           "Makes this server a cluster member (its data transport); returns the "
           "transport address to publish in the member record. With transport 'mpi' "
           "the call is collective over mpi_comm (a Fortran handle, comm.py2f(); "
           "-1: MPI_COMM_WORLD).")
      .def("set_cluster_view", &PyPoolServer::set_cluster_view, "version"_a, "members"_a,
           "positions"_a, "owners"_a, "replicas"_a, "partial"_a = false,
           "Installs the members and their ring (PlacementRing.points()). partial: the view "
           "may lack members (cut off from the coordination service, or not registered yet); "
           "removes then raise UnavailableError.")
      .def("cluster_drain", &PyPoolServer::cluster_drain, "timeout_ms"_a,
           "Waits until blocks committed so far were pushed to their owners.")
      .def("cluster_stats", &PyPoolServer::cluster_stats,
           "Counters of the cluster member, or None when not a member.")
      .def_prop_ro("socket_path", &PyPoolServer::socket_path)
      .def_prop_ro("closed", &PyPoolServer::closed)
      .def("close", &PyPoolServer::close,
           "Disconnects every client and closes the store (writing blocks down per its "
           "durability contract). Raises when that failed.");
}

}  // namespace cascade::py
