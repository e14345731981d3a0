#!/usr/bin/env bash
# Packs what an offline GPU machine lacks for scripts/device_check.sh into two git-ignored folders at the repo
# root, small enough to travel with the working tree (~20 MB): .whl/ (wheels for CPython 3.12: pyzmq, redis,
# pydantic, DeepSpeed built with DS_BUILD_OPS=0, ...) and .devkit/ (this machine's redis-server with the
# libraries it links, behind a wrapper on .devkit/bin). The machine is expected to bring torch (CUDA),
# transformers and numpy; `ASYNCRL_DEVICE_PYTHON=python3 bash scripts/device_check.sh` there installs the
# wheels into /tmp/site and asyncrl itself (--no-deps, editable) and runs the checks.
#
#   bash scripts/device_kit.sh      # then carry .whl and .devkit (and .cache/models/demo-sort)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
grep -qx "/.devkit/" .git/info/exclude 2>/dev/null || echo "/.devkit/" >> .git/info/exclude

rm -rf .whl .devkit && mkdir -p .whl .devkit/bin .devkit/redis/lib
pin() { .venv/bin/python -c "import importlib.metadata as m; print('$1==' + m.version('$1'))"; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "$(pin pyzmq)" "$(pin redis)" "$(pin pydantic)" "$(pin pydantic_core)" "$(pin annotated-types)" \
  "$(pin typing-inspection)" "$(pin hjson)"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation "$(pin deepspeed)" -w .whl

cp "$(command -v redis-server)" .devkit/redis/redis-server.bin
ldd .devkit/redis/redis-server.bin | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
  | xargs -I{} cp -L {} .devkit/redis/lib/
cat > .devkit/bin/redis-server <<'SH'
#!/bin/sh
d=$(dirname "$(readlink -f "$0")")/../redis
LD_LIBRARY_PATH=$d/lib exec "$d/redis-server.bin" "$@"
SH
chmod +x .devkit/bin/redis-server
.devkit/bin/redis-server --version
du -sh .whl .devkit
