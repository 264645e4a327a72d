// rpc::server as a server_group's worker: the connections its group's
// acceptor hands over, taken at housekeeping when the mailbox's eventfd
// fired (the call path never looks at the mailbox, nor takes its lock).

#include <rdmax/detail/rpc/handoff.hpp>
#include <rdmax/rpc/server.hpp>

namespace rdmax::rpc {

void server::take_handoffs() noexcept {
    detail::handoff& box = group_->box(worker_);
    std::vector<detail::handoff_item> items = box.take();
    for (detail::handoff_item& item : items) {
        if (item.device) {
            try {
                accept_one(std::move(*item.device));
            } catch (...) {
                refuse_current("rdma_cm connection request"); // rejected as it goes
            }
        } else if (item.hello.empty()) {
            start_handshake(std::move(item.local), item.tcp);
        } else {
            try {
                if (item.tcp)
                    accept_tcp(std::move(item.local), item.hello);
                else
                    accept_local(std::move(item.local), item.hello);
            } catch (...) {
                // The channel closes as it goes.
                refuse_current(item.tcp ? "tcp handshake" : "node-local handshake");
            }
        }
    }
    // Published before the items stop counting as pending: the acceptor
    // never sees this worker lighter than it is.
    publish_load();
    box.pending.fetch_sub(items.size(), std::memory_order_release);
    if (box.snapshot_wanted.exchange(false, std::memory_order_acq_rel))
        box.publish(ep_.counters);
}

bool server::forward_local(local::unix_channel& ch, std::span<const std::byte> hello,
                           std::uint64_t client, bool tcp) {
    const std::optional<std::size_t> owner = group_->owner(client);
    if (!owner || *owner == worker_)
        return false;
    // A reconnection: the worker that has its replies takes it, hello read.
    detail::handoff_item item;
    item.local = std::move(ch);
    item.hello.assign(hello.begin(), hello.end());
    item.tcp = tcp;
    group_->box(*owner).post(std::move(item));
    return true;
}

void server::publish_load() noexcept {
    group_->box(worker_).load.store(live_ + handshakes_.size(), std::memory_order_release);
}

} // namespace rdmax::rpc
