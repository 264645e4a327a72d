#!/usr/bin/env python3
"""Unit-suite test of count_results.py on scratch test logs: a failed test's
reason is shown (its note on one line, else its output's last 12 lines, each
cut to 300 characters); a record whose stdout or note is not text, a line that
is not a record (a log cut short by a killed run), a line of 5 MB: none stops
the count, each garbled line counts as one failure, and the rest of the log
still counts. The summary line is always printed last.

test_count_results.py COUNT-RESULTS-PY
"""
import json
import pathlib
import subprocess
import sys
import tempfile

count = sys.argv[1]
failures = 0


def expect(what, lines, want_status, want_last, want_texts=(), unwanted=()):
    """Runs count_results on one phase whose log is LINES (records or raw
    text), and checks its exit status, its last line, and what it shows."""
    global failures
    with tempfile.TemporaryDirectory() as scratch:
        log = pathlib.Path(scratch) / "testlog.json"
        log.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
        run = subprocess.run([sys.executable, count, f"phase={log}"], capture_output=True,
                             text=True, check=False, timeout=60)
    out = run.stdout.splitlines()
    problems = []
    if run.returncode != want_status:
        problems.append(f"exit {run.returncode}, want {want_status}")
    if not out or out[-1] != want_last:
        problems.append(f"last line {out[-1] if out else None!r}, want {want_last!r}")
    problems += [f"no {t!r} in the output" for t in want_texts if t not in run.stdout]
    problems += [f"{t!r} in the output" for t in unwanted if t in run.stdout]
    if max((len(l) for l in out), default=0) > 400:
        problems.append("an output line over 400 characters")
    if problems:
        failures += 1
        print(f"FAIL: {what}: {'; '.join(problems)}\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    else:
        print(f"ok: {what}")


def rec(name, result, **fields):
    return {"name": f"rdmax:unit / {name}", "result": result, **fields}


expect("passes only", [rec("a", "OK"), rec("b", "OK")], 0, "2 passed, 0 failed, 0 skipped")
expect("a failure shows its output's last 12 lines",
       [rec("a", "FAIL", stdout="".join(f"out {i}\n" for i in range(1, 21)))], 1,
       "0 passed, 1 failed, 0 skipped", ["| out 9", "| out 20"], ["out 8\n"])
expect("a note shows on one line", [rec("a", "FAIL", note="link: down\ntx timeouts 3")], 1,
       "0 passed, 1 failed, 0 skipped", ["| link: down tx timeouts 3"])
expect("stdout and note that are not text",
       [rec("a", "OK"), rec("b", "FAIL", stdout=5), rec("c", "FAIL", note=["x"]),
        rec("d", "FAIL", stdout={"x": 1}, note=None)], 1, "1 passed, 3 failed, 0 skipped",
       ["rdmax:unit / b: FAIL", "rdmax:unit / c: FAIL", "rdmax:unit / d: FAIL"])
expect("a log cut short: the garbled line fails, the rest counts",
       [rec("a", "OK"), rec("b", "OK"), '{"name": "rdmax:unit / c", "res'], 1,
       "2 passed, 1 failed, 0 skipped", ["line 3 of the test log is not a test record"])
expect("lines that are JSON but not records", [rec("a", "OK"), "[1, 2]", "7", "null"], 1,
       "1 passed, 3 failed, 0 skipped", ["line 2 ", "line 3 ", "line 4 "])
expect("a name and a result that are not text", [{"name": 3, "result": ["OK"]}], 1,
       "0 passed, 1 failed, 0 skipped", ["?: ?"])
expect("a line of 5 MB", [rec("a", "FAIL", stdout="x" * 5_000_000 + "\nboom\n")], 1,
       "0 passed, 1 failed, 0 skipped", ["| boom", "| " + "x" * 300])
expect("no log", [], 1, "0 passed, 1 failed, 0 skipped", ["the test log lists no test"])

sys.exit(1 if failures else 0)
