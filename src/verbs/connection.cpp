#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <utility>

#include <fmt/format.h>

#include <rdmax/detail/verbs/parked_ids.hpp>
#include <rdmax/error.hpp>
#include <rdmax/verbs/connection.hpp>
#include <rdmax/verbs/connection_request.hpp>
#include <rdmax/verbs/listener.hpp>
#include <rdmax/verbs/prepared_connection.hpp>

namespace rdmax::verbs {

namespace {

using clock = std::chrono::steady_clock;

std::chrono::milliseconds left_until(clock::time_point deadline) noexcept {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()),
                    std::chrono::milliseconds(0));
}

/// An event channel whose fd never blocks: every wait goes through poll()
/// with a deadline.
rdma_event_channel* make_channel() {
    rdma_event_channel* ch = rdma_create_event_channel();
    if (ch == nullptr)
        throw_error("rdma_create_event_channel", errno, "is the rdma_ucm module loaded?");
    const int flags = fcntl(ch->fd, F_GETFL);
    if (flags < 0 || fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        const int err = errno;
        rdma_destroy_event_channel(ch);
        throw_error("fcntl(O_NONBLOCK)", err, "rdma_cm event channel");
    }
    return ch;
}

/// The next event on `ch`, or nullptr when the deadline passes first.
rdma_cm_event* next_event(rdma_event_channel* ch, clock::time_point deadline) noexcept {
    for (;;) {
        rdma_cm_event* ev = nullptr;
        if (rdma_get_cm_event(ch, &ev) == 0)
            return ev;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return nullptr;
        const auto left = left_until(deadline);
        if (left.count() == 0)
            return nullptr;
        pollfd pfd{ch->fd, POLLIN, 0};
        (void)::poll(&pfd, 1, static_cast<int>(left.count()) + 1);
    }
}

/// An event's contents, copied out so the event can be acknowledged at once
/// (rdma_destroy_id waits for every event of its id to be acknowledged).
struct event_copy {
    rdma_cm_event_type type;
    int status;
    rdma_cm_id* id;
    std::vector<std::byte> payload;
    std::uint8_t initiator_depth;
    std::uint8_t responder_resources;
};

/// Decodes rdmax's private data: one length byte, then the payload. The wire
/// pads private data to a fixed size, hence the explicit length.
std::vector<std::byte> decode_payload(const void* data, std::size_t len) {
    if (data == nullptr || len == 0)
        return {};
    const auto* bytes = static_cast<const std::byte*>(data);
    const auto n = std::to_integer<std::size_t>(bytes[0]);
    if (n > len - 1)
        return {};
    return {bytes + 1, bytes + 1 + n};
}

event_copy take(rdma_cm_event* ev) {
    event_copy c{ev->event,
                 ev->status,
                 ev->id,
                 decode_payload(ev->param.conn.private_data, ev->param.conn.private_data_len),
                 ev->param.conn.initiator_depth,
                 ev->param.conn.responder_resources};
    rdma_ack_cm_event(ev);
    return c;
}

/// Waits for `expected`; throws naming `step` and what came instead.
event_copy expect(rdma_event_channel* ch, rdma_cm_event_type expected, clock::time_point deadline,
                  const char* step, std::string_view target) {
    rdma_cm_event* ev = next_event(ch, deadline);
    if (ev == nullptr)
        throw_error(step, ETIMEDOUT,
                    fmt::format("{}: no {} before the deadline", target, rdma_event_str(expected)));
    event_copy c = take(ev);
    if (c.type != expected) {
        const int err = c.type == RDMA_CM_EVENT_REJECTED      ? ECONNREFUSED
                        : c.type == RDMA_CM_EVENT_UNREACHABLE ? EHOSTUNREACH
                        : c.status < 0                        ? -c.status
                                                              : ECONNABORTED;
        throw_error(step, err,
                    fmt::format("{}: {} (status {})", target, rdma_event_str(c.type), c.status));
    }
    return c;
}

