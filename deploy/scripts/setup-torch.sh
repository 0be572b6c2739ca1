#!/usr/bin/env bash
# The PyTorch tier's own set-up (make test-workloads): a virtual environment with torch and numpy
# for the training jobs of tests/workloads/test_training.py, kept apart from .venv (torch is
# large: the CPU build is about 1 GB installed, PyPI's default CUDA build about 5.5 GB).
#
#   deploy/scripts/setup-torch.sh          # idempotent; prints the python to use
#
# Environment: TORCH_VENV (default /opt/revenant/torch-venv: not under /tmp, which a job's
# private /tmp would hide from it), TORCH_INDEX (default PyTorch's CPU index; PyPI if that
# cannot be reached).
set -euo pipefail

venv=${TORCH_VENV:-/opt/revenant/torch-venv}
index=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
log() { printf 'setup-torch: %s\n' "$*" >&2; }

case "$venv/" in /tmp/*|/dev/shm/*) log "error: $venv is under a directory jobs get privately"; exit 1 ;; esac
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import torch, numpy' 2>/dev/null; then
    log "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
    echo "$venv/bin/python"
    exit 0
fi
python=$(command -v python3) || { log "error: no python3"; exit 1; }
"$python" -m venv "$venv" 2>/dev/null || {
    log "python3 -m venv failed: installing python3-venv"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    "$python" -m venv "$venv"
}
log "installing torch (from $index) and numpy into $venv"
if ! "$venv/bin/pip" install -q --timeout 20 --retries 1 --index-url "$index" --extra-index-url https://pypi.org/simple torch numpy; then
    log "$index failed: installing torch from the default index (PyPI's CUDA build is much larger)"
    "$venv/bin/pip" install -q torch numpy
fi
"$venv/bin/python" -c 'import torch, numpy; print("setup-torch: torch", torch.__version__)' >&2
echo "$venv/bin/python"
