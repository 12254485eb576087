"""Does SwiGLU's gate/up GEMM with the activation in its launch keep every bit and save time?
(#19; pallas_kernels/triton_gemm_swiglu.py, an experimental leaf, planned on request)

    python scripts/gpu_gemm_swiglu.py [--out DIR] [--rows 1 16 64 256 1024 4096] [--smoke]

An rl-bitwise step runs silu(gate) * up as a launch of its own after the gate/up grouped GEMM (32
per step of an 8B model), reading gate and up back from memory. The experiment's launch runs the
grouped launch's programs (one gate or one up tile each) and the second of each (gate, up) pair to
finish applies the activation to both (the eighteenth session's form, one program computing both
tiles, lost 33-38 %).

  bits    its output against the two launches it replaces (the engine's grouped gate/up launch,
          then silu_triton_torch(gate, times=up)), bf16 float bits, at every --rows and launch
          shape; the JAX launch against the torch one at the smallest and largest M. Control:
          the activation of the unrounded f32 projections must differ.
  timing  µs per layer on the device, 32 launches (weight copies cycled past L2) in one CUDA
          graph: the one launch at each launch shape, and the two launches.

Launch shapes (the K chunks are the table's, so the bits cannot move): the table's tile at that M,
the same with BN 64, and the table's tile in one K loop (flat_k). Llama-3-8B's gate/up (K 4096,
N 14336), bf16. Writes gemm_swiglu.json / .md to --out. --smoke: the bits part under the Triton
interpreter on the CPU at tiny shapes (a logic check of this script).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_gemm_add_norm as common  # noqa: E402 -- bits_differ, device_us_per_layer, write_report

K_GATE, N_GATE = 4096, 14336


def inputs(m, k, n, seed, copies):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]).to(torch.bfloat16)
    ws = [tuple((torch.randn(k, n, generator=g) * k ** -0.5).to(torch.bfloat16).to(common.DEV)
                for _ in range(2)) for _ in range(copies)]
    return x.to(common.DEV), ws


def shapes_of(tile):
    """Launch shapes to try: the table's tile, BN 64, one K loop (k_split > 1 only)."""
    out = {"table": tile}
    if tile.block_n != 64:
        out["BN64"] = dataclasses.replace(tile, block_n=64)
    if tile.k_split > 1:
        out["flat_k"] = dataclasses.replace(tile, flat_k=True)
    return out


def jax_matches_torch(x, wg, wu, tile) -> int | None:
    try:
        import jax
        import jax.numpy as jnp

        if jax.default_backend() != "gpu":
            return None
    except Exception:  # noqa: BLE001 - no usable JAX here
        return None
    from pallas_kernels import triton_gemm_swiglu as gs

    want = gs.gemm_swiglu_triton_torch(x, wg, wu, out_dtype=torch.bfloat16, tile=tile)
    j = [jnp.from_dlpack(t) for t in (x, wg, wu)]
    got = jax.jit(lambda a, b, c: gs.gemm_swiglu_triton(a, b, c, out_dtype=jnp.bfloat16,
                                                        tile=tile))(*j)
    return common.bits_differ(torch.from_dlpack(got), want)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gemm_swiglu"))
    p.add_argument("--rows", type=int, nargs="*", default=[1, 16, 64, 256, 1024, 4096])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = p.parse_args()
    if args.smoke:  # before any @triton.jit source is imported: the interpreter is chosen then
        from tests import triton_interpreter  # noqa: F401
        common.DEV = "cpu"
    from pallas_kernels import triton_activation as act
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels import triton_gemm_swiglu as gs
    from pallas_kernels.triton_gemm_tiles import GemmTile

    k, n = (256, 80) if args.smoke else (K_GATE, N_GATE)
    rows = [1, 20] if args.smoke else args.rows
    copies = 1 if args.smoke else max(2, -(-256 * 2 ** 20 // (2 * k * n * 2)))
    os.makedirs(args.out, exist_ok=True)
    result = []
    for m in rows:
        x, ws = inputs(m, k, n, seed=m, copies=copies)
        wg, wu = ws[0]
        tile = (GemmTile(16, 32, 32, k_split=2) if args.smoke
                else tg.tile_for(n, k, torch.bfloat16, m))
        gate, up = tg.gemm_group_triton_torch(x, (wg, wu), out_dtype=torch.bfloat16, tile=tile)
        want = act.silu_triton_torch(gate, times=up)
        gf, uf = (tg.gemm_triton_torch(x, w, out_dtype="f32", tile=tile) for w in (wg, wu))
        control = (gf / (1 + torch.exp(-gf)) * uf).to(torch.bfloat16)
        row = dict(m=m, control_differ=common.bits_differ(control, want), shapes={})
        for label, shape in shapes_of(tile).items():
            got = gs.gemm_swiglu_triton_torch(x, wg, wu, out_dtype=torch.bfloat16, tile=shape)
            entry = dict(tile=shape.describe(), differ=common.bits_differ(got, want))
            entry["us"] = common.device_us_per_layer(
                lambda i, s=shape: gs.gemm_swiglu_triton_torch(
                    x, *ws[i], out_dtype=torch.bfloat16, tile=s), copies)
            row["shapes"][label] = entry
        if m in (rows[0], rows[-1]) and not args.smoke:
            row["jax_vs_torch_differ"] = jax_matches_torch(x, wg, wu, tile)

        def two(i):
            g, u = tg.gemm_group_triton_torch(x, ws[i], out_dtype=torch.bfloat16, tile=tile)
            return act.silu_triton_torch(g, times=u)

        # the timed two launches (on the GPU `tile` is the engine's own), once: the reference's bits
        row["timed_two_differ"] = common.bits_differ(two(0), want)
        row["two_us"] = common.device_us_per_layer(two, copies)
        print(row, flush=True)
        result.append(row)
    lines = ["| M | launch | bits differing from the two launches | one launch µs/layer | "
             "two launches µs/layer |", "|---|---|---|---|---|"]
    for r in result:
        for label, e in r["shapes"].items():
            lines.append(f"| {r['m']} | {label}: {e['tile']} | {e['differ']} | {e['us']:.1f} | "
                         f"{r['two_us']:.1f} |")
        lines.append(f"| {r['m']} | the timed two launches | {r['timed_two_differ']} | | |")
        lines.append(f"| {r['m']} | control: unrounded projections | {r['control_differ']} "
                     f"(must be > 0) | | |")
        if "jax_vs_torch_differ" in r:
            lines.append(f"| {r['m']} | JAX vs torch launch | {r['jax_vs_torch_differ']} | | |")
    common.write_report(args.out, "gemm_swiglu", result, lines)
    bad = [r for r in result if any(e["differ"] for e in r["shapes"].values())
           or r["control_differ"] == 0 or r.get("jax_vs_torch_differ") or r["timed_two_differ"]]
    print("gemm_swiglu:", "FAIL" if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
