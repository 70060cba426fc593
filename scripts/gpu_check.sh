#!/usr/bin/env bash
# Five commands for a lent GPU machine (one H100, no registry, each one device call under 10 minutes): install
# the carried wheels offline, then run one part of scripts/gpu_check.py's stage table (scripts/gpu_stages.py;
# `python scripts/gpu_check.py --list` prints it) into OUTDIR/report.md and OUTDIR/logs.tar.gz: 1 = correctness and
# the headline (GPU tests; every engine with train.compile and the FP8 head against eager DDP; swiglu, isogmlp,
# swiglu+iso_tanh and the FP8 head at 134m 32 x 2048 against the fair Qwen3 row), 2 = every step row, long context,
# attention, 3 = generation and the micro batch with the Qwen3 rows, 4 = train.py through every one-GPU launch
# config with a resume, 5 = the FP8 head's loss over 200 steps and more steps (250m, profiles).
# `make gpu-wheels` fills .whl/ (carry it); see docs/performance.md, "On a GPU machine".
#   scripts/gpu_check.sh --part N [OUTDIR]    N in 1 2 3 4 5; OUTDIR: default $OUT
#   scripts/gpu_check.sh --dry-run [OUTDIR]   every stage at tiny size on CPU (fp32, no fla, no wheels)
# After OUTDIR, scripts/gpu_check.py's other options, e.g. --stage compile --stage train (only those stages).
# Environment: PYTHON (default python3), SITE (wheel install target, default /tmp/isollm-site).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mode=()
if [[ "${1:-}" == "--dry-run" ]]; then mode=(--dry-run); shift
elif [[ "${1:-}" == "--part" ]]; then mode=(--part "${2:-}"); shift 2
else echo "gpu_check.sh: error: give --part 1|2|3|4|5 (one device call each) or --dry-run" >&2; exit 2; fi
OUTDIR=${1:-${OUT:-}}
shift $(( $# > 0 ))
if [[ -z "$OUTDIR" ]]; then echo "gpu_check.sh: error: give OUTDIR or set \$OUT" >&2; exit 2; fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${mode[0]}" == "--part" ]]; then
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
exec "$PYTHON" scripts/gpu_check.py "${mode[@]}" "$OUTDIR" "$@"
