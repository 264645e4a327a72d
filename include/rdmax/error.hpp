#pragma once
// rdmax::error: what setup code throws. The data path never throws; it returns
// a status instead (see the queue pair and completion headers).

#include <string>
#include <string_view>
#include <system_error>

namespace rdmax {

/// A failed verbs, rdma_cm or system call: names the call and the reason, e.g.
/// "ibv_reg_mr (4096 bytes at 0x7f...): Cannot allocate memory".
class error : public std::system_error {
public:
    error(std::string_view verb, int errnum, std::string_view detail = {});

    /// The call that failed, e.g. "ibv_reg_mr".
    [[nodiscard]] const std::string& verb() const noexcept { return verb_; }

private:
    std::string verb_;
};

/// Throws rdmax::error. Verbs report failure either through errno (calls that
/// return NULL or -1) or as a positive return value (ibv_query_*, ibv_modify_*):
/// pass whichever applies.
[[noreturn]] void throw_error(std::string_view verb, int errnum, std::string_view detail = {});

} // namespace rdmax
