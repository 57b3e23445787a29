#include "transport/transport.h"

#include "transport/backends.h"

namespace cascade {

bool Transport::available(TransportBackend backend) {
  switch (backend) {
    case TransportBackend::kUcx: return ucx_transport_available();
    case TransportBackend::kMpi: return mpi_transport_available();
  }
  return false;
}

Result<std::unique_ptr<Transport>> Transport::Open(const TransportOptions& options) {
  switch (options.backend) {
    case TransportBackend::kUcx: return open_ucx_transport(options);
    case TransportBackend::kMpi: return open_mpi_transport(options);
  }
  return Status::InvalidArgument("transport: unknown backend " +
                                 std::to_string(static_cast<int>(options.backend)));
}

}  // namespace cascade
