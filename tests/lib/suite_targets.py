#!/usr/bin/env python3
"""Prints the ninja targets that a build directory's tests of some suites need.

Usage: suite_targets.py BUILDDIR SUITE... [--not SUITE...]
So that a build made only to run one suite (build-tsan/, build-fuzz/)
compiles only that suite's programs, not everything the project defines.
Reads meson's introspection files, the same ones "meson test" rebuilds from.
Exits 1 when no test of those suites needs a target: an empty list would
make ninja build everything.
"""
import json
import os
import sys


def main(argv):
    builddir, rest = argv[0], argv[1:]
    want, skip = set(), set()
    into = want
    for arg in rest:
        if arg == "--not":
            into = skip
        else:
            into.add(arg)
    info = os.path.join(builddir, "meson-info")
    with open(os.path.join(info, "intro-tests.json"), encoding="utf-8") as f:
        tests = json.load(f)
    with open(os.path.join(info, "intro-targets.json"), encoding="utf-8") as f:
        files = {t["id"]: t["filename"] for t in json.load(f)}
    targets = set()
    for test in tests:
        # Suites are listed as "project:suite" and "suite".
        suites = {s.split(":")[-1] for s in test["suite"]}
        if suites & want and not suites & skip:
            for dep in test.get("depends", []):
                targets.update(os.path.relpath(p, builddir) for p in files.get(dep, []))
    if not targets:
        print(f"suite_targets.py: no test in {builddir} of suites {sorted(want)} needs a target",
              file=sys.stderr)
        return 1
    print("\n".join(sorted(targets)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
