#pragma once
// registration_cache<Registrar, Monitor>::held<Buffer>: a buffer and the
// cache reference that keeps its key valid, what local() and remote() hand
// out for a raw pointer range.
#include <rdmax/mem/cache_handle.hpp>
#include <rdmax/mem/registration_cache.hpp>

namespace rdmax {

/// A buffer together with the cache reference that keeps its key valid:
/// what the data path takes when the user hands it a raw pointer range.
/// Keep it until the work request that uses `buffer` has completed.
template <registrar Registrar, monitor Monitor>
template <class Buffer>
struct registration_cache<Registrar, Monitor>::held {
    handle registration;
    Buffer buffer;
};

} // namespace rdmax
