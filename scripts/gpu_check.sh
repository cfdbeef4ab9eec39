#!/usr/bin/env bash
# The prepared GPU check in one command, for a lent (offline) GPU machine:
#   here:  make wheelhouse                 (hydra, omegaconf, antlr4, optimum-quanto, ... as wheels)
#   there: bash scripts/gpu_check.sh       (the device tool: carry ["wheelhouse"], timeout_s 600)
# Installs the wheels into /tmp/site (the machine's torch and triton are used as they are),
# records the GPU, runs scripts/gpu_kv_dtype.py (90 s at most; SKIP_KV_DTYPE=1 skips it) and
# `python -m decodelab.experiments.gpu_check` (its own budget: 420 s) and leaves results.jsonl,
# gpu_check.log, gpu_kv_dtype.txt and nvidia-smi.txt in $OUT (else outputs/); decodelab-report $OUT makes the tables.
# Extra arguments go to gpu_check (e.g. budget_s=300, or smoke=true for the CPU dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=${OUT:-outputs}
mkdir -p "$DEST"
if [ -z "${NO_WHEELS:-}" ] && ls wheelhouse/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        wheelhouse/*.whl || { echo "installing wheelhouse/ failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the package's import names (decodelab.models, ...) without installing it: a namespace
# folder whose entries link to the repository's top-level folders
NS=$(mktemp -d)
mkdir -p "$NS/decodelab"
for d in models cache decoding experiments; do ln -s "$PWD/$d" "$NS/decodelab/$d"; done
export PYTHONPATH=$NS${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv >"$DEST/nvidia-smi.txt" 2>&1
cat "$DEST/nvidia-smi.txt"
# the dense cache's kv_dtype on CUDA (bf16, fp16, fp8 against fp32; the compiled step's refusal): 1 minute
[ -n "${SKIP_KV_DTYPE:-}" ] || timeout 90 "$PY" scripts/gpu_kv_dtype.py 2>&1 | tee "$DEST/gpu_kv_dtype.txt"
timeout 470 "$PY" -m decodelab.experiments.gpu_check out="$DEST" "$@" 2>&1 | tee "$DEST/gpu_check.log"
