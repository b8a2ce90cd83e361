#!/usr/bin/env bash
# The GPU kit's run on the GPU machine: install the carried wheels, then run the steps of
# `benchmarks/gpu_kit.py run` (setup, smoke sweep, fast-shaped step, gpu_suite rows), each
# under its own time budget, results in $OUT as they finish. Prepare the kit first, on CPU:
#     python benchmarks/gpu_kit.py prepare --megatron-lm PATH
# and make the call that command prints. Arguments go to `gpu_kit.py run` (e.g. --stub).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT="${KIT:-.gpukit}"
PYTHON="${PYTHON:-python3}"
SITE="${SITE:-/tmp/quantpatch-kit-site}"
OUT="${OUT:-$PWD/gpu-kit-out}"
mkdir -p "$OUT"
if [[ ! -f "$KIT/kit.json" ]]; then
    echo "[gpu_run] no kit at $KIT: run 'python benchmarks/gpu_kit.py prepare --megatron-lm PATH' first" >&2
    exit 2
fi
start=$SECONDS
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$KIT"/wheels/*.whl
echo "[gpu_run] wheels installed in $((SECONDS - start)) s" | tee "$OUT/run.log"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export QUANTPATCH="$SITE/bin/quantpatch"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/run.log" 2>&1 || true
exec "$PYTHON" benchmarks/gpu_kit.py run --kit "$KIT" --out "$OUT" "$@"
