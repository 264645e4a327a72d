#pragma once
// rdmax::detail::fd_watch: waits on an asio::io_context for a descriptor it
// does not own (an endpoint's fd()) to become readable, one wait at a time,
// the wait's operation in memory of its own: nothing is allocated per wait.
// For the Asio adapters (include/rdmax/asio/); needs standalone Asio 1.22+.
//
// The reactor watches descriptors edge-triggered: a readiness that came
// while no wait was queued is not reported. The owner queues the wait first,
// then arms its source (rpc::client::arm()) and looks once more, as
// rpc::client::wait() does.
//
// The memory of a wait lives in the watch: its owner keeps the watch alive
// until the wait's handler ran (a handler that holds the owner, as Asio's
// own allocation example does).

#include <chrono>
#include <cstddef>
#include <new>
#include <string>
#include <system_error>
#include <utility>

// Asio's own code, inlined here, trips GCC's -Wnull-dereference (its thread call
// stack lookups): not this project's to fix.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <asio/associated_allocator.hpp>
#include <asio/io_context.hpp>
#include <asio/posix/stream_descriptor.hpp>
#pragma GCC diagnostic pop

#include <rdmax/error.hpp>

namespace rdmax::detail {

/// Memory for one Asio operation at a time (an operation that does not fit,
/// or a second at once, goes to operator new).
class handler_block {
public:
    static constexpr std::size_t size = 512;

    handler_block() = default;
    handler_block(const handler_block&) = delete;
    handler_block& operator=(const handler_block&) = delete;
    ~handler_block() = default;

    [[nodiscard]] void* allocate(std::size_t n) {
        if (!used_ && n <= size) {
            used_ = true;
            return bytes_;
        }
        return ::operator new(n);
    }
    void deallocate(void* p) noexcept {
        if (p == static_cast<void*>(bytes_))
            used_ = false;
        else
            ::operator delete(p);
    }

private:
    alignas(std::max_align_t) std::byte bytes_[size];
    bool used_ = false;
};

/// The allocator an operation's handler associates: its block's memory.
template <class T>
class block_allocator {
public:
    using value_type = T;
    explicit block_allocator(handler_block& b) noexcept
        : block_(&b) {}
    template <class U>
    block_allocator(const block_allocator<U>& o) noexcept // NOLINT(google-explicit-constructor)
        : block_(o.block()) {}
    [[nodiscard]] T* allocate(std::size_t n) {
        return static_cast<T*>(block_->allocate(n * sizeof(T)));
    }
    void deallocate(T* p, std::size_t) noexcept { block_->deallocate(p); }
    [[nodiscard]] handler_block* block() const noexcept { return block_; }
    template <class U>
    [[nodiscard]] bool operator==(const block_allocator<U>& o) const noexcept {
        return block_ == o.block();
    }

private:
    handler_block* block_;
};

/// Handler `f`, its operation's memory from `alloc`'s block.
template <class F>
struct in_block {
    using allocator_type = block_allocator<void>;
    [[nodiscard]] allocator_type get_allocator() const noexcept { return alloc; }
    template <class... A>
    void operator()(A&&... a) {
        f(std::forward<A>(a)...);
    }
    F f;
    allocator_type alloc;
};

/// Watches a descriptor it does not own for reads, on one io_context.
class fd_watch {
public:
    using executor_type = ::asio::io_context::executor_type;

    /// `fd` stays the caller's: never closed here. Throws rdmax::error (the
    /// reactor refused it).
    fd_watch(::asio::io_context& ctx, int fd)
        : d_(ctx.get_executor()) {
        std::error_code ec;
        d_.assign(fd, ec);
        if (ec)
            throw_error("asio::posix::stream_descriptor::assign", ec.value(),
                        "descriptor " + std::to_string(fd) + " into the io_context's reactor");
    }
    fd_watch(const fd_watch&) = delete;
    fd_watch& operator=(const fd_watch&) = delete;
    /// Gives the descriptor back to its owner (a wait still queued ends
    /// operation_aborted; keep the watch until it ran).
    ~fd_watch() { (void)d_.release(); }

    /// Calls f(std::error_code) once the descriptor is readable (or the wait
    /// was cancelled: operation_aborted). One wait at a time.
    template <class F>
    void async_wait(F&& f) {
        waiting_ = true;
        d_.async_wait(::asio::posix::descriptor_base::wait_read,
                      in_block<std::decay_t<F>>{std::forward<F>(f), block_allocator<void>(block_)});
    }
    /// The handler of the wait calls this first: the next wait may be queued.
    void done() noexcept { waiting_ = false; }
    [[nodiscard]] bool waiting() const noexcept { return waiting_; }
    void cancel() noexcept {
        std::error_code ignored;
        d_.cancel(ignored);
    }

private:
    ::asio::posix::basic_stream_descriptor<executor_type> d_;
    handler_block block_;
    bool waiting_ = false;
};

} // namespace rdmax::detail
