// rdmax.devices() and rdmax.Arena (a registered_arena on a device's
// protection domain: its blocks are writable buffers in registered memory).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <rdmax/mem/registered_arena.hpp>
#include <rdmax/verbs/context.hpp>
#include <rdmax/verbs/protection_domain.hpp>

#include "common.hpp"

namespace rdmax::python {

namespace {

py::dict port_dict(const verbs::port_info& p) {
    py::dict d;
    d["number"] = p.number;
    d["state"] = std::string(verbs::to_string(p.state));
    d["active"] = p.active();
    d["link_layer"] = std::string(verbs::to_string(p.layer));
    d["active_mtu"] = verbs::mtu_bytes(p.active_mtu);
    d["max_mtu"] = verbs::mtu_bytes(p.max_mtu);
    d["lid"] = p.lid;
    d["gid_table_len"] = p.gid_table_len;
    d["max_msg_size"] = p.max_msg_size;
    return d;
}

py::dict limits_dict(const verbs::device_limits& l) {
    py::dict d;
    d["name"] = l.name;
    d["firmware"] = l.firmware;
    d["max_mr_size"] = l.max_mr_size;
    d["page_size_cap"] = l.page_size_cap;
    d["max_qp"] = l.max_qp;
    d["max_qp_wr"] = l.max_qp_wr;
    d["max_sge"] = l.max_sge;
    d["max_sge_rd"] = l.max_sge_rd;
    d["max_cq"] = l.max_cq;
    d["max_cqe"] = l.max_cqe;
    d["max_mr"] = l.max_mr;
    d["max_pd"] = l.max_pd;
    d["max_mw"] = l.max_mw;
    d["max_srq"] = l.max_srq;
    d["max_srq_wr"] = l.max_srq_wr;
    d["max_qp_rd_atom"] = l.max_qp_rd_atom;
    d["max_qp_init_rd_atom"] = l.max_qp_init_rd_atom;
    d["phys_port_cnt"] = l.phys_port_cnt;
    d["atomics"] = l.atomics;
    d["memory_windows"] = l.memory_windows;
    d["mw_type_2a"] = l.mw_type_2a;
    d["mw_type_2b"] = l.mw_type_2b;
    d["on_demand_paging"] = l.on_demand_paging;
    return d;
}

/// Every device present, each with its limits and ports (an empty list on a
/// machine with none).
py::list devices() {
    py::list out;
    for (const std::string& name : verbs::device_names()) {
        const verbs::context ctx = verbs::context::open(name);
        py::dict d = limits_dict(ctx.limits());
        py::list ports;
        for (std::uint8_t p = 1; p <= ctx.limits().phys_port_cnt; ++p)
            ports.append(port_dict(ctx.port(p)));
        d["ports"] = ports;
        out.append(d);
    }
    return out;
}

/// A device, its protection domain and an arena on it, destroyed in that
/// order's reverse; shared by the arena object and its blocks.
struct arena_state {
    verbs::context ctx;
    verbs::protection_domain pd;
    registered_arena arena;
    arena_state(verbs::context c, const arena_options& o)
        : ctx(std::move(c))
        , pd(ctx)
        , arena(verbs_registrar(pd), o) {}
};

verbs::context open_device(const std::optional<std::string>& device) {
    return device ? verbs::context::open(*device) : verbs::context::open_first_active();
}

/// One block of registered memory: a writable buffer (memoryview(b),
/// numpy.frombuffer(b, dtype)); the arena lives while it does. Its memory
/// goes back to the arena when the Python object goes, which is after its
/// last view does (each view holds a reference to it): release() only stops
/// new views, so no view can ever see memory handed to another block.
struct arena_block {
    std::shared_ptr<arena_state> owner;
    registered_arena::block b;
    std::size_t asked = 0;
    bool released = false;

    arena_block() = default;
    arena_block(const arena_block&) = delete;
    arena_block& operator=(const arena_block&) = delete;
    ~arena_block() {
        if (owner && b.data != nullptr)
            owner->arena.deallocate(b.data, asked);
    }
};

} // namespace

void bind_devices(py::module_& m) {
    m.def("devices", &devices,
          "The RDMA devices present, each a dict of its limits (name, max_mr_size, max_qp_wr, "
          "...) and 'ports' (state, link_layer, MTUs); [] where there is none.");

    py::class_<arena_state, std::shared_ptr<arena_state>>(
        m, "Arena",
        "Registered memory (rdmax::registered_arena) on a device's protection domain: "
        "allocate() hands out blocks that are registered already, one key per area. Needs an "
        "RDMA device: without one, constructing it raises rdmax.Error saying so.")
        .def(py::init([](const std::optional<std::string>& device,
                         std::optional<std::size_t> area_bytes) {
                 arena_options o = arena_options{}.with_env();
                 if (area_bytes)
                     o.area_bytes = *area_bytes;
                 // Opening the device and the first area's registration may
                 // take milliseconds: without the GIL.
                 py::gil_scoped_release nogil;
                 verbs::context ctx = open_device(device);
                 return std::make_shared<arena_state>(std::move(ctx), o);
             }),
             py::arg("device") = py::none(), py::arg("area_bytes") = py::none(),
             "device: a device name (default: the first with an ACTIVE port).")
        .def_property_readonly("device", [](const arena_state& s) { return s.ctx.name(); })
        .def(
            "allocate",
            [](const std::shared_ptr<arena_state>& s, std::size_t bytes) {
                auto blk = std::make_shared<arena_block>();
                {
                    // A new area is mapped and registered (ibv_reg_mr): without the GIL.
                    py::gil_scoped_release nogil;
                    blk->b = s->arena.allocate(bytes);
                }
                blk->owner = s;
                blk->asked = bytes;
                return blk;
            },
            py::arg("nbytes"),
            "A block of nbytes of registered memory (a writable buffer; .lkey, .rkey, .address).")
        .def("trim", [](arena_state& s) { return s.arena.trim(); });

    py::class_<arena_block, std::shared_ptr<arena_block>>(m, "ArenaBlock", py::buffer_protocol())
        .def_buffer([](arena_block& b) {
            // Never a throw here: pybind11 calls this from the buffer
            // protocol's C slot, where an exception aborts the process. A
            // released block exports an empty buffer.
            const py::ssize_t n = b.released ? 0 : static_cast<py::ssize_t>(b.asked);
            return py::buffer_info(b.b.data, 1, "B", 1, {n}, {1});
        })
        .def_property_readonly("lkey", [](const arena_block& b) { return b.b.lkey; })
        .def_property_readonly("rkey", [](const arena_block& b) { return b.b.rkey; })
        .def_property_readonly(
            "address",
            [](const arena_block& b) { return reinterpret_cast<std::uintptr_t>(b.b.data); })
        .def("__len__", [](const arena_block& b) { return b.released ? 0 : b.asked; })
        .def(
            "release", [](arena_block& b) { b.released = true; },
            "No new view of the block; its memory goes back to the arena once the last view "
            "of it (and the block) is gone, so a view never sees another block's memory.");
}

} // namespace rdmax::python
