// libFuzzer target for registration_cache: the input is a sequence of
// operations on a 64-page arena (get with some rights over a byte range, drop
// a held handle, invalidate a range, flush, make the next registrations fail),
// and after every operation the cache is checked against a plain model of
// what must hold whatever the cache's internals are: what a handle covers, the
// counters, what is registered, and that no registration is ever stale.
//
// Input, read front to back; a byte past the end reads as 0, so every input
// is a valid program:
//   config            bits 0-2 max_count, bits 3-5 max_bytes (tables below),
//                     bits 6-7 == 3: caching disabled
//   then records, opcode % 8:
//   0-2 get           first page, page count, rights (bits: local write,
//                     remote write, remote read, remote atomic; bit 4: ask
//                     zero bytes), head and tail trims (each 0..page-1 bytes)
//   3-4 drop          which held handle
//   5   invalidate    first page, page count, head and tail trims
//   6   flush
//   7   fail          the next 1-3 registrations fail, with ENOMEM or EFAULT
//
// A broken invariant prints what broke and traps, which libFuzzer reports as
// a crash and saves the input as an artifact.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <unistd.h>
#include <utility>
#include <vector>

#include <rdmax/mem/registration_cache.hpp>

namespace {

using rdmax::rights;

int op_index = -1; // for the message of a broken invariant

[[noreturn]] void broken(const char* what) {
    std::fprintf(stderr, "fuzz_registration_cache: invariant broken after operation %d: %s\n",
                 op_index, what);
    __builtin_trap();
}

void require(bool ok, const char* what) {
    if (!ok)
        broken(what);
}

/// counting_registrar plus the live registrations by key, so that the checks
/// see what is registered and not only how much. Keys are unique: the
/// counting registrar numbers its registrations.
struct tracking_registrar : rdmax::counting_registrar {
    std::map<std::uint32_t, record> registered;

    [[nodiscard]] handle reg(void* addr, std::size_t len, rights granted) {
        handle h = counting_registrar::reg(addr, len, granted);
        require(registered.emplace(h->key, *h).second, "a key registered twice");
        return h;
    }
    void dereg(handle h) noexcept {
        require(registered.erase(h->key) == 1, "deregistered something not registered");
        counting_registrar::dereg(h);
    }
};

using cache_t = rdmax::registration_cache<tracking_registrar>;

constexpr std::size_t arena_pages = 64;
const std::uintptr_t page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));

/// Page-aligned memory for the cache to register. Never touched (the
/// registrar registers nothing) and never freed: one arena for all inputs.
std::uintptr_t arena_base() {
    static void* const base = std::aligned_alloc(page, arena_pages * page);
    return reinterpret_cast<std::uintptr_t>(base);
}

/// Rights from four bits, composed from the names rather than assuming the
/// verbs flag values.
constexpr rights rights_of(unsigned bits) {
    rights a = rights::local_read;
    if ((bits & 1u) != 0)
        a = a | rights::local_write;
    if ((bits & 2u) != 0)
        a = a | rights::remote_write;
    if ((bits & 4u) != 0)
        a = a | rights::remote_read;
    if ((bits & 8u) != 0)
        a = a | rights::remote_atomic;
    return a;
}

// get<A>() takes its rights as a template argument: one instantiation per
// combination, chosen at run time through a table.
using getter = cache_t::handle (*)(cache_t&, const void*, std::size_t);
template <unsigned Bits>
cache_t::handle get_with(cache_t& c, const void* addr, std::size_t len) {
    return c.get<rights_of(Bits)>(addr, len);
}
template <unsigned... Bits>
constexpr std::array<getter, sizeof...(Bits)>
make_getters(std::integer_sequence<unsigned, Bits...>) {
    return {&get_with<Bits>...};
}
constexpr auto getters = make_getters(std::make_integer_sequence<unsigned, 16>{});

