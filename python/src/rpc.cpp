// rdmax._rdmax.Client and Server: rpc::client and rpc::server for Python.
//
// The GIL is released around every call into rdmax that may wait (connect,
// call, poll, wait) and around taking the object's lock; it is taken again
// only to run a Python handler or to build a result. Each object takes its
// object_guard for every use, so Python may share one between threads.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <rdmax/error.hpp>
#include <rdmax/rpc/client.hpp>
#include <rdmax/rpc/server.hpp>
#include <rdmax/verbs/context.hpp>
#include <rdmax/verbs/protection_domain.hpp>

#include "common.hpp"

namespace rdmax::python {

namespace {

using namespace std::chrono;

// ---- options ------------------------------------------------------------------------------

rpc::transport_set parse_transports(const py::handle& list) {
    rpc::transport_set set;
    for (const py::handle item : list) {
        const auto name = item.cast<std::string>();
        if (name == "rdma")
            set = set | rpc::transport::rdma;
        else if (name == "shm")
            set = set | rpc::transport::shm;
        else if (name == "tcp")
            set = set | rpc::transport::tcp;
        else
            throw py::value_error("transports: '" + name + "' is none of rdma, shm, tcp");
    }
    if (set.bits == 0)
        throw py::value_error("transports: the list is empty");
    return set;
}

template <class T>
T bounded(const py::handle& v, const char* key, std::uint64_t lo, std::uint64_t hi) {
    const auto n = v.cast<long long>();
    if (n < 0 || static_cast<std::uint64_t>(n) < lo || static_cast<std::uint64_t>(n) > hi)
        throw py::value_error(std::string(key) + ": " + std::to_string(n) + " is out of range " +
                              std::to_string(lo) + ".." + std::to_string(hi));
    return static_cast<T>(n);
}

template <class Duration>
Duration secs(const py::handle& v, const char* key) {
    return seconds_to<Duration>(v.cast<double>(), key);
}

/// rpc_options from the environment's (RDMAX_RPC_*), then the keywords given.
rpc::rpc_options make_options(const py::object& transports, const py::dict& kw) {
    rpc::rpc_options o = rpc::rpc_options{}.with_env();
    if (!transports.is_none())
        o.transports = parse_transports(transports);
    for (const auto& [k, v] : kw) {
        const auto key = k.cast<std::string>();
        if (key == "call_timeout")
            o.call_timeout = secs<milliseconds>(v, "call_timeout");
        else if (key == "connect_timeout")
            o.connect_timeout = secs<milliseconds>(v, "connect_timeout");
        else if (key == "slots")
            o.slots = bounded<std::uint16_t>(v, "slots", 1, 65535);
        else if (key == "slot_bytes")
            o.slot_bytes = bounded<std::uint32_t>(v, "slot_bytes", 1, UINT32_MAX);
        else if (key == "max_message")
            o.max_message = bounded<std::uint32_t>(v, "max_message", 1, UINT32_MAX);
        else if (key == "max_peers")
            o.max_peers = bounded<std::uint32_t>(v, "max_peers", 1, UINT32_MAX);
        else if (key == "housekeeping")
            o.housekeeping = secs<microseconds>(v, "housekeeping");
        else if (key == "keepalive")
            o.keepalive = secs<milliseconds>(v, "keepalive");
        else if (key == "keepalive_timeout")
            o.keepalive_timeout = secs<milliseconds>(v, "keepalive_timeout");
        else if (key == "reconnect")
            o.reconnect = v.cast<bool>();
        else if (key == "local")
            o.local = v.cast<bool>();
        else
            throw py::type_error("unknown rpc option '" + key +
                                 "' (call_timeout, connect_timeout, slots, slot_bytes, "
                                 "max_message, max_peers, housekeeping, keepalive, "
                                 "keepalive_timeout, reconnect, local)");
    }
    return o;
}

/// A device and its protection domain, when the endpoint was given one.
struct device_state {
    std::optional<verbs::context> ctx;
    std::optional<verbs::protection_domain> pd;
    explicit device_state(const std::optional<std::string>& name) {
        if (!name)
            return;
        ctx.emplace(verbs::context::open(*name));
        pd.emplace(*ctx);
    }
};

/// A call's timeout: None is the client's call_timeout; else over 0 (at
/// least 1 us: 0 would mean the default to rdmax).
microseconds call_deadline(const std::optional<double>& timeout) {
    if (timeout && !(*timeout > 0))
        throw py::value_error("timeout: a number of seconds > 0 expected (None: call_timeout)");
    return std::max(microseconds{timeout ? 1 : 0}, seconds_to<microseconds>(timeout, "timeout"));
}

std::uint16_t method_id(int method) {
    if (method < 1 || method > 65535)
        throw py::value_error("method: 1..65535 expected, not " + std::to_string(method));
    return static_cast<std::uint16_t>(method);
}

py::dict counters_dict(const rpc::rpc_counters& c) {
    py::dict d;
#define RDMAX_FIELD(f) d[#f] = c.f
    RDMAX_FIELD(calls);
    RDMAX_FIELD(completed);
    RDMAX_FIELD(failed);
    RDMAX_FIELD(timed_out);
    RDMAX_FIELD(cancelled);
    RDMAX_FIELD(late_replies);
    RDMAX_FIELD(no_credit);
    RDMAX_FIELD(external_bodies);
    RDMAX_FIELD(external_replies);
    RDMAX_FIELD(window_reallocs);
    RDMAX_FIELD(windows_unavailable);
    RDMAX_FIELD(fence_stalls);
    RDMAX_FIELD(cancelled_reads);
    RDMAX_FIELD(rail_joins);
    RDMAX_FIELD(striped_bodies);
    RDMAX_FIELD(rail_bytes);
    RDMAX_FIELD(keepalive_probes);
    RDMAX_FIELD(keepalive_timeouts);
    RDMAX_FIELD(reconnects);
    RDMAX_FIELD(reconnect_attempts);
    RDMAX_FIELD(retried_calls);
    RDMAX_FIELD(unknown_outcomes);
    RDMAX_FIELD(duplicates);
    RDMAX_FIELD(goaways);
    RDMAX_FIELD(bytes_in);
    RDMAX_FIELD(bytes_out);
    RDMAX_FIELD(unknown_method);
    RDMAX_FIELD(rejected_kind);
    RDMAX_FIELD(rejected_slot);
    RDMAX_FIELD(rejected_length);
    RDMAX_FIELD(rejected_malformed);
    RDMAX_FIELD(rejected_credit);
    RDMAX_FIELD(rejected_opcode);
    RDMAX_FIELD(stray_completions);
    RDMAX_FIELD(connected);
    RDMAX_FIELD(connected_local);
    RDMAX_FIELD(connected_tcp);
    RDMAX_FIELD(refused);
    RDMAX_FIELD(disconnected);
    RDMAX_FIELD(link_failures);
    RDMAX_FIELD(last_link_failure);
    RDMAX_FIELD(last_link_event);
    RDMAX_FIELD(last_link_event_status);
#undef RDMAX_FIELD
    d["rejected"] = c.rejected();
    d["last_refusal"] = py::make_tuple(c.last_refusal.error, std::string(c.last_refusal.what()));
    return d;
}

// ---- client -------------------------------------------------------------------------------

class py_client {
public:
    py_client(const py::object& transports, const std::optional<std::string>& device,
              const py::dict& kw)
        : dev_(device) {
        const rpc::rpc_options o = make_options(transports, kw);
        py::gil_scoped_release nogil;
        cli_ =
            dev_.pd ? std::make_unique<rpc::client>(*dev_.pd, o) : std::make_unique<rpc::client>(o);
    }
    py_client(const py_client&) = delete;
    py_client& operator=(const py_client&) = delete;
    /// The client first, then the buffers of its calls in flight (its peer
    /// may read or write them until the client is gone), as close() does.
    ~py_client() { cli_.reset(); }

