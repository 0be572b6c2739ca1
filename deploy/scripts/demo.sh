#!/usr/bin/env bash
# `make demo`: a local cluster; a job checkpointed, vacated and restarted on another
# node with its output continuous; then a node killed under a running job, which is
# restored elsewhere automatically, with the timeline of the failover; then a node
# drained with SIGTERM, whose job goes on elsewhere.  Every job runs as the unprivileged user
# revenant-demo (made by `make setup`), submitted by admin on its behalf (--user).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
dir=${REVENANT_DEMO_DIR:-/tmp/revenant-demo}
job_script=$PWD/tests/jobs/counter.py   # line i every 50 ms, with a hash chained through every earlier line
user=revenant-demo
python=/usr/bin/python3   # the user's: the venv may lie where the user cannot reach it
id -u "$user" >/dev/null 2>&1 || { echo "demo: no user $user: run make setup" >&2; exit 1; }

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
lines() { wc -l < "$dir/storage/jobs/${1:-$job}/output.log" | tr -d ' '; }   # lines [JOB]
pid_of() { python3 -c "import json,sys; print(next(p['pid'] for p in json.load(open(sys.argv[1]))['processes'] if p['name']==sys.argv[2]))" "$dir/cluster.json" "$1"; }
json_field() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }
# moved JOB FROM: the job runs, on a node other than FROM (one `show job` per poll)
moved() { [ "$(revenant show job "$1" --json | python3 -c "import json,sys; j=json.load(sys.stdin); print(j['state'] == 'running' and j['node'] not in ('', sys.argv[1]))" "$2")" = True ]; }
# finish JOB COUNT: wait for the job to complete, then compare its output with an uninterrupted run.
finish() {
    until [ "$(revenant show job "$1" --json | json_field "['state']")" = completed ]; do sleep 0.5; done
    python3 "$job_script" "$2" 0 > "$dir/reference-$1.log"
    if cmp -s "$dir/reference-$1.log" "$dir/storage/jobs/$1/output.log"; then
        echo "job $1: output.log is byte for byte the output of an uninterrupted run ($2 lines, none missing or repeated)"
    else
        echo "job $1: output.log differs from an uninterrupted run:"
        diff "$dir/reference-$1.log" "$dir/storage/jobs/$1/output.log" | head
        exit 1
    fi
}

[ -f "$dir/cluster.json" ] && revenant down --dir "$dir" >/dev/null 2>&1 || true
rm -rf "$dir"
trap 'revenant down --dir "$dir" >/dev/null 2>&1 || true' EXIT

# The agents refuse root's jobs (allow_root_jobs is false, the default): the demo's run as $user.
unset REVENANT_AGENT_ALLOW_ROOT_JOBS
step "revenant up --nodes 3 --dir $dir --detach"
revenant up --nodes 3 --dir "$dir" --detach
# Jobs work in a directory of their own, the user's: a restore moves aside what appeared there after its epoch.
mkdir -p "$dir/work" && cp "$job_script" "$dir/work/counter.py" && chown -R "$user": "$dir/work" && cd "$dir/work"
job_script=$dir/work/counter.py
revenant nodes --dir "$dir"

step "revenant submit --user $user --node node-1 --max-epochs 2 -- $python counter.py 120 0.05"
export REVENANT_NATS=$(json_field "['nats_url']" < "$dir/cluster.json")
export REVENANT_CREDS=$(json_field "['creds']" < "$dir/cluster.json")   # the admin's NKey (docs/security.md)
job=$(revenant submit --user "$user" --node node-1 --max-epochs 2 -- "$python" "$job_script" 120 0.05)
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
finish "$job" 120

step "failover: a job checkpointed every 2 s on node-3, then node-3 is killed"
job2=$(revenant submit --user "$user" --node node-3 --checkpoint 0:02 -- "$python" "$job_script" 200 0.05)
echo "job $job2 (revenant submit --user $user --node node-3 --checkpoint 0:02 ...)"
until [ "$(revenant show job "$job2" --json | json_field "['epochs'].__len__()")" -ge 1 ]; do sleep 0.2; done
sleep 0.6
victim=$(pid_of node-3)
echo "kill -9 node-3's agent (pid $victim); its job dies with it"
killed_at=$(date +%s.%N)
kill -9 "$victim"
until moved "$job2" node-3; do sleep 0.1; done
n=$(lines "$job2"); sleep 1
revenant events --json > "$dir/events.json"
python3 - "$job2" "$killed_at" "$n" "$(lines "$job2")" "$dir/events.json" <<'PY'
import json, sys
job, killed_at, before, after = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
events = [json.loads(line) for line in open(sys.argv[5])]
dead = next(e for e in events if e.get("kind") == "dead" and e.get("node") == "node-3")
restored = next(e for e in events if e.get("type") == "job_event.v1" and e["job"] == job and e["kind"] == "restored")
last_hb = dead["at"] - dead["silence_s"]
print("timeline (seconds after node-3's last heartbeat):")
print(f"  {0.0:6.2f}  last heartbeat from node-3")
print(f"  {killed_at - last_hb:6.2f}  kill -9")
print(f"  {dead['silence_s']:6.2f}  node-3 declared dead (a direct probe failed)")
print(f"  {restored['since_last_heartbeat_s']:6.2f}  job {job} restored on {restored['node']} from epoch {restored['epoch']},"
      f" generation {restored['generation']}")
print(f"  output continues: {before} lines, one second later {after}")
PY

step "waiting for job $job2 to finish on its new node"
finish "$job2" 200
revenant nodes

step "planned shutdown: SIGTERM to node-1's agent drains it; its job goes on elsewhere"
job3=$(revenant submit --user "$user" --node node-1 -- "$python" "$job_script" 100 0.05)
echo "job $job3 on node-1, submitted without --checkpoint"
ps -o user=,pid=,args= -p "$(revenant show job "$job3" --json | json_field "['pid']")"   # the job's init, as $user
until [ "$(lines "$job3")" -ge 20 ]; do sleep 0.1; done
agent1=$(pid_of node-1)
echo "kill -TERM node-1's agent (pid $agent1): it checkpoints its job, stops it and leaves"
kill -TERM "$agent1"
until moved "$job3" node-1; do sleep 0.1; done
revenant show job "$job3"
finish "$job3" 100
revenant nodes

step "revenant events"
revenant events

step "revenant down"
revenant down --dir "$dir"
trap - EXIT
