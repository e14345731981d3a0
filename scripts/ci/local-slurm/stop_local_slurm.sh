#!/usr/bin/env bash
# Vendored copy of tools/local-slurm/stop_local_slurm.sh from the project's shared tools (CI runs on a clean
# clone without them); keep it in step with the original. Original header follows.
# stop_local_slurm.sh - stop only the daemons start_local_slurm.sh started,
# identified by their pidfiles under $SLURM_LOCAL_BASE/run (and a cmdline check
# against PID reuse). Running jobs of this cluster are cancelled first.
#   SLURM_LOCAL_KEEP_MUNGE=1  leave munged running
set -uo pipefail
BASE=${SLURM_LOCAL_BASE:-${TMPDIR:-/tmp}/asyncrl-local-slurm}
CONF=$BASE/etc/slurm.conf
RUN=$BASE/run
export SLURM_CONF=$CONF

log() { echo "[stop_local_slurm $(date +%T)] $*"; }
pid_if_alive() { # PIDFILE PATTERN -> prints pid if running and cmdline matches
  local pf=$1 pat=$2 pid
  [[ -s $pf ]] || return 1
  pid=$(cat "$pf"); [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' < /proc/$pid/cmdline | grep -q -- "$pat" || return 1
  [[ -z ${3:-} ]] || tr '\0' '\n' < /proc/$pid/environ | grep -qx -- "$3" || return 1
  echo "$pid"
}
gone() { # PID -> 0 if exited (zombies count: PID 1 may reap late)
  [[ -r /proc/$1/stat ]] || return 0
  [[ $(awk '{print $3}' /proc/$1/stat 2>/dev/null) == Z ]]
}
stop_pids() { # NAME PID... : SIGTERM all, wait up to 10s, then SIGKILL stragglers
  local name=$1; shift; local p left
  (( $# )) || return 0
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 100); do
    left=(); for p in "$@"; do gone "$p" || left+=("$p"); done
    (( ${#left[@]} )) || { log "stopped $name ($*)"; return 0; }
    sleep 0.1
  done
  log "$name (${left[*]}) ignored SIGTERM for 10s -> SIGKILL"; kill -KILL "${left[@]}" 2>/dev/null || true
}

# cancel this cluster's jobs while slurmctld is still up, so slurmstepd's exit
if ctld=$(pid_if_alive "$RUN/slurmctld.pid" "slurmctld -f $CONF"); then
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u)
  if [[ -n $jobs ]]; then
    log "cancelling jobs: $(echo $jobs)"
    timeout 10 scancel $jobs 2>/dev/null || true
    for _ in $(seq 50); do [[ -z $(timeout 5 squeue -h -t R,CG 2>/dev/null) ]] && break; sleep 0.2; done
  fi
fi

pids=()
for pf in "$RUN"/slurmd.*.pid; do
  [[ -e $pf ]] || continue
  n=${pf##*/slurmd.}; n=${n%.pid}
  if pid=$(pid_if_alive "$pf" "slurmd -f $CONF -N $n"); then pids+=("$pid"); fi
done
stop_pids slurmd "${pids[@]}"; rm -f "$RUN"/slurmd.*.pid
if pid=$(pid_if_alive "$RUN/slurmctld.pid" "slurmctld -f $CONF"); then stop_pids slurmctld "$pid"; fi
rm -f "$RUN/slurmctld.pid"
if pid=$(pid_if_alive "$RUN/slurmdbd.pid" slurmdbd "SLURM_CONF=$CONF"); then stop_pids slurmdbd "$pid"; fi
rm -f "$RUN/slurmdbd.pid"
if [[ ${SLURM_LOCAL_KEEP_MUNGE:-0} != 1 ]]; then  # (also keeps MariaDB on a conf-change restart)
  if pid=$(pid_if_alive "$RUN/mariadb.pid" "mariadbd --no-defaults --user=root --datadir=$BASE/db"); then stop_pids mariadbd "$pid"; fi
fi
if [[ ${SLURM_LOCAL_KEEP_MUNGE:-0} != 1 ]]; then
  if pid=$(pid_if_alive "$RUN/munged.pid" "$RUN/munge.socket"); then stop_pids munged "$pid"; fi
  rm -f "$RUN/munged.pid"
fi
exit 0
