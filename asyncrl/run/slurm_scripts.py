"""The bash of the scripts ``asyncrl slurm`` renders (``@@name`` placeholders, filled by
``asyncrl.run.slurm``): functions every script shares, the whole run's job, its optional blocks (reward
server, learner ranks on more nodes), and a job of generators joining a run."""

COMMON = r"""
set -uo pipefail
umask 077
cd @@workdir || exit 1
ASYNCRL=(@@python -m asyncrl.cli)
RUN_DIR=@@run_dir
SLURM_DIR=@@slurm_dir
PORT=@@port
GEN_PER_NODE=@@per_node
GEN_RESTARTS=@@restarts
EXIT_WAIT_S=@@exit_wait
START_TIMEOUT_S=@@start_timeout
RESTART_DELAY_S=2  # a crash-looping generator waits this long between starts
STATE=$(mktemp -d)  # flags between this script and its background loops (on the batch host)
trap 'rm -rf "$STATE"' EXIT
GEN_PIDS=()

log() { printf '[asyncrl-slurm %(%T)T] %s\n' -1 "$*"; }
fail() { log "error: $*" >&2; }
random_hex() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }  # 64 hex digits, never an argument

node_addr() {  # NODE: the IPv4 address other nodes reach it at (NodeAddr, resolved)
  local addr
  addr=$(scontrol show node "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n1)
  [[ -n $addr ]] || addr=$1
  [[ $addr =~ ^[0-9.]+$ ]] || addr=$(getent ahostsv4 "$addr" | awk 'NR == 1 {print $1}')
  if [[ -z $addr || $addr == 127.* ]] && [[ $1 == "${SLURMD_NODENAME:-}" ]]; then
    addr=$(hostname -I | awk '{print $1}')  # loopback reaches no other host: this host's first address
  fi
  echo "$addr"
}
first_node() { scontrol show hostnames "$1" | head -n1; }
reachable() { timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" 2>/dev/null; }

wait_reachable() {  # WHAT HOST PORT PID: until HOST:PORT answers, while PID (its step) lives; 2 (and
  # nothing said: the caller words it) when the run ended first
  until reachable "$2" "$3"; do
    if [[ -n $4 ]] && ! kill -0 "$4" 2>/dev/null; then fail "$1 ended before it listened on $2:$3"; return 1; fi
    run_going || return 2
    if (( SECONDS > START_TIMEOUT_S )); then fail "$1 not listening on $2:$3 after ${START_TIMEOUT_S}s"; return 1; fi
    sleep 1
  done
}

own_steps() {  # this job's steps (every het component's), not the batch script itself
  local ids=$(env | sed -n 's/^SLURM_JOB_ID_HET_GROUP_[0-9]*=//p' | paste -sd, -)
  squeue -h -s -j "${ids:-$SLURM_JOB_ID}" -o %i 2>/dev/null | grep -vE '\.(batch|extern|interactive)$'
}

finish() {  # WAIT_S: let the generators leave by themselves, cancel this job's steps still there, and
  # let their loops return (they must see the done flag before the EXIT trap removes it)
  local deadline=$((SECONDS + $1)) pid steps
  touch "$STATE/done"
  for pid in "${GEN_PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 1; done
  done
  steps=$(own_steps | paste -sd' ' -)
  [[ -n $steps ]] || return 0
  log "cancelling this job's remaining steps: $steps"
  scancel --signal=TERM $steps 2>/dev/null
  for _ in {1..10}; do [[ -z $(own_steps) ]] || sleep 1; done  # 10 s to leave on SIGTERM, then SIGKILL
  steps=$(own_steps | paste -sd' ' -)
  [[ -z $steps ]] || scancel $steps 2>/dev/null
  for pid in "${GEN_PIDS[@]}"; do for _ in {1..10}; do kill -0 "$pid" 2>/dev/null && sleep 1; done; done
}

gen_loop() {  # NODE SLOT: one generator on NODE; started again when it fails while the run goes on
  local node=$1 slot=$2 tries=0 rc id
  while :; do
    id="slurm$SLURM_JOB_ID-$node-$slot"
    (( tries == 0 )) || id+="-r$tries"
    srun @@gen_het--nodes=1 --ntasks=1 --nodelist="$node" --overlap --job-name="asyncrl-gen-$slot" \
      --input=none --output="$SLURM_DIR/$id.log" \
      "${ASYNCRL[@]}" generator --redis "$HEAD_ADDR:$PORT" --id "$id"
    rc=$?
    if [[ -e $STATE/done || ! -d $STATE ]] || ! run_going; then return 0; fi  # the job is ending
    (( rc != 0 )) || { log "generator $id left the run"; return 0; }
    tries=$((tries + 1))
    if (( tries > GEN_RESTARTS )); then
      log "generator $id exited with code $rc; restart budget ($GEN_RESTARTS) spent: left out, the run goes on"
      return 0
    fi
    log "generator $id exited with code $rc; restarting it ($tries/$GEN_RESTARTS)"
    sleep "$RESTART_DELAY_S"
  done
}

start_generators() {  # NODELIST: GEN_PER_NODE generators on every node of it
  local node slot
  for node in $(scontrol show hostnames "$1"); do
    for ((slot = 0; slot < GEN_PER_NODE; slot++)); do
      gen_loop "$node" "$slot" &
      GEN_PIDS+=($!)
    done
  done
  log "started ${#GEN_PIDS[@]} generator(s) on $1, joining $HEAD_ADDR:$PORT"
}
"""

