"""Does the Triton attention leaf's query tile (ROWS = TPP x GP rows per program) change any bit,
and what does a larger one buy for prefill? An experiment for issue #19 (prefill attention ran at
~58 TFLOP/s with the 16-row tile every step uses today).

    python scripts/gpu_attention_rows.py [--out DIR] [--ref TPP,WARPS,STAGES] [--configs ...]

The leaf's contract (pallas_kernels/_triton_attention_kernels.py) fixes BLOCK_N and SPLIT; ROWS
is fixed too, today, because the MMA a row goes through could in principle round differently at
another M. This measures it: the serial kernel (torch launch) at TPP 4 (ROWS 16, what the engine
and the trainer run) against TPP 8 / 16 / 32 (ROWS 32 / 64 / 128) and num_warps / num_stages
variants, on Llama-3-8B heads (32 q, 8 kv, head_dim 128, bf16, 16-token pages shuffled over the
pool), for one 4096-token prefill, a chunk of 4 x 1024-token prompts and 64 decode rows at
context 1024. Every output's float bits are compared with the ROWS-16 launch (0 rows may differ
for a tile to be usable without a new contract); timings are medians of 20 launches after warm-up.
Negative control: SPLIT 256 -> 128 must change bits (the comparison can fail). --ref compares
against another launch than the engine's (e.g. 4,1,2: ROWS 16 on one warp), --configs names the
launches to compare (TPP,WARPS,STAGES each). --rowsum tree|dot: every launch sums a row with the
halving tree or the MMA (the kernels' ROWSUM, other bits than the engine's): do the two (ROWS,
warps) bit classes become one, and what does it cost? Writes attention_rows.json / .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pallas_kernels import triton_attention as ta  # noqa: E402
from pallas_kernels import triton_attention_plan as tap  # noqa: E402
from pallas_kernels._triton_launch import torch_launch  # noqa: E402

PAGE, HQ, HKV, D = 16, 32, 8, 128
DEV = "cuda"  # --smoke: "cpu" under Triton's interpreter (a logic check of this script)
# --rowsum: every launch sums a row's p with this form (triton_attention_plan.ROWSUM_FORMS; "tree"
# and "dot" are other bits than the engine's, an experiment: does one put every (ROWS, warps) in
# one bit class, and at what cost?)
ROWSUM = "triton"


def constexprs(q, k, **over) -> dict:
    """The leaf's constexprs for q / the pool, with `over` and this run's row sum."""
    return dict(tap.constexprs(q, k), **over, ROWSUM=tap.ROWSUM_FORMS[ROWSUM])


def make_case(gen, lengths, new_tokens):
    """A paged pool holding `lengths` positions per request (pages shuffled, spare slots NaN) and
    the step's rows: the last new_tokens[i] positions of request i."""
    pages_per = [-(-n // PAGE) for n in lengths]
    total = sum(pages_per) + 1
    k = torch.full((total, PAGE, HKV, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    v = torch.full_like(k, float("nan"))
    order = torch.randperm(total - 1, generator=gen) + 1
    width = max(pages_per)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lengths):
        pages = order[used:used + pages_per[r]]
        used += pages_per[r]
        table[r, :len(pages)] = pages.to(torch.int32)
        flat_k = torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16).to(DEV)
        flat_v = torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16).to(DEV)
        for i, p in enumerate(pages.tolist()):
            m = min(PAGE, n - i * PAGE)
            k[p, :m] = flat_k[i * PAGE:i * PAGE + m]
            v[p, :m] = flat_v[i * PAGE:i * PAGE + m]
    req = torch.cat([torch.full((t,), r, dtype=torch.int32) for r, t in enumerate(new_tokens)])
    pos = torch.cat([torch.arange(n - t, n, dtype=torch.int32) for n, t in zip(lengths, new_tokens)])
    q = (torch.randn(len(req), HQ, D, generator=gen) * 2).to(torch.bfloat16).to(DEV)
    return q, k, v, table.to(DEV), req.to(DEV), pos.to(DEV)


def serial(case, tpp, warps, stages, block_n=None, split=tap.SPLIT):
    q, k, v, table, req, pos = case
    c = constexprs(q, k, TPP=tpp, SPLIT=split)
    c["BLOCK_N"] = block_n or c["BLOCK_N"]  # by default the leaf's (tap.constexprs: kv_tile)
    tiles = ta.tiles_torch(req, pos, tpp)
    out = torch.empty_like(q)
    t = q.shape[0]
    inputs = (q, k, v, table, pos, tiles, t, PAGE, table.shape[1], D ** -0.5)
    torch_launch(ta.kernels().attention_serial_kernel, inputs, (out,), (t, HKV),
                 num_warps=warps, num_stages=stages, enable_fp_fusion=False, **c)
    return out


def rows_differ(a, b) -> int:
    a, b = a.view(torch.int16).reshape(a.shape[0] * HQ, D), b.view(torch.int16).reshape(b.shape[0] * HQ, D)
    return int((a != b).any(dim=1).sum())


def median_ms(fn, iters=20) -> float:
    if DEV == "cpu":  # the smoke: wall time of one interpreted launch, meaningless as a speed
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def reference(case) -> torch.Tensor:
    """Every row's attention in f32 (torch, no TF32: a dense causal softmax per request and head),
    to measure a launch's error when its tiles change the bits (--numerics auto has no bit
    contract, only accuracy)."""
    q, k, v, table, req, pos = case
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    g = HQ // HKV
    for r in torch.unique(req).tolist():
        idx = (req == r).nonzero().flatten()
        n = int(pos[idx].max()) + 1
        pages = table[r, :-(-n // PAGE)].long()
        kk = k[pages].reshape(-1, HKV, D)[:n].float().repeat_interleave(g, dim=1)
        vv = v[pages].reshape(-1, HKV, D)[:n].float().repeat_interleave(g, dim=1)
        s = torch.einsum("thd,nhd->htn", q[idx].float(), kk) * D ** -0.5
        future = torch.arange(n, device=q.device)[None, :] > pos[idx].long()[:, None]
        p = torch.softmax(s.masked_fill(future[None], float("-inf")), dim=-1)
        out[idx] = torch.einsum("htn,nhd->thd", p, vv)
    return out


def max_error(out, ref) -> float:
    return float((out.float() - ref).abs().max())


def mean_error(out, ref) -> float:
    return float((out.float() - ref).abs().mean())


def causal_flops(case) -> float:
    """q.k and p.v over the positions each row reads (2 flops per multiply-add)."""
    pos = case[5].double()
    return float(4 * HQ * D * (pos + 1).sum())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/attention_rows")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny cases")
    p.add_argument("--ref", default=f"4,{tap.NUM_WARPS},{tap.NUM_STAGES}",
                   help="TPP,WARPS,STAGES of the launch every other is compared with")
    p.add_argument("--configs", nargs="*",
                   help="TPP,WARPS,STAGES[,BLOCK_N[,SPLIT]] launches (default: a sweep); another "
                        "BLOCK_N or SPLIT is another algorithm (other bits): for --numerics auto's "
                        "tile, judged by its error against f32 (the table's last column)")
    p.add_argument("--rowsum", choices=sorted(tap.ROWSUM_FORMS),
                   default=os.environ.get(tap.ROWSUM_ENV) or tap.DEFAULT_ROWSUM,
                   help="every launch's row sum (reference and control too): tree / dot are "
                        "the layout-free experiments")
    args = p.parse_args()
    global DEV, ROWSUM
    ROWSUM = args.rowsum
    if args.smoke:
        DEV = "cpu"
        from tests import triton_interpreter  # noqa: F401 -- before the kernels' module is imported
    ref_cfg = tuple(int(v) for v in args.ref.split(","))
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    cases = {"prefill 1 x 40": make_case(gen, [40], [40]), "decode 2 x ctx 300": make_case(gen, [301] * 2, [1] * 2)} if args.smoke else {
        "prefill 1 x 4096": make_case(gen, [4096], [4096]),
        "prefill 4 x 1024": make_case(gen, [1024] * 4, [1024] * 4),
        "chunk 2 x 2048 (second half)": make_case(gen, [2048] * 2, [1024] * 2),
        "decode 64 x ctx 1024": make_case(gen, [1025] * 64, [1] * 64),
    }
    configs = [(4, 4, 2), (16, 4, 2), (16, 4, 2, 16, 64)] if args.smoke else [(4, 4, 2), (4, 4, 3), (8, 4, 2), (8, 4, 3), (16, 4, 2), (16, 4, 3), (16, 8, 2),
               (32, 4, 2), (32, 8, 2), (32, 8, 3)]
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    rows = []
    for name, case in cases.items():
        ref = serial(case, *ref_cfg)
        control = rows_differ(ref, serial(case, *ref_cfg, split=tap.SPLIT // 2))
        flops = causal_flops(case)
        exact = reference(case)
        print(f"== {name}: {case[0].shape[0]} rows; control (SPLIT {tap.SPLIT // 2}) differs in "
              f"{control} rows; the reference launch's |error| vs f32: max "
              f"{max_error(ref, exact):.3g}, mean {mean_error(ref, exact):.3g}", flush=True)
        for cfg in configs:
            tpp, warps, stages = cfg[:3]
            block_n = cfg[3] if len(cfg) > 3 else tap.kv_tile(False)
            split = cfg[4] if len(cfg) > 4 else tap.SPLIT
            launch = dict(block_n=block_n, split=split)
            try:
                out = serial(case, tpp, warps, stages, **launch)
                n, error, mean = rows_differ(ref, out), max_error(out, exact), mean_error(out, exact)
                ms = median_ms(lambda: serial(case, tpp, warps, stages, **launch))
                err = None
            except Exception as exc:  # noqa: BLE001 -- a config that does not compile is a result
                n, error, mean, ms = None, None, None, None
                err = f"{type(exc).__name__}: {str(exc)[:200]}"
            row = dict(case=name, tpp=tpp, rows=tpp * 4, warps=warps, stages=stages,
                       block_n=block_n, split=split, rows_differ=n, max_error_vs_f32=error,
                       mean_error_vs_f32=mean,
                       ms=ms, tflops=None if ms is None else flops / ms / 1e9,
                       control_rows_differ=control, error=err)
            rows.append(row)
            print(f"   ROWS {tpp * 4:>3} w{warps} s{stages} BLOCK_N {block_n} SPLIT {split}: "
                  f"differ {n} rows, |error| max / mean "
                  f"{'-' if error is None else f'{error:.3g} / {mean:.3g}'}, "
                  f"{'-' if ms is None else f'{ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s'}"
                  f"{'' if err is None else ' ' + err}", flush=True)
    with open(os.path.join(args.out, "attention_rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "attention_rows.md"), "w") as f:
        f.write(f"| case | ROWS | warps | stages | BLOCK_N | SPLIT | rows differing from ROWS "
                f"{ref_cfg[0] * 4} w{ref_cfg[1]} s{ref_cfg[2]} | ms per layer | TFLOP/s | "
                f"abs error vs f32, max / mean |\n")
        f.write("|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
            tf = "-" if r["tflops"] is None else f"{r['tflops']:.0f}"
            e = "-" if r["max_error_vs_f32"] is None else \
                f"{r['max_error_vs_f32']:.3g} / {r['mean_error_vs_f32']:.3g}"
            f.write(f"| {r['case']} | {r['rows']} | {r['warps']} | {r['stages']} | "
                    f"{r['block_n']} | {r['split']} | "
                    f"{r['rows_differ'] if r['error'] is None else r['error']} | {ms} | {tf} | "
                    f"{e} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