sockaddr_storage resolve(std::string_view addr, std::uint16_t port, bool passive,
                         int family = AF_UNSPEC) {
    addrinfo hints{};
    hints.ai_family = family;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    addrinfo* res = nullptr;
    const std::string host(addr);
    const std::string service = std::to_string(port);
    if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
        rc != 0)
        throw_error("getaddrinfo", EINVAL, fmt::format("'{}': {}", addr, gai_strerror(rc)));
    sockaddr_storage ss{};
    std::memcpy(&ss, res->ai_addr, std::min<std::size_t>(res->ai_addrlen, sizeof ss));
    freeaddrinfo(res);
    return ss;
}

std::vector<std::byte> encode_payload(std::span<const std::byte> payload, std::size_t most,
                                      const char* step) {
    if (payload.size() > most)
        throw_error(step, EMSGSIZE,
                    fmt::format("a payload of {} bytes; the private data carries at most {}",
                                payload.size(), most));
    std::vector<std::byte> out(payload.size() + 1);
    out[0] = static_cast<std::byte>(payload.size());
    std::copy(payload.begin(), payload.end(), out.begin() + 1);
    return out;
}

rdma_cm_id* make_id(rdma_event_channel* ch) {
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0)
        throw_error("rdma_create_id", errno);
    return id;
}

/// The retransmission timeout of the connection's QP (both sides must set it
/// before connect/accept; without it a peer that vanished may never time out).
void set_ack_timeout(rdma_cm_id* id, const qp_config& cfg) noexcept {
    std::uint8_t ack_timeout = cfg.ack_timeout;
    (void)rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &ack_timeout,
                          sizeof ack_timeout); // older kernels lack it; their default is longer
}

/// rdma_create_qp takes only a protection domain of the id's own verbs
/// context: librdmacm's for the device (context::open returns that one too).
void require_device(rdma_cm_id* id, const protection_domain& pd, std::string_view what) {
    if (id->verbs == pd.device().get())
        return;
    const std::string id_device =
        id->verbs != nullptr ? ibv_get_device_name(id->verbs->device) : "no device";
    if (id_device == pd.device().name())
        throw_error("rdma_create_qp", EXDEV,
                    fmt::format("{} goes through rdma_cm's context of {}, but the protection "
                                "domain is on another context of {} (a second ibv_open_device): "
                                "make it on context::open(\"{}\") or the request's device()",
                                what, id_device, id_device, id_device));
    throw_error("rdma_create_qp", EXDEV,
                fmt::format("{} goes through {}, but the protection domain is on {}", what,
                            id_device, pd.device().name()));
}

} // namespace

// ---- connection -----------------------------------------------------------------------------

connection::connection(rdma_event_channel* ch, rdma_cm_id* id) noexcept
    : channel_(ch)
    , id_(id) {}

connection::connection(connection&& o) noexcept
    : channel_(std::exchange(o.channel_, nullptr))
    , id_(std::exchange(o.id_, nullptr))
    , qp_(std::move(o.qp_))
    , peer_payload_(std::move(o.peer_payload_))
    , disconnected_(o.disconnected_)
    , ended_by_(o.ended_by_)
    , disconnect_sent_(o.disconnect_sent_)
    , establishing_(o.establishing_) {
    o.qp_.reset();
}

connection& connection::operator=(connection&& o) noexcept {
    if (this != &o) {
        release();
        channel_ = std::exchange(o.channel_, nullptr);
        id_ = std::exchange(o.id_, nullptr);
        qp_ = std::move(o.qp_);
        o.qp_.reset();
        peer_payload_ = std::move(o.peer_payload_);
        disconnected_ = o.disconnected_;
        ended_by_ = o.ended_by_;
        disconnect_sent_ = o.disconnect_sent_;
        establishing_ = o.establishing_;
    }
    return *this;
}

connection::~connection() {
    release();
}

