/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The kernel API differences between the kernels rdmax builds for (Linux 6.1
 * to 7.x), in one place: the module's code calls these names and holds no
 * version check of its own.
 */
#ifndef RDMAX_COMPAT_H
#define RDMAX_COMPAT_H

#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/version.h>

/*
 * 6.3 made vma->vm_flags read-only: changes go through vm_flags_mod(), which
 * also takes the VMA's write lock for the per-VMA-lock page fault path.
 * ->mmap runs with mmap_lock held for writing, as both forms require.
 */
static inline void rdmax_vm_flags_mod(struct vm_area_struct *vma,
				      vm_flags_t set, vm_flags_t clear)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 3, 0)
	vm_flags_mod(vma, set, clear);
#else
	vma->vm_flags = (vma->vm_flags | set) & ~clear;
#endif
}

/*
 * 6.12 removed no_llseek: a NULL ->llseek now refuses seeking (ESPIPE), as
 * no_llseek did.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 12, 0)
#define rdmax_no_llseek NULL
#else
#define rdmax_no_llseek no_llseek
#endif

#endif /* RDMAX_COMPAT_H */
