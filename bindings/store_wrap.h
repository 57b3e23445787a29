// Hands a C++ store to Python as a cascade.CascadeStore (for stores opened
// elsewhere than CascadeStore(config), e.g. distributed ones).
#pragma once

#include <memory>

#include "cascade/store.h"
#include "common.h"

namespace cascade::py {

// REQUIRES: the GIL is held.
nb::object wrap_store(std::unique_ptr<CascadeStore> store);

}  // namespace cascade::py
