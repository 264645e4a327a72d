#pragma once
// dmabuf_range: a call's request body or reply in accelerator memory (a
// range of a dma-buf its dmabuf_cache knows), named in call_options. The
// server READs such a body from it and WRITEs such a reply into it through
// the device: the caller's CPU never touches those bytes, so the memory may
// be a GPU's that no CPU can map. Only an RDMA connection can; a node-local
// (CMA) or TCP one refuses the call (call_status::dmabuf_unreachable) before
// anything is registered or sent. docs/dmabuf.md has the why of each rule.
//
//     rdmax::dmabuf_cache dev(pd);                  // the client's pd
//     auto buf = dev.add(fd);                       // a udmabuf, a GPU's export
//     auto r = cli.call(p, m, {}, {.body_dmabuf = {&dev, buf, 0, n},
//                                  .reply_dmabuf = {&dev, buf, n, n}});
//     // r.reply is empty; r.dmabuf_reply_bytes of the reply are at buf + n

#include <cstdint>

#include <rdmax/mem/dmabuf_cache.hpp>

namespace rdmax::rpc {

struct dmabuf_range {
    /// Knows the buffer, whose range is registered on its own for the call
    /// (exactly its bytes, deregistered when the call ends: no key outlives
    /// it). In the client's protection domain; it and the buffer outlive the
    /// call's result (a call waiting for a reconnect registers when it goes).
    dmabuf_cache* cache = nullptr;
    dmabuf_cache::buffer buffer{};
    std::uint64_t offset = 0;
    std::uint32_t length = 0; ///< 0: no range

    [[nodiscard]] bool empty() const noexcept { return length == 0; }
};

} // namespace rdmax::rpc
