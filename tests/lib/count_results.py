#!/usr/bin/env python3
"""Counts meson test results across the phases of tests/run.

Usage: count_results.py [--ci] [--ci-no-skip PHASE:SUITE ...] PHASE=testlog.json ...
Prints one line per phase and, last, "N passed, N failed, N skipped" alone on
a line. With --ci a skipped rxe, kmod, dmabuf, install or tidy test counts as failed:
in CI the device and the module are always there (and install and tidy have
their packages), so a skip there means the harness is broken. --ci-no-skip
adds a suite that must not skip in one phase (odp on 7.x, where soft-RoCE has
on-demand paging, while on 6.1 it has none and SKIPs).

Under each failed test it prints why, so that the tail of a CI log (often all a
reader of CI gets) says what broke: the record's "note" (the multi-host suite
writes one) or the last lines of the test's output from meson's log.
"""
import json
import os
import sys

PASS = {"OK", "EXPECTEDFAIL"}
SKIP = {"SKIP"}
WHY_LINES = 12  # the output's last lines shown under a failed test
WHY_TESTS = 6  # failed tests shown with their reasons, in all


def text(value):
    """A record's field as text: anything else (a number, a list, null) is none."""
    return value if isinstance(value, str) else ""


def why(rec):
    """The reason a failed record gives: its note (on one line), else its output's
    last lines (each cut to 300 characters; only the output's tail is read)."""
    note = " ".join(text(rec.get("note")).split())
    if note:
        return [note[:600]]
    tail = text(rec.get("stdout"))[-WHY_LINES * 4096:]
    lines = [l.rstrip()[:300] for l in tail.splitlines() if l.strip()]
    return lines[-WHY_LINES:]


def phase_stderr(path):
    """What a phase that wrote no test log said last: the stderr.log tests/run
    keeps beside where the log should be (a VM's boot or kernel fetch failing)."""
    try:
        with open(os.path.join(os.path.dirname(path), "stderr.log"), encoding="utf-8",
                  errors="replace") as f:
            tail = f.read()[-WHY_LINES * 4096:]
    except OSError:
        return []
    lines = [l.rstrip()[:300] for l in tail.replace("\r", "").splitlines() if l.strip()]
    return lines[-WHY_LINES:]


def read_log(path):
    """The records of a meson test log, and the numbers of its lines that are
    not one (cut short by a killed run, garbled): those count as failures, and
    the rest of the log still counts."""
    records, garbled = [], []
    with open(path, encoding="utf-8", errors="replace") as log:
        for number, line in enumerate(log, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                records.append(rec)
            else:
                garbled.append(number)
    return records, garbled


def main(argv):
    ci = "--ci" in argv
    strict = set()
    phases = []
    args = iter(argv)
    for a in args:
        if a == "--ci-no-skip":
            strict.add(tuple(next(args).split(":", 1)))
        elif a != "--ci":
            phases.append(a)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    explained = 0
    for phase in phases:
        label, _, path = phase.partition("=")
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        problems = []
        try:
            records, garbled = read_log(path)
        except OSError as err:
            records, garbled = [], []
            counts["failed"] += 1
            problems.append(f"no test log ({err.__class__.__name__}): the phase did not run its tests")
            problems.extend("| " + l for l in phase_stderr(path))
        for number in garbled:
            counts["failed"] += 1
            problems.append(f"line {number} of the test log is not a test record (cut short or garbled)")
        if not records and not problems:
            # A log without a test means the phase selected nothing: never a pass.
            counts["failed"] += 1
            problems.append("the test log lists no test: the phase ran nothing")
        for rec in records:
            name, result = text(rec.get("name")) or "?", text(rec.get("result")) or "?"
            suite = name.split(" / ")[0].split(":")[-1]
            if result in PASS:
                counts["passed"] += 1
            elif result in SKIP and ci and suite in ("rxe", "kmod", "dmabuf", "install", "tidy"):
                counts["failed"] += 1
                problems.append(f"{name} skipped, and with CI=true an rxe, kmod, dmabuf, install or tidy skip is a failure")
            elif result in SKIP and ci and (label, suite) in strict:
                counts["failed"] += 1
                problems.append(f"{name} skipped, and with CI=true a {suite} skip in {label} is a failure")
            elif result in SKIP:
                counts["skipped"] += 1
            else:
                counts["failed"] += 1
                problems.append(f"{name}: {result}")
                if explained < WHY_TESTS:
                    explained += 1
                    problems.extend("| " + l for l in why(rec))
        for key in total:
            total[key] += counts[key]
        print(f"  {label:<14} {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
        for p in problems:
            print(f"        {p}" if p.startswith("| ") else f"    - {p}")
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
