#pragma once
// What a call asks (call_options) and what it gets back (call_result):
// rpc::client's start(), call() and poll() take and give them.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>

#include <rdmax/rpc/call_status.hpp>
#include <rdmax/rpc/dmabuf_range.hpp>
#include <rdmax/rpc/peer_id.hpp>
#include <rdmax/sched/priority.hpp>

namespace rdmax::rpc {

struct call_options {
    sched::priority priority = sched::normal;
    /// 0: rpc_options::call_timeout.
    std::chrono::microseconds timeout{0};
    /// Where a reply larger than a slot may go (registered through the cache;
    /// keep it until the call ends). A reply that fits the slot stays there.
    std::span<std::byte> reply_into = {};
    /// The caller's name for the call, handed back in its result.
    std::uint64_t cookie = 0;
    /// Running it twice does no harm: re-sent after a reconnect even to a
    /// server that restarted, and the server keeps no reply of it.
    bool idempotent = false;
    /// While the connection is being made again, start() refuses the call
    /// (peer_gone) instead of holding it until the connection is back.
    bool fail_fast = false;
    /// The request's body in accelerator memory (the request span is then
    /// empty): the server READs it from there, at any size. RDMA only.
    dmabuf_range body_dmabuf = {};
    /// Where every reply body goes, at any size (never into the reply slot:
    /// the CPU never copies it); call_result::dmabuf_reply_bytes says how
    /// much came. Instead of reply_into. RDMA only.
    dmabuf_range reply_dmabuf = {};
};

struct call_result {
    std::uint64_t cookie = 0;
    peer_id peer;
    call_status status = call_status::ok;
    /// The reply's body: in the reply slot or in reply_into. Valid until the
    /// next poll(), call() or release() (the slot then goes back to the server).
    std::span<const std::byte> reply;
    /// A call with reply_dmabuf: how many bytes of its reply the server wrote
    /// there (reply is then empty).
    std::uint32_t dmabuf_reply_bytes = 0;
};

} // namespace rdmax::rpc
