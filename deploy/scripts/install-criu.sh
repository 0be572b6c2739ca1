#!/usr/bin/env bash
# Install a criu that can checkpoint revenant's jobs on this machine, idempotently.
#
# criu 4.2 or later: Linux 6.16 refuses SO_PASSCRED on anything but unix, netlink and
# bluetooth sockets, and criu 4.1 asks every socket for it, so it dumps no UDP or TCP socket
# there (criu issue #2705, fixed in 4.2).  Debian 12's criu (3.17) fails on kernels >= 6.13
# ("Unexpected rt vDSO area bounds"); Debian 13's is 4.1.1.  So, unless the host's own criu is
# 4.2 or later and passes the socket probe below, build a minimal Debian forky root with
# debootstrap (criu 4.2.1 and the libnftables its network lock uses) and run criu through that
# root's own dynamic loader: the host's libc is untouched.
#
# Beyond `criu check`, the probe (python -m revenant.agent.network.netprobe) dumps and restores a
# process holding a UDP socket, a listening TCP socket, an established loopback TCP pair and a
# unix datagram socket connected to the outside; the agent runs the same at start-up.
#
# criu reads each dumped task's rlimits with prlimit(2), which the kernel refuses for another
# user's task unless root holds CAP_SYS_RESOURCE; containers and VMs that drop it (these
# machines) could then checkpoint no user's job.  So the forky root's criu is rebuilt from its
# upstream source with deploy/criu/rlimits-proc-fallback.patch (the limits read from
# /proc/PID/limits where prlimit is refused), marked "GitID: $patched_mark" in its --version
# (the agent looks for it).  The source's checksum is pinned below; the build runs in the root
# (chroot, a private mount namespace), with the root's own compiler and libraries (about a
# minute, 80 build packages).  Where the build cannot run, the unpatched criu is installed and
# users' jobs cannot be checkpointed without CAP_SYS_RESOURCE (the agent warns).
#
# Writes a launcher to $1 (default: .venv/bin/criu).
set -euo pipefail

launcher=${1:-.venv/bin/criu}
root=${REVENANT_CRIU_ROOT:-/opt/revenant/criu-forky}
suite=${REVENANT_CRIU_SUITE:-forky}
min_version=4.2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_file=$here/../criu/rlimits-proc-fallback.patch
patched_mark=revenant-rlimits-1
patched_for=4.2.1
patched_sha256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9

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
    # Debian's own first (debian.sources), then any Debian archive ("/debian" at its end), never a
    # third-party repository that sorts first.
    local m
    m=$(grep -h '^URIs:' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
        | awk '{print $2}' | grep -v -- '-security' | head -1 || true)
    if [ -z "$m" ]; then
        m=$( { grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}';
               grep -h '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}'; } \
            | grep -v -- '-security' | grep -E '/debian/?$' | head -1 || true)
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

# The socket probe, where revenant is installed next to the launcher (set-up's venv).
probe() {
    local py
    py="$(dirname "$launcher")/python"
    if ! [ -x "$py" ] || ! "$py" -c 'import revenant.agent.network.netprobe' 2>/dev/null; then
        log "revenant is not installed next to $launcher: the socket probe is left to the agent"
        return 0
    fi
    timeout 300 "$py" -m revenant.agent.network.netprobe "$launcher" >&2 && probed=" and the socket probe"
}
probed=

[ "$(id -u)" = 0 ] || die "must run as root (criu needs CAP_SYS_ADMIN)"

# The host's criu, unless it is this launcher itself (or another of revenant's: it runs a root's).
host=$(command -v criu || true)
if [ -n "$host" ] && { [ "$(readlink -f "$host")" = "$(readlink -f "$launcher" 2>/dev/null)" ] \
                       || grep -qs 'run through that root' "$host"; }; then
    host=
