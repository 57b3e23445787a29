// The backends behind Transport::Open, one pair per library. Each is built
// from its own file when the library is found (transport_ucx.cc,
// transport_mpi.cc) and from a stub otherwise.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace cascade {

bool ucx_transport_available();
Result<std::unique_ptr<Transport>> open_ucx_transport(const TransportOptions& options);

bool mpi_transport_available();
Result<std::unique_ptr<Transport>> open_mpi_transport(const TransportOptions& options);

}  // namespace cascade