constexpr std::array<std::size_t, 8> count_limits{1, 2, 3, 4, 8, 16, 64, 4096};
constexpr std::array<std::size_t, 8> byte_limits_pages{1, 2, 4, 8, 16, 32, 64, 1u << 20};

class input {
public:
    input(const std::uint8_t* data, std::size_t size) noexcept
        : data_(data)
        , size_(size) {}
    [[nodiscard]] bool done() const noexcept { return pos_ >= size_; }
    std::uint8_t byte() noexcept { return pos_ < size_ ? data_[pos_++] : 0; }
    /// 0 .. page-1, both ends reachable.
    std::uintptr_t trim() noexcept { return byte() * (page - 1) / 255; }

private:
    const std::uint8_t* data_;
    std::size_t size_;
    std::size_t pos_ = 0;
};

struct held {
    cache_t::handle h;
    // What was asked for.
    std::uintptr_t lo, hi;
    rights asked;
    // What was served; an entry does not change while referenced.
    std::uintptr_t start, end;
    rights granted;
    std::uint32_t key;
};

struct model {
    rdmax::rcache_options opt;
    std::vector<held> handles;
    /// For each page, the registrar's registration count when the page was
    /// last invalidated: a registration whose key (its number) is not above
    /// it predates the invalidation.
    std::array<std::uint32_t, arena_pages> invalidated_at{};
    std::uint64_t lookups = 0, hits = 0, misses = 0;
    rdmax::rcache_counters last{};
};

/// The invariants that hold between any two operations.
void check(cache_t& c, model& m) {
    auto& reg = c.registrar_ref();
    const rdmax::rcache_counters n = c.counters();
    const std::uintptr_t base = arena_base();

    require(n.lookups == m.lookups, "lookups differs from the number of get() calls");
    require(n.hits == m.hits, "hits differs from the get() calls that registered nothing");
    require(n.misses == m.misses, "misses differs from the get() calls that registered");
    require(n.hits + n.misses == n.lookups, "hits + misses != lookups");
    require(n.registrations == reg.regs, "registrations differs from the registrar's");
    require(n.merges >= m.last.merges && n.evictions >= m.last.evictions &&
                n.invalidations >= m.last.invalidations,
            "a counter went backwards");
    m.last = n;

    require(reg.regs - reg.deregs == reg.live, "registrar: regs - deregs != live");
    require(reg.live == reg.registered.size(), "registrar: live differs from its records");
    std::size_t bytes = 0;
    for (const auto& [key, r] : reg.registered) {
        bytes += r.len;
        require(r.addr % page == 0 && r.len % page == 0 && r.len > 0,
                "a registration is not whole pages");
        require(r.addr >= base && r.addr + r.len <= base + arena_pages * page,
                "a registration reaches outside everything ever asked for");
    }
    require(reg.live_bytes == bytes, "registrar: live_bytes differs from its records");

    // Every held handle still covers what was asked, with the rights asked,
    // and its registration is still registered as it was served. Reading the
    // handle also lets AddressSanitizer see an entry freed under a holder.
    std::map<std::uint32_t, std::size_t> held_keys;
    for (const held& h : m.handles) {
        require(static_cast<bool>(h.h), "a held handle is empty");
        require(h.h.start() == h.start && h.h.end() == h.end && h.h.granted() == h.granted &&
                    h.h.lkey() == h.key,
                "a held handle changed");
        require(h.start <= h.lo && h.end >= h.hi, "a held handle does not cover what was asked");
        require(rdmax::has(h.granted, h.asked), "a held handle lacks rights that were asked");
        const auto it = reg.registered.find(h.key);
        require(it != reg.registered.end(), "a held handle's registration was deregistered");
        require(it->second.addr == h.start && it->second.len == h.end - h.start &&
                    it->second.granted == h.granted,
                "a held handle's registration differs from what the handle says");
        ++held_keys[h.key];
    }

    // Registrations no handle holds are idle, and an idle one is cached (an
    // entry that left the cache while idle is deregistered at once). Cached
    // ones are disjoint and never stale.
    std::size_t idle = 0, idle_bytes = 0;
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> idle_ranges;
    for (const auto& [key, r] : reg.registered) {
        if (held_keys.count(key) != 0)
            continue;
        ++idle;
        idle_bytes += r.len;
        idle_ranges.emplace_back(r.addr, r.addr + r.len);
        for (std::uintptr_t p = (r.addr - base) / page; p < (r.addr + r.len - base) / page; ++p)
            require(key > m.invalidated_at[p],
                    "an idle registration survived an invalidation of its pages");
    }
    std::sort(idle_ranges.begin(), idle_ranges.end());
    for (std::size_t i = 1; i < idle_ranges.size(); ++i)
        require(idle_ranges[i - 1].second <= idle_ranges[i].first,
                "two cached registrations overlap");
    // The cache's count is the registrar's live set minus the registrations
    // that left the cache but are still held; which held ones those are the
    // model cannot see, so it checks the bounds.
    require(n.registered_count >= idle && n.registered_count <= reg.live,
            "registered_count is outside [idle registrations, live registrations]");
    require(n.registered_bytes >= idle_bytes && n.registered_bytes <= reg.live_bytes,
            "registered_bytes is outside [idle bytes, live bytes]");
    if (!m.opt.enable)
        require(n.registered_count == 0 && idle == 0,
                "caching is disabled, yet something is cached");
}

