#pragma once
// Protection domain: the scope of memory registrations and queue pairs.

#include <infiniband/verbs.h>

#include <rdmax/verbs/context.hpp>

namespace rdmax::verbs {

/// Move-only owner of an ibv_pd. It must outlive what is created in it.
class protection_domain {
public:
    explicit protection_domain(const context& ctx);
    protection_domain(protection_domain&& other) noexcept;
    protection_domain& operator=(protection_domain&& other) noexcept;
    protection_domain(const protection_domain&) = delete;
    protection_domain& operator=(const protection_domain&) = delete;
    ~protection_domain();

    [[nodiscard]] ibv_pd* get() const noexcept { return pd_; }
    [[nodiscard]] const context& device() const noexcept { return *ctx_; }

private:
    const context* ctx_;
    ibv_pd* pd_;
};

} // namespace rdmax::verbs
