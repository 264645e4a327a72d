#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_registration_cache: one input a scenario.

The fuzzer reaches all of these by itself within seconds; the seeds make its
first inputs meaningful and, with RDMAX_FUZZ_SECONDS=0, are a fixed
regression run. The encoding is the one fuzz_registration_cache.cpp
describes at its top; rerun this after changing it.
"""
import os

LW, RW, RR, RA, ZERO = 1, 2, 4, 8, 16  # rights bits, and "ask zero bytes"


def config(count_idx=7, bytes_idx=7, enabled=True):
    return [count_idx | bytes_idx << 3 | (0 if enabled else 3 << 6)]


def get(first, count, rights=LW, head=0, tail=0):
    return [0, first, count - 1, rights, head, tail]


def drop(i=0):
    return [3, i]


def invalidate(first, count, head=0, tail=0):
    return [5, first, count - 1, head, tail]


FLUSH = [6]


def fail(times, efault=False):
    return [7, (times - 1) | (4 if efault else 0)]


SEEDS = {
    # Adjacent and overlapping gets merge; a right the union lacks widens it.
    "merge_and_widen": config() + get(0, 2) + get(2, 2) + get(3, 4, RR) + get(1, 1, LW | RR)
    + drop() + drop() + FLUSH + get(0, 7, RR, head=255, tail=255),
    # Invalidating a held registration: it stays with its holder, the next get
    # registers anew; unaligned ends, and a range that only touches.
    "invalidate_held": config() + get(4, 3) + invalidate(5, 1, head=128) + get(4, 3)
    + invalidate(7, 2) + drop(1) + get(6, 1, RW | LW) + drop() + drop() + FLUSH,
    # Count limit 2 and byte limit 4 pages: eviction of idle ones, not held ones.
    "limits": config(count_idx=1, bytes_idx=2) + get(0, 1) + drop() + get(8, 2) + drop()
    + get(0, 1) + drop() + get(16, 3) + get(24, 1) + drop(1) + get(32, 2) + get(0, 1),
    # ENOMEM: idle registrations are evicted and the registration retried once;
    # failing twice reaches the caller.
    "enomem_retry": config() + get(0, 1) + drop() + get(4, 1) + drop() + fail(1) + get(8, 1)
    + fail(2) + get(12, 1) + get(12, 1),
    # EFAULT on a union: the request is served alone, uncached; on a lone
    # request it reaches the caller.
    "efault_union": config() + get(0, 2) + drop() + fail(1, efault=True) + get(1, 2, RR)
    + fail(1, efault=True) + get(20, 1) + get(1, 2, RR) + drop() + drop(),
    # Caching disabled: every get registers, every release deregisters.
    "disabled": config(enabled=False) + get(0, 4) + get(1, 1) + drop() + invalidate(0, 8)
    + FLUSH + get(0, 4, RR | LW),
    # A zero-length get is refused before it counts as a lookup.
    "zero_length": config() + get(3, 1, ZERO) + get(3, 1) + get(3, 1, ZERO | RR),
}

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "fuzz_registration_cache")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(bytes(data))
