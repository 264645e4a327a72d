#include <rdmax/mem/arena_options.hpp>

namespace rdmax {

arena_options arena_options::with_env() const {
    return config::apply_env(*this, arena_knobs, "arena_options::with_env");
}

} // namespace rdmax
