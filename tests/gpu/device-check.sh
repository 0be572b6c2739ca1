#!/usr/bin/env bash
# revenant's GPU check on a real machine, from a bare start, with no network:
#
#   deploy/scripts/gpu-bundle.sh            # here: wheels + a self-contained criu
#   bash tests/gpu/device-check.sh          # there, from the repository root, with build/gpu-bundle
#
# Writes $OUT/report.md and $OUT/report.json (OUT defaults to ./gpu-report), with every
# step's pass/fail/skip, its time and its error verbatim, and the logs in $OUT/logs.tar.gz.
#   environment: nvidia-smi, driver and CUDA driver API versions, GPU, cuda-checkpoint, nvcc
#   setup:       a venv from the bundle's wheels (offline), the bundled criu on PATH,
#                whether CRIU works in this kernel (criu check; dump/restore of a sleep)
#   (a)          tests/gpu/inplace.py: in-place CUDA checkpoint/restore of 1, 8, 32 GiB, timed
#   (b)          where CRIU works: the counter job under `revenant up --nodes 2`: UDP -> 101,
#                vacate + restart -> 102, checkpoint, kill -9 of its node's agent -> failover -> 103
# Never hangs: every step has a timeout, and the whole stays under GPU_CHECK_BUDGET_S (450 s).
# Exits 0 whenever the report was written (a machine without a GPU included).
set -u

repo=$(pwd)
OUT=${OUT:-./gpu-report}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
bundle=${GPU_BUNDLE:-$repo/build/gpu-bundle}
budget=${GPU_CHECK_BUDGET_S:-450}
port=${GPU_CHECK_PORT:-10000}
# Not under /tmp: a revenant job gets a private /tmp and would not see what is there (the
# repository itself may be under /tmp on the GPU machine: then the work goes to /var/lib).
case "$repo/" in
    /tmp/*|/dev/shm/*|/var/tmp/*) work=${GPU_CHECK_WORK:-/var/lib/revenant-gpu-check} ;;
    *) work=${GPU_CHECK_WORK:-$repo/build/gpu-check} ;;
esac
big_mib=${GPU_CHECK_BIG_MIB:-4096}
parts=${GPU_CHECK_PARTS:-inplace,counter,big,train}
has() { case ",$parts," in *",$1,"*) return 0 ;; esac; return 1; }
big_port=$((port + 1))
start=$(date +%s)
steps=$OUT/steps.tsv
: > "$steps"
rm -rf "$work"
mkdir -p "$work"

# ---------------------------------------------------------------- helpers
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
left() { echo $((start + budget - $(date +%s))); }
# tmo N: N seconds, or what is left of the budget less a margin for the report, if that is less.
tmo() { local l; l=$(($(left) - 20)); [ "$l" -lt 1 ] && l=1; [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
oneline() { tr '\n\t' '  ' | sed 's/  */ /g; s/^ //; s/ $//' | cut -c1-1500; }
# record NAME pass|fail|skip SECONDS DETAIL
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | oneline)" >> "$steps"
           printf 'device-check: %-28s %-4s %6.1fs  %s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | oneline | cut -c1-200)" >&2; }
skip() { record "$1" skip 0 "$2"; }
# step NAME TIMEOUT CMD...: run with a timeout, output in $OUT/logs/NAME.log; pass on status 0.
step() {
    local name=$1 t=$2 t0 rc dur detail; shift 2
    t0=$(now)
    timeout -k 5 "$(tmo "$t")" "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    dur=$(since "$t0")
    if [ $rc -eq 0 ]; then
        record "$name" pass "$dur" "$(tail -3 "$OUT/logs/$name.log")"
    else
        detail="exit $rc$([ $rc -eq 124 ] && echo ' (timed out)'): $(tail -5 "$OUT/logs/$name.log")"
        record "$name" fail "$dur" "$detail"
    fi
    return $rc
}
# check NAME DETAIL CONDITION...: a pass/fail from a condition, timed since $t_check.
check() { local name=$1 detail=$2; shift 2
          if "$@"; then record "$name" pass "$(since "$t_check")" "$detail"
          else record "$name" fail "$(since "$t_check")" "$detail"; return 1; fi; }

# wait_for SECONDS CONDITION...: poll every 0.2 s.
wait_for() { local until=$(($(date +%s) + $(tmo "$1"))); shift
             while ! "$@"; do [ "$(date +%s)" -ge "$until" ] && return 1; sleep 0.2; done; }