    rpc::peer_id connect(const std::string& addr, int port) {
        if (port < 1 || port > 65535)
            throw py::value_error("port: 1..65535 expected");
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.connect");
        return live().connect(addr, static_cast<std::uint16_t>(port));
    }

    void disconnect(rpc::peer_id p) {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.disconnect");
        live().disconnect(p);
    }

    /// One call, waited for with the GIL released.
    py::object call(rpc::peer_id p, int method, const py::handle& body,
                    const std::optional<double>& timeout, bool idempotent,
                    const py::object& reply_into) {
        const std::uint16_t m = method_id(method);
        const buffer_view req(body, false);
        std::optional<buffer_view> into;
        if (!reply_into.is_none())
            into.emplace(reply_into, true);
        rpc::call_options o;
        o.timeout = call_deadline(timeout);
        o.idempotent = idempotent;
        if (into)
            o.reply_into = into->writable();
        py::object out;
        rpc::call_status st = rpc::call_status::ok;
        {
            py::gil_scoped_release nogil;
            const auto lk = guard_.lock("Client.call");
            const rpc::call_result r = live().call(p, m, req.bytes(), o);
            st = r.status;
            if (st == rpc::call_status::ok) {
                py::gil_scoped_acquire gil;
                out = reply_object(r.reply, into ? &*into : nullptr, st);
            }
            live().release();
        }
        if (st != rpc::call_status::ok)
            raise_rpc_error(st, "call of method " + std::to_string(m));
        return out;
    }

