#pragma once
// What a caller may ask of one scheduled request beyond its priority:
// whether its success is reported, whether it is fenced behind every earlier
// request (basic_priority_scheduler.hpp says what a fence orders), and
// whether it wakes a peer that waits for solicited events, and whether it may
// wait for a later doorbell.

namespace rdmax::sched {

/// Per-request options.
struct request_flags {
    bool signaled = true;   ///< report a completion on success (failures always are)
    bool fence = false;     ///< post only after every earlier request was posted (see above)
    bool solicited = false; ///< SEND / WRITE_WITH_IMM: wake a peer waiting for solicited events
    /// Queue it without posting: it goes with the next doorbell the scheduler
    /// rings (flush(), poll(), or a submission without this flag), so that
    /// several requests share one (on soft-RoCE, one system call).
    bool deferred = false;
};

} // namespace rdmax::sched
