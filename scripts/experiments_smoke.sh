#!/usr/bin/env bash
# Every command of experiments/README.md at its smallest setting (the tiny random model
# where the question allows, a few tokens otherwise), each timed, into one directory; then
# decodelab-report over all of it. A check that the commands run as written on a fresh
# clone after `make setup`:   bash scripts/experiments_smoke.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin
OUT=${1:-outputs/smoke}
rm -rf "$OUT" && mkdir -p "$OUT"
TINY=(model=tiny-llama model.device=cpu threads=1)
fails=0
run() {  # name, then the command
    local name=$1 s rc
    shift
    s=$(date +%s)
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || fails=$((fails + 1))
    printf '%-12s rc=%d %4ds  %s\n' "$name" "$rc" "$(( $(date +%s) - s ))" "$*"
}
run baseline $B/decodelab-bench -m experiment=baseline "${TINY[@]}" max_new_tokens=4 workload.per_length=1 \
    'workload.lengths=[32]' "hydra.sweep.dir=$OUT/baseline"
run agree $B/decodelab-agree reference=transformers workload=agree-prompts \
    workload.n=1 forced_tokens=4 free_tokens=4 \
    "${TINY[@]}" draft.layers=1 "hydra.run.dir=$OUT/agree"
run lossless $B/decodelab-bench -m name=lossless cache=dense,paged,int4,sliding decoder=speculative \
    draft=prompt-lookup compare_greedy=true agree_with_dense=false workload=synthetic 'workload.lengths=[200]' \
    max_new_tokens=8 "${TINY[@]}" "hydra.sweep.dir=$OUT/lossless"
run gamma $B/decodelab-bench -m experiment=gamma workload.n=1 workload.max_prompt_tokens=64 max_new_tokens=8 \
    draft=prompt-lookup decoder.gamma=2,4 "${TINY[@]}" "hydra.sweep.dir=$OUT/gamma"
run verify_cost $B/decodelab-micro part=verify_cost 'tokens=[1,3]' repeats=2 "${TINY[@]}" "hydra.run.dir=$OUT/verify_cost"
run kv_speed $B/decodelab-micro part=kv_speed 'contexts=[64]' steps=2 repeats=1 "${TINY[@]}" "hydra.run.dir=$OUT/kv_speed"
# group 32: transformers' quanto groups must divide tokens x head_dim (16 on the tiny model)
run kv_quality $B/decodelab-micro part=kv_quality prompts=1 forced_tokens=8 group_size=32 "${TINY[@]}" \
    "hydra.run.dir=$OUT/kv_quality"
run kv_memory $B/decodelab-micro part=kv_memory 'contexts=[64]' "${TINY[@]}" "hydra.run.dir=$OUT/kv_memory"
run mixed_step $B/decodelab-micro part=mixed_step 'chunks=[4]' decode_rows=2 decode_context=16 chunk_context=24 \
    repeats=1 "${TINY[@]}" "hydra.run.dir=$OUT/mixed_step"
run spec_gamma $B/decodelab-micro part=spec_gamma 'drafts=[prompt-lookup,int8-self]' 'gammas=[1,2]' prompts=1 steps=4 \
    repeats=1 "${TINY[@]}" "hydra.run.dir=$OUT/spec_gamma"
run serve $B/decodelab-serve trace=synthetic requests=4 'synthetic.prompt_tokens=[8,16]' \
    'synthetic.output_tokens=[4,8]' 'rates=[inf,50]' compare_transformers=false check_alone=2 unloaded=1 "${TINY[@]}" \
    "hydra.run.dir=$OUT/serve"
run context $B/decodelab-bench -m experiment=context 'workload.lengths=[64,128]' max_new_tokens=4 "${TINY[@]}" \
    "hydra.sweep.dir=$OUT/context"
run generate $B/decodelab-generate prompt="Hello" max_new_tokens=4 "${TINY[@]}" json=true
run gpu_check $B/decodelab-gpu-check smoke=true "out=$OUT/gpu_check"
run report $B/decodelab-report "$OUT"
echo "$fails failed"
[ "$fails" -eq 0 ]
