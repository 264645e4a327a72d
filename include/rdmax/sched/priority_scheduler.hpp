#pragma once
// priority_scheduler<Policy>: the priority scheduler over one RC queue pair,
// what an application uses. The rules it follows (slicing, the budget, order
// within and across levels, fences, one completion per request) are those of
// basic_priority_scheduler.hpp; queue_pair_port.hpp is how it posts and polls.

#include <utility>

#include <rdmax/sched/basic_priority_scheduler.hpp>
#include <rdmax/sched/queue_pair_port.hpp>
#include <rdmax/sched/scheduler_options.hpp>
#include <rdmax/sched/scheduling_policy.hpp>
#include <rdmax/sched/strict_priority.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax::sched {

/// The scheduler over one RC queue pair.
template <SchedulingPolicy Policy = strict_priority>
class priority_scheduler : public basic_priority_scheduler<Policy, queue_pair_port> {
public:
    explicit priority_scheduler(verbs::queue_pair<verbs::rc>& qp,
                                scheduler_options opts = scheduler_options{}.with_env(),
                                Policy policy = Policy())
        : basic_priority_scheduler<Policy, queue_pair_port>(opts, std::move(policy), qp) {}
};

} // namespace rdmax::sched
