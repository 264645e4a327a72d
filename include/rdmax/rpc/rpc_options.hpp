#pragma once
// Options of RPC servers and clients, with their knobs (rpc_knobs, RDMAX_RPC_*).
//
// Options passed to a client or server are all it uses: nothing below reads
// the environment (the ring arena's and the registration cache's options are
// members here). The environment is read where a caller asks: with_env(),
// which the constructors' default argument calls.

#include <chrono>
#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>

#include <rdmax/config/knob.hpp>
#include <rdmax/mem/arena_options.hpp>
#include <rdmax/mem/rcache_options.hpp>
#include <rdmax/rpc/transport.hpp>
#include <rdmax/sched/scheduler_options.hpp>

namespace rdmax::verbs {
class rail_set;
} // namespace rdmax::verbs

namespace rdmax::rpc {

/// RDMAX_RPC_TRANSPORTS' parser: a comma list of rdma, shm and tcp, in any
/// order (UCX_TLS's way).
struct transport_list {
    template <class T>
        requires std::same_as<T, transport_set>
    [[nodiscard]] transport_set parse(const char* who, std::string_view name,
                                      std::string_view text) const {
        return parse_transports(who, name, text);
    }
    template <class T>
    [[nodiscard]] std::string format(transport_set v) const {
        return format_transports(v);
    }
    template <class T>
    [[nodiscard]] std::string range() const {
        return "a comma list of rdma, shm, tcp";
    }
    /// Throws rdmax::error naming the variable, the value and why.
    static transport_set parse_transports(const char* who, std::string_view name,
                                          std::string_view text);
    static std::string format_transports(transport_set v);
};

struct rpc_options {
    /// Slots per connection: calls in flight on it at most (the client asks,
    /// the server grants at most its own). At most wire max_slots.
    std::uint16_t slots = 64;
    /// Bytes per slot: header, descriptors and inline body (64 B .. 256 KiB,
    /// a multiple of 8). Bodies over it go by READ (requests) or into the
    /// caller's reply buffer (replies).
    std::uint32_t slot_bytes = 4096;
    /// Largest request or reply body, inline or not (the server refuses
    /// larger requests with request_too_large; the client refuses to send them).
    std::uint32_t max_message = 16U << 20;
    /// Server: connections at once; more are refused.
    std::uint32_t max_peers = 256;
    /// Client: a call's deadline unless the call names its own.
    std::chrono::milliseconds call_timeout{5000};
    /// Connection setup and teardown deadline (rdma_cm).
    std::chrono::milliseconds connect_timeout{5000};
    /// How often poll() looks at connection events (new peers, peers gone)
    /// and deadlines: an epoll_wait (and, when it reports one, the events'
    /// reads), so not at every poll. Deadlines are this precise.
    std::chrono::microseconds housekeeping{5000};
    /// Keepalive: a connection that brought nothing for this long is probed
    /// (a zero-length write-with-immediate, which the peer's poll answers),
    /// and one silent for keepalive_timeout is declared gone: its calls are
    /// re-sent after a reconnect (client) or its state freed (server), even
    /// when no connection event ever comes (a pulled cable, a hung host, a
    /// stopped process). A peer answers probes when it polls: a client that
    /// does not poll for keepalive_timeout is dropped by its server, and
    /// reconnects at its next call.
    std::chrono::milliseconds keepalive{1000};
    std::chrono::milliseconds keepalive_timeout{3000};
    /// Client: a connection that ended (failed, silent, drained) is made
    /// again, with exponential backoff from reconnect_backoff up to
    /// reconnect_backoff_max and jitter (each wait a random 50-100 % of the
    /// step); its calls wait for it up to their deadlines (unless fail_fast).
    /// Off: they end peer_gone, and so they do after reconnect_give_up of
    /// failed attempts (0: never give up).
    bool reconnect = true;
    std::chrono::milliseconds reconnect_backoff{50};
    std::chrono::milliseconds reconnect_backoff_max{2000};
    std::chrono::milliseconds reconnect_give_up{0};
    /// Server: the replies of calls not marked idempotent are kept per client
    /// incarnation, so that a call re-sent after a reconnect is answered from
    /// here instead of running again: each client's last reply_cache_calls
    /// calls, at most reply_cache_bytes of replies over every client, none
    /// older than reply_cache_ttl. A client's replies outlive its last
    /// connection by reply_cache_linger (freed at once when it said goodbye);
    /// at most 2 x max_peers clients are kept.
    std::uint32_t reply_cache_calls = 1024;
    std::uint32_t reply_cache_bytes = 64U << 20;
    std::chrono::milliseconds reply_cache_ttl{60000};
    /// (As long as keepalive_timeout: a client that crashed is forgotten
    /// within that of its connection's end.)
    std::chrono::milliseconds reply_cache_linger{3000};
    /// Between processes on one node, through shared memory and CMA instead
    /// of the device: the server also answers on a Unix name, the client tries
    /// it first (RDMAX_RPC_LOCAL=0: always the device).
    bool local = true;
    /// The transports this endpoint may use, UCX_TLS's way: a set, and each
    /// peer takes the best one both ends have: shm for a peer on this node
    /// (with `local`), else rdma, else tcp. rdma needs a protection domain:
    /// a server or client built without one has shm and tcp (docs/rpc.md,
    /// "Without a device"). A server with tcp also listens on TCP at its
    /// address and port (the same number as its rdma_cm port).
    transport_set transports = all_transports;
    /// Whom a client lets read and write its memory by CMA where Yama's
    /// ptrace_scope is 1 (only descendants otherwise): the server on this
    /// node reads large bodies from it and writes large replies into it.
    enum class ptracer_grant : std::uint8_t {
        off,  ///< nobody: under scope 1 such servers are reached through the device
        peer, ///< the first node-local server's process (prctl PR_SET_PTRACER, pid):
              ///< one process at a time, so a second server goes through the device
        any,  ///< any process of this user (PR_SET_PTRACER_ANY), as MPI libraries do
    };
    ptracer_grant ptracer = ptracer_grant::peer;
    /// Each connection's scheduler (priorities, slicing of large transfers).
    sched::scheduler_options scheduler = {};
    /// The arena the rings live in (ring_arena() narrows its rights).
    arena_options arena = {};
    /// The client's registration cache, for bodies and reply buffers over a
    /// slot (its limits derived from the device, as make_verbs_cache does).
    rcache_options cache = {};
    /// Rails (several NICs to one peer, docs/multirail.md): this side's
    /// rails, rail 0 being the endpoint's own device (its protection domain
    /// is rails->pd(0)); null for one. A server listens on each other rail's
    /// address at its port; a client given the server's rail addresses
    /// (client::connect) joins a link's other rails there, and bodies and
    /// reply buffers of stripe_min bytes or more (sched::stripe_options) are
    /// cut across them. The set outlives the endpoint.
    const verbs::rail_set* rails = nullptr;

