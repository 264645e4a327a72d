#include <algorithm>
#include <cerrno>
#include <random>
#include <utility>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/verbs/queue_pair.hpp>

namespace rdmax::verbs {

namespace {

/// Checks the sizes a queue pair is asked for against the device, before any
/// resource is created, and says which limit a request breaks.
qp_config validated(const protection_domain& pd, const qp_config& cfg, ibv_qp_type type) {
    const device_limits& lim = pd.device().limits();
    auto refuse = [&](std::string_view what, std::uint64_t asked, std::uint64_t most) {
        throw_error(type == IBV_QPT_UD ? "ibv_create_qp(UD)" : "ibv_create_qp(RC)", EINVAL,
                    fmt::format("{} {} asked, {} allows 1..{}", what, asked, lim.name, most));
    };
    if (cfg.send_depth == 0 || cfg.send_depth > lim.max_qp_wr)
        refuse("send_depth", cfg.send_depth, lim.max_qp_wr);
    if (cfg.srq == nullptr && (cfg.recv_depth == 0 || cfg.recv_depth > lim.max_qp_wr))
        refuse("recv_depth", cfg.recv_depth, lim.max_qp_wr);
    if (cfg.max_send_sge == 0 || cfg.max_send_sge > lim.max_sge)
        refuse("max_send_sge", cfg.max_send_sge, lim.max_sge);
    if (cfg.max_recv_sge == 0 || cfg.max_recv_sge > lim.max_sge)
        refuse("max_recv_sge", cfg.max_recv_sge, lim.max_sge);
    if (cfg.max_batch == 0 || cfg.max_batch > cfg.send_depth)
        refuse("max_batch", cfg.max_batch, cfg.send_depth);
    if (cfg.port == 0 || cfg.port > lim.phys_port_cnt)
        refuse("port", cfg.port, lim.phys_port_cnt);
    return cfg;
}

std::uint32_t random_psn() {
    std::random_device rd;
    return rd() & 0xffffffu;
}

} // namespace

// ---- creation -----------------------------------------------------------------------------

queue_pair_base::queue_pair_base(const protection_domain& pd, const qp_config& cfg,
                                 ibv_qp_type type, rdma_cm_id* cm_id)
    : pd_(&pd)
    , cfg_(validated(pd, cfg, type))
    , send_cq_(pd.device(), cfg_.send_depth, cfg_.send_channel)
    , own_recv_cq_(cfg_.recv_cq == nullptr
                       ? std::make_unique<completion_queue>(
                             pd.device(), cfg_.srq != nullptr ? 1 : cfg_.recv_depth)
                       : nullptr)
    , recv_cq_(cfg_.recv_cq != nullptr ? cfg_.recv_cq : own_recv_cq_.get())
    , type_(type)
    , slots_(1) {
    ibv_qp_init_attr attr{};
    attr.send_cq = send_cq_.get();
    attr.recv_cq = recv_cq_->get();
    attr.srq = cfg_.srq != nullptr ? cfg_.srq->get() : nullptr;
    attr.qp_type = type;
    attr.sq_sig_all = 0;
    attr.cap.max_send_wr = cfg_.send_depth;
    attr.cap.max_recv_wr = cfg_.srq != nullptr ? 0 : cfg_.recv_depth;
    attr.cap.max_send_sge = cfg_.max_send_sge;
    attr.cap.max_recv_sge = cfg_.max_recv_sge;
    attr.cap.max_inline_data = cfg_.max_inline;
    create(attr, cm_id);
    cm_id_ = cm_id;
    state_ = cm_id != nullptr ? IBV_QPS_INIT : IBV_QPS_RESET;
    // 0 asked means "never inline", whatever minimum the device grants anyway.
    max_inline_ = cfg_.max_inline == 0 ? 0 : attr.cap.max_inline_data;
    max_send_sge_ = attr.cap.max_send_sge;
    max_recv_sge_ = attr.cap.max_recv_sge;
    slots_ = send_slots(attr.cap.max_send_wr, cfg_.signal_interval);
    // Every completion kept for the caller stands for a request of its own
    // that left the send queue: a queue's worth covers what wait_send_slots
    // can reap before the caller has polled what it kept.
    kept_ = kept_completions(slots_.depth());
    wrs_.resize(cfg_.max_batch);
    sges_.resize(static_cast<std::size_t>(cfg_.max_batch) * max_send_sge_);
    try {
        learn_port();
    } catch (...) {
        destroy();
        throw;
    }
}

void queue_pair_base::create(ibv_qp_init_attr& attr, rdma_cm_id* cm_id) {
    const char* verb = cm_id != nullptr ? "rdma_create_qp" : "ibv_create_qp";
    // The device writes what it granted back into attr.cap, even when the
    // create fails (rdma_create_qp copies it back after its own step failed):
    // each attempt starts from what was asked, the inline size halved.
    const ibv_qp_cap asked = attr.cap;
    std::uint32_t inline_ask = asked.max_inline_data;
    for (;;) {
        attr.cap = asked;
        attr.cap.max_inline_data = inline_ask;
        if (cm_id != nullptr) {
            if (rdma_create_qp(cm_id, pd_->get(), &attr) == 0)
                qp_ = cm_id->qp;
        } else {
            qp_ = ibv_create_qp(pd_->get(), &attr);
        }
        if (qp_ != nullptr)
            return;
        const int err = errno;
        // Devices differ in how much inline data they take: halve the request
        // until the device agrees, rather than fail over an optimisation.
        if (err == EINVAL && inline_ask > 0) {
            inline_ask /= 2;
            continue;
        }
        throw_error(verb, err,
                    fmt::format("{} send x{} sge, {} recv x{} sge, inline {} on {}",
                                cfg_.send_depth, cfg_.max_send_sge, cfg_.recv_depth,
                                cfg_.max_recv_sge, cfg_.max_inline, pd_->device().name()));
    }
}

void queue_pair_base::learn_port() {
    const context& ctx = pd_->device();
    const port_info port = ctx.port(cfg_.port);
    max_msg_ = port.max_msg_size;
    mtu_ = port.active_mtu;
    lid_ = port.lid;
    if (auto g = ctx.preferred_gid(cfg_.port)) {
        gid_index_ = static_cast<std::uint8_t>(g->index);
        gid_ = g->value;
    }
    const auto& lim = ctx.limits();
    rd_atomic_ = static_cast<std::uint8_t>(std::clamp<std::uint32_t>(
        std::min({std::uint32_t{cfg_.max_rd_atomic}, lim.max_qp_init_rd_atom, lim.max_qp_rd_atom}),
        1, 255));
    psn_ = random_psn();
}

void queue_pair_base::destroy() noexcept {
    if (qp_ == nullptr)
        return;
    if (cm_id_ != nullptr)
        rdma_destroy_qp(cm_id_);
    else
        ibv_destroy_qp(qp_);
    qp_ = nullptr;
    cm_id_ = nullptr;
}

queue_pair_base::~queue_pair_base() {
    destroy();
}

queue_pair_base::queue_pair_base(queue_pair_base&& o) noexcept
    : pd_(o.pd_)
    , cfg_(o.cfg_)
    , send_cq_(std::move(o.send_cq_))
    , own_recv_cq_(std::move(o.own_recv_cq_))
    , recv_cq_(std::exchange(o.recv_cq_, nullptr))
    , qp_(std::exchange(o.qp_, nullptr))
    , cm_id_(std::exchange(o.cm_id_, nullptr))
    , type_(o.type_)
    , state_(std::exchange(o.state_, IBV_QPS_RESET))
    , max_inline_(o.max_inline_)
    , max_send_sge_(o.max_send_sge_)
    , max_recv_sge_(o.max_recv_sge_)
    , max_msg_(o.max_msg_)
    , psn_(o.psn_)
    , lid_(o.lid_)
    , gid_index_(o.gid_index_)
    , rd_atomic_(o.rd_atomic_)
    , mtu_(o.mtu_)
    , gid_(o.gid_)
    , last_errno_(o.last_errno_)
    , failed_(o.failed_)
    , slots_(std::move(o.slots_))
    , wrs_(std::move(o.wrs_))
    , sges_(std::move(o.sges_))
    , kept_(std::move(o.kept_)) {}

queue_pair_base& queue_pair_base::operator=(queue_pair_base&& o) noexcept {
    if (this != &o) {
        destroy();
        pd_ = o.pd_;
        cfg_ = o.cfg_;
        send_cq_ = std::move(o.send_cq_);
        own_recv_cq_ = std::move(o.own_recv_cq_);
        recv_cq_ = std::exchange(o.recv_cq_, nullptr);
        qp_ = std::exchange(o.qp_, nullptr);
        cm_id_ = std::exchange(o.cm_id_, nullptr);
        type_ = o.type_;
        state_ = std::exchange(o.state_, IBV_QPS_RESET);
        max_inline_ = o.max_inline_;
        max_send_sge_ = o.max_send_sge_;
        max_recv_sge_ = o.max_recv_sge_;
        max_msg_ = o.max_msg_;
        psn_ = o.psn_;
        lid_ = o.lid_;
        gid_index_ = o.gid_index_;
        rd_atomic_ = o.rd_atomic_;
        mtu_ = o.mtu_;
        gid_ = o.gid_;
        last_errno_ = o.last_errno_;
        failed_ = o.failed_;
        slots_ = std::move(o.slots_);
        wrs_ = std::move(o.wrs_);
        sges_ = std::move(o.sges_);
        kept_ = std::move(o.kept_);
    }
    return *this;
}

qp_endpoint queue_pair_base::endpoint() const {
    qp_endpoint e;
    e.address = gid_;
    e.qp_num = qp_->qp_num;
    e.psn = psn_;
    e.qkey = cfg_.qkey;
    e.lid = lid_;
    e.gid_index = gid_index_;
    e.mtu = static_cast<std::uint8_t>(mtu_);
    return e;
}

// ---- state transitions ------------------------------------------------------------------

void queue_pair_base::modify(ibv_qp_attr& attr, int mask, ibv_qp_state to, const char* what) {
    attr.qp_state = to;
    if (int rc = ibv_modify_qp(qp_, &attr, mask | IBV_QP_STATE); rc != 0)
        throw_error("ibv_modify_qp", rc, fmt::format("QP {:#x} to {}", qp_->qp_num, what));
    state_ = to;
}

void queue_pair_base::enter_error() noexcept {
    if (qp_ == nullptr || state_ == IBV_QPS_ERR)
        return;
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    if (ibv_modify_qp(qp_, &attr, IBV_QP_STATE) == 0)
        state_ = IBV_QPS_ERR;
}

void queue_pair_base::to_init() {
    ibv_qp_attr attr{};
    attr.pkey_index = 0;
    attr.port_num = cfg_.port;
    int mask = IBV_QP_PKEY_INDEX | IBV_QP_PORT;
    if (type_ == IBV_QPT_UD) {
        attr.qkey = cfg_.qkey;
        mask |= IBV_QP_QKEY;
    } else {
        // The QP admits every remote operation; each MR's rights then decide.
        attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                               IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
        mask |= IBV_QP_ACCESS_FLAGS;
    }
    modify(attr, mask, IBV_QPS_INIT, "INIT");
}

void queue_pair_base::to_rts_from_rtr(std::uint32_t sq_psn) {
    ibv_qp_attr attr{};
    int mask = IBV_QP_SQ_PSN;
    attr.sq_psn = sq_psn;
    if (type_ == IBV_QPT_RC) {
        attr.timeout = cfg_.ack_timeout;
        attr.retry_cnt = cfg_.retry_count;
        attr.rnr_retry = cfg_.rnr_retry;
        attr.max_rd_atomic = rd_atomic_;
        mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    }
    modify(attr, mask, IBV_QPS_RTS, "RTS");
}

queue_pair<rc>::queue_pair(const protection_domain& pd, const qp_config& cfg)
    : queue_pair_base(pd, cfg, IBV_QPT_RC, nullptr) {}

queue_pair<rc>::queue_pair(const protection_domain& pd, const qp_config& cfg, rdma_cm_id* id)
    : queue_pair_base(pd, cfg, IBV_QPT_RC, id) {}

void queue_pair<rc>::connect(const qp_endpoint& remote) {
    if (cm_id_ != nullptr)
        throw_error("ibv_modify_qp", EINVAL, "this QP belongs to an rdma_cm connection");
    if (state_ == IBV_QPS_RESET)
        to_init();
    if (state_ != IBV_QPS_INIT)
        throw_error("ibv_modify_qp", EINVAL,
                    fmt::format("QP {:#x} is connected already", qp_->qp_num));
    ibv_qp_attr attr{};
    attr.path_mtu = std::min(mtu_, static_cast<ibv_mtu>(remote.mtu));
    attr.dest_qp_num = remote.qp_num;
    attr.rq_psn = remote.psn;
    attr.max_dest_rd_atomic = rd_atomic_;
    attr.min_rnr_timer = 12; // 0.64 ms
    attr.ah_attr.dlid = remote.lid;
    attr.ah_attr.port_num = cfg_.port;
    if (!remote.address.is_zero()) {
        // RoCE always routes by GID; InfiniBand only across subnets.
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.dgid = remote.address.to_ibv();
        attr.ah_attr.grh.sgid_index = gid_index_;
        attr.ah_attr.grh.hop_limit = 64;
    }
    modify(attr,
           IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
           IBV_QPS_RTR, "RTR");
    to_rts_from_rtr(psn_);
}

void queue_pair<rc>::mark_connected() noexcept {
    state_ = IBV_QPS_RTS;
}

queue_pair<ud>::queue_pair(const protection_domain& pd, const qp_config& cfg)
    : queue_pair_base(pd, cfg, IBV_QPT_UD, nullptr) {
    to_init();
    ibv_qp_attr attr{};
    modify(attr, 0, IBV_QPS_RTR, "RTR");
    to_rts_from_rtr(psn_);
}

void connect_pair(queue_pair<rc>& a, queue_pair<rc>& b) {
    const qp_endpoint ea = a.endpoint();
    const qp_endpoint eb = b.endpoint();
    a.connect(eb);
    b.connect(ea);
}

// ---- address handles ----------------------------------------------------------------------

address_handle::address_handle(const protection_domain& pd, const qp_endpoint& remote,
                               std::uint8_t port, std::uint8_t local_gid_index)
    : qp_num_(remote.qp_num)
    , qkey_(remote.qkey) {
    ibv_ah_attr attr{};
    attr.dlid = remote.lid;
    attr.port_num = port;
    if (!remote.address.is_zero()) {
        attr.is_global = 1;
        attr.grh.dgid = remote.address.to_ibv();
        attr.grh.sgid_index = local_gid_index;
        attr.grh.hop_limit = 64;
    }
    ah_ = ibv_create_ah(pd.get(), &attr);
    if (ah_ == nullptr)
        throw_error("ibv_create_ah", errno,
                    fmt::format("to {} QP {:#x}", remote.address, remote.qp_num));
}

address_handle::address_handle(address_handle&& o) noexcept
    : ah_(std::exchange(o.ah_, nullptr))
    , qp_num_(o.qp_num_)
    , qkey_(o.qkey_) {}

address_handle& address_handle::operator=(address_handle&& o) noexcept {
    if (this != &o) {
        if (ah_ != nullptr)
            ibv_destroy_ah(ah_);
        ah_ = std::exchange(o.ah_, nullptr);
        qp_num_ = o.qp_num_;
        qkey_ = o.qkey_;
    }
    return *this;
}

address_handle::~address_handle() {
    if (ah_ != nullptr)
        ibv_destroy_ah(ah_);
}

// ---- receives and completions -----------------------------------------------------------

status queue_pair_base::post_recv_sges(ibv_sge* sges, std::uint32_t n,
                                       std::uint64_t wr_id) noexcept {
    if (state_ == IBV_QPS_RESET || cfg_.srq != nullptr) {
        // RESET takes no receives; with an SRQ, receives go to the SRQ.
        last_errno_ = EINVAL;
        return cfg_.srq != nullptr ? status::post_failed : status::not_connected;
    }
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = sges;
    wr.num_sge = static_cast<int>(n);
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(qp_, &wr, &bad); rc != 0) {
        last_errno_ = rc;
        return status::post_failed;
    }
    return status::ok;
}

