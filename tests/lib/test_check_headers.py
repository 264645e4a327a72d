#!/usr/bin/env python3
"""Unit-suite test of check_headers.py on scratch include trees: a public
header of 400 lines passes and one of 401 fails, also in a subdirectory;
-inl.hpp and detail/ headers may be longer; rdmax.hpp including a detail/
header fails; a verbs/ header naming sched:: fails in code, not in a comment;
an RPC link seam (detail/rpc/link.hpp) of 11 virtuals fails, of 10 passes.
Each failing tree must fail for its own reason (the line check_headers.py
prints for it), so a rule that stopped firing is caught.

test_check_headers.py CHECK-HEADERS-PY
"""
import pathlib
import subprocess
import sys
import tempfile

check = sys.argv[1]
failures = 0


def lines(n):
    return "".join(f"// line {i}\n" for i in range(1, n + 1))


def expect(what, files, want_status, want_text=""):
    """Builds an include tree of FILES (path under rdmax/ -> text), runs the
    check on it, and compares its exit status and output."""
    global failures
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(scratch) / "rdmax"
        tree = {"rdmax.hpp": "#pragma once\n#include <rdmax/a.hpp>\n", "a.hpp": lines(10)}
        tree.update(files)
        for rel, text in tree.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        run = subprocess.run([sys.executable, check, scratch], capture_output=True, text=True,
                             check=False)
    out = run.stdout + run.stderr
    if run.returncode != want_status or want_text not in out:
        print(f"FAIL: {what}: exit {run.returncode} (want {want_status}"
              f"{', saying ' + repr(want_text) if want_text else ''}):\n{out}")
        failures += 1
    else:
        print(f"ok: {what} (exit {run.returncode})")


expect("a public header of 400 lines; longer -inl.hpp and detail/ headers",
       {"a.hpp": lines(400), "a-inl.hpp": lines(900), "detail/ring.hpp": lines(900)}, 0)
expect("a public header of 401 lines", {"a.hpp": lines(401)}, 1, "a.hpp: 401 lines, over 400")
expect("a public header of 401 lines in a subdirectory", {"mem/cache.hpp": lines(401)}, 1,
       "cache.hpp: 401 lines, over 400")
expect("rdmax.hpp including a detail/ header",
       {"rdmax.hpp": "#pragma once\n#include <rdmax/detail/ring.hpp>\n",
        "detail/ring.hpp": lines(5)}, 1, "rdmax.hpp includes a detail/ header")
expect("a verbs/ header naming sched:: in a comment only",
       {"verbs/qp.hpp": "// sched::basic_priority_scheduler calls this\n"}, 0)
expect("a verbs/ header naming sched:: in code",
       {"verbs/qp.hpp": "friend class sched::queue_pair_port;\n"}, 1,
       "verbs knows about sched")


def seam(n):
    ops = "".join(f"    virtual int op{i}(int x) noexcept = 0;\n" for i in range(n))
    return f"class link {{\npublic:\n    virtual ~link() = default;\n{ops}}};\n"


expect("an RPC link seam of 10 virtuals", {"detail/rpc/link.hpp": seam(10)}, 0)
expect("an RPC link seam of 11 virtuals", {"detail/rpc/link.hpp": seam(11)}, 1,
       "11 virtual operations, over 10")
sys.exit(1 if failures else 0)