    /// These options with the variables of rpc_knobs that are set applied, and
    /// the scheduler's, the arena's and the cache's (their with_env()); a
    /// malformed or out-of-range value throws rdmax::error naming the variable,
    /// and nothing is applied.
    [[nodiscard]] rpc_options with_env() const;
    /// Throws rdmax::error if a field is out of range.
    void check(const char* who) const;
    /// Peers on this node go through the node's memory (shm listed, and `local`).
    [[nodiscard]] bool node_local() const noexcept {
        return local && transports.has(transport::shm);
    }
    /// `arena` as the rings' arena uses it: registered for local write alone
    /// (each ring gets a key of its own), in areas of at least 2 MiB.
    [[nodiscard]] arena_options ring_arena() const;
};

/// RDMAX_RPC_*: read by with_env() only (the client's and server's default options).
inline constexpr std::tuple rpc_knobs{
    config::knob{"RDMAX_RPC_SLOTS", &rpc_options::slots, config::number{.lo = 1, .hi = 2048},
                 "calls in flight per connection"},
    config::knob{"RDMAX_RPC_SLOT_BYTES", &rpc_options::slot_bytes,
                 config::number{.lo = 64, .hi = 256 * 1024, .multiple_of = 8}, "bytes per slot"},
    config::knob{"RDMAX_RPC_MAX_MESSAGE", &rpc_options::max_message,
                 config::number{.lo = 1, .hi = 1U << 30, .bytes = true},
                 "largest request or reply body"},
    config::knob{"RDMAX_RPC_MAX_PEERS", &rpc_options::max_peers,
                 config::number{.lo = 1, .hi = 1U << 20}, "connections a server takes at once"},
    config::knob{"RDMAX_RPC_TIMEOUT_MS", &rpc_options::call_timeout,
                 config::number{.lo = 1, .hi = 86'400'000},
                 "a call's deadline unless it names one"},
    config::knob{"RDMAX_RPC_CONNECT_TIMEOUT_MS", &rpc_options::connect_timeout,
                 config::number{.lo = 1, .hi = 600'000}, "connection set-up deadline"},
    config::knob{"RDMAX_RPC_HOUSEKEEPING_US", &rpc_options::housekeeping,
                 config::number{.lo = 1, .hi = 1'000'000},
                 "how often connection events and deadlines are looked at"},
    config::knob{"RDMAX_RPC_KEEPALIVE_MS", &rpc_options::keepalive,
                 config::number{.lo = 1, .hi = 3'600'000},
                 "idle time before a connection is probed"},
    config::knob{"RDMAX_RPC_KEEPALIVE_TIMEOUT_MS", &rpc_options::keepalive_timeout,
                 config::number{.lo = 1, .hi = 3'600'000},
                 "silence after which a peer is declared gone"},
    config::knob{"RDMAX_RPC_RECONNECT", &rpc_options::reconnect, config::flag{},
                 "`0`: a client does not reconnect (calls end peer_gone)"},
    config::knob{"RDMAX_RPC_BACKOFF_MS", &rpc_options::reconnect_backoff,
                 config::number{.lo = 1, .hi = 600'000}, "first wait before reconnecting"},
    config::knob{"RDMAX_RPC_BACKOFF_MAX_MS", &rpc_options::reconnect_backoff_max,
                 config::number{.lo = 1, .hi = 3'600'000}, "longest wait between reconnects"},
    config::knob{"RDMAX_RPC_GIVE_UP_MS", &rpc_options::reconnect_give_up,
                 config::number{.lo = 0, .hi = 86'400'000},
                 "failed reconnects for this long end the calls (0: never)"},
    config::knob{"RDMAX_RPC_REPLY_CACHE_CALLS", &rpc_options::reply_cache_calls,
                 config::number{.lo = 1, .hi = 1U << 24}, "replies a server keeps per client"},
    config::knob{"RDMAX_RPC_REPLY_CACHE_BYTES", &rpc_options::reply_cache_bytes,
                 config::number{.lo = 0, .hi = 1U << 31, .bytes = true},
                 "reply bytes a server keeps, over every client"},
    config::knob{"RDMAX_RPC_REPLY_CACHE_TTL_MS", &rpc_options::reply_cache_ttl,
                 config::number{.lo = 1, .hi = 86'400'000}, "how long a kept reply answers"},
    config::knob{"RDMAX_RPC_REPLY_CACHE_LINGER_MS", &rpc_options::reply_cache_linger,
                 config::number{.lo = 0, .hi = 86'400'000},
                 "how long a client's replies outlive its last connection"},
    config::knob{"RDMAX_RPC_LOCAL", &rpc_options::local, config::flag{},
                 "`0`: RPC between processes on one node through the device too"},
    config::knob{
        "RDMAX_RPC_PTRACER", &rpc_options::ptracer,
        config::one_of<rpc_options::ptracer_grant>({{"off", rpc_options::ptracer_grant::off},
                                                    {"peer", rpc_options::ptracer_grant::peer},
                                                    {"any", rpc_options::ptracer_grant::any}}),
        "under Yama scope 1, whom a client lets use CMA on it: its first node-local "
        "server, `any`, `off`"},
    config::knob{"RDMAX_RPC_TRANSPORTS", &rpc_options::transports, transport_list{},
                 "transports to use, comma list (`rdma`, `shm`, `tcp`); no device: no rdma"},
};

} // namespace rdmax::rpc
