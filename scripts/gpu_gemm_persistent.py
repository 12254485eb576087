"""Would a persistent Triton GEMM -- or the engine's flat-K serial schedule -- on the contract's K
chunks close rl-bitwise's prefill gap? (#19)

    python scripts/gpu_gemm_persistent.py [--out DIR] [--rows 1024 4096] [--smoke]

An experiment, wired into no leaf. rl-bitwise's 4096-token prefill spends 106 ms in the Triton
GEMM against auto's 74 in cuBLAS (docs/performance.md, sixteenth session), 8 ms of it the split
schedule's partials going to memory and back. The kernel here keeps the contract's K schedule --
KSPLIT chunks of K, each accumulated from zero in BK-deep tl.dot steps, the chunk sums added in
order (pallas_kernels/_triton_gemm_kernels.py) -- but one program per SM walks output tiles in the
GEMM's grouped order, and inside a tile one flat loop runs every K block, closing a chunk into the
running total when it ends (the first chunk *is* the total, as in the serial schedule: no 0 + c0
that would turn a -0.0 into +0.0). No partials leave the registers. So the same bits are expected;
this measures it and the time. It also times the engine's own form of that loop, one program per
output tile: a tile's `flat_k` (pallas_kernels/_triton_gemm_kernels._gemm_flat, the serial schedule's
chunks in one K loop), launched through gemm_triton_torch exactly as a table entry with flat_k
would launch it -- if it is as fast, turning it on is a tile-table edit:

  bits    f32 outputs against the engine's launch of the same K chunks (gemm_triton_torch with the
          table's tile), float bits, inputs as scripts/gpu_gemm_decode_tiles.py makes them (rows
          scaled 1e-3 .. 1e3, zeros and -0.0 in x). Control: the persistent kernel at twice the
          chunks must differ.
  timing  ms per GEMM (CUDA events, median of 20 after warm-up) of the engine's launch, each
          persistent launch shape, each flat_k launch shape, and torch.matmul (cuBLAS, auto's
          GEMM), at --rows.

Shapes: q/o and down_proj (k_split 4), gate/up as one N = 28672 GEMM (k_split 2, what the grouped
launch computes). Writes gemm_persistent.json / .md to --out. --smoke: the bits part on the CPU
under the Triton interpreter at tiny shapes (a logic check of this script and the kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_attention_rows as timing  # noqa: E402 -- median_ms: CUDA events, median after warm-up

SHAPES = {"q/o_proj": (4096, 4096, 4), "gate_up (one GEMM)": (4096, 28672, 2),
          "down_proj": (14336, 4096, 4)}  # name: (K, N, k_split)
# (BM, BN, BK, num_warps, num_stages)
CANDIDATES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
              (128, 128, 64, 4, 3), (128, 256, 64, 8, 4)]
SMOKE_SHAPES = {"tiny": (256, 64, 4)}
# The smoke's engine tile is BM16xBN32xBK16 too: the interpreter checks the K schedule's logic,
# not what another launch shape does on a GPU (only the H200 run can say that).
SMOKE_CANDIDATES = [(16, 32, 16, 4, 2)]
# The engine's flat_k serial schedule, one program per output tile (BM, BN, BK, warps, stages).
FLAT_CANDIDATES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                   (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4)]
SMOKE_FLAT_CANDIDATES = [(16, 32, 16, 4, 2), (32, 16, 16, 4, 2)]
DEV = "cuda"  # --smoke: "cpu" under the interpreter


def median_ms(fn) -> float:
    return float("nan") if DEV == "cpu" else timing.median_ms(fn)


def define_kernel():
    """The kernel, defined after --smoke has chosen the interpreter."""
    import triton
    import triton.language as tl

    from pallas_kernels import _triton_gemm_kernels

    # A jitted function finds what it calls among its module's globals, not in a closure.
    globals()["_tile_of"] = _triton_gemm_kernels._tile_of

    @triton.jit(do_not_specialize=["M"])
    def persistent_chunked_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N: tl.constexpr, K: tl.constexpr,
                                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                       GROUP_M: tl.constexpr, KSPLIT: tl.constexpr,
                                       NUM_SMS: tl.constexpr):
        num_pid_n: tl.constexpr = N // BN
        CHUNK: tl.constexpr = K // KSPLIT // BK  # K blocks per chunk
        rk = tl.arange(0, BK)
        num_tiles = tl.cdiv(M, BM) * num_pid_n
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
            pid_m, pid_n = _tile_of(tile, M, num_pid_n, BM, GROUP_M)
            rm = pid_m * BM + tl.arange(0, BM)
            rn = pid_n * BN + tl.arange(0, BN)
            row_ok = (rm < M)[:, None]
            x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(K // BK):
                a = tl.load(x_rows + (ki * BK + rk)[None, :], mask=row_ok, other=0.0)
                b = tl.load(w_ptr + (ki * BK + rk)[:, None] * N + rn[None, :])
                acc = tl.dot(a, b, acc)
                if (ki + 1) % CHUNK == 0:  # a chunk ends: into the total, in order
                    total = tl.where(ki + 1 == CHUNK, acc, total + acc)
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
            tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=row_ok)

    return persistent_chunked_gemm_kernel


def persistent(kernel, x, w, k_split, cand, out_dtype, num_sms):
    bm, bn, bk, warps, stages = cand
    m, k = x.shape
    n = w.shape[1]
    assert n % bn == 0 and k % (k_split * bk) == 0, (n, k, cand, k_split)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    tiles = -(-m // bm) * (n // bn)
    kernel[(min(num_sms, tiles),)](x, w, out, m, N=n, K=k, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                                   KSPLIT=k_split, NUM_SMS=num_sms, num_warps=warps,
                                   num_stages=stages, enable_fp_fusion=False)
    return out


def flat_tile(engine_tile, cand):
    """The engine's tile at launch shape `cand`, serial schedule in one K loop (same k_split)."""
    import dataclasses

    bm, bn, bk, warps, stages = cand
    return dataclasses.replace(engine_tile, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                               num_stages=stages, split_at_every_m=False, fused_reduce=False,
                               flat_k=True)