/// Idle registrations, for the checks that say there must be none.
std::size_t idle_count(cache_t& c, const model& m) {
    std::size_t idle = 0;
    for (const auto& [key, r] : c.registrar_ref().registered)
        idle += std::none_of(m.handles.begin(), m.handles.end(),
                             [k = key](const held& h) { return h.key == k; })
                    ? 1
                    : 0;
    return idle;
}

void do_get(cache_t& c, model& m, input& in) {
    const std::uintptr_t base = arena_base();
    const std::size_t first = in.byte() % arena_pages;
    const std::size_t count = 1 + in.byte() % std::min<std::size_t>(16, arena_pages - first);
    const unsigned bits = in.byte();
    const std::uintptr_t head = in.trim();
    const std::uintptr_t tail = in.trim();
    const std::uintptr_t lo = base + first * page + head;
    const std::uintptr_t hi = std::max(lo + 1, base + (first + count) * page - tail);
    const std::size_t len = (bits & 16u) != 0 ? 0 : hi - lo;
    const rights want = rights_of(bits & 15u);
    auto& reg = c.registrar_ref();
    const std::size_t regs_before = reg.regs;
    const std::size_t armed = reg.fail_next;
    const int fail_errno = reg.fail_errno;

    if (len == 0) {
        // Refused before it counts as a lookup.
        try {
            (void)getters[bits & 15u](c, reinterpret_cast<const void*>(lo), 0);
        } catch (const rdmax::error& err) {
            require(err.code().value() == EINVAL, "a zero-length get() failed without EINVAL");
            require(reg.regs == regs_before, "a refused get() registered something");
            return;
        }
        broken("a zero-length get() was served");
    }

    ++m.lookups;
    cache_t::handle h;
    try {
        h = getters[bits & 15u](c, reinterpret_cast<const void*>(lo), len);
    } catch (const rdmax::error& err) {
        // Only an injected failure may make get() fail, and only a get()
        // that tried to register (a miss); it leaves nothing registered.
        ++m.misses;
        require(armed > 0, "get() failed with no failure injected");
        require(err.code().value() == fail_errno, "get() failed with another errno than injected");
        require(reg.regs == regs_before, "a failed get() left a registration");
        return;
    }
    require(static_cast<bool>(h), "get() returned an empty handle");
    const std::uintptr_t start = h.start(), end = h.end();
    const std::uint32_t key = h.lkey();
    const rights granted = h.granted();
    if (reg.regs == regs_before) {
        ++m.hits;
    } else {
        // A miss registers exactly one registration and serves that one.
        ++m.misses;
        require(reg.regs == regs_before + 1, "one get() registered more than once");
        require(key == reg.regs, "a miss served another registration than the one it made");
    }
    require(start % page == 0 && end % page == 0, "a handle's range is not page aligned");
    require(start <= lo && end >= lo + len, "a handle does not cover what was asked");
    require(rdmax::has(granted, want), "a handle lacks rights that were asked");
    require(start >= base && end <= base + arena_pages * page,
            "a handle reaches outside everything ever asked for");
    for (std::uintptr_t p = (start - base) / page; p < (end - base) / page; ++p)
        require(key > m.invalidated_at[p], "get() served a stale registration");

    // Above a limit after a miss, nothing idle may remain (registrations in
    // use are never evicted). Not after an injected EFAULT: a union that
    // cannot be registered is served alone, uncached, without evicting.
    const bool over = c.counters().registered_count > m.opt.max_count ||
                      c.counters().registered_bytes > m.opt.max_bytes;
    const bool miss = reg.regs != regs_before;
    m.handles.push_back({std::move(h), lo, lo + len, want, start, end, granted, key});
    if (miss && m.opt.enable && !(armed > 0 && fail_errno == EFAULT) && over)
        require(idle_count(c, m) == 0, "over a limit after a miss with idle registrations left");
}

