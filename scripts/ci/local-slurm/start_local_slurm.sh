#!/usr/bin/env bash
# Vendored copy of tools/local-slurm/start_local_slurm.sh from the project's shared tools (CI runs on a clean
# clone without them); keep it in step with the original. Original header follows.
# start_local_slurm.sh - idempotently bring up a real single-host SLURM cluster
# (Debian packages, munged + slurmctld + N slurmd started by hand, no systemd).
#
# Exits 0 once `sinfo` shows every node idle. Safe to re-run: daemons that are
# already running (per pidfile) are left alone; a changed slurm.conf restarts them.
#
# Env knobs (all optional):
#   SLURM_LOCAL_BASE      base dir for conf/state/logs   [${TMPDIR:-/tmp}/asyncrl-local-slurm]
#   SLURM_LOCAL_NODES     number of virtual nodes (one slurmd each) [2]
#                         (a het job with K components needs >= K nodes, see README)
#   SLURM_LOCAL_CPUS      CPUs per virtual node [max(1, nproc / NODES)]
#                         if NODES*CPUS > nproc, SlurmdParameters=config_overrides is set
#   SLURM_LOCAL_MEM       RealMemory (MB) per node   [min(20000, 80% of RAM) / NODES]
#   SLURM_LOCAL_PORT      slurmctld port; slurmd ports are PORT+1 .. PORT+NODES [6817]
#   SLURM_LOCAL_CLEAN=1   wipe job/node state before starting slurmctld
#   SLURM_LOCAL_TIMEOUT   seconds to wait for idle nodes [60]
#   SLURM_LOCAL_ACCOUNTING=1  also run MariaDB + slurmdbd so sacct works (+~15s first time)
#   SLURM_LOCAL_PROBE=0   skip the srun probe that runs `true` on every node
# Afterwards:  source "$SLURM_LOCAL_BASE/env.sh"   (exports SLURM_CONF)
set -euo pipefail

BASE=${SLURM_LOCAL_BASE:-${TMPDIR:-/tmp}/asyncrl-local-slurm}
NODES=${SLURM_LOCAL_NODES:-2}
NPROC=$(nproc)
CPUS=${SLURM_LOCAL_CPUS:-$(( NPROC / NODES > 0 ? NPROC / NODES : 1 ))}
MEM_TOTAL_MB=$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo)
MEM_CAP=$(( MEM_TOTAL_MB * 8 / 10 )); (( MEM_CAP > 20000 )) && MEM_CAP=20000
MEM=${SLURM_LOCAL_MEM:-$(( MEM_CAP / NODES ))}
PORT=${SLURM_LOCAL_PORT:-6817}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
ACCT=${SLURM_LOCAL_ACCOUNTING:-0}
DBPORT=$((PORT + 7000)); DBDPORT=$((PORT + 10000))   # 13817 / 16817 by default
H=$(hostname -s)
CONF=$BASE/etc/slurm.conf
RUN=$BASE/run
export SLURM_CONF=$CONF

