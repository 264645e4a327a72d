#pragma once
// Why the kernel refused to register memory, in words a user can act on.
//
// ibv_reg_mr pins the pages for as long as the registration lives. Linux
// refuses that (EFAULT, "Bad address") for a shared mapping (MAP_SHARED) of a
// file on a file system that writes dirty pages back (ext4, xfs, btrfs...):
// the file system must see every write, which DMA into a pinned page would
// bypass. The verbs registrar, memory_region and so the cache and arenas all
// build their registration error here, so that such a refusal names the
// mapping and says what to use instead.

#include <cstddef>
#include <string>
#include <string_view>

#include <rdmax/mem/rights.hpp>

namespace rdmax {

/// What backs [addr, addr + len), from /proc/self/maps and statfs(2).
struct mapping_facts {
    bool fully_mapped = false; ///< every byte of the range is mapped
    bool shared_file = false;  ///< some of it is a MAP_SHARED mapping of a file on a
                               ///< file system with writeback (not tmpfs, hugetlbfs, ramfs)
    std::string file;          ///< that file's path
    std::string file_system;   ///< its file system ("ext4", "xfs", or statfs's magic)
    bool read_only = false;    ///< some of it is mapped without write permission
};

/// Looks [addr, addr + len) up in this process's mappings.
[[nodiscard]] mapping_facts mapping_facts_of(const void* addr, std::size_t len);

/// The detail of a refused registration of [addr, addr + len) with rights
/// `granted` that failed with errno `err`: "N bytes at ADDR", and, where the
/// mapping explains an EFAULT, why and what to do instead.
[[nodiscard]] std::string registration_failure_detail(int err, const void* addr, std::size_t len,
                                                      rights granted);

/// Throws rdmax::error(verb, err, registration_failure_detail(...)). For
/// EFAULT the detail (which reads /proc/self/maps and may statfs a file) is
/// looked up when what() is first called, so it describes the mappings as
/// they are then; a caught-and-dropped refusal costs no lookup.
[[noreturn]] void throw_registration_error(std::string_view verb, int err, const void* addr,
                                           std::size_t len, rights granted);

} // namespace rdmax
