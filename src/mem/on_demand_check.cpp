#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <rdmax/mem/memory_region.hpp>
#include <rdmax/mem/on_demand_check.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax {

std::string odp_caps_names(std::uint32_t caps) {
    static constexpr std::pair<std::uint32_t, const char*> names[] = {
        {IBV_ODP_SUPPORT_SEND, "send"},     {IBV_ODP_SUPPORT_RECV, "recv"},
        {IBV_ODP_SUPPORT_WRITE, "write"},   {IBV_ODP_SUPPORT_READ, "read"},
        {IBV_ODP_SUPPORT_ATOMIC, "atomic"}, {IBV_ODP_SUPPORT_SRQ_RECV, "srq_recv"},
    };
    std::string out;
    for (const auto& [bit, name] : names)
        if ((caps & bit) != 0)
            out += fmt::format("{}{}", out.empty() ? "" : ", ", name);
    return out.empty() ? std::string("none") : out;
}

namespace {

using namespace std::chrono_literals;

/// Anonymous pages for the ODP side, unmapped when the test ends.
class scratch_pages {
public:
    explicit scratch_pages(std::size_t len)
        : len_(len)
        , p_(mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)) {}
    scratch_pages(const scratch_pages&) = delete;
    scratch_pages& operator=(const scratch_pages&) = delete;
    ~scratch_pages() {
        if (ok())
            munmap(p_, len_);
    }
    [[nodiscard]] bool ok() const noexcept { return p_ != MAP_FAILED; }
    [[nodiscard]] std::span<std::byte> bytes() const noexcept {
        return {static_cast<std::byte*>(p_), len_};
    }

private:
    std::size_t len_;
    void* p_;
};

/// The ODP registration under test, deregistered when the test ends.
struct odp_registration {
    ibv_mr* mr = nullptr;
    odp_registration(const verbs::protection_domain& pd, std::span<std::byte> b)
        : mr(ibv_reg_mr(pd.get(), b.data(), b.size(),
                        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                            IBV_ACCESS_ON_DEMAND)) {}
    odp_registration(const odp_registration&) = delete;
    odp_registration& operator=(const odp_registration&) = delete;
    ~odp_registration() {
        if (mr != nullptr)
            ibv_dereg_mr(mr);
    }
};

void fill(std::span<std::byte> b, unsigned seed) {
    for (std::size_t i = 0; i < b.size(); ++i)
        b[i] = static_cast<std::byte>((i * 7 + seed) % 251);
}

/// The first index where a and b differ, if any.
std::optional<std::size_t> first_difference(std::span<const std::byte> a,
                                            std::span<const std::byte> b) {
    const auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
    if (ia == a.end() && ib == b.end())
        return std::nullopt;
    return static_cast<std::size_t>(ia - a.begin());
}

std::optional<std::string> finish(verbs::queue_pair<verbs::rc>& qp, status posted,
                                  const char* what) {
    if (posted != status::ok)
        return fmt::format("the self-test could not post {}: {}", what, to_string(posted));
    verbs::completion c[1];
    if (qp.wait_send(c, 2s) != 1)
        return fmt::format("{} did not complete within 2 s", what);
    if (!c[0].ok())
        return fmt::format("{} failed: {}", what, c[0].status_name());
    return std::nullopt;
}

/// Runs the self-test; the problem found, if any.
std::optional<std::string> self_test(const verbs::protection_domain& pd) {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::size_t len = 3 * page;
    scratch_pages odp(len);
    if (!odp.ok())
        return fmt::format("the self-test could not map memory: {}", std::strerror(errno));
    const odp_registration reg(pd, odp.bytes());
    if (reg.mr == nullptr)
        return fmt::format("ibv_reg_mr(IBV_ACCESS_ON_DEMAND) failed: {}", std::strerror(errno));
    std::vector<std::byte> pinned(len);
    const memory_region<all_rights> pinned_mr(pd, pinned.data(), pinned.size());
    verbs::qp_config cfg;
    cfg.send_depth = cfg.recv_depth = 4;
    cfg.max_batch = 4;
    cfg.max_inline = 0; // the requester must read the source through its key
    verbs::queue_pair<verbs::rc> a(pd, cfg);
    verbs::queue_pair<verbs::rc> b(pd, cfg);
    verbs::connect_pair(a, b);
    const remote_buffer<rights::remote_write | rights::remote_read | rights::local_write>
        odp_remote{reinterpret_cast<std::uintptr_t>(odp.bytes().data()), len, reg.mr->rkey};

    // An RDMA write into the ODP pages, starting inside the first page and
    // ending inside the second: the bytes land there, and nowhere else.
    const std::size_t woff = page / 4 + 8;
    const std::size_t wlen = page + page / 2;
    fill(pinned, 1);
    if (auto why = finish(a, a.write(pinned_mr.local(0, wlen), odp_remote, woff, 1),
                          "an RDMA write into an ODP registration"))
        return why;
    std::vector<std::byte> expect(len);
    std::copy_n(pinned.begin(), wlen, expect.begin() + static_cast<std::ptrdiff_t>(woff));
    if (auto at = first_difference(odp.bytes(), expect))
        return fmt::format("an RDMA write of {} bytes at offset {} of an ODP registration left "
                           "wrong bytes (first at offset {})",
                           wlen, woff, *at);

    // An RDMA read out of the ODP pages, likewise across a page boundary.
    const std::size_t roff = page / 2 + 24;
    const std::size_t rlen = page + 1000;
    fill(odp.bytes(), 2);
    std::fill(pinned.begin(), pinned.end(), std::byte{0});
    if (auto why = finish(a, a.read(pinned_mr.local(0, rlen), odp_remote, roff, 2),
                          "an RDMA read out of an ODP registration"))
        return why;
    if (auto at = first_difference(std::span(pinned).first(rlen), odp.bytes().subspan(roff, rlen)))
        return fmt::format("an RDMA read of {} bytes at offset {} of an ODP registration brought "
                           "wrong bytes (first at offset {})",
                           rlen, roff, *at);
    return std::nullopt;
}

on_demand_verdict check(const verbs::protection_domain& pd) {
    const auto& l = pd.device().limits();
    on_demand_verdict v;
    if (!l.on_demand_paging) {
        v.problem = fmt::format("{} has no on-demand paging (IBV_ODP_SUPPORT)", l.name);
        return v;
    }
    if ((l.odp_rc_caps & odp_rc_needed) != odp_rc_needed) {
        v.problem = fmt::format("{}'s on-demand paging lacks RC {} (it has: {})", l.name,
                                odp_caps_names(odp_rc_needed & ~l.odp_rc_caps),
                                odp_caps_names(l.odp_rc_caps));
        return v;
    }
    try {
        if (auto why = self_test(pd))
            v.problem =
                fmt::format("{}'s on-demand paging failed rdmax's self-test: {}", l.name, *why);
        else
            v.self_tested = true;
    } catch (const std::exception& e) {
        v.problem =
            fmt::format("{}: the on-demand paging self-test could not run: {}", l.name, e.what());
    }
    return v;
}

} // namespace

on_demand_verdict check_on_demand(const verbs::protection_domain& pd) {
    // Kept per device name for the life of the process: one self-test each.
    static std::mutex lock;
    static std::vector<std::pair<std::string, on_demand_verdict>> kept;
    const std::lock_guard<std::mutex> hold(lock);
    const std::string& name = pd.device().limits().name;
    for (const auto& [dev, verdict] : kept)
        if (dev == name)
            return verdict;
    kept.emplace_back(name, check(pd));
    return kept.back().second;
}

} // namespace rdmax