namespace {
/// After these the CM holds the id in no state that sends on destroy.
bool quiet_end(rdma_cm_event_type e) noexcept {
    return e == RDMA_CM_EVENT_REJECTED || e == RDMA_CM_EVENT_UNREACHABLE ||
           e == RDMA_CM_EVENT_CONNECT_ERROR || e == RDMA_CM_EVENT_TIMEWAIT_EXIT ||
           e == RDMA_CM_EVENT_DEVICE_REMOVAL;
}
} // namespace

bool connection::park_if_port_down() noexcept {
    if (id_ == nullptr || detail::may_send_mads(id_))
        return false;
    qp_.reset();
    detail::park(id_, channel_);
    id_ = nullptr;
    channel_ = nullptr;
    return true;
}

void connection::release() noexcept {
    // Its teardown would send a DREQ or REJ: not through a soft-RoCE port
    // that is down, which would break QP1 for good (parked_ids.hpp).
    const bool sends = !disconnect_sent_ && !(ended_by_ && quiet_end(ended_by_->event));
    if (sends && park_if_port_down())
        return;
    // Tell the peer now; do not wait for its answer here. (With `sends`, the
    // port was asked just now.)
    if (id_ != nullptr && qp_ && !disconnected_)
        send_disconnect(sends);
    qp_.reset(); // rdma_destroy_qp, before the id
    if (id_ == nullptr) {
        if (channel_ != nullptr)
            rdma_destroy_event_channel(channel_);
        channel_ = nullptr;
        return;
    }
    detail::destroy_id(std::exchange(id_, nullptr), std::exchange(channel_, nullptr));
    detail::sweep_parked(); // a port may be up again
}

void connection::pump(std::chrono::milliseconds timeout) noexcept {
    if (channel_ == nullptr)
        return;
    rdma_cm_event* ev = next_event(channel_, clock::now() + timeout);
    if (ev == nullptr)
        return;
    const auto note_end = [&] {
        if (!ended_by_)
            ended_by_ = ending{ev->event, ev->status};
    };
    switch (ev->event) {
    case RDMA_CM_EVENT_ESTABLISHED:
        if (establishing_)
            established_by_traffic();
        break;
    case RDMA_CM_EVENT_REJECTED:
    case RDMA_CM_EVENT_CONNECT_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
        // A handshake that failed after accept_nowait: as good as gone.
        note_end();
        disconnected_ = true;
        if (qp_)
            qp_->enter_error();
        break;
    case RDMA_CM_EVENT_DISCONNECTED:
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
    case RDMA_CM_EVENT_TIMEWAIT_EXIT:
        note_end();
        disconnected_ = true;
        // librdmacm leaves the QP as it was when the peer disconnects: move it
        // to the error state, so that posted work flushes now and new posts
        // are refused, rather than retrying against a peer that is gone.
        if (qp_)
            qp_->enter_error();
        // The peer's disconnect request waits for an answer, which the CM
        // sends only when this side calls rdma_disconnect too; unanswered,
        // the peer's disconnect() runs into its timeout (over 5 s on rxe).
        if (ev->event == RDMA_CM_EVENT_DISCONNECTED)
            send_disconnect();
        break;
    default: break;
    }
    rdma_ack_cm_event(ev);
}

namespace {
/// How long a watched wait polls completions before it looks at the
/// connection's events again.
constexpr std::chrono::microseconds watch_slice{20'000};

template <class Wait>
int watched_wait(connection& c, Wait wait, std::chrono::microseconds timeout) noexcept {
    const auto deadline = clock::now() + timeout;
    for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::microseconds>(deadline - clock::now());
        const int n = wait(std::clamp(left, std::chrono::microseconds(0), watch_slice));
        if (n != 0)
            return n;
        (void)c.peer_disconnected(); // on a disconnect: QP to error, work flushes
        if (clock::now() >= deadline)
            return 0;
    }
}
} // namespace

int connection::wait_send(std::span<completion> out, std::chrono::microseconds timeout) noexcept {
    return watched_wait(
        *this, [&](auto t) { return qp_->wait_send(out, t); }, timeout);
}

