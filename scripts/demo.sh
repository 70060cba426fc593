#!/usr/bin/env bash
# The README's first command (`make demo`): short real training runs of SwiGLU and IsoGMLP on real text,
# three seeds each, then their comparison with a plan for more seeds. Online it streams FineWeb; offline it
# uses ../shared/data/fineweb-sample or, failing that, the Python standard library's docstrings (it says which). A few minutes on 2 CPU cores.
#   scripts/demo.sh [train.py overrides, e.g. train.max_steps=50]
# Environment: PYTHON (default: .venv/bin/python when present, else python).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" scripts/demo.py "$@"