def inputs(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x = x * torch.logspace(-3, 3, m)[:, None]
    x[:, ::17] = 0.0
    x[:, 5::19] = -0.0
    if m > 2:  # whole rows of +0.0 and -0.0: the signed zeros of a first chunk
        x[1] = 0.0
        x[2] = -0.0
    w = torch.randn(k, n, generator=g) * k ** -0.5
    return x.to(torch.bfloat16).to(DEV), w.to(torch.bfloat16).to(DEV)


def bits_differ(a, b) -> int:
    """f32 outputs whose float bits differ (-0.0 != +0.0)."""
    return int((a.view(torch.int32) != b.view(torch.int32)).sum())


def fmt_ms(v) -> str:
    return "-" if v is None or v != v else f"{v:.3f}"


def main() -> int:
    global DEV
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gemm_persistent"))
    p.add_argument("--rows", type=int, nargs="*", default=[1024, 4096])
    p.add_argument("--budget-s", type=float, default=400)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = p.parse_args()
    if args.smoke:  # before any @triton.jit source is imported: the interpreter is chosen then
        from tests import triton_interpreter  # noqa: F401
        DEV = "cpu"
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels.triton_gemm_tiles import GemmTile

    kernel = define_kernel()
    num_sms = 4 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    shapes, cands = (SMOKE_SHAPES, SMOKE_CANDIDATES) if args.smoke else (SHAPES, CANDIDATES)
    flat_cands = SMOKE_FLAT_CANDIDATES if args.smoke else FLAT_CANDIDATES
    rows = [3, 40] if args.smoke else args.rows
    os.makedirs(args.out, exist_ok=True)
    result, t0 = [], time.monotonic()
    for name, (k, n, k_split) in shapes.items():
        engine_tile = (GemmTile(16, 32, 16, k_split=k_split) if args.smoke
                       else tg.tile_for(n, k, torch.bfloat16) if n != 28672
                       else tg.tile_for(14336, k, torch.bfloat16))
        assert engine_tile.k_split == k_split, (name, engine_tile)
        for m in rows:
            if time.monotonic() - t0 > args.budget_s:
                result.append(dict(shape=name, m=m, skipped=True))
                continue
            x, w = inputs(m, k, n, seed=m + n)
            ref = tg.gemm_triton_torch(x, w, out_dtype="f32", tile=engine_tile)
            row = dict(shape=name, m=m, engine_tile=engine_tile.describe(),
                       engine_ms=median_ms(lambda: tg.gemm_triton_torch(
                           x, w, out_dtype="bf16", tile=engine_tile)),
                       cublas_ms=None if args.smoke else median_ms(lambda: x @ w), persistent={},
                       flat={})
            control = persistent(kernel, x, w, 2 * k_split, cands[0], torch.float32, num_sms)
            row["control_differ"] = bits_differ(ref, control)
            for cand in cands:
                label = "BM{}xBN{}xBK{} w{} s{}".format(*cand)
                try:
                    out = persistent(kernel, x, w, k_split, cand, torch.float32, num_sms)
                    ms = median_ms(lambda: persistent(kernel, x, w, k_split, cand,
                                                      torch.bfloat16, num_sms))
                    row["persistent"][label] = dict(differ=bits_differ(ref, out), ms=ms)
                except Exception as exc:  # noqa: BLE001 -- a shape that does not compile is a result
                    row["persistent"][label] = dict(error=f"{type(exc).__name__}: {str(exc)[:160]}")
                print(f"{name} M={m} {label}: {row['persistent'][label]}", flush=True)
            for cand in flat_cands:
                tile = flat_tile(engine_tile, cand)
                label = "BM{}xBN{}xBK{} w{} s{}".format(*cand)
                try:
                    out = tg.gemm_triton_torch(x, w, out_dtype="f32", tile=tile, schedule="serial")
                    ms = median_ms(lambda: tg.gemm_triton_torch(x, w, out_dtype="bf16", tile=tile,
                                                                schedule="serial"))
                    row["flat"][label] = dict(differ=bits_differ(ref, out), ms=ms)
                except Exception as exc:  # noqa: BLE001 -- a shape that does not compile is a result
                    row["flat"][label] = dict(error=f"{type(exc).__name__}: {str(exc)[:160]}")
                print(f"{name} M={m} flat_k {label}: {row['flat'][label]}", flush=True)
            print(f"{name} M={m}: engine {row['engine_ms']} ms, cuBLAS {row['cublas_ms']} ms, "
                  f"control differs in {row['control_differ']}", flush=True)
            result.append(row)
    with open(os.path.join(args.out, "gemm_persistent.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| shape | M | engine launch ms | cuBLAS ms | candidate launch | f32 outputs differing "
             "from the engine's | ms |", "|---|---|---|---|---|---|---|"]
    for r in result:
        if r.get("skipped"):
            lines.append(f"| {r['shape']} | {r['m']} | skipped (budget) | | | | |")
            continue
        for kind in ("persistent", "flat"):
            for label, v in r[kind].items():
                engine, cublas = fmt_ms(r["engine_ms"]), fmt_ms(r["cublas_ms"])
                what = label if kind == "persistent" else f"flat_k serial {label}"
                lines.append(f"| {r['shape']} | {r['m']} | {engine} | {cublas} | {what} | "
                             f"{v.get('differ', v.get('error'))} | {fmt_ms(v.get('ms'))} |")
        lines.append(f"| {r['shape']} | {r['m']} | control: twice the chunks | | | "
                     f"{r['control_differ']} (must be > 0) | |")
    with open(os.path.join(args.out, "gemm_persistent.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [r for r in result if not r.get("skipped") and r["control_differ"] == 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