log() { echo "[start_local_slurm $(date +%T)] $*"; }
alive() { # alive PIDFILE PATTERN -> 0 if pidfile's process is running and cmdline matches
  local pf=$1 pat=$2 pid
  [[ -s $pf ]] || return 1
  pid=$(cat "$pf"); [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' < /proc/$pid/cmdline | grep -q -- "$pat" || return 1
  [[ -z ${3:-} ]] || tr '\0' '\n' < /proc/$pid/environ | grep -qx -- "$3"
}

# ---- 1. packages -----------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  log "installing slurm + munge from apt"
  t0=$(date +%s)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # policy-rc.d (if present) keeps the packages' init scripts from starting services
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  log "apt done in $(( $(date +%s) - t0 ))s: $(dpkg-query -W -f='${Version}' slurmctld)"
fi

if [[ $ACCT == 1 ]] && { ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; }; then
  log "installing slurmdbd + mariadb-server from apt"; t0=$(date +%s)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends slurmdbd mariadb-server >/dev/null
  log "apt done in $(( $(date +%s) - t0 ))s"
fi

# ---- 2. dirs + munge ---------------------------------------------------------
mkdir -p "$BASE"/{etc,run,log,state,spool,munge}
chmod 755 "$BASE" "$RUN"; chmod 700 "$BASE/munge"
for i in $(seq 0 $((NODES - 1))); do mkdir -p "$BASE/spool/slurmd.$H-$i"; done

if [[ ! -s $BASE/munge/munge.key ]]; then
  mungekey --create --keyfile="$BASE/munge/munge.key" --force
  chmod 400 "$BASE/munge/munge.key"
fi
if ! alive "$RUN/munged.pid" "$RUN/munge.socket"; then
  log "starting munged"
  rm -f "$RUN/munge.socket" "$RUN/munge.socket.lock"
  # --force: tolerate lax permissions on parent dirs (CI workspaces)
  munged --force --key-file="$BASE/munge/munge.key" --socket="$RUN/munge.socket" \
         --pid-file="$RUN/munged.pid" --log-file="$BASE/log/munged.log" \
         --seed-file="$BASE/munge/munged.seed"
fi
for _ in $(seq 50); do [[ -S $RUN/munge.socket ]] && break; sleep 0.1; done
munge -S "$RUN/munge.socket" -n | unmunge -S "$RUN/munge.socket" >/dev/null

# ---- 3. slurm.conf -----------------------------------------------------------
if [[ $ACCT == 1 ]]; then
  ACCT_LINES="JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBDPORT
# with a non-default munge socket, this is how the slurmdbd connection finds it
AccountingStoragePass=$RUN/munge.socket"
else
  ACCT_LINES="JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none"
fi
EXTRA=""
(( NODES * CPUS > NPROC )) && EXTRA="SlurmdParameters=config_overrides"
NEW=$(mktemp)
{
cat <<EOF
# generated by start_local_slurm.sh
ClusterName=localcluster
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$RUN/munge.socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
$ACCT_LINES
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
SchedulerType=sched/backfill
# het jobs are only started by the backfill loop (default every 30s)
SchedulerParameters=bf_interval=1
ReturnToService=2
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/slurmd.%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmctldTimeout=120
SlurmdTimeout=300
Waittime=0
$EXTRA
EOF
for i in $(seq 0 $((NODES - 1))); do
  echo "NodeName=$H-$i NodeHostname=$H NodeAddr=127.0.0.1 Port=$((PORT + 1 + i)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
done
echo "PartitionName=gen Nodes=$H-[0-$((NODES - 1))] Default=YES MaxTime=INFINITE State=UP"
echo "PartitionName=learn Nodes=$H-[0-$((NODES - 1))] Default=NO MaxTime=INFINITE State=UP"
} > "$NEW"

if [[ -f $CONF ]] && ! cmp -s "$NEW" "$CONF"; then
  log "slurm.conf changed -> restarting slurm daemons"
  SLURM_LOCAL_KEEP_MUNGE=1 SLURM_LOCAL_BASE=$BASE "$(dirname "$(readlink -f "$0")")/stop_local_slurm.sh"
  [[ ${SLURM_LOCAL_CLEAN:-0} == 1 ]] || { rm -f "$BASE"/state/node_state*; }  # node set may differ
fi
mv "$NEW" "$CONF"; chmod 644 "$CONF"
echo "export SLURM_CONF=$CONF" > "$BASE/env.sh"

# ---- 4. daemons --------------------------------------------------------------
if [[ $ACCT == 1 ]]; then
  if [[ ! -d $BASE/db/mysql ]]; then
    log "initialising MariaDB datadir"
    mkdir -p "$BASE/db"
    mariadb-install-db --no-defaults --user=root --datadir="$BASE/db" \
      --auth-root-authentication-method=socket --skip-test-db > "$BASE/log/mariadb-install.log" 2>&1
  fi
  if ! alive "$RUN/mariadb.pid" "mariadbd --no-defaults --user=root --datadir=$BASE/db"; then
    log "starting mariadbd (127.0.0.1:$DBPORT)"
    rm -f "$RUN/mysql.sock"
    setsid mariadbd --no-defaults --user=root --datadir="$BASE/db" --socket="$RUN/mysql.sock" \
      --pid-file="$RUN/mariadb.pid" --bind-address=127.0.0.1 --port="$DBPORT" \
      --innodb-buffer-pool-size=64M --log-error="$BASE/log/mariadb.log" </dev/null >/dev/null 2>&1 &
    for _ in $(seq 300); do [[ -S $RUN/mysql.sock ]] && break; sleep 0.1; done
    mariadb --no-defaults -S "$RUN/mysql.sock" -u root -e "
      CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
      CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  fi
  cat > "$BASE/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$RUN/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBDPORT
SlurmUser=root
LogFile=$BASE/log/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$BASE/etc/slurmdbd.conf"
  # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF
  if ! alive "$RUN/slurmdbd.pid" slurmdbd "SLURM_CONF=$CONF"; then
    log "starting slurmdbd (127.0.0.1:$DBDPORT)"; slurmdbd
    for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$DBDPORT") 2>/dev/null && break; sleep 0.1; done
  fi
  sacctmgr -n -P show cluster format=cluster | grep -qx localcluster \
    || sacctmgr -i add cluster localcluster >/dev/null
fi
if ! alive "$RUN/slurmctld.pid" "slurmctld -f $CONF"; then
  if [[ ${SLURM_LOCAL_CLEAN:-0} == 1 ]]; then rm -rf "${BASE:?}"/state/*; fi
  log "starting slurmctld"
  slurmctld -f "$CONF"
fi
for i in $(seq 0 $((NODES - 1))); do
  n=$H-$i
  if ! alive "$RUN/slurmd.$n.pid" "slurmd -f $CONF -N $n"; then
    log "starting slurmd $n"
    slurmd -f "$CONF" -N "$n"
  fi
done

# ---- 5. wait for idle nodes ----------------------------------------------------
deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
  states=$(sinfo -h -N -p gen -o '%N %T' 2>/dev/null || true)
  # idle (or busy with jobs from an earlier run) counts as up
  nup=$(awk '$2 ~ /^(idle|mixed|allocated|completing|planned)$/' <<<"$states" | wc -l)
  if (( nup == NODES )); then
    # end-to-end probe: one tiny job step on every node (skip: SLURM_LOCAL_PROBE=0)
    if [[ ${SLURM_LOCAL_PROBE:-1} == 1 ]] && ! timeout 30 srun -Q -J probe -p gen -N "$NODES" -n "$NODES" \
         -w "$H-[0-$((NODES - 1))]" -t 1 --mem=10M true; then
      log "probe job failed"; (( $(date +%s) > deadline )) && exit 1; sleep 1; continue
    fi
    log "cluster up: $NODES node(s) idle and running jobs"; sinfo
    log "use: source $BASE/env.sh   (SLURM_CONF=$CONF)"
    exit 0
  fi
  # nodes left DOWN/DRAIN from a previous run: resume them
  for n in $(awk '$2 ~ /down|drain/ {print $1}' <<<"$states"); do
    scontrol update nodename="$n" state=resume 2>/dev/null || true
  done
  if (( $(date +%s) > deadline )); then
    log "timeout waiting for idle nodes:"; echo "$states"
    tail -n 20 "$BASE/log/slurmctld.log" "$BASE"/log/slurmd.*.log >&2 || true
    exit 1
  fi
  sleep 0.5
done
