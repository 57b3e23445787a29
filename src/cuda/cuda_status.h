// The one place CUDA error codes become Status values.
//
// cuda_status() maps a runtime error (cudaError_t), cu_status() a driver
// error (CUresult, for the virtual-memory calls). Out-of-memory errors become
// NoSpace (a tier then evicts or reports full), a missing or unusable device
// Unavailable, bad arguments InvalidArgument, everything else IOError. The
// message reads "what: <CUDA's error name and text>".
//
// cuda_status() of a failure also takes it off the runtime's per-thread
// error state when it is the error pending there: the runtime is shared
// with the caller's own CUDA code (torch and others check that state after
// their kernel launches), and an error this library reported, or handled
// by a fallback, must not surface there. A different pending error is the
// caller's and stays; so does a sticky error (a fault that ruins the
// context), as it must.
//
// Private: included only by files compiled with CUDA.
// Thread-safety: thread-safe (the error state is per thread).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string_view>

#include "cascade/status.h"

namespace cascade {

Status cuda_status(cudaError_t err, std::string_view what);
Status cu_status(CUresult err, std::string_view what);

}  // namespace cascade

// Returns the mapped Status from the enclosing function when a runtime call fails.
#define CASCADE_CUDA_RETURN(call, what)                             \
  do {                                                              \
    cudaError_t _e = (call);                                        \
    if (_e != cudaSuccess) return ::cascade::cuda_status(_e, what); \
  } while (0)
