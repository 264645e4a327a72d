#include <rdmax/sched/stripe_options.hpp>

namespace rdmax::sched {

stripe_options stripe_options::with_env() const {
    return config::apply_env(*this, stripe_knobs, "stripe_options::with_env");
}

} // namespace rdmax::sched
