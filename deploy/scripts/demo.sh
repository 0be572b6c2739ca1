#!/usr/bin/env bash
# `make demo`: a local cluster; a job checkpointed, vacated and restarted on another
# node with its output continuous; then a node killed and declared dead.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
dir=${REVENANT_DEMO_DIR:-/tmp/revenant-demo}
job_script=$PWD/tests/jobs/counter.py   # line i every 50 ms, with a hash chained through every earlier line

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
lines() { wc -l < "$dir/storage/jobs/$job/output.log" | tr -d ' '; }
json_field() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }

[ -f "$dir/cluster.json" ] && revenant down --dir "$dir" >/dev/null 2>&1 || true
rm -rf "$dir"
trap 'revenant down --dir "$dir" >/dev/null 2>&1 || true' EXIT

step "revenant up --nodes 3 --dir $dir --detach"
revenant up --nodes 3 --dir "$dir" --detach
revenant nodes --dir "$dir"

step "revenant submit --node node-1 --max-epochs 2 -- python3 counter.py 120 0.05"
export REVENANT_NATS=$(json_field "['nats_url']" < "$dir/cluster.json")
job=$(revenant submit --node node-1 --max-epochs 2 -- python3 "$job_script" 120 0.05)
echo "job $job"
sleep 1.5

step "revenant checkpoint create $job   (the job keeps running)"
revenant checkpoint create "$job"
sleep 1

step "revenant checkpoint vacate $job   (checkpoint, then stop: node-1 is free)"
revenant checkpoint vacate "$job"
n=$(lines); sleep 1
echo "output while vacated: $n lines, one second later: $(lines) lines"

step "revenant checkpoint restart $job --node node-2"
revenant checkpoint restart "$job" --node node-2
revenant show job "$job"

step "waiting for the job to finish on node-2"
until [ "$(revenant show job "$job" --json | json_field "['state']")" = completed ]; do sleep 0.5; done
python3 "$job_script" 120 0 > "$dir/reference.log"
if cmp -s "$dir/reference.log" "$dir/storage/jobs/$job/output.log"; then
    echo "output.log is byte for byte the output of an uninterrupted run ($(lines) lines, none missing or repeated)"
else
    echo "output.log differs from an uninterrupted run:"; diff "$dir/reference.log" "$dir/storage/jobs/$job/output.log" | head
    exit 1
fi

victim=$(python3 -c "import json,sys; print(next(p['pid'] for p in json.load(open(sys.argv[1]))['processes'] if p['name']=='node-3'))" "$dir/cluster.json")
step "kill -9 node-3's agent (pid $victim) and wait for the verdict"
kill -9 "$victim"
start=$(date +%s%N)
until revenant nodes --json | python3 -c "import json,sys; sys.exit(0 if any(n['name']=='node-3' and n['state']=='dead' for n in json.load(sys.stdin)) else 1)"; do
    sleep 0.2
done
ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo "node-3 declared dead about $((ms / 1000)).$(( (ms % 1000) / 100 )) s after the kill (the CLI polls every 0.2 s)"
revenant nodes

step "revenant events"
revenant events

step "revenant down"
revenant down --dir "$dir"
trap - EXIT