# ---------------------------------------------------------------- environment
{ uname -a; echo; cat /proc/version 2>/dev/null; echo; id; nproc; free -g 2>/dev/null; df -h . 2>/dev/null; } \
    > "$OUT/logs/system.txt" 2>&1
have_gpu=yes
step nvidia-smi 30 nvidia-smi || have_gpu=no
step nvidia-smi-query 30 nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,driver_version,mig.mode.current \
    --format=csv || true
py3=$(command -v python3 || true)
if [ -n "$py3" ]; then
    step cuda-driver-api 60 "$py3" -c '
import sys; sys.path.insert(0, "tests/gpu")
from cudrv import Driver
try:
    d = Driver(); v = d.driver_version()
    print(f"cuDriverGetVersion {v} (CUDA {v // 1000}.{v % 1000 // 10})")
    dev = d.init(0)
    print(f"device 0: {d.device_name(dev)}, {d.total_mem(dev) / 2**30:.1f} GiB")
except Exception as exc:
    sys.exit(f"{type(exc).__name__}: {exc}")' || have_gpu=no
else
    skip cuda-driver-api "no python3 on PATH"
fi
if command -v cuda-checkpoint > /dev/null; then
    step cuda-checkpoint-help 20 cuda-checkpoint --help || true
else
    skip cuda-checkpoint-help "cuda-checkpoint is not installed (not on PATH)"
fi
nvcc=$(command -v nvcc || true)
if [ -n "$nvcc" ]; then step nvcc-version 30 "$nvcc" --version || true; else skip nvcc-version "no nvcc on PATH"; fi

# ---------------------------------------------------------------- setup: venv and criu
venv=$work/venv
venv_ok=no
if [ -z "$py3" ]; then
    skip venv "no python3 on PATH"
elif [ "$have_gpu" != yes ] && [ -z "${GPU_CHECK_CPU:-}" ]; then
    skip venv "no usable NVIDIA GPU: nothing here needs it (GPU_CHECK_CPU=1 sets it up all the same)"
elif [ ! -d "$bundle/wheels" ]; then
    skip venv "no bundle at $bundle (run deploy/scripts/gpu-bundle.sh and carry build/gpu-bundle)"
else
    pip_offline=(--no-index --find-links "$bundle/wheels" --disable-pip-version-check)
    # The working tree itself (so the check runs this very code), else the bundled revenant wheel.
    if step venv-create 120 "$py3" -m venv "$venv" &&
       { step venv-install 180 env PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install "${pip_offline[@]}" "$repo[test]" ||
         step venv-install-wheel 120 env PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install "${pip_offline[@]}" "revenant[test]"; }
    then
        venv_ok=yes
        step venv-revenant 30 "$venv/bin/revenant" --help || venv_ok=no
    fi
fi

