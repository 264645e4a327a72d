// dmabuf_cache's slot table and registrar (include/rdmax/mem/dmabuf_cache.hpp).
#include <cerrno>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <rdmax/error.hpp>
#include <rdmax/mem/dmabuf_cache.hpp>
#include <rdmax/mem/dmabuf_region.hpp>

namespace rdmax {

namespace {

constexpr std::uint64_t slot_bytes = std::uint64_t{1} << dmabuf_slots::slot_shift;

// What `fd` is, if it is a dma-buf: its identity and size; throws otherwise.
// A buffer up to a page short of a slot: its last registration, rounded up to
// pages, must not reach the next slot (the cache would merge them).
std::pair<dmabuf_identity, std::size_t> inspect(int fd) {
    constexpr std::string_view verb = "dmabuf_cache::add";
    const long long end = dmabuf_size(fd);
    if (end < 0)
        throw_error(verb, EINVAL, fmt::format("fd {} is not a dma-buf", fd));
    struct stat st {};
    if (::fstat(fd, &st) != 0)
        throw_error(verb, errno, fmt::format("fd {}", fd));
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    if (end <= 0 || static_cast<std::uint64_t>(end) > slot_bytes - page)
        throw_error(verb, EINVAL,
                    fmt::format("dma-buf fd {} has {} bytes: the cache takes 1 byte to 1 TiB "
                                "less a page",
                                fd, end));
    return {{st.st_dev, st.st_ino}, static_cast<std::size_t>(end)};
}

} // namespace

dmabuf_slots::~dmabuf_slots() {
    for (auto& b : table_)
        if (b.fd >= 0)
            ::close(b.fd);
}

dmabuf_slots::found dmabuf_slots::add(int fd) {
    // The dup first, and what it is from the dup: the caller's fd number may
    // be closed and reused by another thread meanwhile; the dup cannot.
    const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0)
        throw_error("dmabuf_cache::add", errno, fmt::format("dup of fd {}", fd));
    std::pair<dmabuf_identity, std::size_t> what;
    try {
        what = inspect(dup);
    } catch (...) {
        ::close(dup);
        throw;
    }
    const auto& [id, size] = what;
    const std::scoped_lock lock(mutex_);
    unsigned empty = 0;
    for (unsigned s = 1; s < slots; ++s) {
        if (table_[s].adds != 0 && table_[s].id == id) {
            ++table_[s].adds;
            ::close(dup);
            return {s, table_[s].size, generation_[s].load(std::memory_order_relaxed)};
        }
        if (empty == 0 && table_[s].adds == 0 && !table_[s].closing)
            empty = s;
    }
    if (empty == 0) {
        ::close(dup);
        throw_error("dmabuf_cache::add", ENOSPC,
                    fmt::format("{} buffers are known already: forget() some", slots - 1));
    }
    table_[empty] = {id, dup, size, 1};
    return {empty, size, generation_[empty].load(std::memory_order_relaxed)};
}

bool dmabuf_slots::release(unsigned slot, std::uint32_t generation) {
    const std::scoped_lock lock(mutex_);
    buffer& b = table_.at(slot);
    if (b.adds == 0 || generation_[slot].load(std::memory_order_relaxed) != generation)
        throw_error("dmabuf_cache::forget", EBADF, "the buffer was forgotten already");
    if (--b.adds != 0)
        return false;
    ::close(b.fd);
    b = {};
    b.closing = true; // not reused until free(): its registrations are still cached
    generation_[slot].fetch_add(1, std::memory_order_release); // its tokens go stale
    return true;
}

void dmabuf_slots::free(unsigned slot) {
    const std::scoped_lock lock(mutex_);
    table_.at(slot).closing = false;
}

dmabuf_slots::use dmabuf_slots::lend(unsigned slot) {
    std::unique_lock lock(mutex_);
    const buffer& b = table_.at(slot);
    const int fd = b.adds != 0 ? b.fd : -1;
    const std::size_t size = b.size;
    return {std::move(lock), fd, size};
}

