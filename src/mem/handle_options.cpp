#include <rdmax/mem/handle_options.hpp>

namespace rdmax {

handle_options handle_options::with_env() const {
    return config::apply_env(*this, handle_knobs, "handle_options::with_env");
}

} // namespace rdmax