    /// Starts a call: its cookie, or None when every slot holds a call
    /// (no_credit: try again after a result came). Other refusals raise.
    py::object start(rpc::peer_id p, int method, const py::handle& body,
                     const std::optional<double>& timeout, bool idempotent,
                     const py::object& reply_into) {
        const std::uint16_t m = method_id(method);
        pending call{buffer_view(body, false), std::nullopt};
        if (!reply_into.is_none())
            call.into.emplace(reply_into, true);
        rpc::call_options o;
        o.timeout = call_deadline(timeout);
        o.idempotent = idempotent;
        if (call.into)
            o.reply_into = call.into->writable();
        rpc::call_status st = rpc::call_status::ok;
        {
            py::gil_scoped_release nogil;
            const auto lk = guard_.lock("Client.start");
            o.cookie = next_cookie_++;
            st = live().start(p, m, call.req.bytes(), o);
            // Under the lock, so that a poll in another thread finds it.
            if (st == rpc::call_status::ok)
                pending_.emplace(o.cookie, std::move(call));
        }
        if (st == rpc::call_status::no_credit)
            return py::none();
        if (st != rpc::call_status::ok)
            raise_rpc_error(st, "start of method " + std::to_string(m));
        return py::int_(o.cookie);
    }

    /// The calls that ended: (cookie, reply) pairs, the reply bytes (or a
    /// memoryview into reply_into), or an RpcError instance. Waits up to
    /// `timeout` seconds (0: does not wait) with the GIL released.
    py::list poll(std::size_t max, double timeout) {
        std::vector<rpc::call_result> got(
            std::max<std::size_t>(1, std::min<std::size_t>(max, 256)));
        const auto wait_for = seconds_to<microseconds>(timeout, "timeout");
        py::list out;
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.poll");
        const int n = wait_for.count() > 0 ? live().wait(got, wait_for) : live().poll(got);
        {
            py::gil_scoped_acquire gil;
            for (int i = 0; i < n; ++i) {
                const rpc::call_result& r = got[static_cast<std::size_t>(i)];
                auto it = pending_.find(r.cookie);
                const buffer_view* into = nullptr;
                if (it != pending_.end() && it->second.into)
                    into = &*it->second.into;
                rpc::call_status st = r.status;
                py::object value;
                if (st == rpc::call_status::ok)
                    value = reply_object(r.reply, into, st);
                if (st != rpc::call_status::ok)
                    value = make_rpc_error(st, "call " + std::to_string(r.cookie));
                out.append(py::make_tuple(r.cookie, value));
                if (it != pending_.end())
                    pending_.erase(it); // the buffers go back to Python
            }
        }
        live().release();
        return out;
    }

