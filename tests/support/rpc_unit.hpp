#pragma once
// What the RPC unit tests on fake links (test_rpc_*, test_asio_*,
// test_server_group) say in common: short names for the types they talk
// about, strings as message bodies, the virtual clock their endpoints may
// read, and the options of the Asio tests. Each of them used to declare the
// same names and define the same helpers itself; they bring in this one copy
// with `using namespace rdmax::test::rpc_unit;`.

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include <rdmax/sched/coarse_clock.hpp>

#include "fake_link.hpp"

namespace rdmax::test::rpc_unit {

using rpc::call_result;
using rpc::call_status;
using rpc::peer_id;
using rpc::peer_state;
using test::fake_end;
using test::fake_path;
using inside = rpc::protocol_test_access;
using time_point = sched::coarse_clock::time_point;
using namespace std::chrono_literals; // the tests write their times so

/// A string's bytes, as a request or reply body.
inline std::span<const std::byte> bytes_of(std::string_view s) {
    return std::as_bytes(std::span(s.data(), s.size()));
}
/// A body's bytes, as a string (to compare with what was sent).
inline std::string text(std::span<const std::byte> b) {
    return {reinterpret_cast<const char*>(b.data()), b.size()};
}

/// A virtual clock, for endpoints given it with inside::use_clock: time
/// moves only when the test moves virtual_now.
inline time_point virtual_now{std::chrono::hours(1)};
inline time_point virtual_clock() noexcept {
    return virtual_now;
}

/// The options of the Asio tests on node-local fake links (test_asio_server,
/// test_asio_chain), whose endpoints an io_context runs on real time: 8
/// slots of 256 B, housekeeping every millisecond, and a call timeout that
/// no test reaches.
inline rpc::rpc_options asio_options() {
    rpc::rpc_options o;
    o.slots = 8;
    o.slot_bytes = 256;
    o.local = false;
    o.call_timeout = 30s;
    o.housekeeping = 1ms;
    return o;
}

} // namespace rdmax::test::rpc_unit
