"""The trainer's op-by-op RMSNorm (HF: widen, pow(2).mean(-1), + eps, rsqrt, multiply, round,
weight) against the engine's Triton norm kernel on the GPU, at norm widths that are and are not
powers of two, with the variance from the Triton mean twin (pallas_kernels/triton_norm.py, what
trainer mode plans) and, as the control, from the generic XLA mean twin.

    python3 scripts/gpu_norm_mean.py            (gpu_run.sh step: norm_mean)

Prints, per width, how many rows of the normed output differ; exits 1 if the Triton mean twin's
rows differ anywhere.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import torch

    from pallas_kernels import rmsnorm, triton_norm

    eps, rows, failed = 1e-6, 16384, False
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| width | rows | Triton mean twin: rows differ | XLA mean twin (control): rows differ |")
    print("|---|---|---|---|")
    for width in (1536, 512, 2048, 7168):
        x = (torch.randn(rows, width, device="cuda", generator=g) * 2).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(torch.bfloat16)
        engine = triton_norm.rmsnorm_triton_torch(x, w, eps=eps)
        counts = []
        for mean in (triton_norm.mean_fixed_order_torch, rmsnorm.mean_fixed_order_torch):
            xf = x.float()
            h = xf * rmsnorm.rsqrt_torch(mean(xf.pow(2)) + eps)
            trainer = w * h.to(torch.bfloat16)
            counts.append(int((trainer.view(torch.int16) != engine.view(torch.int16))
                              .any(dim=1).sum()))
        failed |= counts[0] != 0
        print(f"| {width} | {rows} | {counts[0]} | {counts[1]} |", flush=True)
    print("norm_mean:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