    bool cancel(rpc::peer_id p, std::uint64_t cookie) {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.cancel");
        return live().cancel(p, cookie);
    }
    bool arm() {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.arm");
        return live().arm();
    }
    void awake() {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.awake");
        live().awake();
    }
    int fd() {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.fd");
        return live().fd();
    }
    std::size_t in_flight() {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.in_flight");
        return live().in_flight();
    }
    py::object transport(rpc::peer_id p) {
        std::optional<rpc::transport> t;
        {
            py::gil_scoped_release nogil;
            const auto lk = guard_.lock("Client.transport");
            t = live().transport(p);
        }
        if (!t)
            return py::none();
        return py::str(std::string(rpc::to_string(*t)));
    }
    std::string state(rpc::peer_id p) {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.state");
        return std::string(rpc::to_string(live().state(p)));
    }
    py::dict counters() {
        rpc::rpc_counters c;
        {
            py::gil_scoped_release nogil;
            const auto lk = guard_.lock("Client.counters");
            c = live().counters();
        }
        return counters_dict(c);
    }
    double housekeeping() {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.housekeeping");
        return duration<double>(live().options().housekeeping).count();
    }
    double call_timeout() {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.call_timeout");
        return duration<double>(live().options().call_timeout).count();
    }
    void close() {
        std::unordered_map<std::uint64_t, pending> gone; // freed with the GIL, at the end
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Client.close");
        cli_.reset();
        gone.swap(pending_);
    }
    [[nodiscard]] bool closed() const noexcept { return cli_ == nullptr; }

private:
    struct pending {
        buffer_view req;
        std::optional<buffer_view> into;
    };

    rpc::client& live() {
        if (!cli_)
            throw std::runtime_error("the client is closed");
        return *cli_;
    }

    /// The reply as bytes (a copy), or as a memoryview of reply_into (the
    /// reply copied there when it came in the slot). Call with the GIL.
    static py::object reply_object(std::span<const std::byte> reply, const buffer_view* into,
                                   rpc::call_status& st) {
        if (into == nullptr)
            return py::bytes(reinterpret_cast<const char*>(reply.data()), reply.size());
        const std::span<std::byte> room = into->writable();
        if (reply.size() > room.size()) {
            st = rpc::call_status::reply_too_large;
            return py::none();
        }
        if (reply.data() != room.data() && !reply.empty())
            std::memcpy(room.data(), reply.data(), reply.size());
        return byte_view(*into, reply.size());
    }

    device_state dev_;
    std::unique_ptr<rpc::client> cli_;
    object_guard guard_;
    std::uint64_t next_cookie_ = 1;
    /// Calls started and not yet handed back: under the lock (erased with the GIL too).
    std::unordered_map<std::uint64_t, pending> pending_;
};

// ---- server -------------------------------------------------------------------------------

class py_server {
public:
    py_server(const std::string& addr, int port, const py::object& transports,
              const std::optional<std::string>& device, const py::dict& kw)
        : dev_(device) {
        if (port < 0 || port > 65535)
            throw py::value_error("port: 0..65535 expected");
        const rpc::rpc_options o = make_options(transports, kw);
        const auto p = static_cast<std::uint16_t>(port);
        py::gil_scoped_release nogil;
        srv_ = dev_.pd ? std::make_unique<rpc::server>(*dev_.pd, addr, p, o)
                       : std::make_unique<rpc::server>(addr, p, o);
    }
    py_server(const py_server&) = delete;
    py_server& operator=(const py_server&) = delete;
    ~py_server() {
        // With the GIL (pybind11 destroys holders with it): nothing polls any more.
        srv_.reset();
        for (auto& [m, h] : handlers_)
            Py_XDECREF(h);
    }

