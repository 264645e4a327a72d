#pragma once
// Everything rdmax offers, for programs that would rather not pick headers.

#include <rdmax/error.hpp>
#include <rdmax/mem/access.hpp>
#include <rdmax/mem/auto_monitor.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/fork_policy.hpp>
#include <rdmax/mem/memory_region.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/mem/registrar.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/mem/uffd_monitor.hpp>
#include <rdmax/mem/verbs_cache.hpp>
#include <rdmax/status.hpp>
#include <rdmax/verbs/completion.hpp>
#include <rdmax/verbs/completion_channel.hpp>
#include <rdmax/verbs/completion_queue.hpp>
#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/context.hpp>
#include <rdmax/verbs/device_limits.hpp>
#include <rdmax/verbs/gid.hpp>
#include <rdmax/verbs/listener.hpp>
#include <rdmax/verbs/port.hpp>
#include <rdmax/verbs/protection_domain.hpp>
#include <rdmax/verbs/queue_pair.hpp>
#include <rdmax/verbs/send_slots.hpp>
#include <rdmax/verbs/shared_receive_queue.hpp>