MAIN = r"""
run_going() { [[ ! -e $STATE/head-done ]]; }
if [[ -z ${ASYNCRL_SECRET:-} ]]; then ASYNCRL_SECRET=$(random_hex); fi
export ASYNCRL_SECRET
HEAD_NODE=$(first_node "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}")
HEAD_ADDR=${ASYNCRL_HEAD_ADDR:-$(node_addr "$HEAD_NODE")}
mkdir -p "$SLURM_DIR"
log "job $SLURM_JOB_ID: run @@name, head on $HEAD_NODE ($HEAD_ADDR:$PORT), run directory $RUN_DIR"
@@reward_block
# -- the head: redis-server and the learner ranks; its exit is the run's -----------------------------
srun @@head_het--nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" --job-name=asyncrl-head --input=none \
  "${ASYNCRL[@]}" launch @@launch_args &
HEAD_PID=$!
@@learner_block
@@gen_start
wait "$HEAD_PID"
HEAD_RC=$?
touch "$STATE/head-done"
if (( HEAD_RC == 0 )); then
  log "the head finished (exit 0): the run completed; waiting up to ${EXIT_WAIT_S}s for the generators to leave"
  finish "$EXIT_WAIT_S"
  log "job $SLURM_JOB_ID done: see $RUN_DIR/summary.json"
  exit 0
fi
fail "the head step (redis-server + learners on $HEAD_NODE) exited with code $HEAD_RC; logs: $RUN_DIR/logs"
finish 10
exit "$HEAD_RC"
"""

REWARD_BLOCK = r"""
# -- the reward server, before the head (whose preflight checks data.reward) ------------------------
REWARD_NODE=$(first_node "$SLURM_JOB_NODELIST_HET_GROUP_@@k")
REWARD_ADDR=${ASYNCRL_REWARD_ADDR:-$(node_addr "$REWARD_NODE")}
if [[ -z ${ASYNCRL_REWARD_TOKEN:-} ]]; then ASYNCRL_REWARD_TOKEN=$(random_hex); fi
export ASYNCRL_REWARD_TOKEN
printf '%s\n' "$ASYNCRL_REWARD_TOKEN" > "$SLURM_DIR/reward.token"  # 0600 (umask): for --join jobs
srun --het-group=@@k --nodes=1 --ntasks=1 --nodelist="$REWARD_NODE" --job-name=asyncrl-reward --input=none \
  "${ASYNCRL[@]}" reward-serve --reward @@reward --host "$REWARD_ADDR" --port @@reward_port \
  --token-file "$SLURM_DIR/reward.token" &
REWARD_PID=$!
if ! wait_reachable "the reward server" "$REWARD_ADDR" @@reward_port "$REWARD_PID"; then finish 0; exit 1; fi
log "reward server on $REWARD_NODE ($REWARD_ADDR:@@reward_port)"
"""

