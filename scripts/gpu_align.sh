#!/usr/bin/env bash
# Trainer alignment on the GPU for one family: a tiny random HF checkpoint, a trainer dump written
# by HF transformers under trainer mode on CUDA (Triton twins where Triton leaves win the plan),
# then `jengine align` under rl-bitwise; and the negative control (a stock-torch dump must diverge).
# Usage on the GPU machine (carry .whl):  bash scripts/gpu_align.sh "$OUT" Qwen2ForCausalLM
set -u
out=${1:-${OUT:-/tmp/out}}; arch=${2:-Qwen2ForCausalLM}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
work=/tmp/align && mkdir -p $work
python3 - "$work" "$arch" <<'PY'
import json, sys
from interop.testing import make_tiny_hf_model
work, arch = sys.argv[1], sys.argv[2]
make_tiny_hf_model(f"{work}/model", arch)
text = " ".join(f"Step {i}: fold the block partials left to right in fp32." for i in range(24))
with open(f"{work}/seqs.jsonl", "w") as f:
    f.write(json.dumps({"ids": list(range(100, 120))}) + "\n")
    f.write(json.dumps({"messages": [{"role": "user", "content": text},
                                     {"role": "assistant", "content": "Understood."}]}) + "\n")
PY
python3 -m interop.trainer_dump --hf-model $work/model --input $work/seqs.jsonl --out $work/dump.pt --device cuda > "$out/dump.log" 2>&1
python3 -m interop.trainer_dump --hf-model $work/model --input $work/seqs.jsonl --out $work/stock.pt --device cuda --stock > "$out/stock_dump.log" 2>&1
python3 -m jengine.cli align --model $work/model --dump $work/dump.pt --numerics rl-bitwise --skip-warmup > "$out/align.log" 2>&1
echo "align rc=$?" | tee -a "$out/summary.txt"
python3 -m jengine.cli align --model $work/model --dump $work/stock.pt --numerics rl-bitwise --skip-warmup > "$out/align_stock.log" 2>&1
echo "align stock (negative control, must be non-zero) rc=$?" | tee -a "$out/summary.txt"
tail -n 12 "$out/dump.log" "$out/align.log" "$out/align_stock.log"