    void on(int method, const py::function& fn) {
        const std::uint16_t m = method_id(method);
        PyObject* const keep = fn.ptr();
        Py_INCREF(keep);
        PyObject* old = nullptr;
        {
            py::gil_scoped_release nogil;
            const auto lk = guard_.lock("Server.on");
            try {
                live().on(m, [this, keep](rpc::request_context& c) { run_handler(keep, c); });
            } catch (...) {
                py::gil_scoped_acquire gil;
                Py_DECREF(keep);
                throw;
            }
            PyObject*& slot = handlers_[m];
            old = slot;
            slot = keep;
        }
        Py_XDECREF(old);
    }

    /// The hook rdmax.rpc.Server gives: called with a handler's exception.
    void set_error_hook(py::object hook) { error_hook_ = std::move(hook); }

    /// Serves what came, waiting up to `timeout` seconds for something when
    /// nothing had (0: does not wait). The requests handled.
    int poll(double timeout) {
        const auto wait_for = seconds_to<microseconds>(timeout, "timeout");
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Server.poll");
        return wait_for.count() > 0 ? live().wait(wait_for) : live().poll();
    }

    int port() {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Server.port");
        return live().port();
    }
    std::size_t peers() {
        py::gil_scoped_release nogil;
        const auto lk = guard_.lock("Server.peers");
        return live().peers();
    }
    py::dict counters() {
        rpc::rpc_counters c;
        if (guard_.mine()) { // from a handler of this server: its thread holds the lock
            c = live().counters();
        } else {
            py::gil_scoped_release nogil;
            const auto lk = guard_.lock("Server.counters");
            c = live().counters();
        }
        py::dict d = counters_dict(c);
        d["handler_errors"] = handler_errors_;
        return d;
    }
    /// Closes the server and drops its handlers and hook (which may refer
    /// to the Python object that holds this: a cycle the GC cannot see).
    void close() {
        std::unordered_map<std::uint16_t, PyObject*> gone;
        {
            py::gil_scoped_release nogil;
            const auto lk = guard_.lock("Server.close");
            srv_.reset();
            gone.swap(handlers_);
        }
        for (auto& [m, h] : gone)
            Py_XDECREF(h);
        error_hook_ = py::none();
    }
    [[nodiscard]] bool closed() const noexcept { return srv_ == nullptr; }

private:
    rpc::server& live() {
        if (!srv_)
            throw std::runtime_error("the server is closed");
        return *srv_;
    }

    /// Runs a Python handler (in the thread that polls, under the lock): the
    /// body as a read-only memoryview, released when the handler returns.
    void run_handler(PyObject* fn, rpc::request_context& c) noexcept {
        py::gil_scoped_acquire gil;
        const std::span<const std::byte> body = c.body();
        // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): a read-only view
        char* const data = const_cast<char*>(reinterpret_cast<const char*>(body.data()));
        try {
            auto mv = py::reinterpret_steal<py::object>(
                PyMemoryView_FromMemory(data, static_cast<py::ssize_t>(body.size()), PyBUF_READ));
            if (!mv)
                throw py::error_already_set();
            py::object result;
            try {
                result = py::reinterpret_borrow<py::object>(fn)(mv);
            } catch (...) {
                release_view(mv);
                throw;
            }
            release_view(mv);
            if (result.is_none()) {
                c.reply({});
                return;
            }
            const buffer_view reply(result, false);
            c.reply(reply.bytes());
        } catch (py::error_already_set& e) {
            // Reported (kept, logged) before the caller is answered: a caller
            // that sees handler_failed finds last_handler_error set.
            ++handler_errors_;
            report(e);
            c.fail(rpc::call_status::handler_failed);
        } catch (const std::exception& e) {
            ++handler_errors_;
            PyErr_SetString(PyExc_TypeError, e.what());
            py::error_already_set err;
            report(err);
            c.fail(rpc::call_status::handler_failed);
        }
    }

