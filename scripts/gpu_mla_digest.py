"""SHA-256 of the Triton MLA leaf's output bits on fixed inputs, for comparing two code trees.

    cd TREE && python3 /path/to/scripts/gpu_mla_digest.py [--out FILE]

Imports the leaf and scripts/gpu_mla_attention.py's `Case` from the *current directory's* tree, so
the same command run in two checkouts (e.g. before and after a refactor of the kernels) prints
digests that must be equal when no bit moved. The H200 goldens (scripts/goldens.py) hold no MLA
model, which is why this exists. Cases: 16 and 128 heads at ctx 1024 (bf16, kv_lora 512, rope 64,
shuffled pages): the whole prefill of request 0 (serial schedule), its last 48 rows (split
schedule) and a 64-row decode step. The negative control digest (SPLIT 128) must differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

import numpy as np  # noqa: E402

import gpu_mla_attention as g  # noqa: E402
from pallas_kernels._triton_launch import bits  # noqa: E402


def digest(x) -> str:
    return hashlib.sha256(np.ascontiguousarray(bits(x)).tobytes()).hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    out = {}
    for heads in (16, 128):
        c = g.Case(heads, 1024)
        prefill = [(0, i) for i in range(1024)]
        tail = prefill[-48:]
        decode = [(r, 1023) for r in range(g.BATCH)]
        out[f"h{heads} prefill serial"] = digest(c.jax(prefill, schedule="serial"))
        out[f"h{heads} last 48 split"] = digest(c.jax(tail, schedule="split"))
        out[f"h{heads} decode bs64"] = digest(c.jax(decode))
        saved = g.tm.SPLIT
        try:
            g.tm.SPLIT = 128
            out[f"h{heads} control SPLIT 128"] = digest(c.jax(tail, schedule="split"))
        finally:
            g.tm.SPLIT = saved
    for k, v in out.items():
        print(f"{k}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
