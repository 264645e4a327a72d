#pragma once
// rdmax::rpc::detail::call_handler: the completion handler of one
// async_client call, type-erased without an allocation: stored in a fixed
// buffer of its own (an awaitable's handler, a small callback), or in
// memory from the handler's associated allocator when it is larger. Part of
// the Asio adapter (include/rdmax/asio/client.hpp); needs standalone Asio.

#include <cstddef>
#include <memory>
#include <new>
#include <system_error>
#include <type_traits>
#include <utility>

// Asio's own code, inlined here, trips GCC's -Wnull-dereference (its thread call
// stack lookups): not this project's to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/any_io_executor.hpp>
#include <asio/associated_allocator.hpp>
#include <asio/associated_executor.hpp>
#include <asio/bind_allocator.hpp>
#include <asio/dispatch.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#pragma GCC diagnostic pop

#include <rdmax/rpc/client.hpp>

namespace rdmax::rpc {

/// What an async call completes with: the result, and its status as an
/// error code (make_error_code(result.status); empty for ok). Coroutines
/// see errors as exceptions unless they ask for a tuple
/// (asio::experimental::as_tuple) or redirect_error.
using call_signature = void(std::error_code, call_result);

/// The error code of a call's result (empty for ok).
[[nodiscard]] inline std::error_code error_of(const call_result& r) noexcept {
    return r.status == call_status::ok ? std::error_code{} : make_error_code(r.status);
}

namespace detail {

/// True when `ex` is the io_context executor `io` itself (plain, or inside
/// an any_io_executor, as a coroutine's is).
template <class Executor>
[[nodiscard]] bool is_context(const Executor& ex,
                              const ::asio::io_context::executor_type& io) noexcept {
    using io_executor = ::asio::io_context::executor_type;
    if constexpr (std::is_same_v<Executor, io_executor>) {
        return ex == io;
    } else if constexpr (std::is_same_v<Executor, ::asio::any_io_executor>) {
        const auto* target = ex.template target<io_executor>();
        return target != nullptr && *target == io;
    } else {
        return false;
    }
}

/// Runs `h(ec, r)` through h's associated executor (dispatch: at once when
/// that is the running io_context's; else queued, with h's allocator).
/// error_of(r) is found by argument-dependent lookup (the result's namespace).
template <class Handler, class Result>
void run_handler(Handler h, const Result& r, const ::asio::io_context::executor_type& io) {
    const auto ex = ::asio::get_associated_executor(h, io);
    if (is_context(ex, io) && io.running_in_this_thread()) {
        // What dispatch would do here, without its type-erased executor on
        // the way (a coroutine's handler names an any_io_executor).
        std::move(h)(error_of(r), r);
        return;
    }
    const auto alloc = ::asio::get_associated_allocator(h);
    ::asio::dispatch(ex, ::asio::bind_allocator(alloc, [h = std::move(h), r]() mutable {
                         std::move(h)(error_of(r), r);
                     }));
}

/// As run_handler, but never at once, and with an error of the caller's
/// choosing: error_of(r) for an operation that did not start (its handler
/// runs after the initiating function returned), or a refusal that is not
/// the result's own status.
template <class Handler, class Result>
void post_handler(Handler h, std::error_code ec, const Result& r,
                  const ::asio::io_context::executor_type& io) {
    const auto ex = ::asio::get_associated_executor(h, io);
    const auto alloc = ::asio::get_associated_allocator(h);
    ::asio::post(ex, ::asio::bind_allocator(
                         alloc, [h = std::move(h), ec, r]() mutable { std::move(h)(ec, r); }));
}

/// One operation's handler, erased: called with (error_of(r), r) for a
/// Result r. Empty, or holding one handler.
template <class Result>
class op_handler {
public:
    /// Enough for an awaitable's handler, a deferred one's, and callbacks
    /// that capture a few pointers.
    static constexpr std::size_t inline_bytes = 128;
    using io_executor = ::asio::io_context::executor_type;

