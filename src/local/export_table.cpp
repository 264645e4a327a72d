#include <cerrno>
#include <new>

#include <fmt/format.h>

#include <rdmax/detail/local/export_table.hpp>
#include <rdmax/error.hpp>

namespace rdmax::local {

std::span<export_slot> export_table::view(std::span<std::byte> control,
                                          std::uint32_t slots) noexcept {
    if (control.size() < std::size_t{slots} * sizeof(export_slot))
        return {};
    return {reinterpret_cast<export_slot*>(control.data()), slots};
}

export_table::export_table(std::uint32_t slots)
    : control_(shared_segment::create("exports", std::size_t{slots} * sizeof(export_slot)))
    , slots_(slots) {
    if (slots == 0)
        throw_error("export_table", EINVAL, "a table of 0 slots");
    for (std::uint32_t i = 0; i < slots; ++i)
        new (control_.data() + std::size_t{i} * sizeof(export_slot)) export_slot{{0}, 0};
    table_ = view(control_.bytes(), slots);
    free_.reserve(slots);
    for (std::uint32_t i = slots; i-- > 0;)
        free_.push_back(i);
}

export_notice export_table::publish_bytes(std::uint64_t bytes) {
    if (free_.empty())
        throw_error("export_table::publish", ENOSPC,
                    fmt::format("all {} export slots are taken: revoke some", slots_));
    const std::uint32_t id = free_.back();
    free_.pop_back();
    export_notice n;
    n.id = id;
    n.generation = next_generation_++;
    n.bytes = bytes;
    table_[id].bytes = n.bytes;
    table_[id].generation.store(n.generation, std::memory_order_release);
    ++live_;
    return n;
}

bool export_table::revoke(const export_notice& n) noexcept {
    if (n.id >= slots_ || n.generation == 0 ||
        table_[n.id].generation.load(std::memory_order_relaxed) != n.generation)
        return false;
    table_[n.id].generation.store(0, std::memory_order_release);
    free_.push_back(n.id);
    --live_;
    return true;
}

} // namespace rdmax::local
