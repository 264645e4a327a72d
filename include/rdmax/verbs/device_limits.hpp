#pragma once
// A device's limits, queried once when its context opens. Every queue size and
// work request the library builds is clamped to, or checked against, these.

#include <cstdint>
#include <string>

#include <fmt/format.h>

namespace rdmax::verbs {

struct device_limits {
    std::string name;
    std::string firmware;
    std::uint64_t max_mr_size = 0;
    std::uint64_t page_size_cap = 0;
    std::uint32_t max_qp = 0;
    std::uint32_t max_qp_wr = 0;
    std::uint32_t max_sge = 0;
    std::uint32_t max_sge_rd = 0;
    std::uint32_t max_cq = 0;
    std::uint32_t max_cqe = 0;
    std::uint32_t max_mr = 0;
    std::uint32_t max_pd = 0;
    std::uint32_t max_mw = 0;
    std::uint32_t max_srq = 0;
    std::uint32_t max_srq_wr = 0;
    std::uint32_t max_qp_rd_atom = 0;      ///< outstanding RDMA reads/atomics as target
    std::uint32_t max_qp_init_rd_atom = 0; ///< ... as initiator
    std::uint8_t phys_port_cnt = 0;
    bool atomics = false;        ///< compare-and-swap and fetch-and-add supported
    bool memory_windows = false; ///< type 2 memory windows (2A or 2B)
    /// Type 2A windows are tied to a queue pair by its number, 2B by number
    /// and protection domain; the verbs API allocates either as IBV_MW_TYPE_2.
    bool mw_type_2a = false;
    bool mw_type_2b = false;
    bool on_demand_paging = false;
    /// IBV_ODP_SUPPORT_* bits: what on-demand registrations may be used for
    /// on RC and UD queue pairs (mem/on_demand_check.hpp checks them).
    std::uint32_t odp_rc_caps = 0;
    std::uint32_t odp_ud_caps = 0;
};

} // namespace rdmax::verbs

/// Prints the limits as an aligned two-column table, one limit a line.
template <>
struct fmt::formatter<rdmax::verbs::device_limits> {
    constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
    auto format(const rdmax::verbs::device_limits& l, fmt::format_context& ctx) const {
        auto out = ctx.out();
        auto row = [&out](std::string_view key, const auto& value) {
            out = fmt::format_to(out, "  {:<22} {}\n", key, value);
        };
        row("device", l.name);
        row("firmware", l.firmware.empty() ? std::string("-") : l.firmware);
        row("ports", l.phys_port_cnt);
        row("max_qp", l.max_qp);
        row("max_qp_wr", l.max_qp_wr);
        row("max_sge", l.max_sge);
        row("max_sge_rd", l.max_sge_rd);
        row("max_cq", l.max_cq);
        row("max_cqe", l.max_cqe);
        row("max_srq / max_srq_wr", fmt::format("{} / {}", l.max_srq, l.max_srq_wr));
        row("max_pd", l.max_pd);
        row("max_mr", l.max_mr);
        row("max_mr_size", l.max_mr_size);
        row("max_mw", l.max_mw);
        row("max_qp_rd_atom",
            fmt::format("{} (initiator {})", l.max_qp_rd_atom, l.max_qp_init_rd_atom));
        row("page_size_cap", fmt::format("{:#x}", l.page_size_cap));
        row("atomics", l.atomics ? "yes" : "no");
        row("memory windows", !l.memory_windows              ? "no"
                              : l.mw_type_2a && l.mw_type_2b ? "type 2A and 2B"
                              : l.mw_type_2a                 ? "type 2A"
                                                             : "type 2B");
        row("on-demand paging",
            l.on_demand_paging
                ? fmt::format("yes (rc caps {:#x}, ud caps {:#x})", l.odp_rc_caps, l.odp_ud_caps)
                : std::string("no"));
        return out;
    }
};