void do_invalidate(cache_t& c, model& m, input& in) {
    const std::size_t first = in.byte() % arena_pages;
    const std::size_t count = 1 + in.byte() % std::min<std::size_t>(16, arena_pages - first);
    const std::uintptr_t lo = arena_base() + first * page + in.trim();
    const std::uintptr_t hi = std::max(lo, arena_base() + (first + count) * page - in.trim());
    c.invalidate(reinterpret_cast<const void*>(lo), hi - lo);
    if (hi == lo)
        return; // an empty range invalidates nothing
    // Every page [lo, hi) touches is invalidated now (the cache may drop more).
    const auto now = static_cast<std::uint32_t>(c.registrar_ref().regs);
    for (std::uintptr_t p = (lo - arena_base()) / page; p < (hi - arena_base() + page - 1) / page;
         ++p)
        m.invalidated_at[p] = now;
}

void run(const std::uint8_t* data, std::size_t size) {
    input in(data, size);
    model m;
    const std::uint8_t config = in.byte();
    m.opt.max_count = count_limits[config & 7u];
    m.opt.max_bytes = byte_limits_pages[(config >> 3) & 7u] * page;
    m.opt.enable = (config >> 6) != 3;
    m.opt.monitor = rdmax::monitor_kind::manual;
    cache_t c{tracking_registrar{}, {}, m.opt};
    op_index = 0;
    check(c, m);
    while (!in.done()) {
        ++op_index;
        switch (in.byte() % 8) {
        case 0:
        case 1:
        case 2: do_get(c, m, in); break;
        case 3:
        case 4:
            if (const std::size_t i = in.byte(); !m.handles.empty()) {
                std::swap(m.handles[i % m.handles.size()], m.handles.back());
                m.handles.pop_back();
            }
            break;
        case 5: do_invalidate(c, m, in); break;
        case 6:
            c.flush();
            require(idle_count(c, m) == 0, "flush() left an idle registration");
            break;
        default: {
            const std::uint8_t b = in.byte();
            c.registrar_ref().fail_next = 1 + b % 3;
            c.registrar_ref().fail_errno = (b & 4u) != 0 ? EFAULT : ENOMEM;
            break;
        }
        }
        check(c, m);
    }
    // No leak: once every handle is gone, flush() leaves nothing registered.
    ++op_index;
    m.handles.clear();
    check(c, m);
    c.flush();
    check(c, m);
    require(c.registrar_ref().live == 0 && c.registrar_ref().registered.empty(),
            "registrations left after dropping every handle and flush()");
    require(c.counters().registered_count == 0 && c.counters().registered_bytes == 0,
            "the cache counts registrations after dropping every handle and flush()");
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    run(data, size);
    return 0;
}