int queue_pair_base::translate_send(const ibv_wc* wcs, int n, std::span<completion> out) noexcept {
    int k = 0;
    for (int i = 0; i < n; ++i) {
        // A send completion in error puts an RC queue pair in the error state
        // (a UD one's send queue in SQE): from now on posts are refused up
        // front (qp_failed) instead of being taken and flushed.
        if (wcs[i].status != IBV_WC_SUCCESS) [[unlikely]] {
            failed_ = true;
            state_ = IBV_QPS_ERR;
        }
        const send_slots::done d = slots_.complete(wcs[i].wr_id, wcs[i].status == IBV_WC_SUCCESS);
        if (d.report)
            out[static_cast<std::size_t>(k++)] = completion::from(wcs[i], d.wr_id);
    }
    return k;
}

int queue_pair_base::poll_send(std::span<completion> out) noexcept {
    if (!kept_.empty()) [[unlikely]]
        return kept_.take(out);
    ibv_wc wcs[32];
    const std::size_t want = std::min(out.size(), std::size(wcs));
    const int n = send_cq_.poll(std::span(wcs, want));
    return n <= 0 ? n : translate_send(wcs, n, out);
}

int queue_pair_base::wait_send(std::span<completion> out,
                               std::chrono::microseconds timeout) noexcept {
    if (!kept_.empty()) [[unlikely]]
        return kept_.take(out);
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + timeout;
    ibv_wc wcs[32];
    const std::size_t want = std::min(out.size(), std::size(wcs));
    for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::microseconds>(deadline - clock::now());
        const int n =
            send_cq_.wait(std::span(wcs, want), std::max(left, std::chrono::microseconds(0)));
        if (n < 0)
            return n;
        // Completions of requests the library signaled for its own accounting
        // are not the caller's: keep waiting for one that is.
        if (int k = translate_send(wcs, n, out); k > 0)
            return k;
        if (n == 0 && clock::now() >= deadline)
            return 0;
    }
}

