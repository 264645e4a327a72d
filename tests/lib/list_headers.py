#!/usr/bin/env python3
"""Prints the public headers under INCLUDE-DIR/rdmax, one per line, as
<rdmax/...> include paths (for tests/meson.build's headers-alone check)."""
import pathlib
import sys

root = pathlib.Path(sys.argv[1])
for header in sorted((root / "rdmax").rglob("*.hpp")):
    print(header.relative_to(root).as_posix())
