#include <cerrno>
#include <utility>

#include <rdmax/error.hpp>
#include <rdmax/verbs/protection_domain.hpp>

namespace rdmax::verbs {

protection_domain::protection_domain(const context& ctx)
    : ctx_(&ctx)
    , pd_(ibv_alloc_pd(ctx.get())) {
    if (pd_ == nullptr)
        throw_error("ibv_alloc_pd", errno, ctx.name());
}

protection_domain::protection_domain(protection_domain&& other) noexcept
    : ctx_(other.ctx_)
    , pd_(std::exchange(other.pd_, nullptr)) {}

protection_domain& protection_domain::operator=(protection_domain&& other) noexcept {
    if (this != &other) {
        if (pd_ != nullptr)
            ibv_dealloc_pd(pd_);
        ctx_ = other.ctx_;
        pd_ = std::exchange(other.pd_, nullptr);
    }
    return *this;
}

protection_domain::~protection_domain() {
    if (pd_ != nullptr)
        ibv_dealloc_pd(pd_); // EBUSY if a child outlived it; nothing a destructor can do
}

} // namespace rdmax::verbs
