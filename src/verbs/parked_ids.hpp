#pragma once

#include <cstddef>

#include <rdma/rdma_cma.h>

namespace rdmax::verbs::detail {

/// True when the port that `id` is bound to is ACTIVE (or the id is bound to
/// none, so tearing it down sends nothing). One ibv_query_port: off the hot path.
[[nodiscard]] bool port_active(const rdma_cm_id* id) noexcept;

/// Keeps `id` (and its event channel, which may be null) until its port is
/// ACTIVE again, instead of destroying it now.
///
/// Why: tearing down a connected id makes the kernel's CM send a DREQ (or a
/// REJ) through the port's QP1. On soft-RoCE (Linux 6.1 to 7.3 at least) a
/// send that finds no route, because the netdev is down, moves QP1 to the
/// error state, and the MAD layer never brings it back: every later rdma_cm
/// handshake through that port fails (REQs go out, the answers are dropped)
/// until the device is re-created. A connection broken by a local link-down
/// is therefore parked here, its QP already destroyed, and its id destroyed
/// once the link is up again.
void park(rdma_cm_id* id, rdma_event_channel* channel) noexcept;

/// Destroys the parked ids whose port is ACTIVE again. Called before a new
/// connection is made and when one is torn down; cheap when none is parked.
void sweep_parked() noexcept;

/// How many ids are parked now (tests, diagnostics).
[[nodiscard]] std::size_t parked_ids() noexcept;

} // namespace rdmax::verbs::detail
