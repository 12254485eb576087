"""The unfused layer boundary (add + RMSNorm, round_sum) on several rows per program: bits against
one row per program, and µs per launch, at the Llama-3-8B width (#19: rl-bitwise's 4096-token
prefill spent 7.3 ms in 64 one-row launches on the H200, ~1.1 TB/s).

    python3 scripts/gpu_norm_rows.py [--out DIR] [--rows 1 64 256 1024 4096]

Launches through triton_norm.add_rmsnorm_triton_torch with an explicit plan (ROWS_PLAN's form), so
what is timed is the leaf's own launch: µs per launch of 32 launches in one CUDA graph
(gpu_gemm_add_norm.device_us_per_layer; device time: one torch launch from Python takes longer
than the kernel at decode M, so timing launches one by one measured the host there). Bits: both
outputs (the normed rows and the new residual) as bf16 bit patterns against the one-row kernel's;
the control is the fused boundary's f32-sum norm, which must differ. Writes norm_rows.json / .md
to --out; exits 1 if a plan's bits differ or the control does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

# (rows per program, warps). One row on 1 / 2 / 4 warps: the decode rows' candidates (sm_90 PTX of
# the one-row launch: 0 / 2 / 5 barriers and 0 / 16 / 28 shared-memory stores on 1 / 2 / 4 warps,
# against 8 and 38 on today's 8 -- on one warp the halving tree is in-thread adds and shuffles
# only, at 255 registers without spill; bs 1 spends 64 launches of ~4.7 µs on the boundary, H200
# profile_bs1).
PLANS = [(1, 1), (1, 2), (1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8)]


def main() -> int:
    import torch

    from gpu_gemm_add_norm import device_us_per_layer
    from pallas_kernels import triton_norm

    def graph_us(call) -> float:
        return device_us_per_layer(lambda _copy: call(), 1)

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/norm_rows"))
    p.add_argument("--rows", type=int, nargs="*", default=[1, 64, 256, 1024, 4096])
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    h, eps, bad, result = args.hidden, 1e-5, False, []
    w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(torch.bfloat16)
    for m in args.rows:
        x = (torch.randn(m, h, device="cuda", generator=g) * 3).to(torch.bfloat16)
        r = (torch.randn(m, h, device="cuda", generator=g) * 30).to(torch.bfloat16)

        def call(plan):
            return triton_norm.add_rmsnorm_triton_torch(x, r, w, eps=eps, round_sum=True,
                                                        plan=plan)
        one = call(())
        control = triton_norm.add_rmsnorm_triton_torch(x, r, w, eps=eps)[0]
        ctrl = int((control.view(torch.int16) != one[0].view(torch.int16)).sum())
        row = dict(m=m, one_row_us=graph_us(lambda: call(())), control_differ=ctrl,
                   plans={})
        bad |= ctrl == 0
        for rows, warps in PLANS:
            got = call(((1, rows, warps),))
            differ = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum())
                         for a, b in zip(got, one))
            us = graph_us(lambda: call(((1, rows, warps),)))
            row["plans"][f"{rows} rows w{warps}"] = dict(differ=differ, us=us)
            bad |= differ != 0
            print(f"M={m} {rows} rows w{warps}: {differ} differ, {us:.1f} us "
                  f"(one row: {row['one_row_us']:.1f})", flush=True)
        result.append(row)
    with open(os.path.join(args.out, "norm_rows.json"), "w") as f:
        json.dump(result, f, indent=1)
    labels = list(result[0]["plans"]) if result else []
    lines = ["| M | one row per program µs | " + " | ".join(labels) + " | control differs |",
             "|---|---|" + "---|" * len(labels) + "---|"]
    for row in result:
        cells = [f"{v['us']:.1f} ({v['differ']})" for v in row["plans"].values()]
        lines.append(f"| {row['m']} | {row['one_row_us']:.1f} | " + " | ".join(cells)
                     + f" | {row['control_differ']} |")
    text = "\n".join(lines) + "\n\n(µs per launch, device time of 32 launches in a CUDA graph; " \
        "in brackets bf16 outputs differing from one row per program: 0 expected)\n"
    with open(os.path.join(args.out, "norm_rows.md"), "w") as f:
        f.write(text)
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