std::optional<completion> queue_pair_base::wait_send_for(std::uint64_t wr_id,
                                                         std::chrono::microseconds timeout) {
    // It may have arrived already, during an earlier wait.
    if (std::optional<completion> c = kept_.take_id(wr_id))
        return c;
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + timeout;
    ibv_wc wcs[32];
    completion got[32];
    for (;;) {
        // Room first: once polled, a completion exists nowhere else.
        kept_.make_room(std::size(wcs));
        const auto left =
            std::chrono::duration_cast<std::chrono::microseconds>(deadline - clock::now());
        const int n = send_cq_.wait(wcs, std::max(left, std::chrono::microseconds(0)));
        if (n < 0)
            return std::nullopt;
        const int k = translate_send(wcs, n, got);
        std::optional<completion> found;
        for (int i = 0; i < k; ++i) {
            const completion& c = got[static_cast<std::size_t>(i)];
            if (!found && c.wr_id == wr_id)
                found = c;
            else
                kept_.push(c);
        }
        if (found)
            return found;
        if (clock::now() >= deadline)
            return std::nullopt;
    }
}

status queue_pair_base::wait_send_slots(std::uint32_t n,
                                        std::chrono::microseconds timeout) noexcept {
    if (n > slots_.depth())
        return status::out_of_range;
    // A failure already kept: the queue pair is broken, and more slots would
    // only carry more work to be flushed.
    if (kept_.any_failed())
        return status::qp_failed;
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + timeout;
    ibv_wc wcs[32];
    completion got[32];
    for (;;) {
        if (slots_.available() >= n)
            return status::ok;
        // Never poll more than the keep has room for: each polled completion
        // gives the caller at most one, and none may be dropped.
        const std::size_t want = std::min(kept_.room(), std::size(wcs));
        if (want == 0)
            return status::queue_full; // the caller's own completions fill the keep
        const auto left =
            std::chrono::duration_cast<std::chrono::microseconds>(deadline - clock::now());
        const int polled =
            send_cq_.wait(std::span(wcs, want), std::max(left, std::chrono::microseconds(0)));
        if (polled < 0)
            return status::qp_failed;
        const int k = translate_send(wcs, polled, got);
        bool failed = false;
        for (int i = 0; i < k; ++i) {
            const completion& c = got[static_cast<std::size_t>(i)];
            failed = failed || !c.ok();
            kept_.push(c);
        }
        if (failed)
            return status::qp_failed;
        if (polled == 0 && clock::now() >= deadline)
            return slots_.available() >= n ? status::ok : status::queue_full;
    }
}