int connection::wait_recv(std::span<completion> out, std::chrono::microseconds timeout) noexcept {
    return watched_wait(
        *this, [&](auto t) { return qp_->wait_recv(out, t); }, timeout);
}

bool connection::peer_disconnected() noexcept {
    pump(std::chrono::milliseconds(0));
    return disconnected_;
}

bool connection::established() noexcept {
    if (establishing_)
        pump(std::chrono::milliseconds(0));
    return !establishing_ && !disconnected_;
}

void connection::established_by_traffic() noexcept {
    if (!establishing_)
        return;
    establishing_ = false;
    qp_->mark_connected();
}

bool connection::wait_disconnected(std::chrono::milliseconds timeout) noexcept {
    const auto deadline = clock::now() + timeout;
    while (!disconnected_) {
        const auto left = left_until(deadline);
        pump(left);
        if (left.count() == 0)
            break;
    }
    return disconnected_;
}

void connection::disconnect(std::chrono::milliseconds timeout) noexcept {
    if (id_ == nullptr)
        return;
    if (!disconnected_)
        send_disconnect();
    (void)wait_disconnected(timeout);
}

void connection::send_disconnect(bool port_checked) noexcept {
    if (disconnect_sent_)
        return;
    if (!port_checked && !detail::may_send_mads(id_)) {
        // Not through a soft-RoCE port that is down (release() parks the id),
        // but posted work must still flush, as rdma_disconnect would make it.
        if (qp_)
            qp_->enter_error();
        return;
    }
    rdma_disconnect(id_);
    disconnect_sent_ = true;
}

void connection::create_qp(const protection_domain& pd, const qp_config& cfg,
                           std::string_view what) {
    if (qp_)
        throw_error("rdma_create_qp", EEXIST, fmt::format("{}: it has a QP already", what));
    require_device(id_, pd, what);
    qp_.emplace(queue_pair<rc>(pd, cfg, id_));
    set_ack_timeout(id_, cfg);
}

void connection::established(std::vector<std::byte> peer_payload) noexcept {
    peer_payload_ = std::move(peer_payload);
    qp_->mark_connected();
}

connection connection::connect(const protection_domain& pd, std::string_view addr,
                               std::uint16_t port, std::span<const std::byte> payload,
                               const qp_config& cfg, std::chrono::milliseconds timeout,
                               std::string_view source) {
    const auto deadline = clock::now() + timeout;
    // Refused before anything is resolved or made.
    (void)encode_payload(payload, max_connect_payload, "rdma_connect");
    prepared_connection p(pd, addr, port, cfg, timeout, source);
    return p.connect(payload, left_until(deadline));
}

// ---- prepared_connection --------------------------------------------------------------------

prepared_connection::prepared_connection(const protection_domain& pd, std::string_view addr,
                                         std::uint16_t port, const qp_config& cfg,
                                         std::chrono::milliseconds timeout, std::string_view source)
    : conn_(nullptr, nullptr)
    , target_(source.empty() ? fmt::format("{}:{}", addr, port)
                             : fmt::format("{}:{} from {}", addr, port, source)) {
    const auto deadline = clock::now() + timeout;
    // With a source, the destination in its family (rdma_cm refuses a
    // pair of two families; a name with A and AAAA records has both).
    sockaddr_storage src{};
    if (!source.empty())
        src = resolve(source, 0, false);
    sockaddr_storage dst = resolve(addr, port, false, source.empty() ? AF_UNSPEC : src.ss_family);
    detail::sweep_parked(); // ids parked while the link was down go first

    rdma_event_channel* ch = make_channel();
    rdma_cm_id* id = nullptr;
    try {
        id = make_id(ch);
    } catch (...) {
        rdma_destroy_event_channel(ch);
        throw;
    }
    conn_ = connection(ch, id);    // frees id and channel on every way out from here
    conn_.disconnect_sent_ = true; // nothing to disconnect until it connects

    if (rdma_resolve_addr(id, source.empty() ? nullptr : reinterpret_cast<sockaddr*>(&src),
                          reinterpret_cast<sockaddr*>(&dst),
                          static_cast<int>(left_until(deadline).count()) + 1) != 0)
        throw_error("rdma_resolve_addr", errno, target_);
    expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, deadline, "rdma_resolve_addr", target_);
    if (rdma_resolve_route(id, static_cast<int>(left_until(deadline).count()) + 1) != 0)
        throw_error("rdma_resolve_route", errno, target_);
    expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, deadline, "rdma_resolve_route", target_);
    conn_.create_qp(pd, cfg, target_);
}

