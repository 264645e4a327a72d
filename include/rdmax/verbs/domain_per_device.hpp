#pragma once
// One protection domain per device, made on first use: what a listener on a
// wildcard address hands accept() to pick the domain of the device each
// request arrived on (listener::accept(domains, ...)), and where the server
// then finds that domain again to register memory in it.

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include <rdmax/verbs/context.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax::verbs {

class domain_per_device {
public:
    domain_per_device() = default;
    domain_per_device(domain_per_device&&) noexcept = default;
    domain_per_device& operator=(domain_per_device&&) noexcept = default;
    domain_per_device(const domain_per_device&) = delete;
    domain_per_device& operator=(const domain_per_device&) = delete;
    ~domain_per_device() = default;

    /// The protection domain of `device`'s device, made the first time that
    /// device is asked for. It is made on the context context::open(name)
    /// returns, librdmacm's where rdma_cm is available, which is the one
    /// rdma_cm connections on that device use, whichever handle of the device
    /// `device` is. The domain lives as long as this object, and does not
    /// move when other devices are added.
    const protection_domain& operator()(const context& device) {
        return entries_[index_of(device)]->pd;
    }
    /// The index of `device`'s domain here (0, 1, ... in the order the
    /// devices were first asked for), the domain made as operator() does.
    std::size_t index_of(const context& device) {
        for (std::size_t d = 0; d < entries_.size(); ++d)
            if (entries_[d]->ctx.name() == device.name())
                return d;
        entries_.push_back(std::make_unique<entry>(context::open(device.name())));
        return entries_.size() - 1;
    }
    /// The domain of index d (index_of); throws std::out_of_range past size().
    [[nodiscard]] const protection_domain& at(std::size_t d) const { return entries_.at(d)->pd; }

    /// How many devices have a domain here.
    [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }

private:
    struct entry {
        context ctx;
        protection_domain pd{ctx}; // keeps a pointer to ctx: an entry never moves
        explicit entry(context c)
            : ctx(std::move(c)) {}
    };
    std::vector<std::unique_ptr<entry>> entries_;
};

} // namespace rdmax::verbs
