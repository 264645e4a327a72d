#pragma once
// A real rpc::client and rpc::server over device-path fake links that the
// test makes, cuts and lets the client make again (its redial), on a virtual
// clock. test_rpc_resilience (what survives a lost connection) and
// test_asio_client (the Asio adapter over the same losses) both stand on
// this; one copy keeps the two worlds from drifting apart. A test's world
// derives from it, makes the server (make_server, then its own handlers) and
// then calls connect(). Built on rpc_unit.hpp (its virtual clock), which it
// brings along for the tests that use it.

#include <functional>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "fake_link.hpp"
#include "rpc_unit.hpp"

namespace rdmax::test {

/// Both endpoints read rpc_unit::virtual_clock.
struct redialing_pair {
    using inside = rpc::protocol_test_access;

    rpc::rpc_options o;
    std::unique_ptr<rpc::client> cli;
    std::unique_ptr<rpc::server> srv;
    std::shared_ptr<fake_end> c, s;             ///< the current connection's ends
    std::vector<std::shared_ptr<fake_end>> old; ///< earlier connections' ends, kept alive
    rpc::peer_id p;
    bool up = true; ///< the server takes connections

    explicit redialing_pair(rpc::rpc_options opts)
        : o(opts)
        , cli(inside::make_client(o)) {
        inside::use_clock(*cli, &rpc_unit::virtual_clock);
    }

    /// A (new) server on the virtual clock, with no handlers yet.
    void make_server() {
        srv = inside::make_server(o);
        inside::use_clock(*srv, &rpc_unit::virtual_clock);
    }
    /// The first connection, and how the client makes the next ones: each
    /// attempt (`on_attempt` told first) is refused while !up, else joins.
    void connect(std::function<void()> on_attempt = {}) {
        p = inside::adopt(*cli, join(), srv->incarnation());
        inside::redial(
            *cli,
            [this, on_attempt = std::move(on_attempt)]() -> std::unique_ptr<rpc::detail::link> {
                if (on_attempt)
                    on_attempt();
                if (!up)
                    throw std::runtime_error("connection refused");
                auto w = std::make_unique<fake_link>(join());
                w->peer_incarnation = srv->incarnation();
                return w;
            });
    }
    /// A new connection: its server end adopted by the server, its client end returned.
    std::shared_ptr<fake_end> join() {
        if (c) {
            old.push_back(c);
            old.push_back(s);
        }
        c = std::make_shared<fake_end>(fake_path::device, o.slots, o.slot_bytes);
        s = std::make_shared<fake_end>(fake_path::device, o.slots, o.slot_bytes);
        c->peer = s.get();
        s->peer = c.get();
        (void)inside::adopt(*srv, s, cli->incarnation(), inside::next_call(*cli));
        return c;
    }
    /// The connection fails under both (connection events on both sides);
    /// what was in flight on it is lost.
    void cut() {
        c->outbox.clear();
        s->outbox.clear();
        c->leave();
        s->leave();
    }
    /// One round of the network: what the client sent lands at the server,
    /// the server polls, what it sent lands at the client. True when
    /// something reached the client.
    bool land_both_ways() {
        bool to_client = false;
        while (!c->outbox.empty())
            if (const auto imm = c->land_one())
                inside::receive_imm(*srv, *s, *imm);
        (void)srv->poll();
        while (!s->outbox.empty())
            if (const auto imm = s->land_one()) {
                inside::receive_imm(*cli, *c, *imm);
                to_client = true;
            }
        return to_client;
    }
};

} // namespace rdmax::test