ibv_mr* dmabuf_registrar::reg(void* addr, std::size_t len, rights granted) {
    const auto at = reinterpret_cast<std::uintptr_t>(addr);
    const auto slot = static_cast<unsigned>(at >> dmabuf_slots::slot_shift);
    const std::uint64_t offset = at & (slot_bytes - 1);
    if (slot == 0 || slot >= dmabuf_slots::slots)
        throw_error("ibv_reg_dmabuf_mr", EINVAL,
                    fmt::format("{:#x} is no address of a dma-buf cache", at));
    const auto use = slots_->lend(slot);
    if (use.fd < 0)
        throw_error("ibv_reg_dmabuf_mr", EBADF, "the buffer was forgotten (dmabuf_cache::forget)");
    // The cache asks for whole host pages, and a buffer's last page may be
    // partial: that much is cut off; anything further (a forged token's size)
    // is refused, so that no entry claims bytes its registration lacks.
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t whole = (use.size + page - 1) / page * page;
    if (offset >= use.size || len > whole - offset)
        throw_error(
            "ibv_reg_dmabuf_mr", ERANGE,
            fmt::format("[{}, +{}) is not inside the buffer's {} bytes", offset, len, use.size));
    len = std::min<std::size_t>(len, use.size - offset);
    return register_dmabuf(*pd_, use.fd, offset, len, at, granted);
}

dmabuf_cache::buffer dmabuf_cache::add(int fd) {
    const auto f = slots_.add(fd);
    return {std::uint64_t{f.slot} << dmabuf_slots::slot_shift, f.size, f.generation};
}

void dmabuf_cache::forget(buffer b) {
    const auto slot = static_cast<unsigned>(b.base >> dmabuf_slots::slot_shift);
    if (b.base == 0 || slot >= dmabuf_slots::slots || (b.base & (slot_bytes - 1)) != 0)
        throw_error("dmabuf_cache::forget", EINVAL, "no buffer of this cache");
    // The slot is closed first, so a miss racing with this finds no fd
    // (EBADF) rather than registering anew what is being forgotten; and it is
    // reused only once its registrations left the cache, so that another
    // buffer in it can never hit one of them.
    if (slots_.release(slot, b.generation)) {
        cache_.invalidate(reinterpret_cast<const void*>(b.base), slot_bytes);
        slots_.free(slot);
    }
}

ibv_mr* dmabuf_cache::register_exact(buffer b, std::uint64_t offset, std::size_t len,
                                     rights granted) {
    (void)address(b, offset, len); // EBADF, ERANGE
    const auto slot = static_cast<unsigned>(b.base >> dmabuf_slots::slot_shift);
    const auto use = slots_.lend(slot);
    // Under the slot table's mutex: a forget() and an add() between the
    // check above and here could have given the slot to another buffer.
    if (use.fd < 0 || !slots_.current(slot, b.generation))
        throw_error("ibv_reg_dmabuf_mr", EBADF, "the buffer was forgotten (dmabuf_cache::forget)");
    if (offset > use.size || len > use.size - offset) // a token that claims more than its buffer
        throw_error("ibv_reg_dmabuf_mr", ERANGE,
                    fmt::format("[{}, +{}) of a {}-byte dma-buf", offset, len, use.size));
    return register_dmabuf(*pd_, use.fd, offset, len, iova(b, offset), granted);
}

const void* dmabuf_cache::address(buffer b, std::uint64_t offset, std::size_t len) const {
    const auto slot = static_cast<unsigned>(b.base >> dmabuf_slots::slot_shift);
    if (b.base == 0 || (b.base & (slot_bytes - 1)) != 0 || !slots_.current(slot, b.generation))
        throw_error("dmabuf_cache", EBADF, "a token of a buffer forgotten, or of no buffer");
    if (offset > b.size || len > b.size - offset)
        throw_error("dmabuf_cache", ERANGE,
                    fmt::format("[{}, +{}) of a {}-byte dma-buf", offset, len, b.size));
    return reinterpret_cast<const void*>(b.base + offset);
}

} // namespace rdmax