fi
has_cap_sys_resource() {  # bit 24 of this process's effective capabilities
    local eff
    eff=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)
    [ $(( (16#$eff >> 24) & 1 )) = 1 ]
}

# The host's criu serves only where root may read other users' rlimits (or it is already patched).
if [ -n "$host" ] && ! has_cap_sys_resource && ! "$host" --version 2>/dev/null | grep -q "$patched_mark"; then
    log "root lacks CAP_SYS_RESOURCE here and the host's criu ($host) cannot read other users' rlimits: building a $suite root instead"
    host=
fi
if [ -n "$host" ] && version_ok timeout 30 "$host"; then
    write_launcher "#!/bin/sh
exec $host \"\$@\""
    if timeout 60 "$launcher" check >/dev/null 2>&1 && probe; then
        log "$("$launcher" --version | head -1) (the host's) at $launcher: criu check$probed passed"
        exit 0
    fi
    log "the host's criu ($host) fails the checks: building a $suite root instead"
fi

loader=$root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
if ! [ -x "$root/usr/sbin/criu" ] || ! version_ok "$loader" --library-path "$root/usr/lib/x86_64-linux-gnu" "$root/usr/sbin/criu"; then
    command -v debootstrap >/dev/null || apt_install debootstrap
    mirror=$(debian_mirror)
    script=/usr/share/debootstrap/scripts/$suite
    [ -e "$script" ] || script=/usr/share/debootstrap/scripts/sid  # Debian 12's debootstrap knows no forky
    log "building a $suite root with criu in $root (about a minute)"
    rm -rf "$root.partial"
    mkdir -p "$(dirname "$root")"
    debootstrap --variant=minbase --include=criu "$suite" "$root.partial" "$mirror" "$script" >"$root.log" 2>&1 \
        || die "debootstrap failed; see $root.log"
    rm -rf "$root"
    mv "$root.partial" "$root"
fi
in_root() {  # in_root COMMAND...: run it in the root, with /dev, /proc and a /tmp of its own
    unshare --mount --propagation private sh -c 'r=$1; shift; mount --rbind /dev "$r/dev" && mount -t proc proc "$r/proc" &&
        mount -t tmpfs tmpfs "$r/tmp" && exec chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"' sh "$root" "$@"
}

# build_patched: the root's criu $patched_for, from its checksummed upstream source, with the patch.
build_patched() {
    local have mirror work apt
    have=$(chroot "$root" dpkg-query -W -f='${Version}' criu 2>/dev/null | sed 's/-[^-]*$//') || have=?
    if [ "$have" != "$patched_for" ]; then
        log "warning: the $suite root's criu is $have, the patch is for $patched_for: not patched"
        return 1
    fi
    mirror=$(debian_mirror)
    work=$root/tmp-build
    rm -rf "$work" && mkdir -p "$work"
    log "building criu $patched_for with revenant's rlimits patch in $root (about a minute)"
    command -v curl >/dev/null || apt_install curl ca-certificates
    if ! curl -fsSL --retry 3 -o "$work/src.tar.xz" "${mirror%/}/pool/main/c/criu/criu_${patched_for}.orig.tar.xz"; then
        log "warning: cannot download criu's source from $mirror"; rm -rf "$work"; return 1
    fi
    if [ "$(sha256sum "$work/src.tar.xz" | cut -d' ' -f1)" != "$patched_sha256" ]; then
        log "warning: criu's source from $mirror does not match its pinned checksum: not built"; rm -rf "$work"; return 1
    fi
    tar -xJf "$work/src.tar.xz" -C "$work"
    patch -d "$work/criu-$patched_for" -p1 --quiet < "$patch_file"
    # (The mirror may serve a testing suite whose Release has passed its Valid-Until.)
    apt="apt-get -o Acquire::Check-Valid-Until=false -qq"
    if ! in_root sh -c "$apt update && $apt install -y --no-install-recommends gcc make pkgconf libc6-dev \
            libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf libnl-3-dev \
            libnet1-dev libcap-dev libnftables-dev libbsd-dev libaio-dev uuid-dev libgnutls28-dev binutils && $apt clean" \
            >"$root.build.log" 2>&1 \
       || ! in_root sh -c "cd /tmp-build/criu-$patched_for && make -j$(nproc) GITID=$patched_mark criu &&
            strip -o /usr/local/sbin/criu criu/criu" >>"$root.build.log" 2>&1; then
        log "warning: building the patched criu failed; see $root.build.log"; rm -rf "$work"; return 1
    fi
    rm -rf "$work"
}

criu_bin=$root/usr/local/sbin/criu
if ! "$loader" --library-path "$root/usr/lib/x86_64-linux-gnu" "$criu_bin" --version 2>/dev/null | grep -q "$patched_mark"; then
    build_patched || criu_bin=$root/usr/sbin/criu
fi
write_launcher "#!/bin/sh
# criu from a $suite root, run through that root's own loader (host libc untouched)$( [ "$criu_bin" = "$root/usr/sbin/criu" ] || printf ', with revenant'"'"'s rlimits patch').
exec $loader --library-path $root/usr/lib/x86_64-linux-gnu $criu_bin \"\$@\""

version_ok "$launcher" || die "$launcher is not criu >= $min_version ($suite's criu: $("$launcher" --version 2>&1 | head -1))"
if ! out=$("$launcher" check 2>&1); then
    die "criu check failed: $(printf '%s\n' "$out" | grep -v RLIMIT_NOFILE | tail -1)"
fi
probe || die "$("$launcher" --version | head -1) at $launcher cannot checkpoint sockets on this kernel (above)"
log "$("$launcher" --version | head -1) at $launcher: criu check$probed passed"