    op_handler() = default;
    op_handler(const op_handler&) = delete;
    op_handler& operator=(const op_handler&) = delete;
    ~op_handler() { reset(); }

    template <class H>
    void emplace(H&& h) {
        using T = std::decay_t<H>;
        if constexpr (sizeof(T) <= inline_bytes && alignof(T) <= alignof(std::max_align_t)) {
            obj_ = ::new (static_cast<void*>(buf_)) T(std::forward<H>(h));
        } else {
            auto alloc = rebound<T>(h);
            T* p = std::allocator_traits<decltype(alloc)>::allocate(alloc, 1);
            try {
                ::new (static_cast<void*>(p)) T(std::forward<H>(h));
            } catch (...) {
                std::allocator_traits<decltype(alloc)>::deallocate(alloc, p, 1);
                throw;
            }
            obj_ = p;
        }
        ops_ = &ops_of<T>;
    }
    [[nodiscard]] bool empty() const noexcept { return ops_ == nullptr; }
    /// Takes the handler out (this is empty after) and runs it with `r`
    /// (`posted`: never at once, as post_handler).
    void complete(const Result& r, const io_executor& io, bool posted = false) {
        if (posted) {
            complete_with(error_of(r), r, io);
            return;
        }
        const ops* o = std::exchange(ops_, nullptr);
        o->complete(std::exchange(obj_, nullptr), r, io, buf_);
    }
    /// Takes the handler out and runs it with (ec, r), posted: an operation
    /// refused before it started, whose error is not r's own.
    void complete_with(std::error_code ec, const Result& r, const io_executor& io) {
        const ops* o = std::exchange(ops_, nullptr);
        o->complete_with(std::exchange(obj_, nullptr), ec, r, io, buf_);
    }
    /// Destroys the handler without running it.
    void reset() noexcept {
        if (const ops* o = std::exchange(ops_, nullptr))
            o->destroy(std::exchange(obj_, nullptr), buf_);
    }

private:
    struct ops {
        void (*complete)(void* obj, const Result& r, const io_executor& io, std::byte* buf);
        void (*complete_with)(void* obj, std::error_code ec, const Result& r, const io_executor& io,
                              std::byte* buf);
        void (*destroy)(void* obj, std::byte* buf) noexcept;
    };
    template <class T>
    static auto rebound(const T& h) {
        using A = typename std::allocator_traits<
            ::asio::associated_allocator_t<T>>::template rebind_alloc<T>;
        return A(::asio::get_associated_allocator(h));
    }
    /// Destroys the handler at `obj` and frees its memory, if not `buf`.
    template <class T>
    static void free(T* obj, std::byte* buf) noexcept {
        if (static_cast<void*>(obj) == static_cast<void*>(buf)) {
            obj->~T();
            return;
        }
        auto alloc = rebound<T>(*obj);
        obj->~T();
        std::allocator_traits<decltype(alloc)>::deallocate(alloc, obj, 1);
    }
    template <class T>
    static constexpr ops ops_of{
        [](void* obj, const Result& r, const io_executor& io, std::byte* buf) {
            T* p = static_cast<T*>(obj);
            T h(std::move(*p));
            free(p, buf); // its storage is free before it runs: it may start another call
            run_handler(std::move(h), r, io);
        },
        [](void* obj, std::error_code ec, const Result& r, const io_executor& io, std::byte* buf) {
            T* p = static_cast<T*>(obj);
            T h(std::move(*p));
            free(p, buf);
            post_handler(std::move(h), ec, r, io);
        },
        [](void* obj, std::byte* buf) noexcept { free(static_cast<T*>(obj), buf); },
    };

    alignas(std::max_align_t) std::byte buf_[inline_bytes];
    void* obj_ = nullptr;
    const ops* ops_ = nullptr;
};

/// One call's handler (rpc::async_client).
using call_handler = op_handler<call_result>;

} // namespace detail
} // namespace rdmax::rpc
