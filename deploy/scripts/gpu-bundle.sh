#!/usr/bin/env bash
# Build build/gpu-bundle/: everything a machine with no network needs to run revenant's
# GPU checks (tests/gpu/device-check.sh) besides the repository itself.
#
#   wheels/     revenant and all its runtime and test dependencies: binary wheels for
#               CPython 3.11, 3.12 and 3.13 on x86_64 manylinux, pure wheels once, plus
#               setuptools and wheel so that the working tree itself can be installed offline:
#                 python3 -m venv v && v/bin/pip install --no-index --find-links wheels 'revenant[test]'
#   criu/       a self-contained criu: bin/criu (the binary), lib/ (only the shared
#               libraries it loads, and the dynamic loader) and the launcher ./criu, which
#               runs bin/criu through lib/'s loader with --library-path (the host libc is
#               never used).
#   MANIFEST.txt  every file with its size and sha256.
#
# Usage: deploy/scripts/gpu-bundle.sh [OUTDIR]     (default build/gpu-bundle; fails over 60 MiB)
# Environment: PYTHON (default .venv/bin/python), CRIU_LAUNCHER (default .venv/bin/criu, a
# launcher as deploy/scripts/install-criu.sh writes) or CRIU_ROOT (the root criu runs from).
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
out=${1:-build/gpu-bundle}
python=${PYTHON:-.venv/bin/python}
launcher=${CRIU_LAUNCHER:-.venv/bin/criu}
limit_mib=60
pyversions=(3.11 3.12 3.13)
platforms=(manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)

log() { printf 'gpu-bundle: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ -x "$python" ] || die "no python at $python (set PYTHON)"
rm -rf "$out"
mkdir -p "$out/wheels" "$out/criu/bin" "$out/criu/lib"

# --- (a) wheels ---------------------------------------------------------------------------
# The requirements, read from pyproject.toml: runtime, the test extra, and the build backend.
mapfile -t reqs < <("$python" - <<'EOF'
import tomllib
doc = tomllib.load(open("pyproject.toml", "rb"))
for r in doc["project"]["dependencies"] + doc["project"]["optional-dependencies"]["test"]:
    print(r)
for r in doc["build-system"]["requires"] + ["wheel"]:
    print(r)
EOF
)
log "requirements: ${reqs[*]}"

log "building the revenant wheel"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$out/wheels" . >&2

# Packages published only as source (nkeys, say) are built here into pure wheels first, with
# this Python's binary wheels alongside; the downloads below then find them in wheels/.
log "building and collecting wheels for $("$python" -c 'import sys; print(sys.version.split()[0])')"
PIP_CONSTRAINT= "$python" -m pip wheel --quiet --wheel-dir "$out/wheels" "${reqs[@]}" >&2

plat_args=()
for p in "${platforms[@]}"; do plat_args+=(--platform "$p"); done
for v in "${pyversions[@]}"; do
    log "downloading wheels for CPython $v"
    # No constraints file: the versions are whatever the registry has for that Python.
    PIP_CONSTRAINT= "$python" -m pip download --quiet --dest "$out/wheels" --only-binary=:all: \
        --find-links "$out/wheels" --implementation cp --python-version "$v" "${plat_args[@]}" "${reqs[@]}" >&2
done

# --- (b) criu -------------------------------------------------------------------------------
# The launcher is `exec LOADER --library-path LIBDIR CRIU "$@"`: read the three paths from it.
if [ -z "${CRIU_ROOT:-}" ]; then
    [ -r "$launcher" ] || die "no criu launcher at $launcher (set CRIU_LAUNCHER or CRIU_ROOT)"
    read -r loader libdir criu_bin < <(awk '$1 == "exec" && $3 == "--library-path" {print $2, $4, $5}' "$launcher")
    [ -n "${criu_bin:-}" ] || die "$launcher is not 'exec LOADER --library-path DIR CRIU \"\$@\"'"
else
    loader=$CRIU_ROOT/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
    libdir=$CRIU_ROOT/usr/lib/x86_64-linux-gnu
    criu_bin=$CRIU_ROOT/usr/sbin/criu
fi
for f in "$loader" "$criu_bin"; do [ -x "$f" ] || die "$f is missing or not executable"; done
log "criu: $criu_bin (loader $loader, libraries $libdir)"

cp -L "$criu_bin" "$out/criu/bin/criu"
cp -L "$loader" "$out/criu/lib/ld-linux-x86-64.so.2"
# Only what the loader really maps for criu (its --list), never the vdso.
n_libs=0
while read -r lib; do
    [ -n "$lib" ] || continue
    [ "$(basename "$lib")" = "ld-linux-x86-64.so.2" ] && continue
    cp -L "$lib" "$out/criu/lib/$(basename "$lib")"
    n_libs=$((n_libs + 1))
done < <("$loader" --library-path "$libdir" --list "$criu_bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
log "criu: $n_libs shared libraries"

cat > "$out/criu/criu" <<'EOF'
#!/bin/sh
# criu run through the bundle's own loader and libraries (the host libc is never used).
d=$(dirname "$(readlink -f "$0")")
exec "$d/lib/ld-linux-x86-64.so.2" --library-path "$d/lib" "$d/bin/criu" "$@"
EOF
chmod 755 "$out/criu/criu"
"$out/criu/criu" --version >&2 || die "the bundled criu does not run here"

# --- (c) manifest and size ------------------------------------------------------------------
(cd "$out" && find . -type f ! -name MANIFEST.txt | LC_ALL=C sort | while read -r f; do
    printf '%10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)" "${f#./}"
done) > "$out/MANIFEST.txt"
total=$(du -sb "$out" | cut -f1)
n_wheels=$(find "$out/wheels" -name '*.whl' | wc -l)
printf 'total %d bytes (%s MiB), %d wheels\n' "$total" "$(awk -v t="$total" 'BEGIN { printf "%.1f", t / 1048576 }')" "$n_wheels" \
    >> "$out/MANIFEST.txt"
log "$(tail -1 "$out/MANIFEST.txt")"
if [ "$total" -gt $((limit_mib * 1024 * 1024)) ]; then
    die "the bundle is $total bytes, over the ${limit_mib} MiB limit"
fi
echo "$out: $(tail -1 "$out/MANIFEST.txt")"