connection prepared_connection::connect(std::span<const std::byte> payload,
                                        std::chrono::milliseconds timeout) {
    if (!pending())
        throw_error("rdma_connect", EINVAL,
                    fmt::format("{}: this prepared connection was connected already", target_));
    const auto deadline = clock::now() + timeout;
    const std::vector<std::byte> pdata =
        encode_payload(payload, max_connect_payload, "rdma_connect");
    if (!detail::may_send_mads(conn_.id_))
        throw_error("rdma_connect", ENETDOWN,
                    fmt::format("{}: the soft-RoCE port is down or lost its address", target_));
    connection c = std::move(conn_); // spent from here, whatever happens
    c.disconnect_sent_ = false;
    const qp_config& cfg = c.qp_->config();
    rdma_conn_param param{};
    param.private_data = pdata.data();
    param.private_data_len = static_cast<std::uint8_t>(pdata.size());
    const auto rd_atomic = static_cast<std::uint8_t>(c.qp_->max_rd_atomic());
    param.responder_resources = rd_atomic;
    param.initiator_depth = rd_atomic;
    param.retry_count = cfg.retry_count;
    param.rnr_retry_count = cfg.rnr_retry;
    if (rdma_connect(c.id_, &param) != 0)
        throw_error("rdma_connect", errno, target_);
    event_copy est =
        expect(c.channel_, RDMA_CM_EVENT_ESTABLISHED, deadline, "rdma_connect", target_);
    c.established(std::move(est.payload));
    return c;
}

// ---- listener -------------------------------------------------------------------------------

listener::listener(std::string_view addr, std::uint16_t port, int backlog) {
    sockaddr_storage ss = resolve(addr, port, true);
    channel_ = make_channel();
    try {
        id_ = make_id(channel_);
        if (rdma_bind_addr(id_, reinterpret_cast<sockaddr*>(&ss)) != 0)
            throw_error("rdma_bind_addr", errno, fmt::format("{}:{}", addr, port));
        if (rdma_listen(id_, backlog) != 0)
            throw_error("rdma_listen", errno, fmt::format("{}:{}", addr, port));
    } catch (...) {
        if (id_ != nullptr)
            rdma_destroy_id(id_);
        rdma_destroy_event_channel(channel_);
        throw;
    }
}

listener::listener(listener&& o) noexcept
    : channel_(std::exchange(o.channel_, nullptr))
    , id_(std::exchange(o.id_, nullptr)) {}

listener& listener::operator=(listener&& o) noexcept {
    if (this != &o) {
        release();
        channel_ = std::exchange(o.channel_, nullptr);
        id_ = std::exchange(o.id_, nullptr);
    }
    return *this;
}

listener::~listener() {
    release();
}

void listener::release() noexcept {
    if (id_ != nullptr) {
        // Requests nobody accepted: refuse them, acknowledge, then go.
        while (rdma_cm_event* ev = next_event(channel_, clock::now())) {
            if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
                rdma_cm_id* req = ev->id;
                rdma_reject(req, nullptr, 0);
                rdma_ack_cm_event(ev);
                rdma_destroy_id(req);
            } else {
                rdma_ack_cm_event(ev);
            }
        }
        rdma_destroy_id(id_);
        id_ = nullptr;
    }
    if (channel_ != nullptr) {
        rdma_destroy_event_channel(channel_);
        channel_ = nullptr;
    }
}

std::uint16_t listener::port() const noexcept {
    return id_ != nullptr ? ntohs(rdma_get_src_port(id_)) : 0;
}

