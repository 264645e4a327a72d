#pragma once
// One finished work request, as the application sees it.

#include <cstdint>
#include <string_view>

#include <infiniband/verbs.h>

namespace rdmax::verbs {

struct completion {
    std::uint64_t wr_id = 0;
    ibv_wc_status status = IBV_WC_SUCCESS;
    ibv_wc_opcode opcode = IBV_WC_SEND;
    std::uint32_t byte_len = 0; ///< bytes received (receives only)
    std::uint32_t imm = 0;      ///< immediate data, host order, when has_imm
    bool has_imm = false;
    std::uint32_t qp_num = 0;
    std::uint32_t src_qp = 0; ///< sender's QP number (UD receives)

    [[nodiscard]] bool ok() const noexcept { return status == IBV_WC_SUCCESS; }
    /// "success", "remote access error", "transport retry counter exceeded", ...
    [[nodiscard]] std::string_view status_name() const noexcept {
        return ibv_wc_status_str(status);
    }

    [[nodiscard]] static completion from(const ibv_wc& wc, std::uint64_t wr_id) noexcept {
        completion c;
        c.wr_id = wr_id;
        c.status = wc.status;
        c.opcode = wc.opcode;
        c.byte_len = wc.byte_len;
        c.has_imm = (wc.wc_flags & IBV_WC_WITH_IMM) != 0;
        c.imm = c.has_imm ? be32toh(wc.imm_data) : 0;
        c.qp_num = wc.qp_num;
        c.src_qp = wc.src_qp;
        return c;
    }
};

} // namespace rdmax::verbs
