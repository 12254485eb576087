"""Does down_proj with SwiGLU's activation made in the loads of its A keep every bit and save
time at decode rows? (#19; the kernel is silu_gemm_rows_kernel in
pallas_kernels/_triton_gemm_epilogue_kernels.py, an experiment wired into no leaf)

    python scripts/gpu_silu_down.py [--out DIR] [--rows 1 2 3 4 8 16 32 64] [--smoke]

An rl-bitwise decode step runs silu(gate) * up as a launch of its own between the gate/up and the
down_proj launches (32 per step of an 8B model, each ~2 µs with a gap before it); at bs 1 the
step's device is idle ~0.6 ms of 7.0 between its ~290 launches (H100). The experiment's launch is
down_proj's fused-reduce GEMM whose programs make their chunk of A from gate and up with
silu_kernel's operations. Two things could sink it: the MMA then reads A from registers (sm_90:
wgmma RS, where the engine's GEMM reads it from shared memory, SS), which no one has shown to give
the same bits; and every column tile's program recomputes its chunk's activation.

  bits    the one launch against the two it replaces (silu_triton_torch(gate, times=up), then
          the engine's down_proj launch on the table's decode tile), bf16 float bits, at every
          --rows, with the real rows only in A (RB = next power of two >= M) and with all BM rows
          (RB = BM, the padded form). gate holds +-0, subnormals and large values beside
          random ones. Control: the activation rounded once (the f32 product of the unrounded
          SiLU and up) must differ.
  timing  µs per layer on the device, 32 launches (weight copies cycled past L2) in one CUDA
          graph: each one-launch form and the two launches.

Llama-3-8B's down_proj (K 14336, N 4096), bf16. Writes silu_down.json / .md to --out. --smoke: the
bits part under the Triton interpreter on the CPU at tiny shapes (a logic check of this script).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_gemm_add_norm as common  # noqa: E402 -- bits_differ, device_us_per_layer, write_report

K_DOWN, N_DOWN = 14336, 4096
EXTREMES = (0.0, -0.0, 1e-39, -1e-39, 88.0, -88.0, 1e4, -1e4)  # 1e-39: a bf16 subnormal


def inputs(m, k, n, seed, copies):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(m, k, generator=g) * 3
    gate[:, :len(EXTREMES)] = torch.tensor(EXTREMES)
    up = torch.randn(m, k, generator=g)
    ws = [(torch.randn(k, n, generator=g) * k ** -0.5).to(torch.bfloat16).to(common.DEV)
          for _ in range(copies)]
    return gate.to(torch.bfloat16).to(common.DEV), up.to(torch.bfloat16).to(common.DEV), ws


def next_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def runners(gate, up, ws, tile, rbs):
    """{label: callable of the weight copy index} on buffers made once, all writing `out`: the one
    launch at each RB, and the two launches it replaces."""
    from pallas_kernels import _triton_gemm_epilogue_kernels as ek
    from pallas_kernels import triton_activation as act
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels._triton_launch import cdiv

    m, k = gate.shape
    n = ws[0].shape[1]
    if (k // tile.k_split) % tile.block_k or not tile.fused_reduce or m > tile.block_m:
        raise ValueError(f"tile {tile.describe()} at M={m}: needs a fused reduce, "
                         "K chunks of whole BK steps and one row tile")
    launch = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    parts = torch.empty((tile.k_split, m, n), dtype=torch.float32, device=gate.device)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=gate.device)
    a = torch.empty_like(gate)
    grid = (cdiv(n, tile.block_n), tile.k_split)
    sems = torch.zeros(grid[0], dtype=torch.int32, device=gate.device)
    consts = dict(N=n, K=k, BM=tile.block_m, BN=tile.block_n, BK=tile.block_k,
                  KSPLIT=tile.k_split)
    run = {}
    for rb in rbs:
        def one(i, rb=rb):
            tg.torch_launch(ek.silu_gemm_rows_kernel, (gate, up, ws[i], m, sems),
                            (parts, out, sems), grid, **launch, **consts, RB=rb)
        run[f"one launch, RB {rb}"] = one
    (g_grid, g_consts), _ = tg._launches(m, k, n, gate.dtype, None, tile, "split")
    g_sems = torch.zeros(g_grid[0], dtype=torch.int32, device=gate.device)

    def two(i):
        tg.torch_launch(act.kernels().silu_kernel, (gate, up), (a,), (cdiv(m * k, act.BLOCK),),
                        num_warps=4, num_stages=1, N=m * k, BLOCK=act.BLOCK, HAS_TIMES=True)
        tg.torch_launch(tg.kernels().fixed_tile_gemm_fused_kernel, (a, ws[i], ws[i], m, g_sems),
                        (parts, out, g_sems), g_grid, **launch, **tg._fused(g_consts))
    run["two launches"] = two
    return run, out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/silu_down"))
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 3, 4, 8, 16, 32, 64])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = p.parse_args()
    if args.smoke:  # before any @triton.jit source is imported: the interpreter is chosen then
        from tests import triton_interpreter  # noqa: F401
        common.DEV = "cpu"
    from pallas_kernels import triton_activation as act
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels.triton_gemm_tiles import GemmTile

    k, n = (256, 80) if args.smoke else (K_DOWN, N_DOWN)
    rows = [1, 3, 16] if args.smoke else args.rows
    copies = 1 if args.smoke else max(2, -(-256 * 2 ** 20 // (k * n * 2)))  # > L2: 256 MiB
    os.makedirs(args.out, exist_ok=True)
    result = []
    for m in rows:
        gate, up, ws = inputs(m, k, n, seed=m, copies=copies)
        tile = (GemmTile(16, 32, 32, k_split=4, fused_reduce=True) if args.smoke
                else tg.tile_for(n, k, torch.bfloat16, m))
        row = dict(m=m, tile=tile.describe(), forms={})
        want = tg.gemm_triton_torch(act.silu_triton_torch(gate, times=up), ws[0],
                                    out_dtype=torch.bfloat16, tile=tile, schedule="split")
        gf, uf = gate.float(), up.float()
        once = (gf / (1 + torch.exp(-gf)) * uf).to(torch.bfloat16)
        control = tg.gemm_triton_torch(once, ws[0], out_dtype=torch.bfloat16, tile=tile,
                                       schedule="split")
        row["control_differ"] = common.bits_differ(control, want)
        rbs = sorted({next_pow2(m), tile.block_m})
        try:
            run, out = runners(gate, up, ws, tile, rbs)
        except ValueError as exc:
            row["error"] = str(exc)
            result.append(row)
            print(row, flush=True)
            continue
        for label, launch in run.items():
            launch(0)  # the timed launches' own outputs: the bits, or the timing measures else
            row["forms"][label] = dict(differ=common.bits_differ(out, want),
                                       us=common.device_us_per_layer(launch, copies))
        print(row, flush=True)
        result.append(row)
    lines = ["| M | tile | form | bits differing from the two launches | µs/layer |",
             "|---|---|---|---|---|"]
    for r in result:
        if "error" in r:
            lines.append(f"| {r['m']} | {r['tile']} | {r['error']} | | |")
            continue
        for label, e in r["forms"].items():
            lines.append(f"| {r['m']} | {r['tile']} | {label} | {e['differ']} | {e['us']:.1f} |")
        lines.append(f"| {r['m']} | | control: the activation rounded once | "
                     f"{r['control_differ']} (must be > 0) | |")
    common.write_report(args.out, "silu_down", result, lines)
    checked = [r for r in result if "error" not in r]
    bad = [r for r in checked if any(e["differ"] for e in r["forms"].values())
           or r["control_differ"] == 0]
    print("silu_down:", "FAIL" if bad or not checked else "PASS")
    return 1 if bad or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
