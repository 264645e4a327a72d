#!/usr/bin/env python3
"""The include tree's rules (unit test header_rules; docs/design.md, "Include layout"):

- rdmax.hpp includes no header of include/rdmax/detail/ (machinery users never
  name; a public header that needs one includes it);
- no public header is over 400 lines: a class's contract and API stay readable
  top to bottom, its member bodies go to a NAME-inl.hpp beside it (public
  means outside detail/ and not an -inl.hpp);
- verbs/ (and detail/verbs/) headers know nothing of the scheduler above them:
  no include of rdmax/sched/, no sched:: name outside comments (a port reaches
  the queue pair through its *_for_port members);
- the RPC transport seam (detail/rpc/link.hpp, rpc::detail::link) declares at
  most 10 virtual operations: what both paths share, no more (issue 24).

check_headers.py INCLUDE-DIR
"""
import pathlib
import re
import sys

MAX_LINES = 400
MAX_LINK_VIRTUALS = 10

root = pathlib.Path(sys.argv[1]) / "rdmax"
failures = []

umbrella = root / "rdmax.hpp"
for n, line in enumerate(umbrella.read_text().splitlines(), 1):
    if re.match(r"\s*#\s*include\s*<rdmax/detail/", line):
        failures.append(f"{umbrella}:{n}: rdmax.hpp includes a detail/ header: {line.strip()}")

for header in sorted(root.rglob("*.hpp")):
    rel = header.relative_to(root).as_posix()
    if rel.startswith("detail/") or header.name.endswith("-inl.hpp"):
        continue
    lines = len(header.read_text().splitlines())
    if lines > MAX_LINES:
        failures.append(f"{header}: {lines} lines, over {MAX_LINES}: move member bodies to "
                        f"{header.stem}-inl.hpp, or machinery to detail/")

for header in sorted([*(root / "verbs").rglob("*.hpp"), *(root / "detail" / "verbs").rglob("*.hpp")]):
    for n, line in enumerate(header.read_text().splitlines(), 1):
        code = line.split("//")[0]  # comments may say who calls a hook
        if "rdmax/sched/" in line or "sched::" in code:
            failures.append(f"{header}:{n}: verbs knows about sched: {line.strip()}")

seam = root / "detail" / "rpc" / "link.hpp"
if seam.exists():
    code = "\n".join(line.split("//")[0] for line in seam.read_text().splitlines())
    virtuals = [m.group(1) for m in re.finditer(r"\bvirtual\b[^;{(]*?\b(\w+)\s*\(", code)
                if not m.group(1).startswith("~")]
    virtuals = [v for v in virtuals if v != "link"]
    if len(virtuals) > MAX_LINK_VIRTUALS:
        failures.append(f"{seam}: {len(virtuals)} virtual operations, over "
                        f"{MAX_LINK_VIRTUALS}: {', '.join(virtuals)}")

for f in failures:
    print(f"FAIL: {f}")
if failures:
    sys.exit(1)
print(f"ok: rdmax.hpp includes no detail/ header; public headers <= {MAX_LINES} lines; "
      "verbs names no sched; the RPC link seam has <= 10 virtuals")
