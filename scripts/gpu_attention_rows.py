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
launches to compare (TPP,WARPS,STAGES each). --rowsum-tree: every launch sums a row with the
halving tree (ROWSUM_LEVELS, other bits than the engine's): do the two (ROWS, warps) bit classes
become one, and what does it cost? Writes attention_rows.json / .md to --out.
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
from pallas_kernels._triton_launch import torch_launch  # noqa: E402

PAGE, HQ, HKV, D = 16, 32, 8, 128
DEV = "cuda"  # --smoke: "cpu" under Triton's interpreter (a logic check of this script)
# --rowsum-tree: every launch sums a row's p with the halving tree (the kernels' ROWSUM_LEVELS;
# other bits than the engine's, an experiment: does it put every (ROWS, warps) in one bit class,
# and at what cost?)
ROWSUM_LEVELS = 0


def constexprs(q, k, **over) -> dict:
    """The leaf's constexprs for q / the pool, with this run's row sum and `over`."""
    return dict(ta._constexprs(q, k), ROWSUM_LEVELS=ROWSUM_LEVELS, **over)


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


def serial(case, tpp, warps, stages, split=ta.SPLIT):
    q, k, v, table, req, pos = case
    c = constexprs(q, k, TPP=tpp, SPLIT=split)
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


def causal_flops(case) -> float:
    """q.k and p.v over the positions each row reads (2 flops per multiply-add)."""
    pos = case[5].double()
    return float(4 * HQ * D * (pos + 1).sum())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/attention_rows")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny cases")
    p.add_argument("--ref", default=f"4,{ta.NUM_WARPS},{ta.NUM_STAGES}",
                   help="TPP,WARPS,STAGES of the launch every other is compared with")
    p.add_argument("--configs", nargs="*", help="TPP,WARPS,STAGES launches (default: a sweep)")
    p.add_argument("--rowsum-tree", action="store_true",
                   help="every launch (reference and control too) with the halving-tree row sum")
    args = p.parse_args()
    global DEV, ROWSUM_LEVELS
    if args.rowsum_tree:
        ROWSUM_LEVELS = ta.BLOCK_N.bit_length() - 1
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
    configs = [(4, 4, 2), (16, 4, 2)] if args.smoke else [(4, 4, 2), (4, 4, 3), (8, 4, 2), (8, 4, 3), (16, 4, 2), (16, 4, 3), (16, 8, 2),
               (32, 4, 2), (32, 8, 2), (32, 8, 3)]
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    rows = []
    for name, case in cases.items():
        ref = serial(case, *ref_cfg)
        control = rows_differ(ref, serial(case, *ref_cfg, split=128))
        flops = causal_flops(case)
        print(f"== {name}: {case[0].shape[0]} rows; control (SPLIT 128) differs in {control} rows",
              flush=True)
        for tpp, warps, stages in configs:
            try:
                out = serial(case, tpp, warps, stages)
                n = rows_differ(ref, out)
                ms = median_ms(lambda: serial(case, tpp, warps, stages))
                err = None
            except Exception as exc:  # noqa: BLE001 -- a config that does not compile is a result
                n, ms, err = None, None, f"{type(exc).__name__}: {str(exc)[:200]}"
            row = dict(case=name, tpp=tpp, rows=tpp * 4, warps=warps, stages=stages,
                       rows_differ=n, ms=ms, tflops=None if ms is None else flops / ms / 1e9,
                       control_rows_differ=control, error=err)
            rows.append(row)
            print(f"   ROWS {tpp * 4:>3} w{warps} s{stages}: differ {n} rows, "
                  f"{'-' if ms is None else f'{ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s'}"
                  f"{'' if err is None else ' ' + err}", flush=True)
    with open(os.path.join(args.out, "attention_rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "attention_rows.md"), "w") as f:
        f.write(f"| case | ROWS | warps | stages | rows differing from ROWS {ref_cfg[0] * 4} w{ref_cfg[1]} "
                f"s{ref_cfg[2]} | ms per layer | TFLOP/s |\n")
        f.write("|---|---|---|---|---|---|---|\n")
        for r in rows:
            ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
            tf = "-" if r["tflops"] is None else f"{r['tflops']:.0f}"
            f.write(f"| {r['case']} | {r['rows']} | {r['warps']} | {r['stages']} | "
                    f"{r['rows_differ'] if r['error'] is None else r['error']} | {ms} | {tf} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
