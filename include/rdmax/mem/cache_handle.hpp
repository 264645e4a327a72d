#pragma once
// registration_cache<Registrar, Monitor>::handle: a reference to a cached
// registration. Holding it keeps the registration (and its keys) alive; its
// last release after the entry left the cache deregisters it. A handle a
// session gave counts in the session's slot instead of the entry's word.
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <utility>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/buffer.hpp>
#include <rdmax/mem/registration_cache.hpp>
#include <rdmax/mem/rights.hpp>

namespace rdmax {

/// A reference to a cached registration that covers what get() asked for.
template <registrar Registrar, monitor Monitor>
class registration_cache<Registrar, Monitor>::handle {
public:
    handle() noexcept = default;
    handle(handle&& o) noexcept
        : cache_(std::exchange(o.cache_, nullptr))
        , e_(std::exchange(o.e_, nullptr))
        , users_(std::exchange(o.users_, nullptr)) {}
    handle& operator=(handle&& o) noexcept {
        if (this != &o) {
            reset();
            cache_ = std::exchange(o.cache_, nullptr);
            e_ = std::exchange(o.e_, nullptr);
            users_ = std::exchange(o.users_, nullptr);
        }
        return *this;
    }
    handle(const handle&) = delete;
    handle& operator=(const handle&) = delete;
    ~handle() { reset(); }

    [[nodiscard]] explicit operator bool() const noexcept { return e_ != nullptr; }
    /// The registration's page-aligned range and rights (it may be larger
    /// than what was asked for, after merging).
    [[nodiscard]] std::uintptr_t start() const noexcept { return e_->start; }
    [[nodiscard]] std::uintptr_t end() const noexcept { return e_->end; }
    [[nodiscard]] rights granted() const noexcept { return e_->granted; }
    [[nodiscard]] std::uint32_t lkey() const noexcept { return e_->keys.lkey; }
    [[nodiscard]] std::uint32_t rkey() const noexcept { return e_->keys.rkey; }
    /// The registrar's handle of the registration (ibv_mr* for verbs): what
    /// a memory window over part of it is bound to.
    [[nodiscard]] typename Registrar::handle registration() const noexcept { return e_->reg; }

    /// [addr, addr + len) as a local buffer with rights A; throws if the
    /// registration does not cover it with those rights.
    template <rights A>
    [[nodiscard]] local_buffer<A> local(const void* addr, std::size_t len) const {
        check<A>(addr, len, "local");
        return {static_cast<std::byte*>(const_cast<void*>(addr)), static_cast<std::uint32_t>(len),
                e_->keys.lkey};
    }
    /// The token a peer needs to address [addr, addr + len).
    template <rights A>
    [[nodiscard]] remote_buffer<A> remote(const void* addr, std::size_t len) const {
        check<A>(addr, len, "remote");
        return {reinterpret_cast<std::uintptr_t>(addr), len, e_->keys.rkey, 0};
    }

    /// Drops the reference (the destructor does it too).
    void reset() noexcept {
        if (users_ != nullptr) // a session's: its slot holds the reference
            --*users_;
        else if (e_ != nullptr)
            cache_->release(e_);
        e_ = nullptr;
        cache_ = nullptr;
        users_ = nullptr;
    }

private:
    friend class registration_cache;
    handle(registration_cache* c, entry* e, std::uint32_t* users = nullptr) noexcept
        : cache_(c)
        , e_(e)
        , users_(users) {}
    template <rights A>
    void check(const void* addr, std::size_t len, const char* what) const {
        const auto a = reinterpret_cast<std::uintptr_t>(addr);
        // a > end first: end - a would wrap and accept anything past the end.
        if (e_ == nullptr || a < e_->start || a > e_->end || len > e_->end - a ||
            !has(e_->granted, A) || len > UINT32_MAX)
            throw_error("registration_cache::handle", ERANGE,
                        fmt::format("{}({}, {}) is not inside the registration", what, addr, len));
    }
    registration_cache* cache_ = nullptr;
    entry* e_ = nullptr;
    std::uint32_t* users_ = nullptr; ///< set for a session's handle
};

// The cache's local() and remote() pair a handle with its buffer: defined
// here, where handle is complete (clang wants a by-value parameter's type
// complete where the function is defined, whichever header came first).
template <registrar Registrar, monitor Monitor>
template <rights A>
auto registration_cache<Registrar, Monitor>::hold_local(handle h, const void* addr, std::size_t len)
    -> held<local_buffer<A>> {
    auto b = h.template local<A>(addr, len);
    return {std::move(h), b};
}

template <registrar Registrar, monitor Monitor>
template <rights A>
auto registration_cache<Registrar, Monitor>::hold_remote(handle h, const void* addr,
                                                         std::size_t len)
    -> held<remote_buffer<A>> {
    auto b = h.template remote<A>(addr, len);
    return {std::move(h), b};
}

} // namespace rdmax
