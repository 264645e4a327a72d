#pragma once
// A scope whose allocations counting_new.hpp leaves out: a test's own
// scaffolding (the fake links' copies of each message) around a path that
// must allocate nothing itself.

namespace rdmax::test {

/// Scopes open on this thread.
inline thread_local int not_counted_depth = 0;

struct not_counted {
    not_counted() noexcept { ++not_counted_depth; }
    not_counted(const not_counted&) = delete;
    not_counted& operator=(const not_counted&) = delete;
    ~not_counted() { --not_counted_depth; }
};

} // namespace rdmax::test