    static void release_view(py::object& mv) noexcept {
        // A view of it that the handler exported (numpy.frombuffer) keeps it:
        // then it stays, and its bytes must not be used after the handler.
        PyObject* r = PyObject_CallMethod(mv.ptr(), "release", nullptr);
        if (r == nullptr)
            PyErr_Clear();
        Py_XDECREF(r);
    }

    void report(py::error_already_set& e) noexcept {
        try {
            if (error_hook_ && !error_hook_.is_none())
                error_hook_(e.value());
        } catch (py::error_already_set& inner) {
            inner.discard_as_unraisable("rdmax.rpc.Server error hook");
        } catch (...) {
        }
    }

    device_state dev_;
    std::unique_ptr<rpc::server> srv_;
    object_guard guard_;
    std::unordered_map<std::uint16_t, PyObject*> handlers_; ///< owned references
    py::object error_hook_;
    std::uint64_t handler_errors_ = 0;
};

} // namespace

void bind_rpc(py::module_& m) {
    py::class_<rpc::peer_id>(m, "Peer", "A connection of a Client (Client.connect's result).")
        .def_readonly("index", &rpc::peer_id::index)
        .def_readonly("generation", &rpc::peer_id::generation)
        .def("__eq__", [](const rpc::peer_id& a, const rpc::peer_id& b) { return a == b; })
        .def("__hash__",
             [](const rpc::peer_id& p) {
                 return std::hash<std::uint64_t>{}((std::uint64_t{p.generation} << 32) | p.index);
             })
        .def("__repr__", [](const rpc::peer_id& p) {
            return "<rdmax.Peer " + std::to_string(p.index) + "." + std::to_string(p.generation) +
                   ">";
        });

    py::class_<py_client>(m, "Client")
        .def(py::init<const py::object&, const std::optional<std::string>&, const py::dict&>(),
             py::arg("transports"), py::arg("device"), py::arg("options"))
        .def("connect", &py_client::connect, py::arg("addr"), py::arg("port"))
        .def("disconnect", &py_client::disconnect)
        .def("call", &py_client::call, py::arg("peer"), py::arg("method"), py::arg("body"),
             py::arg("timeout") = py::none(), py::arg("idempotent") = false,
             py::arg("reply_into") = py::none())
        .def("start", &py_client::start, py::arg("peer"), py::arg("method"), py::arg("body"),
             py::arg("timeout") = py::none(), py::arg("idempotent") = false,
             py::arg("reply_into") = py::none())
        .def("poll", &py_client::poll, py::arg("max") = 64, py::arg("timeout") = 0.0)
        .def("cancel", &py_client::cancel)
        .def("arm", &py_client::arm)
        .def("awake", &py_client::awake)
        .def("fd", &py_client::fd)
        .def("in_flight", &py_client::in_flight)
        .def("transport", &py_client::transport)
        .def("state", &py_client::state)
        .def("counters", &py_client::counters)
        .def("housekeeping", &py_client::housekeeping)
        .def("call_timeout", &py_client::call_timeout)
        .def("close", &py_client::close)
        .def_property_readonly("closed", &py_client::closed);

    py::class_<py_server>(m, "Server")
        .def(py::init<const std::string&, int, const py::object&, const std::optional<std::string>&,
                      const py::dict&>(),
             py::arg("addr"), py::arg("port"), py::arg("transports"), py::arg("device"),
             py::arg("options"))
        .def("on", &py_server::on)
        .def("set_error_hook", &py_server::set_error_hook)
        .def("poll", &py_server::poll, py::arg("timeout") = 0.0)
        .def("port", &py_server::port)
        .def("peers", &py_server::peers)
        .def("counters", &py_server::counters)
        .def("close", &py_server::close)
        .def_property_readonly("closed", &py_server::closed);
}

} // namespace rdmax::python