context listener::device() const {
    if (id_ == nullptr)
        throw_error("listener::device", EBADF, "the listener listens nowhere");
    if (id_->verbs == nullptr)
        throw_error("rdma_bind_addr", ENODEV,
                    "the listener is bound to a wildcard address: no single device carries it");
    return context::borrow(id_->verbs);
}

connection_request listener::next_request(std::chrono::milliseconds timeout) {
    if (channel_ == nullptr)
        throw_error("listener::next_request", EBADF, "the listener listens nowhere");
    const auto deadline = clock::now() + timeout;
    std::string where = fmt::format("listener on port {}", port());
    event_copy req =
        expect(channel_, RDMA_CM_EVENT_CONNECT_REQUEST, deadline, "rdma_accept", where);
    return hand_over(req.id, std::move(req.payload), req.initiator_depth, req.responder_resources);
}

std::optional<connection_request> listener::poll_request() {
    while (channel_ != nullptr) {
        rdma_cm_event* ev = next_event(channel_, clock::now());
        if (ev == nullptr)
            return std::nullopt;
        event_copy req = take(ev);
        if (req.type == RDMA_CM_EVENT_CONNECT_REQUEST)
            return hand_over(req.id, std::move(req.payload), req.initiator_depth,
                             req.responder_resources);
        // Any other event of a listener's channel is of no use here.
    }
    return std::nullopt;
}

int listener::fd() const noexcept {
    return channel_ != nullptr ? channel_->fd : -1;
}

connection_request listener::hand_over(rdma_cm_id* id, std::vector<std::byte> payload,
                                       std::uint8_t initiator_depth,
                                       std::uint8_t responder_resources) {
    std::string where = fmt::format("listener on port {}", port());
    detail::sweep_parked(); // ids parked while the link was down go first
    // The request's own channel: its events (ESTABLISHED, DISCONNECTED) then
    // reach whoever holds it, not the listener.
    rdma_event_channel* ch = nullptr;
    try {
        ch = make_channel();
        if (rdma_migrate_id(id, ch) != 0)
            throw_error("rdma_migrate_id", errno, where);
    } catch (...) {
        rdma_reject(id, nullptr, 0);
        rdma_destroy_id(id);
        if (ch != nullptr)
            rdma_destroy_event_channel(ch);
        throw;
    }
    connection pending(ch, id);
    pending.disconnect_sent_ = true; // nothing to disconnect until it is accepted
    pending.peer_payload_ = std::move(payload);
    return connection_request(std::move(pending), initiator_depth, responder_resources,
                              std::move(where));
}

connection listener::accept(const protection_domain& pd, std::span<const std::byte> payload,
                            const qp_config& cfg, std::chrono::milliseconds timeout) {
    return accept_choosing([&pd](const context&) -> const protection_domain& { return pd; },
                           payload, cfg, timeout);
}

connection listener::accept_choosing(const chooser_ref& choose, std::span<const std::byte> payload,
                                     const qp_config& cfg, std::chrono::milliseconds timeout) {
    const auto deadline = clock::now() + timeout;
    // Refused before a request is taken (and then rejected for it).
    (void)encode_payload(payload, max_accept_payload, "rdma_accept");
    connection_request req = next_request(timeout);
    // Whatever throws from here destroys `req`, which rejects the request.
    req.create_qp(choose(req.device()), cfg);
    return req.accept(payload, left_until(deadline));
}

// ---- connection_request ---------------------------------------------------------------------

connection_request::connection_request(connection&& pending, std::uint8_t initiator_depth,
                                       std::uint8_t responder_resources, std::string where) noexcept
    : conn_(std::move(pending))
    , initiator_depth_(initiator_depth)
    , responder_resources_(responder_resources)
    , where_(std::move(where)) {}

connection_request::connection_request(connection_request&& o) noexcept
    : conn_(std::move(o.conn_))
    , initiator_depth_(o.initiator_depth_)
    , responder_resources_(o.responder_resources_)
    , where_(std::move(o.where_)) {}

