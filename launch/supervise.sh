#!/usr/bin/env bash
# Run a multi-process launcher so that a stop by signal that ended in a checkpoint exits 0.
#
#   launch/supervise.sh accelerate launch --config_file launch/accelerate/ddp.yaml train.py --config X.yaml
#   launch/supervise.sh python -m torch.distributed.run --standalone --nproc_per_node 8 train.py ...
#
# torchrun and accelerate launch forward a SIGTERM to their ranks, which checkpoint and exit 0, but then exit 1
# themselves (torch elastic's SignalException), and Slurm's requeue and other schedulers read that as a failure.
# Here SIGTERM / SIGINT sent to this script go to the launcher's ranks as SIGTERM (the launcher then sees them
# finish and exits 0 too), and when the launcher exits non-zero although every rank on this node reported exit 0
# (through ISOLLM_EXIT_DIR, written by train.py), this script exits 0. Anything else keeps the launcher's status.
set -uo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 LAUNCHER [ARGS ...]" >&2
    exit 2
fi
ISOLLM_EXIT_DIR="$(mktemp -d)"
export ISOLLM_EXIT_DIR
trap 'rm -rf "$ISOLLM_EXIT_DIR"' EXIT

"$@" &
launcher=$!
# The ranks are the launcher's children. SIGTERM, never SIGINT: a second SIGINT interrupts a rank at once.
trap 'pkill -TERM -P "$launcher" 2>/dev/null || true' TERM INT
# `wait` returns early (128 + signal) when a trapped signal arrives: keep waiting while the launcher lives,
# then read its exit status (bash remembers it for a finished background job).
while kill -0 "$launcher" 2>/dev/null; do
    wait "$launcher" || true
done
status=0
wait "$launcher" || status=$?

every_rank_exited_0() {
    local files=("$ISOLLM_EXIT_DIR"/rank*) code ranks
    [[ -e "${files[0]}" ]] || return 1
    for file in "${files[@]}"; do
        read -r code ranks < "$file"
        [[ "$code" == 0 ]] || return 1
    done
    (( ${#files[@]} == ranks ))
}

if (( status != 0 )) && every_rank_exited_0; then
    echo "supervise.sh: the launcher exited ${status}, but every rank on this node exited 0 (a stop by signal" \
         "that ended in a checkpoint): exiting 0" >&2
    status=0
fi
exit "$status"