JOIN = r"""
# A join that comes after the run ended (its head job done, or the run stopped) has nothing to do: it
# says so in one line and exits 0, and so does each generator, so no srun step fails.
JOIN_JOB=@@join
head_record() { scontrol -o show job "$JOIN_JOB" 2>/dev/null | head -n1; }  # its component 0
field() { tr ' ' '\n' <<<"$2" | sed -n "s/^$1=//p" | head -n1; }
run_going() { [[ $(field JobState "$(head_record)") == RUNNING ]]; }
ended() { log "job $JOIN_JOB is $1: its run has ended; nothing to join"; exit 0; }
while :; do  # the head job may still be pending
  REC=$(head_record)
  case $(field JobState "$REC") in
    RUNNING) break ;;
    PENDING | CONFIGURING) ;;
    *) ended "$(field JobState "$REC" | grep . || echo gone)" ;;  # `asyncrl slurm --join` saw it exist
  esac
  if (( SECONDS > START_TIMEOUT_S )); then fail "job $JOIN_JOB did not start in ${START_TIMEOUT_S}s"; exit 1; fi
  sleep 2
done
HEAD_NODE=$(first_node "$(field NodeList "$REC")")
HEAD_ADDR=${ASYNCRL_HEAD_ADDR:-$(node_addr "$HEAD_NODE")}
if [[ -z ${ASYNCRL_SECRET:-} ]]; then  # into the environment (the generator's weight bus reads it there)
  until [[ -s $RUN_DIR/secret ]]; do  # the head writes it before its Redis listens
    run_going || ended "over"
    (( SECONDS < START_TIMEOUT_S )) || { fail "no $RUN_DIR/secret and no \$ASYNCRL_SECRET"; exit 1; }
    sleep 1
  done
  ASYNCRL_SECRET=$(<"$RUN_DIR/secret")
fi
export ASYNCRL_SECRET
TOKEN_FILE=$SLURM_DIR/reward.token  # the run's reward server's, if it has one
[[ -n ${ASYNCRL_REWARD_TOKEN:-} || ! -s $TOKEN_FILE ]] || export ASYNCRL_REWARD_TOKEN=$(<"$TOKEN_FILE")
log "job $SLURM_JOB_ID: generators joining run @@name of job $JOIN_JOB, head on $HEAD_NODE ($HEAD_ADDR:$PORT)"
wait_reachable "the head's redis-server (job $JOIN_JOB)" "$HEAD_ADDR" "$PORT" ""
case $? in 0) ;; 2) ended "over" ;; *) exit 1 ;; esac
start_generators "$SLURM_JOB_NODELIST"
while :; do  # until every generator has left, or the head job ended (then they have a while to leave)
  live=0
  for pid in "${GEN_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && live=1; done
  (( live )) || break
  run_going || { log "job $JOIN_JOB ended"; break; }
  sleep 2
done
finish "$EXIT_WAIT_S"
log "job $SLURM_JOB_ID done"
"""


LEARNERS = r"""
# -- learner ranks on the other nodes of component 0 (`asyncrl learner`), once the head listens: ranks
# 0..@@local-1 are the head's own (run.local_learners), the rest @@local per node; a rank that fails
# fails the head's ranks with it (their collectives), and so the job
start_learners() {
  local rank=@@local node i
  for node in $(scontrol show hostnames "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}" | tail -n +2); do
    for ((i = 0; i < @@local; i++)); do
      srun @@head_het--nodes=1 --ntasks=1 --nodelist="$node" --overlap --job-name="asyncrl-learner-$rank" \
        --input=none --output="$SLURM_DIR/learner-$rank.log" \
        "${ASYNCRL[@]}" learner --redis "$HEAD_ADDR:$PORT" --rank "$rank" --local-rank "$i" &
      rank=$((rank + 1))
    done
  done
  log "started learner ranks @@local..$((rank - 1)) on the other learner nodes"
}
wait_reachable "the head" "$HEAD_ADDR" "$PORT" "$HEAD_PID" && start_learners
"""
