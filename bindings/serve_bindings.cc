// cascade._core.PoolServer: the node pool server (`cascade serve`).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.h"
#include "guarded.h"
#include "serve/pool_server.h"
#include "store_wrap.h"

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
      nb::gil_scoped_release release;
      server = PoolServer::Start(config, o);
    }
    check(server.status());
    server_.open(std::move(server.value()));
  }

  nb::dict stats() {
    auto use = server_.use();
    PoolServer::Stats s;
    {
      nb::gil_scoped_release release;
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
      nb::gil_scoped_release release;
      cs = use->clients();
    }
    nb::list out;
    for (const auto& c : cs) {
      nb::dict d;
      d["id"] = c.id;
      d["pid"] = c.pid;
      d["uid"] = c.uid;
      d["namespace"] = c.name_space;
      d["channels"] = c.channels;
      d["leases"] = c.leases;
      d["reservations"] = c.reservations;
      d["requests"] = c.requests;
      out.append(d);
    }
    return out;
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
  nb::class_<PyPoolServer>(m, "PoolServer",
                           "The node pool server: one store shared by the node's processes "
                           "(docs/node-pool.md). Clients connect with pool_socket set.")
      .def(nb::init<const CascadeConfig&, const std::string&, uint32_t, int64_t, int, bool, int>(),
           "config"_a, "socket_path"_a, "socket_mode"_a = 0600, "allowed_gid"_a = -1,
           "max_clients"_a = 256, "share_across_users"_a = false, "workers"_a = 0)
      .def("stats", &PyPoolServer::stats, "Counters of the server and its store.")
      .def("clients", &PyPoolServer::clients, "The connected clients.")
      .def_prop_ro("socket_path", &PyPoolServer::socket_path)
      .def_prop_ro("closed", &PyPoolServer::closed)
      .def("close", &PyPoolServer::close,
           "Disconnects every client and closes the store (writing blocks down per its "
           "durability contract). Raises when that failed.");
}

}  // namespace cascade::py
