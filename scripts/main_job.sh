#!/usr/bin/env bash
# The main job (`make run`): the story of this framework on the embedded SmolLM2-135M in
# four measurements, each side by side in one run, then one report with its plots:
#   1. weights: decode tok/s of fp32, int8 and int4 weights next to transformers' generate(),
#      vs context, 32 to 256 prompt tokens x 16 new     (decodelab-micro part=weights)
#   2. gamma:   speculative speedup over greedy vs gamma 1..8 for prompt lookup, the int8 and
#      int4 self-drafts and early exit, measured next to predicted, 2 ShareGPT prompts x 24
#      tokens, greedy decoded side by side                (decodelab-micro part=spec_gamma)
#   3. context: ITL and KV bytes vs context, 128 to 1536 prompt tokens, per cache backend
#      (experiment=main-context: dense, paged, int4; then sliding with a 512-token window and
#      4 sink positions imposed on every layer, StreamingLLM style, so that it bounds the bytes)
#   4. agree:   every cache x decoder x weights setup against dense, teacher-forced
#                                                        (decodelab-agree)
#   bash scripts/main_job.sh [OVERRIDE ...]     # e.g. threads=1; into $DECODELAB_MAIN (outputs/main)
# Each OVERRIDE goes to every step, so only keys all four take: threads=, model=, model.dtype=
# (a model with windows of its own refuses an imposed one: SLIDING="cache=sliding" there).
# A rerun measures everything again, except the context runs already finished (bench skips them;
# delete $OUT/context to redo them).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BIN:-.venv/bin}
OUT=${DECODELAB_MAIN:-outputs/main}
mkdir -p "$OUT"
ARGS=(threads=2 "$@")   # this machine's 2 cores; a later threads= on the command line wins
start=$(date +%s)
step() {  # name, then the command; its log in $OUT/NAME.log, stopping at the first failure
    local name=$1 s rc=0
    shift
    s=$(date +%s)
    echo ">> $name: $*" >&2
    "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 25 "$OUT/$name.log" >&2
        echo "main job: step '$name' failed (exit $rc); its log: $OUT/$name.log" >&2
        exit "$rc"
    fi
    printf '   %s done in %ds\n' "$name" "$(( $(date +%s) - s ))" >&2
}
step weights $B/decodelab-micro part=weights 'weight_types=[int8,int4]' weight_compile=false \
    'contexts=[32,64,128,192,256]' steps=16 prompts_per_context=1 repeats=1 "${ARGS[@]}" "hydra.run.dir=$OUT/weights"
step gamma $B/decodelab-micro part=spec_gamma prompts=2 steps=24 repeats=1 "${ARGS[@]}" "hydra.run.dir=$OUT/gamma"
step context $B/decodelab-bench -m experiment=main-context "${ARGS[@]}" "hydra.sweep.dir=$OUT/context"
# shellcheck disable=SC2086  # SLIDING is a list of overrides
step sliding $B/decodelab-bench -m experiment=main-context ${SLIDING:-cache=sliding cache.window=512 cache.sinks=4} \
    "${ARGS[@]}" "hydra.sweep.dir=$OUT/context"
step agree $B/decodelab-agree workload.n=2 forced_tokens=24 free_tokens=8 "${ARGS[@]}" "hydra.run.dir=$OUT/agree"
$B/decodelab-report "$OUT"
echo "main job: $(( $(date +%s) - start )) s; every step's log, results and the plots above are in $OUT" >&2
