// rdmax._rdmax: the extension module under the rdmax Python package
// (python/rdmax/). Errors, buffers and the thread guard here; devices and
// arenas in devices.cpp, RPC in rpc.cpp.

#include <cerrno>
#include <string>
#include <unistd.h>
#include <vector>

#include <rdmax/error.hpp>
#include <rdmax/stats/publisher.hpp>
#include <rdmax/stats/reader.hpp>

#include "common.hpp"

namespace rdmax::python {

exception_types& exceptions() noexcept {
    static exception_types t;
    return t;
}

std::string_view status_name(rpc::call_status s) noexcept {
    using rpc::call_status;
    switch (s) {
    case call_status::ok: return "ok";
    case call_status::unknown_method: return "unknown_method";
    case call_status::handler_failed: return "handler_failed";
    case call_status::request_too_large: return "request_too_large";
    case call_status::reply_too_large: return "reply_too_large";
    case call_status::read_failed: return "read_failed";
    case call_status::unknown_outcome: return "unknown_outcome";
    case call_status::timed_out: return "timed_out";
    case call_status::peer_gone: return "peer_gone";
    case call_status::no_credit: return "no_credit";
    case call_status::too_large: return "too_large";
    case call_status::bad_peer: return "bad_peer";
    case call_status::bad_reply: return "bad_reply";
    case call_status::invalid_method: return "invalid_method";
    case call_status::registration_failed: return "registration_failed";
    case call_status::cancelled: return "cancelled";
    case call_status::dmabuf_unreachable: return "dmabuf_unreachable";
    case call_status::bad_options: return "bad_options";
    }
    return "unknown";
}

py::object make_rpc_error(rpc::call_status s, std::string_view what) {
    std::string msg(what);
    msg += ": ";
    msg += status_name(s);
    msg += " (";
    msg += rpc::to_string(s);
    msg += ")";
    py::object e = py::reinterpret_borrow<py::object>(exceptions().rpc_error)(msg);
    e.attr("status") = py::str(std::string(status_name(s)));
    return e;
}

void raise_rpc_error(rpc::call_status s, std::string_view what) {
    const py::object e = make_rpc_error(s, what);
    PyErr_SetObject(exceptions().rpc_error.ptr(), e.ptr());
    throw py::error_already_set();
}

buffer_view::buffer_view(py::handle obj, bool writable) {
    const int flags = writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO;
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
        // Not a buffer, or not a writable one: a TypeError either way.
        PyErr_Clear();
        throw py::type_error(std::string(writable ? "a writable" : "a") +
                             " bytes-like object (buffer protocol) is required, not '" +
                             std::string(py::str(obj.get_type().attr("__name__"))) + "'");
    }
    if (PyBuffer_IsContiguous(&view_, 'C') == 0) {
        // Released before throwing: no destructor runs for a constructor that
        // throws, and a held export would pin the object (a bytearray could
        // never be resized again).
        PyBuffer_Release(&view_);
        throw py::type_error("the buffer must be C-contiguous (numpy: np.ascontiguousarray)");
    }
    held_ = true;
}

py::object byte_view(const buffer_view& b, std::size_t n) {
    auto mv = py::reinterpret_steal<py::object>(PyMemoryView_FromObject(b.object().ptr()));
    if (!mv)
        throw py::error_already_set();
    return mv.attr("cast")("B")[py::slice(0, static_cast<py::ssize_t>(n), 1)];
}

object_guard::held object_guard::lock(const char* what) {
    if (mine())
        throw std::runtime_error(std::string(what) +
                                 ": called from inside this object's own handler or wait "
                                 "(rdmax objects are not re-entrant)");
    mu_.lock();
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    return held(*this);
}

} // namespace rdmax::python

using namespace rdmax::python;

PYBIND11_MODULE(_rdmax, m) {
    m.doc() = "rdmax's C++ core (use the rdmax package, not this module)";
    auto runtime_error = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
    PyObject* err = PyErr_NewExceptionWithDoc(
        "rdmax.Error",
        "An rdmax operation failed: the message names the call and the reason "
        "(.verb: the call, .errno: the error number, 0 when none).",
        runtime_error.ptr(), nullptr);
    if (err == nullptr)
        throw py::error_already_set();
    PyObject* rpc_err = PyErr_NewExceptionWithDoc(
        "rdmax.RpcError",
        "An RPC that did not end ok; .status names how it ended (\"timed_out\", "
        "\"unknown_method\", \"handler_failed\", ...).",
        err, nullptr);
    if (rpc_err == nullptr)
        throw py::error_already_set();
    m.add_object("Error", py::handle(err));
    m.add_object("RpcError", py::handle(rpc_err));
    exceptions().error = err;
    exceptions().rpc_error = rpc_err;
    py::setattr(py::handle(err), "verb", py::str(""));
    py::setattr(py::handle(err), "errno", py::int_(0));
    py::setattr(py::handle(rpc_err), "status", py::str(""));

    // pybind11 takes a void(*)(std::exception_ptr): the pointer by value.
    // NOLINTNEXTLINE(performance-unnecessary-value-param)
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p)
                std::rethrow_exception(p);
        } catch (const rdmax::error& e) {
            py::object inst = py::reinterpret_borrow<py::object>(exceptions().error)(e.what());
            inst.attr("verb") = py::str(e.verb());
            inst.attr("errno") = py::int_(e.code().value());
            PyErr_SetObject(exceptions().error.ptr(), inst.ptr());
        }
    });

    bind_devices(m);
    bind_rpc(m);

    // This process's live counters (docs/stats.md), as rdmax-stat reads them:
    // every registration cache, arena, scheduler sum and RPC endpoint.
    m.def(
        "stats",
        [] {
            py::list out;
            std::vector<rdmax::stats::object_snapshot> objects;
            {
                py::gil_scoped_release nogil;
                rdmax::stats::publish_pulled_now(); // caches and arenas as of now
                if (!rdmax::stats::segment_path().empty())
                    objects = rdmax::stats::read_segment(::getpid(), ::getuid()).objects;
            }
            for (const auto& o : objects) {
                py::dict values;
                for (const auto& f : o.fields)
                    values[py::str(f.name)] = f.value;
                py::dict d;
                d["kind"] = o.kind;
                d["name"] = o.name;
                d["values"] = values;
                out.append(d);
            }
            return out;
        },
        "This process's published counters: a list of {'kind', 'name', 'values'} (caches "
        "'rcache', arenas 'arena', 'rpc_client', 'rpc_server', 'scheduler'). Caches and "
        "arenas as of the call; endpoints as of their last housekeeping (RDMAX_STAT_INTERVAL_MS). "
        "[] with RDMAX_STAT=0.");
}
