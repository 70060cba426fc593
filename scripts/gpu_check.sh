#!/usr/bin/env bash
# One command for a lent GPU machine (one H100, no registry, under 10 minutes): install the carried wheels
# offline, then run scripts/gpu_check.py's stages (GPU tests, training-step MFU, train.py through every
# one-GPU launch config with a resume, attention and generation benchmarks) into OUTDIR/report.md and
# OUTDIR/logs.tar.gz. `make gpu-wheels` fills .whl/ (carry it); see docs/performance.md, "On a GPU machine".
#   scripts/gpu_check.sh [OUTDIR]             OUTDIR: default $OUT
#   scripts/gpu_check.sh --dry-run [OUTDIR]   the same sequence at tiny size on CPU (fp32, no fla, no wheels)
# Environment: PYTHON (default python3), SITE (wheel install target, default /tmp/isollm-site).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mode=()
if [[ "${1:-}" == "--dry-run" ]]; then mode=(--dry-run); shift; fi
OUTDIR=${1:-${OUT:-}}
if [[ -z "$OUTDIR" ]]; then echo "gpu_check.sh: error: give OUTDIR or set \$OUT" >&2; exit 2; fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ ${#mode[@]} -eq 0 ]]; then
    shopt -s nullglob
    wheels=(.whl/*.whl)
    if [[ ${#wheels[@]} -eq 0 ]]; then
        echo "gpu_check.sh: warning: no wheels in .whl/ (make gpu-wheels, then carry .whl): using the environment as is" >&2
    else
        SITE=${SITE:-/tmp/isollm-site}
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}"
        export PYTHONPATH="$SITE:$PYTHONPATH"
    fi
fi
exec "$PYTHON" scripts/gpu_check.py "${mode[@]}" "$OUTDIR"
