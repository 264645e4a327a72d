#pragma once
// Every RDMAX_* knob of the library, from the tables beside each options
// struct (knob.hpp): what rdmax-info prints and the README's table is checked
// against.

#include <vector>

#include <rdmax/config/knob.hpp>

namespace rdmax::config {

/// A row per knob of every options struct (rcache, arena, handle, scheduler,
/// rpc, mapping cache, in that order), its value read from this process's
/// environment; a malformed value is reported in the row, not thrown.
[[nodiscard]] std::vector<knob_row> knobs_from_env();

} // namespace rdmax::config
