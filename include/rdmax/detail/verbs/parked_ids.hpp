#pragma once
// Ids kept past their connection while their soft-RoCE port is down.
//
// Tearing down a connected rdma_cm id makes the kernel's CM send a DREQ (or a
// REJ) through the port's QP1. On soft-RoCE (rxe; Linux 6.1 to 7.3 at least)
// a send that finds no route, because the netdev is down or its address is
// gone, moves QP1 to the error state, and the MAD layer never brings it back:
// every later rdma_cm handshake through that port fails (REQs go out, the
// answers are dropped) until the device is made again, for every program on
// the host. So verbs::connection destroys the QP of such an id at once and
// parks the id, which is destroyed once its port can carry MADs again. A NIC
// sends MADs through its own port, not the kernel's routing, and is not
// affected: only soft-RoCE ids are parked.

#include <cstddef>

#include <rdma/rdma_cma.h>

namespace rdmax::verbs::detail {

/// False when `id` is on a soft-RoCE port that cannot carry a MAD now: the
/// port is not ACTIVE, or the id's source GID is no longer in its table (its
/// address was removed). True otherwise, and for ids bound to no device. An
/// ibv_query_port (and a GID-table read), for soft-RoCE ids only.
[[nodiscard]] bool may_send_mads(const rdma_cm_id* id) noexcept;

/// Keeps `id` (its QP already destroyed; its event channel, which may be
/// null, goes with it) until may_send_mads(id), instead of destroying it now.
/// Past max_parked ids, the id is destroyed at once, as before.
void park(rdma_cm_id* id, rdma_event_channel* channel) noexcept;

/// Destroys `id` (its QP already destroyed) and its event channel (may be
/// null, and must not block): the events pending on it are acknowledged
/// first, as rdma_destroy_id waits for that. Every teardown of an id goes
/// through here, parked or not.
void destroy_id(rdma_cm_id* id, rdma_event_channel* channel) noexcept;

/// Destroys the parked ids that may send MADs again. Called before a new
/// connection is made or accepted and after one is torn down; a lock and an
/// empty check when none is parked.
void sweep_parked() noexcept;

/// How many ids are parked now (tests, diagnostics).
[[nodiscard]] std::size_t parked_ids() noexcept;

/// At most this many ids are parked at once (each holds a kernel cm_id and
/// an event channel's fd).
inline constexpr std::size_t max_parked = 1024;

} // namespace rdmax::verbs::detail
