#!/usr/bin/env python3
"""A cache of translation units clang-tidy found clean (suite tidy).

clang-tidy takes minutes over the whole build on 2 cores, and its verdict on a
unit depends only on what the unit reads: its compile command, every file it
includes (ninja's record of the compiler's dependency output), the
.clang-tidy files and clang-tidy's version. A unit whose key (a hash of all
those) was found clean before is not checked again. Only clean runs are
recorded, so a finding is reported every time until it is fixed.

  tidy_cache.py select BUILD DB-IN DB-OUT KEYS-OUT SOURCE TIDY-VERSION
      writes to DB-OUT the units of DB-IN (deduplicated) whose key is not in
      the cache, and their keys to KEYS-OUT; prints "N of M units cached".
  tidy_cache.py mark KEYS
      records the keys of a clean run.

The cache is RDMAX_TIDY_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/rdmax/tidy);
RDMAX_TIDY_CACHE=off checks every unit.
Caveat: ninja records what g++ included; a header that only clang would include
(under #ifdef __clang__) is not in the key. rdmax's own headers have none.
"""
import hashlib
import json
import os
import pathlib
import subprocess
import sys


def cache_dir():
    where = os.environ.get("RDMAX_TIDY_CACHE")
    if where == "off":
        return None
    if where:
        return pathlib.Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return pathlib.Path(base) / "rdmax" / "tidy"


def unit_deps(build):
    """output -> the files ninja saw it read (one `ninja -t deps` for all)."""
    text = subprocess.run(["ninja", "-C", build, "-t", "deps"], check=True,
                          capture_output=True, text=True).stdout
    deps, current = {}, None
    for line in text.splitlines():
        if not line.strip():
            current = None
        elif not line.startswith(" "):
            current = line.split(":", 1)[0]
            deps[current] = [] if "(VALID)" in line else None
        elif current is not None and deps[current] is not None:
            deps[current].append(line.strip())
    return deps


def config_digest(source, version):
    h = hashlib.sha256(version.encode())
    for path in sorted(pathlib.Path(source).rglob(".clang-tidy")):
        if "subprojects" in path.parts or path.parts[-2].startswith("build"):
            continue
        h.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def select(build, db_in, db_out, keys_out, source, version):
    units, seen = [], set()
    for e in json.load(open(db_in)):
        if (e["directory"], e["file"]) not in seen:
            seen.add((e["directory"], e["file"]))
            units.append(e)
    where = cache_dir()
    deps = unit_deps(build) if where else {}
    config = config_digest(source, version)
    file_hash = {}

    def digest(path):
        if path not in file_hash:
            try:
                file_hash[path] = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
            except OSError:
                file_hash[path] = "missing"
        return file_hash[path]

    todo, keys = [], []
    for e in units:
        files = deps.get(e.get("output", ""))
        if not where or files is None:  # no record: check it, cache nothing
            todo.append(e)
            continue
        h = hashlib.sha256((config + e["directory"] + e["command"]).encode())
        for f in files:
            h.update(f.encode() + b"\0" + digest(os.path.join(build, f)).encode())
        key = h.hexdigest()
        if not (where / key).exists():
            todo.append(e)
            keys.append(key)
    json.dump(todo, open(db_out, "w"))
    pathlib.Path(keys_out).write_text("".join(k + "\n" for k in keys))
    print(f"{len(units) - len(todo)} of {len(units)} units cached as clean")


def mark(keys):
    where = cache_dir()
    if not where:
        return
    where.mkdir(parents=True, exist_ok=True)
    for key in pathlib.Path(keys).read_text().split():
        (where / key).touch()


if __name__ == "__main__":
    if sys.argv[1] == "select":
        select(*sys.argv[2:8])
    elif sys.argv[1] == "mark":
        mark(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} select|mark ...")
