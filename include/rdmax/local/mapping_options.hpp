#pragma once
// Options of mapping_cache (mapping_cache.hpp) and their knobs.

#include <cstddef>
#include <tuple>

#include <rdmax/config/knob.hpp>

namespace rdmax::local {

struct mapping_options {
    std::size_t max_count = 256;                  ///< mappings kept at most
    std::size_t max_bytes = std::size_t{1} << 30; ///< bytes mapped at most
    /// These options with the variables of mapping_knobs that are set applied;
    /// a malformed value throws rdmax::error naming the variable.
    [[nodiscard]] mapping_options with_env() const;
};

/// RDMAX_MAPCACHE_*: read by with_env() only.
inline constexpr std::tuple mapping_knobs{
    config::knob{"RDMAX_MAPCACHE_MAX_COUNT", &mapping_options::max_count, config::number{},
                 "a peer's mappings of exports kept at most"},
    config::knob{"RDMAX_MAPCACHE_MAX_BYTES", &mapping_options::max_bytes,
                 config::number{.bytes = true}, "bytes of a peer's mappings of exports at most"},
};

} // namespace rdmax::local
