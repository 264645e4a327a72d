#!/usr/bin/env bash
# Install check (suite install): `meson install` this build into a scratch
# directory, then build tests/install/consumer.cpp the way the README tells a
# user to, with nothing but `pkg-config --cflags --libs rdmax`, and run it
# (against the shared library, then statically linked).
#   check_install.sh BUILD-DIR SOURCE-DIR VERSION
set -euo pipefail
build=$1 source=$2 version=$3
cxx=${CXX:-c++}
command -v pkg-config >/dev/null || { echo "SKIP: pkg-config is not installed"; exit 77; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

meson install -C "$build" --no-rebuild --destdir "$scratch/root" --quiet
pcfile=$(find "$scratch/root" -name rdmax.pc -print -quit)
[ -n "$pcfile" ] || { echo "FAIL: meson install wrote no rdmax.pc"; exit 1; }
# The .pc names the configured prefix, but a staged install lies under the
# scratch root: a copy of it with that root in front of its prefix is what an
# install made there would have written (pkg-config's --define-variable would
# move libibverbs' and fmt's prefixes too).
mkdir "$scratch/pc"
sed "s|^prefix=|prefix=$scratch/root|" "$pcfile" >"$scratch/pc/rdmax.pc"
export PKG_CONFIG_PATH=$scratch/pc
pc() { pkg-config "$@" rdmax; }
flags=$(pc --cflags --libs)
echo "pkg-config --cflags --libs rdmax: $flags"
[ "$(pc --modversion)" = "$version" ] ||
    { echo "FAIL: rdmax.pc says version $(pc --modversion), meson.build $version"; exit 1; }
libdir=$(pc --variable=libdir)

# shellcheck disable=SC2086 # the flags are words
"$cxx" -Wall -Wextra -Werror -o "$scratch/consumer" "$source/tests/install/consumer.cpp" $flags \
    -Wl,-rpath,"$libdir"
"$scratch/consumer" "$version"
# The shared library is the one pkg-config linked against, not the build tree's.
# ldd's whole output first: `ldd | grep -q` under pipefail fails whenever grep
# stops reading before ldd has written its last line (SIGPIPE), as it did once in CI.
loaded=$(ldd "$scratch/consumer")
grep -q "$libdir/librdmax" <<<"$loaded" ||
    { echo "FAIL: the consumer did not load the installed librdmax"; echo "$loaded"; exit 1; }

# Static: the same flags with --static, against librdmax.a.
# shellcheck disable=SC2086
"$cxx" -Wall -Wextra -Werror -o "$scratch/consumer-static" "$source/tests/install/consumer.cpp" \
    $(pc --cflags) "$libdir/librdmax.a" $(pc --libs --static | sed 's/-lrdmax//')
"$scratch/consumer-static" "$version"
echo "ok: installed headers, rdmax.pc and librdmax serve a consumer (shared and static)"
