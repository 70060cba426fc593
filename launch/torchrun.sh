#!/usr/bin/env bash
# One node, N processes (one per GPU) with torchrun: the same train.py and config as the CPU demo.
#
#   launch/torchrun.sh 8 --config configs/experiments/X.yaml name=x train.max_steps=1000
#
# The first argument is the number of processes; everything after it goes to train.py unchanged.
# torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; Accelerate reads them and
# runs DDP (NCCL on GPUs, gloo on CPU). --standalone rendezvouses on a free local port, so two jobs on
# one node do not clash. For FSDP2 or DeepSpeed use `accelerate launch --config_file
# launch/accelerate/<mode>.yaml` instead (docs/distributed.md).
# SIGTERM / SIGINT to this script stop every rank after a checkpoint, with exit code 0 (launch/supervise.sh).
# Environment: PYTHON (interpreter, default python), OMP_NUM_THREADS (default: cores / processes),
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (seconds torchrun waits for the ranks' checkpoint after a signal, default 540).
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NPROC --config FILE.yaml [key=value ...]  (NPROC: processes on this node)" >&2
    exit 2
fi
procs="$1"
shift
cd "$(dirname "$0")/.."

cores="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / procs > 0 ? cores / procs : 1 ))}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-540}"

exec launch/supervise.sh "${PYTHON:-python}" -m torch.distributed.run \
    --standalone --nproc_per_node "$procs" \
    train.py "$@"