int queue_pair_base::poll_recv(std::span<completion> out) noexcept {
    ibv_wc wcs[32];
    const std::size_t want = std::min(out.size(), std::size(wcs));
    const int n = recv_cq_->poll(std::span(wcs, want));
    for (int i = 0; i < n; ++i)
        out[static_cast<std::size_t>(i)] = completion::from(wcs[i], wcs[i].wr_id);
    return n;
}

int queue_pair_base::wait_recv(std::span<completion> out,
                               std::chrono::microseconds timeout) noexcept {
    ibv_wc wcs[32];
    const std::size_t want = std::min(out.size(), std::size(wcs));
    const int n = recv_cq_->wait(std::span(wcs, want), timeout);
    for (int i = 0; i < n; ++i)
        out[static_cast<std::size_t>(i)] = completion::from(wcs[i], wcs[i].wr_id);
    return n;
}

// ---- send batches --------------------------------------------------------------------------

send_batch::send_batch(queue_pair_base& qp) noexcept
    : qp_(qp)
    , start_(qp.slots_.mark()) {}

send_batch::~send_batch() {
    if (count_ > 0)
        qp_.slots_.rollback(start_); // staged, never posted: the slots go back
}

status send_batch::reserve(std::size_t nsge, ibv_sge*& sges) noexcept {
    if (count_ >= qp_.wrs_.size())
        return status::batch_full;
    if (nsge == 0)
        return status::zero_length;
    if (nsge > qp_.max_send_sge_)
        return status::too_many_sge;
    sges = &qp_.sges_[static_cast<std::size_t>(count_) * qp_.max_send_sge_];
    return status::ok;
}

