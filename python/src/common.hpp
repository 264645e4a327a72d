#pragma once
// What the parts of rdmax._rdmax share: the exception types, buffers taken
// from Python objects without a copy, and the guard that keeps an rdmax
// object (single-threaded by design) to one thread at a time.

#include <atomic>
#include <cstddef>
#include <mutex>
#include <optional>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include <rdmax/rpc/call_status.hpp>

namespace rdmax::python {

namespace py = pybind11;

/// rdmax.Error (every rdmax::error, with .verb) and rdmax.RpcError (a call
/// that did not end ok, with .status). Set once, at import.
struct exception_types {
    py::handle error;
    py::handle rpc_error;
};
exception_types& exceptions() noexcept;

/// The call_status's name as the enum spells it ("timed_out").
[[nodiscard]] std::string_view status_name(rpc::call_status s) noexcept;
/// An rdmax.RpcError instance for `s` (the Python error indicator untouched).
[[nodiscard]] py::object make_rpc_error(rpc::call_status s, std::string_view what);
/// Raises rdmax.RpcError for `s`.
[[noreturn]] void raise_rpc_error(rpc::call_status s, std::string_view what);

/// A Python object's bytes, taken through the buffer protocol (no copy),
/// C-contiguous (else TypeError), writable when asked. Release needs the GIL:
/// make and destroy it with the GIL held (its bytes may be used without).
class buffer_view {
public:
    buffer_view(py::handle obj, bool writable);
    buffer_view(const buffer_view&) = delete;
    buffer_view& operator=(const buffer_view&) = delete;
    buffer_view(buffer_view&& o) noexcept
        : view_(o.view_)
        , held_(o.held_) {
        o.held_ = false;
    }
    buffer_view& operator=(buffer_view&&) = delete;
    ~buffer_view() {
        if (held_)
            PyBuffer_Release(&view_);
    }
    [[nodiscard]] std::span<const std::byte> bytes() const noexcept {
        return {static_cast<const std::byte*>(view_.buf), static_cast<std::size_t>(view_.len)};
    }
    [[nodiscard]] std::span<std::byte> writable() const noexcept {
        return {static_cast<std::byte*>(view_.buf), static_cast<std::size_t>(view_.len)};
    }
    [[nodiscard]] py::handle object() const noexcept { return view_.obj; }

private:
    Py_buffer view_{};
    bool held_ = false;
};

/// A memoryview of the first n bytes of `b`'s object (format "B"): no copy.
[[nodiscard]] py::object byte_view(const buffer_view& b, std::size_t n);

/// rdmax's client and server are single-threaded objects: every use of one
/// takes this lock, with the GIL released (so a thread that waits for it
/// never holds the GIL, and a handler that takes the GIL under it cannot
/// deadlock). The thread that holds it may not come back in (a handler
/// calling its own server): that raises RuntimeError instead of deadlocking.
class object_guard {
public:
    class held {
    public:
        explicit held(object_guard& g)
            : g_(&g) {}
        held(const held&) = delete;
        held& operator=(const held&) = delete;
        ~held() {
            g_->owner_.store(std::thread::id{}, std::memory_order_relaxed);
            g_->mu_.unlock();
        }

    private:
        object_guard* g_;
    };
    /// Call with the GIL released. Throws std::runtime_error on re-entry.
    [[nodiscard]] held lock(const char* what);
    /// True when this thread holds it (inside a handler of this object).
    [[nodiscard]] bool mine() const noexcept {
        return owner_.load(std::memory_order_relaxed) == std::this_thread::get_id();
    }

private:
    std::mutex mu_;
    std::atomic<std::thread::id> owner_{};
};

/// Seconds (a Python float; None: 0) as a duration, refusing negatives.
template <class Duration>
[[nodiscard]] Duration seconds_to(const std::optional<double>& s, const char* what) {
    if (!s)
        return Duration{0};
    if (!(*s >= 0) || *s > 1e9)
        throw py::value_error(std::string(what) + ": a number of seconds >= 0 expected");
    return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(*s));
}

void bind_rpc(py::module_& m);
void bind_devices(py::module_& m);

} // namespace rdmax::python
