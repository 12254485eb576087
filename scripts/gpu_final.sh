#!/usr/bin/env bash
# One device call: the rl-bitwise invariance harness on the H200 (Triton leaves registered), a
# re-check of the GEMM tiles, the auto negative control, and a short decode benchmark.
# Usage on the GPU machine (carry .whl, and optionally .gpu_tiny = a pre-generated tiny-v1):
#   bash scripts/gpu_final.sh "$OUT"
set -u
out=${1:-${OUT:-/tmp/out}}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d .gpu_tiny ] && export JENGINE_CACHE_DIR=$PWD/.gpu_tiny
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "| $name | rc=$rc | $((SECONDS - t0)) s |" | tee -a "$out/summary.md"
}
echo "| step | result | wall |" > "$out/summary.md"
echo "|---|---|---|" >> "$out/summary.md"
step invariance_rl_bitwise 300 python3 -m jengine.cli invariance --numerics rl-bitwise --max-new-tokens 8
step gemm_leaves 90 python3 scripts/gpu_validate.py --skip-harness --only gemm --out "$out/val"
step invariance_auto 120 python3 -m jengine.cli invariance --numerics auto --temperature 0 --max-new-tokens 8
step bench_decode 150 python3 -m jengine.cli bench --parts roofline model --batch-sizes 1 64 --prefill-tokens 0 --iters 5 --out "$out/bench"
tail -n 25 "$out"/invariance_*.log
cat "$out/summary.md"