status send_batch::commit(ibv_send_wr& wr, std::uint64_t wr_id, send_flags f, bool inline_ok,
                          std::uint64_t total) noexcept {
    if (qp_.slots_.available() == 0)
        return status::queue_full;
    unsigned flags = 0;
    if (f.force_inline) {
        if (!inline_ok || total > qp_.max_inline_)
            return status::inline_too_large;
        flags |= IBV_SEND_INLINE;
    } else if (inline_ok && total != 0 && total <= qp_.max_inline_) {
        flags |= IBV_SEND_INLINE; // the NIC reads the data from the WQE: one DMA fewer
    }
    if (f.fence)
        flags |= IBV_SEND_FENCE;
    if (f.solicited)
        flags |= IBV_SEND_SOLICITED;
    const send_slots::claim c = qp_.slots_.take(wr_id, f.signaled);
    if (c.signaled)
        flags |= IBV_SEND_SIGNALED;
    wr.wr_id = c.id;
    wr.send_flags = flags;
    wr.next = nullptr;
    if (count_ > 0)
        qp_.wrs_[count_ - 1].next = &wr;
    ++count_;
    return status::ok;
}

namespace {

/// A remote buffer whose range runs past the end of the address space: a
/// token no registration made (a peer's garbage or a forgery). Refused, so
/// that remote_addr never wraps around to an address the peer did not name.
bool wraps(std::uint64_t raddr, std::uint64_t rlen) noexcept {
    return rlen > UINT64_MAX - raddr;
}

} // namespace

