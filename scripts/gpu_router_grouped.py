"""The ("moe", "router_grouped_topk") torch leaf against HF's live `DeepseekV3TopkRouter` on CUDA.

    JAX_PLATFORMS=cpu python scripts/gpu_router_grouped.py [--out DIR] [--device cuda|cpu]

For (E, n_group, topk_group, k) in SHAPES, norm_topk_prob on and off, on random, tied (equal logits
in runs), group-tied (every group's top-2 sum equal) and near-tied (one ulp apart) rows:

  order  (fatal) HF's router on the GPU with its sigmoid fed the leaf's scores (`Tensor.sigmoid`
         patched): ids in slot order equal, weight bits equal. This checks the leaf's claims about
         PyTorch CUDA -- topk(sorted=False)'s write order and lowest-id ties, the row-sum order of
         the normalisation -- against the live kernels, independent of how the sigmoids round.
  stock  (reported) stock HF (torch's CUDA sigmoid) vs the leaf: rows with equal ids and weight
         bits. Trainer mode runs the leaf's twin in the router, so engine and trainer agree by
         construction, not through this row.

The leaf runs in JAX on the CPU backend (its bits do not depend on the backend: fixed-order exp,
IEEE adds). Exits 1 on any fatal mismatch; writes router_grouped.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import moe_router_grouped as grouped  # noqa: E402

SHAPES = ((16, 1, 1, 4), (16, 4, 2, 2), (64, 8, 4, 8), (64, 4, 1, 6), (256, 8, 4, 8))
_LEAF = jax.jit(grouped.router_grouped_topk_torch, static_argnames=grouped._STATIC)
_SCORES = jax.jit(grouped.scores_of, static_argnames="score")


def case_logits(e: int, n_group: int, rng) -> np.ndarray:
    rand = (rng.standard_normal((64, e)) * 2).astype(np.float32)
    tied = np.repeat(rng.integers(-2, 3, (16, e // 4)).astype(np.float32), 4, axis=1)
    group = np.tile(np.float32([2.0, 2.0] + [0.0] * (e // n_group - 2)), (8, n_group))
    near = np.repeat(rand[:8], 2, axis=0)
    near[1::2, 3] = np.nextafter(near[1::2, 3], np.float32(np.inf))
    return np.concatenate([rand, tied, group, near])


def run(rng, device: str = "cuda") -> tuple[list[dict], list[str]]:
    import torch
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    def leaf_sigmoid(t):
        cpu = jnp.asarray(t.detach().float().cpu().numpy())
        return torch.from_numpy(np.array(_SCORES(cpu, score="sigmoid"))).to(t.device)

    table, failures = [], []
    for e, n_group, topk_group, k in SHAPES:
        for norm in (False, True):
            cfg = transformers.DeepseekV3Config(hidden_size=8, n_routed_experts=e,
                                                num_experts_per_tok=k, n_group=n_group,
                                                topk_group=topk_group, norm_topk_prob=norm,
                                                routed_scaling_factor=2.5)
            router = DeepseekV3TopkRouter(cfg).to(device)
            bias = (rng.standard_normal(e) * 0.01).astype(np.float32)
            bias[: e // 2] = 0.0  # ties among unbiased experts survive the bias
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
            logits = case_logits(e, n_group, rng)
            # HF's router from its logits on: its gate GEMM replaced by the identity on E inputs.
            router.hidden_dim = e
            router.weight = torch.nn.Parameter(torch.eye(e, device=device))
            x = torch.from_numpy(logits).to(device)
            with torch.no_grad():
                _, stock_w, stock_ids = router(x)
                with mock.patch.object(torch.Tensor, "sigmoid", leaf_sigmoid):
                    _, hf_w, hf_ids = router(x)
            ids, w = _LEAF(jnp.asarray(logits), jnp.asarray(bias), k=k, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5,
                           score="sigmoid")
            ids, w = np.asarray(ids), np.asarray(w)
            hf_ids, hf_w = hf_ids.cpu().numpy(), hf_w.cpu().numpy()
            stock_ids, stock_w = stock_ids.cpu().numpy(), stock_w.cpu().numpy()
            order = int(((hf_ids != ids).any(-1) | (hf_w.view(np.uint32) != w.view(np.uint32))
                         .any(-1)).sum())
            stock = float(((stock_ids == ids).all(-1) & (stock_w.view(np.uint32)
                                                          == w.view(np.uint32)).all(-1)).mean())
            row = {"E": e, "n_group": n_group, "topk_group": topk_group, "k": k, "norm": norm,
                   "rows": len(logits), "order_mismatch": order, "stock_rows_equal": stock}
            table.append(row)
            print(row, flush=True)
            if order:
                failures.append(f"{row}: {order} rows differ from HF's router on CUDA")
    return table, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (CPU topk's order differs)")
    args = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}, jax {jax.__version__} ({jax.default_backend()})")
    table, failures = run(np.random.default_rng(0), args.device)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "router_grouped.json"), "w") as f:
            json.dump({"table": table, "failures": failures}, f, indent=1)
    for line in failures:
        print("FAIL", line)
    print("router_grouped:", "FAILED" if failures else "PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
