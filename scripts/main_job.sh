#!/usr/bin/env bash
# The main job (`make run`): the story of this framework on the embedded SmolLM2-135M in
# five measurements, each side by side in one process, then one report with its plots:
#   1. weights: decode tok/s of fp32, int8 and int4 weights next to transformers' generate(),
#      vs context, 32 / 128 / 256 prompt tokens x 16 new, 3 timed rounds per point (n=3 decodes,
#      3 TTFT rounds), after a warm-up round                  (decodelab-micro part=weights)
#   2. gamma:   speculative speedup over greedy vs gamma 1, 2, 4, 8 for prompt lookup, the int8
#      and int4 self-drafts and early exit, measured next to predicted, 3 ShareGPT prompts x 24
#      tokens (n=3 speedups per point), greedy decoded beside each drafter
#                                                            (decodelab-micro part=spec_gamma)
#   3. context: ITL and KV bytes vs context, 128 to 1536 prompt tokens + 16 new (15 steps per
#      point), per cache backend (experiment=main-context: dense, paged, int4; then sliding
#      with a 512-token window and 4 sink positions imposed on every layer, StreamingLLM
#      style, so that it bounds the bytes)
#   4. ppl:     held-out perplexity (1,536 tokens each of ShareGPT replies and of Shakespeare's plays,
#      windows of 512 every 256)
#      of fp32, int8 and int4 weights x dense and int4 KV, transformers' fp32 the reference
#                                                            (decodelab-micro part=perplexity)
#   5. agree:   every cache x decoder x weights setup against dense, teacher-forced 64 tokens
#      after 3 ShareGPT prompts of 380-500 tokens (workload=sharegpt-long: int4 KV reads most
#      of each context quantized; 192 positions per setup, where 48 read int8 weights' top-1
#      of about 0.97 as 0.917 on a Zen 5), 8 free           (decodelab-agree)
# Where the minutes go, measured (experiments/results/main: a fresh clone's `make run`, 2 cores,
# AMD EPYC Zen 5, 2 torch threads, 440 s): weights 102 s (with the native kernels' first build),
# gamma 70 s, context 35 s + sliding 14 s, ppl 93 s, agree 123 s (a slower CPU takes longer).
#   bash scripts/main_job.sh [OVERRIDE ...]     # into $DECODELAB_MAIN (default: outputs/main)
# Each OVERRIDE goes to every step, so only keys all of them take: threads= (default: the
# machine's cores), model=, model.dtype=. Each step's own options can be extended through
# WEIGHTS_ARGS, GAMMA_ARGS, CONTEXT_ARGS, PPL_ARGS and AGREE_ARGS (space-separated overrides,
# after its defaults, so they win); SLIDING holds the sliding run's cache options (a model with
# windows of its own refuses an imposed one: SLIDING="cache=sliding"; SLIDING="" skips that run).
# A setup that fails its agreement bar is a result, not a failure of the job: the report is
# still written, and the job then exits 1 naming it. Any other failing step stops the job
# with the tail of its log. A rerun measures everything again, except the context runs
# already finished (bench skips them; delete $DECODELAB_MAIN/context to redo them).
set -euo pipefail
case "${DECODELAB_MAIN:-}" in
    "") OUT=outputs/main ;;                   # under the repository
    /*) OUT=$DECODELAB_MAIN ;;
    *) OUT=$PWD/$DECODELAB_MAIN ;;            # relative to where the job was started
esac
cd "$(dirname "$0")/.."
B=${BIN:-.venv/bin}
mkdir -p "$OUT"
ARGS=("threads=$(nproc)" "$@")   # a threads= on the command line comes later and wins
start=$(date +%s)
step() {  # name, exit codes that are results (e.g. "0 1"), then the command; its log in $OUT/NAME.log
    local name=$1 ok=$2 s rc=0
    shift 2
    s=$(date +%s)
    echo ">> $name: $*" >&2
    "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    if [[ " $ok " != *" $rc "* ]]; then
        tail -n 25 "$OUT/$name.log" >&2
        echo "main job: step '$name' failed (exit $rc); its log: $OUT/$name.log" >&2
        exit "$rc"
    fi
    printf '   %s done in %ds (exit %d)\n' "$name" "$(( $(date +%s) - s ))" "$rc" >&2
    return "$rc"
}
# shellcheck disable=SC2086  # the *_ARGS and SLIDING variables are lists of overrides
step weights 0 "$B/decodelab-micro" part=weights 'weight_types=[int8,int4]' weight_compile=false \
    'contexts=[32,128,256]' steps=16 prompts_per_context=1 repeats=3 ttft_rounds=3 "${ARGS[@]}" ${WEIGHTS_ARGS:-} \
    "hydra.run.dir=$OUT/weights"
# shellcheck disable=SC2086
step gamma 0 "$B/decodelab-micro" part=spec_gamma prompts=3 steps=24 repeats=1 'gammas=[1,2,4,8]' "${ARGS[@]}" \
    ${GAMMA_ARGS:-} "hydra.run.dir=$OUT/gamma"
# shellcheck disable=SC2086
step context 0 "$B/decodelab-bench" -m experiment=main-context "${ARGS[@]}" ${CONTEXT_ARGS:-} \
    "hydra.sweep.dir=$OUT/context"
if [ -n "${SLIDING-cache=sliding}" ]; then
    # shellcheck disable=SC2086
    step sliding 0 "$B/decodelab-bench" -m experiment=main-context ${SLIDING-cache=sliding cache.window=512 cache.sinks=4} \
        "${ARGS[@]}" ${CONTEXT_ARGS:-} "hydra.sweep.dir=$OUT/context"
fi
# shellcheck disable=SC2086
step ppl 0 "$B/decodelab-micro" part=perplexity ppl_tokens=1536 context=512 stride=256 ppl_anchors=false \
    "${ARGS[@]}" ${PPL_ARGS:-} "hydra.run.dir=$OUT/ppl"
agree=0
# shellcheck disable=SC2086
step agree "0 1" "$B/decodelab-agree" workload=sharegpt-long forced_tokens=64 free_tokens=8 "${ARGS[@]}" \
    ${AGREE_ARGS:-} "hydra.run.dir=$OUT/agree" || agree=$?
"$B/decodelab-report" "$OUT"
echo "main job: $(( $(date +%s) - start )) s; every step's log, results and the plots above are in $OUT" >&2
if [ "$agree" -ne 0 ]; then
    grep '^FAIL ' "$OUT/agree.log" >&2 || true
    echo "main job: some setups failed their agreement bars (above; red in $OUT/agreement.png)" >&2
    exit 1
fi
