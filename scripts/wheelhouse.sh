#!/usr/bin/env bash
# Download every wheel the project needs that an offline GPU machine lacks into
# wheelhouse/ (git-ignored), for `pip install --no-index` there.
#
# The lent H200 image (see /work/.library/device/KINDS.md) has python3.12 with torch,
# triton, transformers, safetensors, accelerate, numpy, pyyaml, pandas, pyarrow,
# huggingface-hub, tqdm, requests and ninja, and lacks: hydra-core, omegaconf,
# antlr4-python3-runtime (hydra's parser), optimum-quanto (the int4 cache), gguf (GGUF
# checkpoints), datasets (workloads) and datasets' dill and multiprocess. Versions are
# the ones this checkout's venv runs, so the GPU machine runs what CI tested.
#
#   make wheelhouse                      # or: bash scripts/wheelhouse.sh
#   PYVER=3.11 EXTRA="pyarrow==26.0.1" bash scripts/wheelhouse.sh
#
# On the GPU machine (carry the folder `wheelhouse`), before anything imports them:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site wheelhouse/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}        # the pip client (any python with pip)
[ -x "$PY" ] || PY=python3
DEST=${DEST:-wheelhouse}
PYVER=${PYVER:-3.12}              # the GPU machine's python
EXTRA=${EXTRA:-}                  # more name==version pins, space separated

# name and the version to fetch: the venv's, else a default known to work together
pin() {
    local v
    v=$("$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null) || v=$2
    echo "$1==$v"
}
BINARY=(
    "$(pin hydra-core 1.3.8)" "$(pin omegaconf 2.3.1)" "$(pin optimum-quanto 0.2.7)" "$(pin gguf 0.19.0)"
    "$(pin datasets 5.2.0)" "$(pin dill 0.4.1)" "$(pin multiprocess 0.70.19)"
)
# omegaconf pins antlr4-python3-runtime 4.9.*, published as an sdist only: built into a
# (pure-Python) wheel here
ANTLR=$(pin antlr4-python3-runtime 4.9.3)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two stop the whole install there
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "${BINARY[@]}" $EXTRA
"$PY" -m pip wheel -q --no-deps -w "$DEST" "$ANTLR"
ls -1 "$DEST"
du -sh "$DEST"
