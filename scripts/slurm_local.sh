#!/usr/bin/env bash
# A 2-node Slurm cluster on this machine, for the tests marked `slurm` (tests/slurm/) and for trying
# launch/slurm/train.sbatch without a cluster.
#
#   scripts/slurm_local.sh up      # then: export SLURM_CONF=/tmp/isollm-slurm/slurm.conf
#   scripts/slurm_local.sh down
#
# One slurmctld and two slurmd (`slurmd -N n1`, `slurmd -N n2`), each on its own port, all on 127.0.0.1,
# with their own munged (own key and socket), config, state, logs and pid files under $ISOLLM_SLURM_DIR
# (default /tmp/isollm-slurm): a system Slurm or munge on this machine is left alone. n1 and n2 resolve to
# 127.0.0.1 through /etc/hosts (added by `up`, removed by `down`). `up` installs slurm-wlm and munge with
# apt-get when they are absent and it runs as root, and is idempotent: a cluster already up is left as it is. `down` cancels the
# cluster's jobs, then stops the daemons it started, by the pids they wrote, and removes the /etc/hosts lines.
# Ports (override by environment): SLURMCTLD_PORT (default 16817), SLURMD_PORT (n1; n2 takes the next one).
set -euo pipefail

DIR="${ISOLLM_SLURM_DIR:-/tmp/isollm-slurm}"
CTLD_PORT="${SLURMCTLD_PORT:-16817}"
SLURMD_PORT="${SLURMD_PORT:-16818}"
NODES=(n1 n2)
export SLURM_CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

# The daemons this script starts, by the pid file each writes.
pid_files() { echo "$DIR/slurmd-n2.pid" "$DIR/slurmd-n1.pid" "$DIR/slurmctld.pid" "$DIR/munged.pid"; }

alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    command -v apt-get >/dev/null ||
        die "slurm-wlm and munge are not installed and there is no apt-get: install them (slurmctld, slurmd, munged), then rerun"
    echo "installing slurm-wlm and munge"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null ||
        { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }
}

hosts_entries() {
    local node
    for node in "${NODES[@]}"; do
        getent hosts "$node" | grep -q '^127\.0\.0\.1 ' && continue
        grep -qE "^[^#]*[[:space:]]$node([[:space:]]|\$)" /etc/hosts && die "/etc/hosts names $node with another address"
        echo "127.0.0.1 $node  # scripts/slurm_local.sh" >> /etc/hosts
    done
}

remove_hosts_entries() {
    # The lines hosts_entries added, and no other. /etc/hosts is rewritten in place (cat >), not replaced
    # (sed -i renames a new file over it), since a container bind-mounts it.
    grep -q '# scripts/slurm_local.sh$' /etc/hosts 2>/dev/null && [[ -w /etc/hosts ]] || return 0
    local kept
    kept="$(grep -v '# scripts/slurm_local.sh$' /etc/hosts)"
    printf '%s\n' "$kept" > /etc/hosts
}

write_config() {
    cat > "$SLURM_CONF" <<EOF
# Written by scripts/slurm_local.sh: a 2-node cluster on one machine (loopback only).
ClusterName=isollm-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
# Short waits: the tests signal, kill and requeue jobs on purpose.
KillWait=5
MinJobAge=600
SchedulerParameters=sched_interval=2
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$SLURMD_PORT CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + 1)) CPUs=2 State=UNKNOWN
PartitionName=local Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_until() {  # wait_until SECONDS COMMAND...: poll COMMAND once a second; false when it never succeeds
    local deadline=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || return 1
        sleep 1
    done
}

no_jobs() { [[ -z "$(squeue -h -o %i 2>/dev/null)" ]]; }

nodes_idle() { [[ "$(sinfo -h -N -o '%N %t' | sort | tr '\n' ' ')" == "n1 idle n2 idle " ]]; }

# Both nodes answer (idle, or running jobs): a cluster that is up.
nodes_ready() { [[ "$(sinfo -h -N -o '%N %t' | sort | sed -E 's/ (idle|mix|alloc|comp)$/ ok/' | tr '\n' ' ')" == "n1 ok n2 ok " ]]; }

up() {
    if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd-n1.pid" && alive "$DIR/slurmd-n2.pid" &&
       alive "$DIR/munged.pid" && nodes_ready; then
        echo "slurm_local.sh: already up; export SLURM_CONF=$SLURM_CONF"
        return
    fi
    (( EUID == 0 )) || die "up needs root (it installs slurm-wlm and munge when absent, adds n1 and n2 to /etc/hosts and runs the daemons as SlurmUser=root): rerun as root"
    down >/dev/null 2>&1 || true   # a half-started cluster: start again from nothing
    install_packages
    hosts_entries
    mkdir -p "$DIR/state" "$DIR/spool-n1" "$DIR/spool-n2"
    chmod 700 "$DIR"
    [[ -s "$DIR/munge.key" ]] || { dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none; chmod 400 "$DIR/munge.key"; }
    write_config
    # --force: munged refuses to run as root otherwise.
    munged --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
        --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
    wait_until 20 alive "$DIR/munged.pid" || die "munged did not start (see $DIR/munged.log)"
    # -c: no jobs from an earlier cluster in this directory.
    slurmctld -c -f "$SLURM_CONF"
    wait_until 30 scontrol ping || die "slurmctld did not answer within 30 s (see $DIR/slurmctld.log)"
    local node
    for node in "${NODES[@]}"; do
        slurmd -N "$node" -f "$SLURM_CONF"
    done
    wait_until 60 nodes_idle || die "nodes n1 and n2 not idle within 60 s: $(sinfo -h -N -o '%N %t' | tr '\n' ' ')(see $DIR/slurmd-*.log)"
    echo "slurm_local.sh: up (n1, n2 idle); export SLURM_CONF=$SLURM_CONF"
}

down() {
    [[ -f "$SLURM_CONF" ]] || { remove_hosts_entries; echo "slurm_local.sh: not up"; return; }
    if alive "$DIR/slurmctld.pid"; then
        local jobs
        mapfile -t jobs < <(squeue -h -o %i 2>/dev/null)
        (( ${#jobs[@]} == 0 )) || scancel --full "${jobs[@]}" 2>/dev/null || true
        # Their processes end before the slurmd that watches them is stopped.
        wait_until 60 no_jobs || echo "slurm_local.sh: jobs still listed after 60 s" >&2
    fi
    local file pid
    for file in $(pid_files); do
        alive "$file" || continue
        pid="$(cat "$file")"
        kill -TERM "$pid"
        wait_until 20 bash -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null || true
    done
    rm -f "$DIR"/*.pid
    remove_hosts_entries
    echo "slurm_local.sh: down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
