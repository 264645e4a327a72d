#include <rdmax/sched/scheduler_options.hpp>

namespace rdmax::sched {

scheduler_options scheduler_options::with_env() const {
    return config::apply_env(*this, scheduler_knobs, "scheduler_options::with_env");
}

} // namespace rdmax::sched