status send_batch::stage_rdma(ibv_wr_opcode op, std::size_t nsge, std::uint64_t total,
                              std::uint64_t raddr, std::uint64_t rlen, std::uint32_t rkey,
                              std::uint64_t offset, std::uint64_t wr_id, send_flags f,
                              std::optional<std::uint32_t> imm) noexcept {
    if (status s = qp_.can_post(); s != status::ok)
        return s;
    if (total == 0 && op != IBV_WR_RDMA_WRITE_WITH_IMM)
        return status::zero_length;
    if (total > qp_.max_msg_)
        return status::too_long;
    if (offset > rlen || total > rlen - offset || wraps(raddr, rlen))
        return status::out_of_range;
    ibv_send_wr& wr = qp_.wrs_[count_];
    wr = {};
    wr.opcode = op;
    wr.sg_list = &qp_.sges_[static_cast<std::size_t>(count_) * qp_.max_send_sge_];
    wr.num_sge = static_cast<int>(nsge);
    wr.wr.rdma.remote_addr = raddr + offset;
    wr.wr.rdma.rkey = rkey;
    if (imm)
        wr.imm_data = htobe32(*imm);
    return commit(wr, wr_id, f, op != IBV_WR_RDMA_READ, total);
}

status send_batch::stage_message(std::size_t nsge, std::uint64_t total, std::uint64_t wr_id,
                                 send_flags f, std::optional<std::uint32_t> imm,
                                 const address_handle* to) noexcept {
    if (status s = qp_.can_post(); s != status::ok)
        return s;
    if (total == 0 && !imm)
        return status::zero_length;
    const bool ud = qp_.type_ == IBV_QPT_UD;
    if (ud != (to != nullptr))
        return status::not_connected; // UD needs a destination, RC has one
    if (total > (ud ? mtu_bytes(qp_.mtu_) : qp_.max_msg_))
        return status::too_long;
    ibv_send_wr& wr = qp_.wrs_[count_];
    wr = {};
    wr.opcode = imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    wr.sg_list = &qp_.sges_[static_cast<std::size_t>(count_) * qp_.max_send_sge_];
    wr.num_sge = static_cast<int>(nsge);
    if (imm)
        wr.imm_data = htobe32(*imm);
    if (ud) {
        wr.wr.ud.ah = to->get();
        wr.wr.ud.remote_qpn = to->qp_num();
        wr.wr.ud.remote_qkey = to->qkey();
    }
    return commit(wr, wr_id, f, true, total);
}

