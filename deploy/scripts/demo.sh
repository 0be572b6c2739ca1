#!/usr/bin/env bash
# `make demo`: a three-node local cluster, a node killed, and the detector's verdict.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
dir=${REVENANT_DEMO_DIR:-/tmp/revenant-demo}

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

[ -f "$dir/cluster.json" ] && revenant down --dir "$dir" >/dev/null 2>&1 || true
rm -rf "$dir"
trap 'revenant down --dir "$dir" >/dev/null 2>&1 || true' EXIT

step "revenant up --nodes 3 --dir $dir --detach"
revenant up --nodes 3 --dir "$dir" --detach

step "revenant nodes"
revenant nodes --dir "$dir"

victim=$(python3 -c "import json,sys; print(next(p['pid'] for p in json.load(open(sys.argv[1]))['processes'] if p['name']=='node-2'))" "$dir/cluster.json")
step "kill -9 node-2's agent (pid $victim) and wait for the verdict"
kill -9 "$victim"
start=$(date +%s%N)
until revenant nodes --dir "$dir" --json | python3 -c "import json,sys; sys.exit(0 if any(n['name']=='node-2' and n['state']=='dead' for n in json.load(sys.stdin)) else 1)"; do
    sleep 0.2
done
ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo "node-2 declared dead about $((ms / 1000)).$(( (ms % 1000) / 100 )) s after the kill (the CLI polls every 0.2 s)"
revenant nodes --dir "$dir"

step "revenant events"
revenant events --dir "$dir"

step "revenant down"
revenant down --dir "$dir"
trap - EXIT
