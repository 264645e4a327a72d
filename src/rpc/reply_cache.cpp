// rpc::detail::reply_cache: see reply_cache.hpp.

#include <algorithm>

#include <rdmax/detail/rpc/reply_cache.hpp>

namespace rdmax::rpc::detail {

namespace {
/// Replies up to this keep their entry's room for the next call (no
/// allocation on the call path once the ring has been round); larger ones
/// give it back when their entry is reused.
constexpr std::size_t small_reply = 4096;
} // namespace

void reply_cache::attach(std::uint64_t client, std::uint64_t first_call) {
    if (!records_.contains(client) && records_.size() >= limits_.records)
        make_room();
    auto [it, fresh] = records_.try_emplace(client);
    record& r = it->second;
    if (fresh) {
        try {
            r.ring.resize(limits_.calls);
        } catch (...) {
            records_.erase(it);
            throw;
        }
        // Calls before this record's first were sent to a server that did
        // not keep them here: a copy of one may have run.
        r.let_go = first_call > 0 ? first_call - 1 : 0;
    }
    ++r.connections;
    r.gone.reset();
}

void reply_cache::make_room() noexcept {
    auto oldest = records_.end();
    for (auto it = records_.begin(); it != records_.end(); ++it)
        if (it->second.gone &&
            (oldest == records_.end() || *it->second.gone < *oldest->second.gone))
            oldest = it;
    if (oldest != records_.end()) {
        release(oldest->second);
        records_.erase(oldest);
    }
}

void reply_cache::release(const record& r) noexcept {
    for (const entry& x : r.ring)
        bytes_ -= x.body.capacity();
}

void reply_cache::detach(std::uint64_t client, bool bye, time_point now) noexcept {
    const auto it = records_.find(client);
    if (it == records_.end())
        return;
    record& r = it->second;
    if (r.connections > 0)
        --r.connections;
    if (r.connections != 0)
        return;
    if (bye || limits_.linger.count() == 0) {
        release(r);
        records_.erase(it);
    } else {
        r.gone = now;
    }
}

void reply_cache::expire(time_point now) noexcept {
    std::erase_if(records_, [&](auto& kv) {
        if (!kv.second.gone || now - *kv.second.gone < limits_.linger)
            return false;
        release(kv.second);
        return true;
    });
}

reply_cache::entry* reply_cache::at(const entry_ref& e) noexcept {
    const auto it = records_.find(e.client);
    if (it == records_.end() || e.at >= it->second.ring.size())
        return nullptr;
    entry& x = it->second.ring[e.at];
    return x.st != state::empty && x.call_id == e.call_id ? &x : nullptr;
}

const reply_cache::entry* reply_cache::at(const entry_ref& e) const noexcept {
    return const_cast<reply_cache*>(this)->at(e);
}

std::optional<reply_cache::entry_ref> reply_cache::find(std::uint64_t client,
                                                        std::uint64_t call_id) const noexcept {
    const auto it = records_.find(client);
    if (it == records_.end())
        return std::nullopt;
    const std::vector<entry>& ring = it->second.ring;
    // Re-sent calls only (a few, after a reconnect): a scan of the ring.
    for (std::uint32_t i = 0; i < ring.size(); ++i)
        if (ring[i].st != state::empty && ring[i].call_id == call_id)
            return entry_ref{client, call_id, i};
    return std::nullopt;
}

void reply_cache::record_call(record& r, std::uint64_t call_id, time_point now,
                              std::uint64_t client, std::optional<entry_ref>& recorded) noexcept {
    entry& x = r.ring[r.next];
    if (x.st != state::empty)
        // Let go: a copy of it re-sent later may have run, and is not run again.
        r.let_go = std::max(r.let_go, x.call_id);
    if (x.body.capacity() > small_reply) {
        // A large reply's room is not held for the next call in this entry.
        bytes_ -= x.body.capacity();
        std::vector<std::byte>().swap(x.body); // (`= {}` would keep the capacity)
    }
    x.call_id = call_id;
    x.st = state::running;
    x.status = call_status::ok;
    x.when = now;
    x.body.clear();
    x.wants.reset();
    recorded = entry_ref{client, call_id, r.next};
    r.next = (r.next + 1) % static_cast<std::uint32_t>(r.ring.size());
}

reply_cache::verdict reply_cache::admit(std::uint64_t client, std::uint64_t call_id, bool retry,
                                        time_point now,
                                        std::optional<entry_ref>& recorded) noexcept {
    recorded.reset();
    const auto it = records_.find(client);
    if (it == records_.end())
        // No record: a re-sent call was meant for an earlier server (or one
        // whose record expired), which may have run it. A first copy (a
        // connection made without one: cannot happen) just runs.
        return retry ? verdict::unknown : verdict::run;
    record& r = it->second;
    if (retry) {
        if (const std::optional<entry_ref> e = find(client, call_id)) {
            const entry& x = r.ring[e->at];
            recorded = e;
            if (x.st == state::running)
                // One running past the TTL (a deferred call never answered)
                // is not waited for any longer.
                return now - x.when >= limits_.ttl ? verdict::unknown : verdict::running;
            if (x.st == state::lost || now - x.when >= limits_.ttl)
                return verdict::unknown;
            return verdict::cached;
        }
        if (call_id <= r.let_go)
            return verdict::unknown;
    }
    record_call(r, call_id, now, client, recorded);
    return verdict::run;
}

call_status reply_cache::reply(const entry_ref& e, std::span<const std::byte>& body) const {
    const entry* x = at(e);
    if (x == nullptr || x->st != state::done) {
        body = {};
        return call_status::unknown_outcome;
    }
    body = x->body;
    return x->status;
}

void reply_cache::set_waiter(const entry_ref& e, const waiter& w) noexcept {
    if (entry* x = at(e))
        x->wants = w;
}

bool reply_cache::keep_body(entry& x, std::span<const std::byte> body) noexcept {
    const std::size_t had = x.body.capacity();
    if (body.size() > had) {
        // More room: within the budget of every client's replies, or none.
        if (bytes_ - had + body.size() > limits_.bytes) {
            std::vector<std::byte>().swap(x.body);
            bytes_ -= had;
            return false;
        }
        try {
            x.body.reserve(body.size());
        } catch (...) {
            return false; // no memory: not kept
        }
        bytes_ += x.body.capacity() - had;
    }
    x.body.assign(body.begin(), body.end()); // within its capacity: no allocation
    return true;
}

std::optional<reply_cache::waiter> reply_cache::done(const entry_ref& e, call_status st,
                                                     std::span<const std::byte> body,
                                                     time_point now) noexcept {
    entry* x = at(e);
    if (x == nullptr || x->st != state::running)
        return std::nullopt;
    x->status = st;
    x->when = now;
    x->st = keep_body(*x, body) ? state::done : state::lost;
    std::optional<waiter> w = x->wants;
    x->wants.reset();
    return w;
}

std::optional<reply_cache::waiter> reply_cache::forget(const entry_ref& e) noexcept {
    entry* x = at(e);
    if (x == nullptr || x->st != state::running)
        return std::nullopt;
    x->st = state::empty;
    std::optional<waiter> w = x->wants;
    x->wants.reset();
    return w;
}

std::size_t reply_cache::entries() const noexcept {
    std::size_t n = 0;
    for (const auto& kv : records_)
        n += static_cast<std::size_t>(
            std::count_if(kv.second.ring.begin(), kv.second.ring.end(),
                          [](const entry& x) { return x.st != state::empty; }));
    return n;
}

} // namespace rdmax::rpc::detail