status send_batch::atomic(ibv_wr_opcode op, ibv_sge result, std::uint64_t raddr, std::uint64_t rlen,
                          std::uint32_t rkey, std::uint64_t offset, std::uint64_t operand,
                          std::uint64_t swap, std::uint64_t wr_id, send_flags f) noexcept {
    if (status s = qp_.can_post(); s != status::ok)
        return s;
    if (result.length != 8 || (raddr + offset) % 8 != 0)
        return status::misaligned_atomic;
    if (offset > rlen || 8 > rlen - offset || wraps(raddr, rlen))
        return status::out_of_range;
    if (f.force_inline)
        return status::inline_too_large;
    ibv_sge* sges = nullptr;
    if (status s = reserve(1, sges); s != status::ok)
        return s;
    sges[0] = result;
    ibv_send_wr& wr = qp_.wrs_[count_];
    wr = {};
    wr.opcode = op;
    wr.sg_list = sges;
    wr.num_sge = 1;
    wr.wr.atomic.remote_addr = raddr + offset;
    wr.wr.atomic.compare_add = operand;
    wr.wr.atomic.swap = swap;
    wr.wr.atomic.rkey = rkey;
    return commit(wr, wr_id, f, false, 8);
}

status send_batch::bind_mw(ibv_mw* mw, std::uint32_t rkey, ibv_mr* mr, std::uint64_t addr,
                           std::uint64_t length, rights window_rights, std::uint64_t wr_id,
                           send_flags f) noexcept {
    if (qp_.type_ != IBV_QPT_RC)
        return status::bad_window; // type-2 windows bind through connected QPs
    if (status s = qp_.can_post(); s != status::ok)
        return s;
    if (count_ >= qp_.wrs_.size())
        return status::batch_full;
    // What the device would check, and fail the queue pair over: checked here.
    ibv_pd* pd = qp_.qp_->pd;
    if (mw == nullptr || mw->type != IBV_MW_TYPE_2 || mw->pd != pd || mr == nullptr || mr->pd != pd)
        return status::bad_window;
    // A new key of the same window: same index (upper 24 bits), new low byte.
    if ((rkey >> 8) != (mw->rkey >> 8) || rkey == mw->rkey)
        return status::bad_window;
    const int granted = to_ibv(window_rights);
    if (granted == 0 || (granted & ~to_ibv(remote_rights)) != 0)
        return status::bad_window;
    if (length == 0)
        return status::zero_length;
    const auto base = reinterpret_cast<std::uint64_t>(mr->addr);
    if (addr < base || length > mr->length || addr - base > mr->length - length)
        return status::out_of_range;
    ibv_send_wr& wr = qp_.wrs_[count_];
    wr = {};
    wr.opcode = IBV_WR_BIND_MW;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = rkey;
    wr.bind_mw.bind_info.mr = mr;
    wr.bind_mw.bind_info.addr = addr;
    wr.bind_mw.bind_info.length = length;
    wr.bind_mw.bind_info.mw_access_flags = static_cast<unsigned>(granted);
    return commit(wr, wr_id, f, false, 0);
}

