// Hands a C++ store to Python as a cascade.CascadeStore (for stores opened
// elsewhere than CascadeStore(config), e.g. distributed ones), and back.
#pragma once

#include <memory>

#include "cascade/store.h"
#include "common.h"
#include "guarded.h"

namespace cascade::py {

// REQUIRES: the GIL is held.
nb::object wrap_store(std::unique_ptr<CascadeStore> store);

// The C++ store behind a cascade.CascadeStore, for one call (close() waits
// until the Use is dropped). TypeError for another object, UnavailableError
// when it is closed. REQUIRES: the GIL is held.
Guarded<CascadeStore>::Use use_store(nb::handle obj);

// The store's statistics as the dict CascadeStore.stats() returns.
nb::dict store_stats_dict(const StoreStats& s);

}  // namespace cascade::py