criu_ok=no
inet_ok=no
if [ -x "$bundle/criu/criu" ]; then
    export PATH=$bundle/criu:$PATH REVENANT_CRIU=$bundle/criu/criu
    step criu-version 20 criu --version || true
    step criu-check 60 criu check || true
    # A tiny dump and restore: the real test of whether this kernel lets CRIU work (gVisor does not).
    d=$work/criu-smoke
    mkdir -p "$d"
    setsid sleep 600 < /dev/null > /dev/null 2>&1 &
    sleeper=$!
    disown "$sleeper"  # no job notice when criu kills it; this shell still reaps it
    sleep 0.5
    gone() { ! kill -0 "$sleeper" 2> /dev/null; }
    # The restore needs the pid free again: the dumped process killed and reaped.
    if step criu-dump 60 criu dump -t "$sleeper" -D "$d" -v4 -o dump.log &&
       { t_check=$(now); wait_for 10 gone; check criu-dumped-task-gone "pid $sleeper" gone; } &&
       step criu-restore 60 criu restore -D "$d" -d -v4 -o restore.log &&
       kill -0 "$sleeper" 2> /dev/null; then
        criu_ok=yes
        record criu-works pass 0 "dump and restore of pid $sleeper"
    else
        record criu-works fail 0 "CRIU cannot checkpoint here; kernel $(uname -r); see logs/criu-*.log and logs/{dump,restore}.log: $(cat "$d"/*.log 2> /dev/null | grep -E 'Error|error' | tail -3)"
    fi
    cp "$d"/*.log "$OUT/logs/" 2> /dev/null
    kill -9 "$sleeper" 2> /dev/null
    # A process holding a UDP socket: CRIU 4.1 fails on Linux >= 6.16 (SO_PASSCRED refused on
    # INET sockets, criu issue #2718); the counter then takes its packets from a file instead.
    if [ "$criu_ok" = yes ] && [ -n "$py3" ]; then
        d=$work/criu-inet
        mkdir -p "$d"
        setsid "$py3" -c 'import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); time.sleep(600)' \
            < /dev/null > /dev/null 2>&1 &
        holder=$!
        disown "$holder"
        sleep 1
        if step criu-dump-udp 60 criu dump -t "$holder" -D "$d" -v4 -o dump.log --leave-running; then
            inet_ok=yes
        else
            record criu-inet-sockets fail 0 "$(grep -E 'Error' "$d/dump.log" | head -3)"
        fi
        cp "$d/dump.log" "$OUT/logs/dump-udp.log" 2> /dev/null
        kill -9 "$holder" 2> /dev/null
    fi
    # What the agent's own probe finds: sockets, established TCP, the nftables network lock.
    if [ "$criu_ok" = yes ] && [ "$venv_ok" = yes ]; then
        step netprobe 60 "$venv/bin/python" -m revenant.agent.network.netprobe "$bundle/criu/criu" || true
    fi
else
    skip criu-works "no bundled criu at $bundle/criu/criu"
fi

# ---------------------------------------------------------------- (a) in-place checkpoint timing
if ! has inplace; then
    skip inplace "not in GPU_CHECK_PARTS ($parts)"
elif [ "$have_gpu" = yes ] && [ -n "$py3" ]; then
    step inplace 200 "$py3" tests/gpu/inplace.py --sizes "${GPU_CHECK_SIZES:-1,8,32}" --json "$OUT/inplace.json" || true
else
    skip inplace "no usable NVIDIA GPU (nvidia-smi or libcuda failed; see above)"
fi

# ---------------------------------------------------------------- (b) the counter under revenant
rv() { "$venv/bin/revenant" "$@"; }
job_json() { rv show job "$job" --json --timeout 10 2> /dev/null; }
job_field() { job_json | "$venv/bin/python" -c "import json,sys; print(json.load(sys.stdin)$1)" 2> /dev/null; }
is_running() { [ "$(job_field '["state"]')" = running ]; }
is_running_elsewhere() { is_running && [ "$(job_field '["node"]')" != "$1" ]; }
listening() { grep -q "listening on" "$D/storage/jobs/$job/output.log" 2> /dev/null; }
last_line_is() { [ "$(tail -1 "$D/storage/jobs/$job/output.log" 2> /dev/null)" = "$1" ]; }
# udp EXPECTED NAME [PORT [MESSAGE]]: one packet, one answer within 30 s (with --poll: a byte
# appended to the request file, and the answer on the job's output).
udp() {
    local to=${3:-$port} msg=${4:-hi}
    t_check=$(now)
    if [ -n "$poll_file" ] && [ "$to" = "$port" ]; then
        printf x >> "$poll_file"
        wait_for 30 last_line_is "$1"
        check "$2" "expected $1, got: $(tail -1 "$D/storage/jobs/$job/output.log" 2> /dev/null) (request file)" \
            last_line_is "$1"
        return
    fi
    got=$(timeout 40 "$venv/bin/python" -c "
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(30)
s.sendto(b'$msg', ('127.0.0.1', $to))
try:
    print(s.recv(64).decode().strip())
except OSError as e:
    print('no answer:', e)" 2>&1)
    check "$2" "expected $1, got: $got" [ "$got" = "$1" ]
}
agent_pid() { "$venv/bin/python" -c "
import json, sys
doc = json.load(open('$D/cluster.json'))
print(next(p['pid'] for p in doc['processes'] if p['role'] == 'agent' and p['name'] == sys.argv[1]))" "$1"; }

D=$work/cluster
job=
# GPU_CHECK_CPU=1: a dry run of (b) on a machine without a GPU (the counter kept in host memory).
cpu_only=${GPU_CHECK_CPU:-}
if [ "$have_gpu" != yes ] && [ -z "$cpu_only" ]; then
    skip cluster "no usable NVIDIA GPU"
elif [ "$criu_ok" != yes ]; then
    skip cluster "CRIU cannot run in this kernel ($(uname -r)); see criu-works"
elif [ "$venv_ok" != yes ]; then
    skip cluster "no revenant venv (see venv-*)"
else
    # The job's programs beside its work, never under a /tmp the job cannot see.
    mkdir -p "$work/bin"
    cp tests/gpu/counter_driver.py tests/gpu/cudrv.py "$work/bin/"
    poll_file=
    transport=("$port")
    if [ "$inet_ok" != yes ]; then
        poll_file=$work/requests
        : > "$poll_file"
        transport=(--poll "$poll_file")
    fi
    if [ -n "$cpu_only" ]; then
        job_argv=("$venv/bin/python" "$work/bin/counter_driver.py" "${transport[@]}" --cpu)
    elif [ -n "$nvcc" ] && step counter-build 120 "$nvcc" -O2 -gencode 'arch=compute_90,code=[sm_90,compute_90]' \
            -o "$work/counter" tests/gpu/counter.cu; then
        job_argv=("$work/counter" "${transport[@]}")
    else
        job_argv=("$venv/bin/python" "$work/bin/counter_driver.py" "${transport[@]}")
    fi
    record counter-program pass 0 "${job_argv[*]}"
    export REVENANT_AGENT_ALLOW_ROOT_JOBS=true
    if step cluster-up 120 "$venv/bin/revenant" up --nodes 2 --dir "$D" --detach --timeout 60; then
        REVENANT_NATS=$("$venv/bin/python" -c "import json; print(json.load(open('$D/cluster.json'))['nats_url'])")
        REVENANT_CREDS=$("$venv/bin/python" -c "import json; print(json.load(open('$D/cluster.json'))['creds'])")
        export REVENANT_NATS REVENANT_CREDS
        step nodes 20 "$venv/bin/revenant" nodes --json || true
        cp "$OUT/logs/nodes.log" "$OUT/nodes.json" 2> /dev/null
        # Its own working directory: the repository holds the cluster's storage (build/).
        mkdir -p "$work/job"
        if has counter && step submit 30 "$venv/bin/revenant" submit --timeout 20 --name gpu-counter --workdir "$work/job" \
                -- "${job_argv[@]}"; then
            job=$(tail -1 "$OUT/logs/submit.log")
            t_check=$(now)
            wait_for 90 listening
            check job-listening "job $job: $(tail -2 "$D/storage/jobs/$job/output.log" 2> /dev/null)" listening
            udp 101 packet-101 &&
            step vacate 180 "$venv/bin/revenant" checkpoint vacate "$job" --timeout 170 &&
            step restart 180 "$venv/bin/revenant" checkpoint restart "$job" --timeout 170 &&
            { t_check=$(now); wait_for 60 is_running; check restart-running "$(job_json | head -c 600)" is_running; } &&
            udp 102 packet-102 &&
            step create 180 "$venv/bin/revenant" checkpoint create "$job" --timeout 170 &&
            {
                old_node=$(job_field '["node"]')
                old_pid=$(job_field '["pid"]')
                t_check=$(now)
                # The node dies: its agent, and the job with it (else its copy keeps the port and the GPU).
                apid=$(agent_pid "$old_node")
                kill -9 "$apid" "$old_pid"
                record kill-node pass 0 "kill -9 agent $apid of $old_node and job pid $old_pid"
                t_check=$(now)
                wait_for 120 is_running_elsewhere "$old_node"
                check failover "$(job_json | head -c 600)" is_running_elsewhere "$old_node"
            } &&
            udp 103 packet-103
            job_json > "$OUT/job.json"
            cp "$D/storage/jobs/$job/output.log" "$OUT/logs/job-output.log" 2> /dev/null
        fi
        # (c) a job holding GPU_CHECK_BIG_MIB of filled device memory: checkpoint, vacate,
        # restart; its memory read back after the restore, and the counter still counting.
        counter_job=$job
        big_argv=("$venv/bin/python" "$work/bin/counter_driver.py" "$big_port" --device-mib "$big_mib")
        [ -n "$cpu_only" ] && big_argv+=(--cpu)
        mkdir -p "$work/job-big"
        if has big && [ "$(left)" -gt 120 ] &&
           step big-submit 30 "$venv/bin/revenant" submit --timeout 20 --name gpu-big --workdir "$work/job-big" \
                -- "${big_argv[@]}"; then
            job=$(tail -1 "$OUT/logs/big-submit.log")
            t_check=$(now)
            wait_for 120 listening
            check big-listening "job $job: $(tail -2 "$D/storage/jobs/$job/output.log" 2> /dev/null)" listening &&
            udp 101 big-101 "$big_port" &&
            step big-create 240 "$venv/bin/revenant" checkpoint create "$job" --timeout 230 &&
            step big-vacate 240 "$venv/bin/revenant" checkpoint vacate "$job" --timeout 230 &&
            step big-restart 240 "$venv/bin/revenant" checkpoint restart "$job" --timeout 230 &&
            { t_check=$(now); wait_for 120 is_running; check big-restart-running "$(job_json | head -c 400)" is_running; } &&
            { [ -n "$cpu_only" ] || udp "verified $big_mib MiB" big-verify "$big_port" verify; } &&
            udp 102 big-102 "$big_port"
            job_json > "$OUT/job-big.json"
            cp "$D/storage/jobs/$job/output.log" "$OUT/logs/job-big-output.log" 2> /dev/null
            job=$counter_job
        fi
        # (d) a PyTorch training loop with DataLoader workers, once for each worker start method
        # (GPU_CHECK_TRAIN_CONTEXTS): a checkpoint, then its node killed mid-run; after the failover
        # it runs to its end, and its whole output must equal an uninterrupted run's byte for byte
        # (every loss, every weight checksum, the weights' sha256).
        torch_py=${GPU_CHECK_TORCH_PY:-$py3}
        train_args=(--steps "${GPU_CHECK_TRAIN_STEPS:-300}" --workers 2)
        [ -n "$cpu_only" ] && train_args+=(--device cpu --width 256)
        cp tests/gpu/train.py "$work/bin/"
        out_lines() { [ "$(cat "$D/storage/jobs/$job/output.log" 2> /dev/null | wc -l)" -ge "$1" ]; }
        is_completed() { [ "$(job_field '["state"]')" = completed ]; }
        # train_flow CONTEXT: the training job with its workers started by CONTEXT, through a failover.
        train_flow() {
            local ctx=$1 t=train-$1
            mkdir -p "$work/job-$t"
            step "$t-submit" 30 "$venv/bin/revenant" submit --timeout 20 --name "gpu-$t" --workdir "$work/job-$t" \
                -- "$torch_py" "$work/bin/train.py" "${train_args[@]}" --mp-context "$ctx" || return
            job=$(tail -1 "$OUT/logs/$t-submit.log")
            t_check=$(now)
            wait_for 120 out_lines 40
            check "$t-started" "job $job: $(tail -1 "$D/storage/jobs/$job/output.log" 2> /dev/null)" out_lines 40 &&
            step "$t-create" 150 "$venv/bin/revenant" checkpoint create "$job" --timeout 140 &&
            {
                # More steps after the checkpoint, which the failover must take back out of the output.
                sleep 3
                old_node=$(job_field '["node"]')
                old_pid=$(job_field '["pid"]')
                apid=$(agent_pid "$old_node")
                kill -9 "$apid" "$old_pid"
                record "$t-kill-node" pass 0 "kill -9 agent $apid of $old_node and job pid $old_pid at line $(wc -l < "$D/storage/jobs/$job/output.log")"
                t_check=$(now)
                wait_for 150 is_running_elsewhere "$old_node"
                check "$t-failover" "$(job_json | head -c 400)" is_running_elsewhere "$old_node"
            } &&
            { t_check=$(now); wait_for 240 is_completed; check "$t-completed" "$(job_json | head -c 400)" is_completed; } &&
            {
                t_check=$(now)
                check "$t-identical" "$(wc -l < "$work/train-reference.out") lines; $(diff "$work/train-reference.out" \
                    "$D/storage/jobs/$job/output.log" 2>&1 | head -6)" cmp -s "$work/train-reference.out" "$D/storage/jobs/$job/output.log"
            }
            job_json > "$OUT/job-$t.json"
            cp "$D/storage/jobs/$job/output.log" "$OUT/logs/job-$t-output.log" 2> /dev/null
            # A job left running (a refused checkpoint) would hold the GPU through the next one.
            [ "$(job_field '["state"]')" = running ] && kill -9 "$(job_field '["pid"]')" 2> /dev/null
            return 0
        }
        if ! has train; then
            skip train "not in GPU_CHECK_PARTS ($parts)"
        elif ! "$torch_py" -c 'import torch' > /dev/null 2>&1; then
            skip train "no torch for $torch_py"
        elif [ "$(left)" -lt 150 ]; then
            skip train "too little of the budget left ($(left) s)"
        elif step train-reference 150 "$torch_py" "$work/bin/train.py" "${train_args[@]}"; then
            cp "$OUT/logs/train-reference.log" "$work/train-reference.out"
            for ctx in ${GPU_CHECK_TRAIN_CONTEXTS:-fork forkserver}; do
                if [ "$(left)" -lt 100 ]; then skip "train-$ctx" "too little of the budget left ($(left) s)"; continue; fi
                train_flow "$ctx"
            done
        fi
        step events 20 "$venv/bin/revenant" events --json --timeout 10 || true
    fi
    for f in "$D"/logs/*.log; do [ -f "$f" ] && tail -300 "$f" > "$OUT/logs/cluster-$(basename "$f")"; done
    if [ -f "$D/cluster.json" ]; then
        step cluster-down 60 "$venv/bin/revenant" down --dir "$D" --timeout 40 || {
            "$venv/bin/python" -c "
import json, os, signal
doc = json.load(open('$D/cluster.json'))
for p in ([doc['supervisor']] if doc.get('supervisor') else []) + doc['processes']:
    try: os.kill(p['pid'], signal.SIGKILL)
    except OSError: pass" 2> /dev/null; }
    fi
fi

# ---------------------------------------------------------------- report
total=$(( $(date +%s) - start ))
{
    echo "# revenant GPU device check"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm), ${total} s in all."
    echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2> /dev/null | head -1)"
    echo "GPU usable: $have_gpu; CRIU works: $criu_ok; venv: $venv_ok; nvcc: ${nvcc:-none};" \
         "cuda-checkpoint: $(command -v cuda-checkpoint || echo none)"
    echo
    echo "| step | result | seconds | detail |"
    echo "| --- | --- | ---: | --- |"
    while IFS=$'\t' read -r name status secs detail; do
        printf '| %s | %s | %.1f | %s |\n' "$name" "$status" "$secs" "$(printf '%s' "$detail" | sed 's/|/\\|/g' | cut -c1-400)"
    done < "$steps"
    if [ -f "$OUT/inplace.json" ] && [ -f "$OUT/logs/inplace.log" ]; then
        echo
        echo '## In-place checkpoint (tests/gpu/inplace.py)'
        echo
        echo '```'
        grep -v '^inplace: ' "$OUT/logs/inplace.log" | tail -30
        echo '```'
    fi
} > "$OUT/report.md"
if [ -n "$py3" ]; then
    "$py3" - "$steps" "$OUT" "$have_gpu" "$criu_ok" "$venv_ok" "$total" > "$OUT/report.json" <<'EOF'
import json, os, sys
steps_file, out, gpu, criu, venv, total = sys.argv[1:]
steps = []
for line in open(steps_file):
    name, status, secs, detail = (line.rstrip("\n").split("\t") + ["", "", "", ""])[:4]
    steps.append({"name": name, "status": status, "seconds": float(secs or 0), "detail": detail})
doc = {"gpu_usable": gpu == "yes", "criu_works": criu == "yes", "venv": venv == "yes", "total_s": int(total),
       "passed": sum(s["status"] == "pass" for s in steps), "failed": sum(s["status"] == "fail" for s in steps),
       "steps": steps}
for name in ["inplace", "nodes", "job", "job-big"] + [f"job-train-{c}" for c in ("fork", "forkserver", "spawn")]:
    path = os.path.join(out, name + ".json")
    try:
        doc[name] = json.load(open(path))
    except (OSError, ValueError):
        pass
print(json.dumps(doc, indent=2))
EOF
else
    printf '{"error": "no python3 to write JSON; see report.md"}\n' > "$OUT/report.json"
fi
# criu's logs that the agents kept for failed dumps and restores, beside the step logs.
if [ -d "$D/storage" ]; then
    find "$D/storage" -name '*.log' ! -name output.log -size -4M 2> /dev/null | head -40 | while read -r f; do
        cp "$f" "$OUT/logs/kept-$(echo "${f#"$D"/storage/}" | tr '/' '_')"
    done
fi
rm -rf "$work/venv" "$work/criu-smoke" "$work/criu-inet"
echo "device-check: report in $OUT/report.md ($(grep -c $'\tpass\t' "$steps") passed," \
     "$(grep -c $'\tfail\t' "$steps") failed, $(grep -c $'\tskip\t' "$steps") skipped, ${total} s)" >&2
# At most 8 files come back from a device run: report.md and report.json (which holds the
# JSON files too), and everything else as one archive.
for f in "$OUT"/steps.tsv "$OUT"/*.json; do
    [ -f "$f" ] && [ "$(basename "$f")" != report.json ] && mv "$f" "$OUT/logs/"
done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs 2> /dev/null && rm -rf "$OUT/logs"
cat "$OUT/report.md"
exit 0