status send_batch::local_invalidate(std::uint32_t rkey, std::uint64_t wr_id,
                                    send_flags f) noexcept {
    if (status s = qp_.can_post(); s != status::ok)
        return s;
    if (count_ >= qp_.wrs_.size())
        return status::batch_full;
    ibv_send_wr& wr = qp_.wrs_[count_];
    wr = {};
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.invalidate_rkey = rkey;
    return commit(wr, wr_id, f, false, 0);
}

status send_batch::post() noexcept {
    if (count_ == 0) {
        accepted_ = 0;
        return status::ok;
    }
    if (qp_.failed_) {
        // The queue pair failed after these were staged: none goes.
        accepted_ = 0;
        count_ = 0;
        qp_.slots_.rollback(start_);
        start_ = qp_.slots_.mark();
        return status::qp_failed;
    }
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(qp_.qp_, qp_.wrs_.data(), &bad);
    accepted_ = count_;
    if (rc != 0 && bad != nullptr)
        for (std::uint32_t i = 0; i < count_; ++i)
            if (&qp_.wrs_[i] == bad) {
                accepted_ = i;
                break;
            }
    if (rc != 0 && bad == nullptr)
        accepted_ = 0;
    count_ = 0;
    if (rc != 0) {
        qp_.last_errno_ = rc;
        // What the device did not take gives its slots back; what it took
        // before `bad` stays accounted.
        qp_.slots_.rollback_to(bad != nullptr ? bad->wr_id : start_.head);
        start_ = qp_.slots_.mark();
        return status::post_failed;
    }
    start_ = qp_.slots_.mark();
    return status::ok;
}

} // namespace rdmax::verbs