connection_request& connection_request::operator=(connection_request&& o) noexcept {
    if (this != &o) {
        reject();
        conn_ = std::move(o.conn_);
        initiator_depth_ = o.initiator_depth_;
        responder_resources_ = o.responder_resources_;
        where_ = std::move(o.where_);
    }
    return *this;
}

connection_request::~connection_request() {
    reject();
}

void connection_request::reject() noexcept {
    if (!pending())
        return;
    // Answer the peer now, rather than leave it to the kernel when the id
    // goes; then free the QP, id and channel. Not through a soft-RoCE port
    // that is down: parked, the id answers when it goes.
    if (conn_.park_if_port_down())
        return;
    rdma_reject(conn_.id_, nullptr, 0);
    conn_.release();
}

context connection_request::device() const {
    if (!pending())
        throw_error("rdma_accept", EINVAL,
                    fmt::format("{}: the request was answered already", where_));
    return context::borrow(conn_.id_->verbs);
}

bool connection_request::abandoned(std::chrono::milliseconds wait) noexcept {
    const auto deadline = clock::now() + wait;
    while (!conn_.disconnected_ && conn_.id_ != nullptr) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
        conn_.pump(std::max(left, std::chrono::milliseconds{0}));
        if (clock::now() >= deadline)
            break;
    }
    return conn_.disconnected_;
}

queue_pair<rc>& connection_request::create_qp(const protection_domain& pd, const qp_config& cfg) {
    if (!pending())
        throw_error("rdma_create_qp", EINVAL,
                    fmt::format("{}: the request was answered already", where_));
    conn_.create_qp(pd, cfg, fmt::format("the connection request to the {}", where_));
    return *conn_.qp_;
}

queue_pair<rc>& connection_request::qp() {
    if (!has_qp())
        throw_error("rdma_create_qp", EINVAL,
                    fmt::format("{}: the request has no QP yet (create_qp)", where_));
    return *conn_.qp_;
}

connection connection_request::accept(std::span<const std::byte> payload,
                                      std::chrono::milliseconds timeout) {
    const auto deadline = clock::now() + timeout;
    connection c = accept_nowait(payload); // spent from here, whatever happens
    expect(c.channel_, RDMA_CM_EVENT_ESTABLISHED, deadline, "rdma_accept", where_);
    c.establishing_ = false;
    // The payload came with the request; established() keeps it.
    std::vector<std::byte> peer = std::move(c.peer_payload_);
    c.established(std::move(peer));
    return c;
}

connection connection_request::accept_nowait(std::span<const std::byte> payload) {
    if (!pending())
        throw_error("rdma_accept", EINVAL,
                    fmt::format("{}: the request was answered already", where_));
    if (!has_qp())
        throw_error("rdma_accept", EINVAL,
                    fmt::format("{}: make the request's QP (create_qp) before accepting", where_));
    const std::vector<std::byte> pdata = encode_payload(payload, max_accept_payload, "rdma_accept");
    connection c = std::move(conn_); // spent from here, whatever happens
    c.disconnect_sent_ = false;      // its teardown now answers the request (a REJ)
    if (!detail::may_send_mads(c.id_))
        throw_error("rdma_accept", ENETDOWN,
                    fmt::format("{}: the soft-RoCE port is down or lost its address", where_));
    rdma_conn_param param{};
    param.private_data = pdata.data();
    param.private_data_len = static_cast<std::uint8_t>(pdata.size());
    const auto rd_atomic = static_cast<std::uint8_t>(c.qp_->max_rd_atomic());
    param.responder_resources = std::min(rd_atomic, initiator_depth_);
    param.initiator_depth = std::min(rd_atomic, responder_resources_);
    param.rnr_retry_count = c.qp_->config().rnr_retry;
    if (rdma_accept(c.id_, &param) != 0)
        throw_error("rdma_accept", errno, where_);
    // The payload came with the request and stays; ESTABLISHED is taken by pump().
    c.establishing_ = true;
    return c;
}

} // namespace rdmax::verbs
