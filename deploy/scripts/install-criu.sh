#!/usr/bin/env bash
# Install a working CRIU (4.1 or later) for this machine, idempotently.
#
#   Debian 13+ : apt-get install criu (4.1.1 works on kernels >= 6.13).
#   Debian 12  : bookworm's criu 3.17 fails on kernels >= 6.13 ("Unexpected rt vDSO
#                area bounds"), and installing trixie's criu with apt would upgrade the
#                host libc.  Instead build a minimal trixie root with debootstrap and run
#                criu through that root's own dynamic loader.  The host is untouched.
#
# Writes a launcher to $1 (default: .venv/bin/criu) and verifies it with `criu check`.
set -euo pipefail

launcher=${1:-.venv/bin/criu}
root=${REVENANT_CRIU_ROOT:-/opt/revenant/criu-trixie}
min_version=4.1

log() { printf 'install-criu: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

version_ok() {  # version_ok CRIU_COMMAND...
    local v
    v=$("$@" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -1) || return 1
    [ -n "$v" ] || return 1
    [ "$(printf '%s\n%s\n' "$min_version" "$v" | sort -V | head -1)" = "$min_version" ]
}

apt_ready=
apt_install() {
    if [ -z "$apt_ready" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        apt_ready=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

debian_mirror() {
    # The machine's own configured mirror: deb822 sources first, then the classic list.
    local m
    m=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '{print $2}' | grep -v -- '-security' | head -1 || true)
    if [ -z "$m" ]; then
        m=$(grep -h '^deb ' /etc/apt/sources.list 2>/dev/null \
            | awk '{print $2}' | grep -v -- '-security' | head -1 || true)
    fi
    [ -n "$m" ] || die "no Debian mirror found in /etc/apt/sources.list{,.d}"
    printf '%s\n' "$m"
}

write_launcher() {
    mkdir -p "$(dirname "$launcher")"
    printf '%s\n' "$1" > "$launcher.tmp"
    chmod 0755 "$launcher.tmp"
    mv "$launcher.tmp" "$launcher"
}

[ "$(id -u)" = 0 ] || die "must run as root (criu needs CAP_SYS_ADMIN)"

codename=$( . /etc/os-release; echo "${VERSION_CODENAME:-}" )
major=$(cut -d. -f1 /etc/debian_version 2>/dev/null || echo 0)
case "$major" in (*[!0-9]*|'') major=0 ;; esac

if [ "$major" -ge 13 ] || [ "$codename" = trixie ] || [ "$codename" = forky ]; then
    command -v criu >/dev/null && version_ok criu || apt_install criu
    target=$(command -v criu)
    write_launcher "#!/bin/sh
exec $target \"\$@\""
else
    loader=$root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
    if ! [ -x "$root/usr/sbin/criu" ] || ! version_ok "$loader" --library-path "$root/usr/lib/x86_64-linux-gnu" "$root/usr/sbin/criu"; then
        command -v debootstrap >/dev/null || apt_install debootstrap
        mirror=$(debian_mirror)
        log "building a trixie root with criu in $root (about 30 s)"
        rm -rf "$root.partial"
        mkdir -p "$(dirname "$root")"
        debootstrap --variant=minbase --include=criu trixie "$root.partial" "$mirror" >"$root.log" 2>&1 \
            || die "debootstrap failed; see $root.log"
        rm -rf "$root"
        mv "$root.partial" "$root"
    fi
    write_launcher "#!/bin/sh
# criu from a trixie root, run through that root's own loader (host libc untouched).
exec $loader --library-path $root/usr/lib/x86_64-linux-gnu $root/usr/sbin/criu \"\$@\""
fi

version_ok "$launcher" || die "$launcher is not criu >= $min_version"
if ! out=$("$launcher" check 2>&1); then
    die "criu check failed: $(printf '%s\n' "$out" | grep -v RLIMIT_NOFILE | tail -1)"
fi
log "$("$launcher" --version | head -1) at $launcher: criu check passed"
