#!/usr/bin/env bash
# A SLURM cluster on this machine, for the sweep's SLURM tests (tests/test_sweep_slurm.py) and the multi-node launch
# test (tests/test_multiprocess.py): installs Debian's slurm-wlm and munge (apt), writes /etc/slurm/slurm.conf for
# this host, starts munged, slurmctld and two slurmd, and waits until `sinfo` shows both nodes idle.
#
# Nodes: this host (partition `debug`, the default: the sweeps' one node) and a second slurmd on the same host
# under the name `localhost` (its own port, spool and pid file; Debian's slurmd runs as any node it is told with
# `-N`). Partition `multinode` holds both, so `srun --nodes=2` starts one task per "node", each with its own
# $SLURM_NODEID, as on two machines. Both nodes count this host's CPUs: jobs in the two partitions may share them.
#
#   sudo .ci/slurm_up.sh            # idempotent: a second call finds the node up and returns at once
#   SLURM_UP_STOP=1 .ci/slurm_up.sh # stop the daemons it started
#
# No job accounting (no slurmdbd, no database): the sweep tracks runs with squeue plus the run folders.
# No cgroups either (proctrack/linuxproc, task/none), so it runs in containers and on CI machines.
# It never touches a slurm.conf it did not write (the first line marks its own).
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by trl-grpo-ext .ci/slurm_up.sh"
STATE=/var/lib/slurm
LOGS=/var/log/slurm
PARTITION=${SLURM_UP_PARTITION:-debug}
MAX_TIME=${SLURM_UP_MAX_TIME:-02:00:00}
HOST=$(hostname -s)
SECOND=localhost  # a name that resolves here, as a node's name does on a real cluster (MASTER_ADDR reads it)
MULTINODE=multinode

log() { echo "slurm_up: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts system daemons): sudo $0"
[ "$HOST" != "$SECOND" ] || die "this host is called $SECOND, the second node's name"

stop_pidfile() {  # stop the daemon whose pid file this script's config names, if it is running
    local pidfile=$1 pid
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
}

stop_slurmds() {
    stop_pidfile "/run/slurmd-$HOST.pid"
    stop_pidfile "/run/slurmd-$SECOND.pid"
    stop_pidfile /run/slurmd.pid  # written by this script's one-node version
}

if [ -n "${SLURM_UP_STOP:-}" ]; then
    stop_slurmds
    stop_pidfile /run/slurmctld.pid
    stop_pidfile /run/munge/munged.pid
    exit 0
fi

node_state() { sinfo --noheader --nodes="$1" --format=%t 2>/dev/null | head -n1 || true; }
up() { case "$(node_state "$1")" in idle|mix|alloc) return 0 ;; esac; return 1; }

# ----------------------------------------------------------------------------------------------- install
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v sbatch >/dev/null; then
    log "installing slurm-wlm and munge (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # Package scripts may try to start the daemons (no init system in containers): harmless either way.
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# ----------------------------------------------------------------------------------------------- config
if [ -f "$CONF" ] && [ "$(head -n1 "$CONF")" != "$MARK" ]; then
    die "$CONF exists and was not written by this script; not touching it"
fi
# The node's real CPUs and memory, as slurmd sees them (a node configured with more would be drained).
read -r CPUS MEM_MB < <(slurmd -C | head -n1 | tr ' ' '\n' \
    | awk -F= '$1=="CPUs"{c=$2} $1=="RealMemory"{m=$2} END{print c, m}')
[ -n "$CPUS" ] && [ -n "$MEM_MB" ] || die "slurmd -C did not report this node's CPUs and memory"
MEM_MB=$((MEM_MB * 9 / 10))  # headroom for the OS and the daemons
mkdir -p "$CONF_DIR" "$STATE/slurmctld" "$STATE/slurmd" "$LOGS"
NEW_CONF=$(cat <<EOF
$MARK
ClusterName=trlgrpoext
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
MpiDefault=none
# no cgroups: processes tracked by parent pid, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
ReturnToService=2
KillWait=10
MailProg=/bin/true
StateSaveLocation=$STATE/slurmctld
# per node (%n): two slurmd on this host
SlurmdSpoolDir=$STATE/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
NodeName=$HOST NodeAddr=127.0.0.1 Port=6818 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
NodeName=$SECOND NodeAddr=127.0.0.1 Port=6819 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=$MAX_TIME DefMemPerCPU=$((MEM_MB / CPUS)) State=UP
PartitionName=$MULTINODE Nodes=$HOST,$SECOND MaxTime=$MAX_TIME DefMemPerCPU=$((MEM_MB / CPUS)) State=UP
EOF
)
CHANGED=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEW_CONF" ]; then
    printf '%s\n' "$NEW_CONF" > "$CONF"
    CHANGED=1
fi

if [ "$CHANGED" = 0 ] && up "$HOST" && up "$SECOND"; then
    log "nodes $HOST and $SECOND are up"
    exit 0
fi

# ----------------------------------------------------------------------------------------------- daemons
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer"
fi

# A changed config, or daemons left from an earlier session: start both afresh (jobs' state is kept).
stop_slurmds
stop_pidfile /run/slurmctld.pid
log "starting slurmctld and two slurmd (nodes $HOST and $SECOND: $CPUS CPUs, $MEM_MB MB each; partitions" \
    "$PARTITION: $HOST, $MULTINODE: both)"
slurmctld || die "slurmctld did not start; see $LOGS/slurmctld.log"
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
scontrol ping >/dev/null 2>&1 || die "slurmctld does not answer; see $LOGS/slurmctld.log"
mkdir -p "$STATE/slurmd/$HOST" "$STATE/slurmd/$SECOND"
for node in "$HOST" "$SECOND"; do
    slurmd -N "$node" || die "slurmd of node $node did not start; see $LOGS/slurmd-$node.log"
done

for _ in $(seq 120); do
    if up "$HOST" && up "$SECOND"; then log "nodes $HOST and $SECOND are up"; sinfo >&2; exit 0; fi
    for node in "$HOST" "$SECOND"; do
        case "$(node_state "$node")" in
            down*|drain*|drng*) scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
        esac
    done
    sleep 0.5
done
sinfo >&2 || true
tail -n 20 "$LOGS/slurmctld.log" "$LOGS/slurmd-$HOST.log" "$LOGS/slurmd-$SECOND.log" >&2 || true
die "nodes $HOST and $SECOND did not both become idle"
