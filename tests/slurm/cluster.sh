#!/usr/bin/env bash
# A real one-node Slurm for the tests (tests/test_sweep_slurm.py), on this machine, as root:
#   cluster.sh install      apt-get installs Debian's Slurm, munge and MariaDB where missing
#   cluster.sh start DIR    munged, MariaDB (its own data folder in DIR), slurmdbd with its
#                           accounting database, slurmctld and slurmd; waits for the node idle
#   cluster.sh stop DIR     stops every daemon that start left running (their pid files in DIR)
# Everything it writes is under DIR (configuration, state, logs); clients find the cluster
# through SLURM_CONF=DIR/etc/slurm.conf. The node is this machine: 32 CPUs (3 a GPU rank asks for) and 8 GPUs declared
# (SLURM_NODE_GPUS=N declares N instead, as a user's 2-GPU node does; config_overrides; the
# GPUs are dummy files in DIR/dev, enough for --gpus-per-node), the
# minimal plugins that work without systemd or cgroups (proctrack/linuxproc, task/none).
# SLURM_NODES=N starts N nodes instead (qp1..qpN, one `slurmd -N` each on this machine, each
# on its own port, with SLURM_NODE_GPUS GPUs each): a multi-node allocation on one machine.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
DB_PORT=3317
DBD_PORT=6829
CTLD_PORT=6827
SLURMD_PORT=6828

log() { echo "[slurm-cluster] $*" >&2; }

install() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        log "installed already: ${PACKAGES[*]}"
        return 0
    fi
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit="$1" what="$2" i
    shift 2
    for ((i = 0; i < limit * 10; i++)); do
        if "$@" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    log "$what did not come up within ${limit} s"
    return 1
}

start() {
    local dir host
    dir="$(realpath -m "$1")"
    host="$(hostname -s)"
    mkdir -p "$dir"/{etc,log,run,spool/ctld,spool/d,dev,munge,mysql}
    chmod 700 "$dir/munge"
    # munge: a key of this cluster's own, a socket in DIR
    if [[ ! -s "$dir/munge/munge.key" ]]; then
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$dir/munge/munge.key"
    fi
    local socket="$dir/munge/munge.socket"
    munged --force --key-file="$dir/munge/munge.key" --socket="$socket" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
    wait_for 10 munged test -S "$socket"

    # MariaDB: its own data folder and TCP port, never the machine's database
    if [[ ! -d "$dir/mysql/mysql" ]]; then
        mariadb-install-db --user=root --datadir="$dir/mysql" --auth-root-authentication-method=normal \
            --skip-test-db >"$dir/log/mariadb-install.log" 2>&1
    fi
    mariadbd --user=root --datadir="$dir/mysql" --socket="$dir/run/mysqld.sock" \
        --pid-file="$dir/run/mariadbd.pid" --port="$DB_PORT" --bind-address=127.0.0.1 \
        --log-error="$dir/log/mariadb.log" --skip-log-bin </dev/null >/dev/null 2>&1 &
    wait_for 60 MariaDB mariadb-admin --socket="$dir/run/mysqld.sock" -uroot ping
    mariadb --socket="$dir/run/mysqld.sock" -uroot -e "
        CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

    local i n gpus="${SLURM_NODE_GPUS:-8}" nodes="${SLURM_NODES:-1}"
    for (( i = 0; i < gpus; i++ )); do : >"$dir/dev/gpu$i"; done
    local node_lines gres_lines
    if (( nodes == 1 )); then
        node_lines="NodeName=$host NodeAddr=127.0.0.1 CPUs=32 Gres=gpu:$gpus State=UNKNOWN"
        gres_lines="NodeName=$host Name=gpu File=$dir/dev/gpu[0-$((gpus - 1))]"
    else
        node_lines="" gres_lines=""
        for (( n = 1; n <= nodes; n++ )); do
            for (( i = 0; i < gpus; i++ )); do : >"$dir/dev/qp$n-gpu$i"; done
            node_lines+="NodeName=qp$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + 10 + n)) CPUs=32 Gres=gpu:$gpus State=UNKNOWN"$'\n'
            gres_lines+="NodeName=qp$n Name=gpu File=$dir/dev/qp$n-gpu[0-$((gpus - 1))]"$'\n'
        done
    fi
    cat >"$dir/etc/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$socket
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
PidFile=$dir/run/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
CONF
    chmod 600 "$dir/etc/slurmdbd.conf"
    cat >"$dir/etc/slurm.conf" <<CONF
ClusterName=quantpatch-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$socket
StateSaveLocation=$dir/spool/ctld
SlurmdSpoolDir=$dir/spool/d-%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ReturnToService=2
KillWait=2
MinJobAge=300
MpiDefault=none
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    cat >"$dir/etc/gres.conf" <<CONF
$gres_lines
CONF
    cat >"$dir/env" <<CONF
export SLURM_CONF=$dir/etc/slurm.conf
CONF
    export SLURM_CONF="$dir/etc/slurm.conf"
    slurmdbd
    wait_for 30 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"
    slurmctld -i
    wait_for 30 slurmctld scontrol ping
    if (( nodes == 1 )); then
        slurmd
    else
        for (( n = 1; n <= nodes; n++ )); do slurmd -N "qp$n"; done
    fi
    wait_for 60 "the nodes (idle in sinfo)" bash -c \
        "[[ \"\$(sinfo -h -N -o %T | grep -cx idle)\" == $nodes ]]"
    log "up: $(sinfo -h -N -o '%N %T %G')"
}

stop() {
    local dir pid i
    dir="$(realpath -m "$1")"
    if [[ -s "$dir/run/slurmctld.pid" ]] && kill -0 "$(<"$dir/run/slurmctld.pid")" 2>/dev/null; then
        # the jobs first, so that no task outlives the cluster
        SLURM_CONF="$dir/etc/slurm.conf" scancel --user "$(id -un)" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            [[ -z "$(SLURM_CONF="$dir/etc/slurm.conf" squeue -h -t R,CG 2>/dev/null)" ]] && break
            sleep 0.1
        done
    fi
    local file
    for file in "$dir"/run/slurmd*.pid "$dir"/run/{slurmctld,slurmdbd,mariadbd,munged}.pid; do
        [[ -s "$file" ]] || continue
        pid="$(<"$file")"
        kill -TERM "$pid" 2>/dev/null || continue
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$file"
    done
}

case "${1:-}" in
    install) install ;;
    start) start "${2:?start DIR}" ;;
    stop) stop "${2:?stop DIR}" ;;
    *)
        echo "usage: $0 install | start DIR | stop DIR" >&2
        exit 2
        ;;
esac
