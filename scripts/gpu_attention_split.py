"""Does the split attention schedule's launch shape change any bit, and what does it buy at the
few-row decode steps it runs? An experiment for issue #19 (at bs 1 the split kernel and its combine
took ~17 + 7 µs per layer for 4 MB of KV with a separate combine kernel: latency, not bandwidth;
the merge now runs in the split launch's last program per tile).

    python scripts/gpu_attention_split.py [--out DIR] [--smoke]

The split kernel's programs each walk SPLIT / BLOCK_N = 8 KV tiles (4 on 64); num_stages sets how
many tiles' loads are in flight ahead of the math, num_warps how many warps share a tile's rows
(which could change the row sums' order: measured here). The block table is as wide as the engine's
for an 8k context (33 splits per row, most of them empty programs at ctx 1024), as the model bench
runs it. Every output's float bits are compared with the serial schedule's (the reference every
other step runs) and with today's split launch (4 warps, 2 stages); the control (SPLIT 128) must
differ. Llama-3-8B heads, bf16, shuffled 16-token pages; device µs of the split launch, captured in
a CUDA graph and replayed 200 times. Writes attention_split.json / .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_attention_rows as rows_exp  # noqa: E402
import torch  # noqa: E402

ta, tap = rows_exp.ta, rows_exp.tap
TODAY = (4, 2)  # the split kernel's (warps, stages)
ITERS = 200  # device_us's replays (--iters)
ENGINE_WIDTH = 8192 // rows_exp.PAGE + 1  # block-table pages of an 8k-context launch


def widen(case, width):
    q, k, v, table, req, pos = case
    wide = torch.zeros(table.shape[0], max(width, table.shape[1]), dtype=table.dtype,
                       device=table.device)
    wide[:, :table.shape[1]] = table
    return q, k, v, wide, req, pos


def _launch_constexprs(q, k, tpp, block_n, split, pages):
    """The leaf's constexprs with a config's TPP / BLOCK_N / SPLIT (None or 0: the leaf's) and,
    where `pages` is not None, that PAGES (0: page ids per tile;
    triton_attention_plan.pages_per_split: per split)."""
    c = rows_exp.constexprs(q, k, SPLIT=split or tap.SPLIT)
    c["TPP"] = tpp or c["TPP"]
    c["BLOCK_N"] = block_n or c["BLOCK_N"]
    if pages is not None:
        c["PAGES"] = pages
    return c


def _bound(maxnreg) -> dict:
    """Triton's `maxnreg` launch option where a config sets one (0 / None: ptxas's own choice).
    jax-triton 0.3.1 cannot pass it, so only this torch launch can try it: a register bound
    changes register allocation (and may spill), not the arithmetic, so the bits must not move."""
    return {"maxnreg": maxnreg} if maxnreg else {}


def split_launch(case, warps, stages, tpp=None, block_n=None, split=None, maxnreg=None,
                 pages=None):
    """The leaf's split schedule with these launch settings (tpp: tokens per program, the leaf's
    by default or at 0; block_n / split: another algorithm, other bits; maxnreg: see _bound;
    pages: see _launch_constexprs): (run, output). `run` launches the kernel on buffers made
    once -- its counters zeroed once: each launch leaves them zero, as in the engine's step --
    so a CUDA graph of it times the device."""
    q, k, v, table, req, pos = case
    c = _launch_constexprs(q, k, tpp, block_n, split, pages)
    tiles = ta.tiles_torch(req, pos, c["TPP"])
    t = q.shape[0]
    nsplit = ta.cdiv(rows_exp.PAGE * table.shape[1], c["SPLIT"])
    n = t * c["HKV"] * nsplit * c["TPP"] * c["GP"]
    parts = (torch.empty(n, dtype=torch.float32, device=q.device),
             torch.empty(n, dtype=torch.float32, device=q.device),
             torch.empty(n, c["D"], dtype=torch.float32, device=q.device))
    inputs = (q, k, v, table, pos, tiles, t, rows_exp.PAGE, table.shape[1], rows_exp.D ** -0.5)
    out = torch.empty_like(q)
    sems = torch.zeros(t * c["HKV"], dtype=torch.int32, device=q.device)

    def run():
        rows_exp.torch_launch(ta.kernels().attention_split_kernel, (*inputs, sems),
                              (*parts, out, sems), (t, c["HKV"], nsplit), num_warps=warps,
                              num_stages=stages, enable_fp_fusion=False, **c, NSPLIT=nsplit,
                              MERGE_STAGES=tap.MERGE_STAGES, **_bound(maxnreg))
    run()
    return run, out


def _launch_label(r: dict, split_key: str) -> str:
    """' / TPP t / BLOCK_N b / SPLIT s' of the settings a table row's launch sets (split_key: the
    row's key for its config's SPLIT)."""
    return "".join(f" / {name} {r[key]}" for name, key in
                   (("TPP", "tpp"), ("BLOCK_N", "block_n"), ("SPLIT", split_key),
                    ("maxnreg", "maxnreg")) if r.get(key))


def write_results(args, name: str, rows: list[dict], header: str, line) -> int:
    """`rows` to NAME.json in --out, and NAME.md: `header`, then `line(row)` for each."""
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(header)
        f.writelines(line(r) for r in rows)
    return 0


def report(label, cfg, n, us, err) -> None:
    """One progress line of a launch-settings sweep."""
    extra = "".join(f" {k} {v}" for k, v in zip(("TPP", "BLOCK_N", "SPLIT", "maxnreg"), cfg[2:])
                    if v)
    print(f"   {label} w{cfg[0]} s{cfg[1]}{extra}: differ {n} rows, "
          f"{'-' if us is None else f'{us:.1f} us'}{'' if err is None else ' ' + err}",
          flush=True)


def measure(launch, case, cfg, ref):
    """(rows differing from ref, device us, error) of `launch(case, *cfg)`; a config that does
    not compile is a result, not a failure."""
    try:
        run, out = launch(case, *cfg)
        return rows_exp.rows_differ(ref, out), device_us(run), None
    except Exception as exc:  # noqa: BLE001
        return None, None, f"{type(exc).__name__}: {str(exc)[:200]}"


def serial_launch(case, warps, stages, tpp=None, block_n=None, split=None, maxnreg=None,
                  pages=None):
    """The leaf's serial schedule (every step of more than SPLIT_MAX_ROWS rows) with these launch
    settings: (run, output), as split_launch."""
    q, k, v, table, req, pos = case
    c = _launch_constexprs(q, k, tpp, block_n, split, pages)
    tiles = ta.tiles_torch(req, pos, c["TPP"])
    t = q.shape[0]
    inputs = (q, k, v, table, pos, tiles, t, rows_exp.PAGE, table.shape[1], rows_exp.D ** -0.5)
    out = torch.empty_like(q)

    def run():
        rows_exp.torch_launch(ta.kernels().attention_serial_kernel, inputs, (out,), (t, c["HKV"]),
                              num_warps=warps, num_stages=stages, enable_fp_fusion=False, **c,
                              **_bound(maxnreg))
    run()
    return run, out


def pages_ab(args, launch, cases, configs, name: str) -> int:
    """--pages-ab: every config launched twice on the same buffers' values, with the page ids
    loaded per tile (PAGES 0) and per split (JENGINE_ATTENTION_PAGES; the leaf's default since the
    twenty-third session, where its plan puts them):
    rows differing between the two -- 0 expected, only the addresses' source changes -- and the
    device µs of each (a config's SPLIT, where it sets one, sizes its page window). The
    control (SPLIT 128, or 64 where the config's is 128) must differ, so the comparison can fail.
    Each config's per-tile launch is also compared with the case's first config's (rows_vs_first:
    0 where a config changes only launch settings, e.g. a register bound)."""
    rows = []
    for case_name, case in cases.items():
        first = None
        for cfg in configs:
            tpp, block_n, split, maxnreg = (list(cfg[2:6]) + [None] * 4)[:4]
            pages = tap.pages_per_split(rows_exp.PAGE, split or tap.SPLIT)
            phase = "page ids per tile"  # which launch failed, where one does
            try:
                run0, out0 = launch(case, *cfg, pages=0)
                us0 = device_us(run0)
                phase = "page ids per split"
                run1, out1 = launch(case, *cfg, pages=pages)
                us1, n, err = device_us(run1), rows_exp.rows_differ(out0, out1), None
                first = out0.clone() if first is None else first
                vs_first = rows_exp.rows_differ(first, out0)
                other = 128 if (split or tap.SPLIT) != 128 else 64  # another algorithm
                phase = f"the control (SPLIT {other})"
                control = rows_exp.rows_differ(out0, launch(
                    case, cfg[0], cfg[1], tpp, block_n, other, maxnreg,
                    pages=tap.pages_per_split(rows_exp.PAGE, other))[1])  # its own page window
            except Exception as exc:  # noqa: BLE001 -- a config that does not compile is a result
                us0 = us1 = n = control = vs_first = None
                err = f"{phase}: {type(exc).__name__}: {str(exc)[:200]}"
            rows.append(dict(case=case_name, warps=cfg[0], stages=cfg[1], tpp=tpp,
                             block_n=block_n, split=split, maxnreg=maxnreg, pages=pages,
                             rows_differ=n, control_rows_differ=control, rows_vs_first=vs_first,
                             us_tile=us0, us_split=us1, error=err))
            r = rows[-1]
            print(f"   {case_name} w{cfg[0]} s{cfg[1]}{_launch_label(r, 'split')}: page ids per "
                  f"split vs per tile differ in {n} rows (control {control}; per tile vs the "
                  f"first config: {vs_first}); "
                  f"{'-' if us0 is None else f'{us0:.1f} -> {us1:.1f} us'}"
                  f"{'' if err is None else ' ' + err}", flush=True)
    def line(r):
        us = "-" if r["us_tile"] is None else f"{r['us_tile']:.1f} -> {r['us_split']:.1f}"
        return (f"| {r['case']} | {r['warps']} / {r['stages']}{_launch_label(r, 'split')} | "
                f"{r['rows_differ'] if r['error'] is None else r['error']} "
                f"({r['control_rows_differ']}) | {r.get('rows_vs_first')} | {us} |\n")
    return write_results(args, name, rows, "| case | warps / stages | rows differing, per split vs "
                         "per tile (control) | per tile vs the first config | µs per layer, per "
                         "tile -> per split |\n|---|---|---|---|---|\n", line)


def serial_main(args) -> int:
    """--serial: the serial schedule's launch settings at the steps that run it (decode at 64 and
    256 rows, a 4096-token prefill chunk): bits vs today's launch, device µs per layer."""
    gen = torch.Generator().manual_seed(0)
    mk = rows_exp.make_case
    cases = {"decode 40 x ctx 300": mk(gen, [301] * 40, [1] * 40)} if args.smoke else {
        "decode 64 x ctx 1024": mk(gen, [1025] * 64, [1] * 64),
        "decode 256 x ctx 1024": mk(gen, [1025] * 256, [1] * 256),
        "prefill 4096": mk(gen, [4096], [4096]),
    }
    configs = [TODAY, (4, 3)] if args.smoke else [TODAY, (4, 3), (4, 4), (8, 2), (8, 3), (2, 2)]
    configs = args.configs or configs
    cases = {name: widen(case, 40 if args.smoke else ENGINE_WIDTH) for name, case in cases.items()}
    if args.pages_ab:
        return pages_ab(args, serial_launch, cases, configs, "attention_serial_pages")
    rows = []
    for name, case in cases.items():
        ref = serial_launch(case, *TODAY)[1]
        for cfg in configs:
            n, us, err = measure(serial_launch, case, cfg, ref)
            rows.append({"case": name, "warps": cfg[0], "stages": cfg[1],
                         "tpp": cfg[2] if len(cfg) > 2 else None, "rows_differ": n,
                         "block_n": cfg[3] if len(cfg) > 3 else None,
                         "split": cfg[4] if len(cfg) > 4 else None,
                         "maxnreg": cfg[5] if len(cfg) > 5 else None,
                         "us": us, "error": err})
            report(f"{name} serial", cfg, n, us, err)
    def line(r):
        us = "-" if r["us"] is None else f"{r['us']:.1f}"
        return (f"| {r['case']} | {r['warps']} / {r['stages']}{_launch_label(r, 'split')} | "
                f"{r['rows_differ'] if r['error'] is None else r['error']} | {us} |\n")
    return write_results(args, "attention_serial", rows, "| case | serial warps / stages | rows "
                         "differing from today | µs per layer |\n|---|---|---|---|\n", line)


def device_us(run) -> float:
    """µs per run on the device: `run` captured once in a CUDA graph and replayed back to back
    (Triton's Python launcher costs more host time per launch than the kernels take), `--iters`
    times."""
    if rows_exp.DEV == "cpu":
        return float("nan")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / ITERS * 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/attention_split")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny cases")
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="also time today's launch with these SPLIT sizes, page ids per split "
                        "(the engine's form): other bits, so for --numerics auto only (no "
                        "contract there); rows differing are reported")
    p.add_argument("--configs", nargs="*", type=lambda c: tuple(int(v) for v in c.split(",")),
                   help="WARPS,STAGES[,TPP[,BLOCK_N[,SPLIT[,MAXNREG]]]] launches to sweep "
                        "(default: a fixed set around today's; 0 is the leaf's value, for MAXNREG "
                        "no register bound (torch launch only); another BLOCK_N or SPLIT "
                        "is another algorithm, other bits)")
    p.add_argument("--serial", action="store_true",
                   help="the serial schedule's launch settings instead (64 / 256 rows, prefill)")
    p.add_argument("--pages-ab", action="store_true",
                   help="each config with the page ids per tile and per split "
                        "(JENGINE_ATTENTION_PAGES): rows differing (0 expected) and µs")
    p.add_argument("--iters", type=int, default=200,
                   help="replays per timing (a few under compute-sanitizer, which checks each)")
    p.add_argument("--rowsum", choices=sorted(tap.ROWSUM_FORMS),
                   default=os.environ.get(tap.ROWSUM_ENV) or tap.DEFAULT_ROWSUM,
                   help="every launch's row sum: tree / dot are the layout-free experiments "
                        "(other bits)")
    args = p.parse_args()
    global ITERS
    ITERS = args.iters
    rows_exp.ROWSUM = args.rowsum  # this script's launches take their constexprs from there,
    os.environ[tap.ROWSUM_ENV] = args.rowsum  # the leaf's own (the serial reference) from here
    if args.smoke:  # before the kernels' module is imported: the interpreter is chosen then
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        "tests"))
        import triton_interpreter  # noqa: F401
        rows_exp.DEV = "cpu"
    os.makedirs(args.out, exist_ok=True)
    if args.serial:
        return serial_main(args)
    gen = torch.Generator().manual_seed(0)
    mk = rows_exp.make_case
    width = 40 if args.smoke else ENGINE_WIDTH
    cases = {"decode 1 x ctx 300": mk(gen, [301], [1])} if args.smoke else {
        "decode 1 x ctx 1024": mk(gen, [1025], [1]),
        "decode 1 x ctx 4096": mk(gen, [4097], [1]),
        "decode 16 x ctx 1024": mk(gen, [1025] * 16, [1] * 16),
        "decode 16 x ctx 8192": mk(gen, [8193] * 16, [1] * 16),
    }
    configs = [TODAY, (4, 3)] if args.smoke else [
        TODAY, (4, 3), (4, 4), (2, 2), (2, 3), (8, 2)]
    configs = args.configs or configs
    if args.pages_ab:
        return pages_ab(args, split_launch, {n: widen(c, width) for n, c in cases.items()},
                        configs, "attention_split_pages")
    rows = []
    for name, case in cases.items():
        case = widen(case, width)
        ref = split_launch(case, *TODAY)[1]
        q, k, v, table, req, pos = case
        serial = ta.paged_attention_triton_torch(q, (k, v), table, req, pos,
                                                 scale=rows_exp.D ** -0.5, schedule="serial")
        vs_serial = rows_exp.rows_differ(serial, ref)
        control = rows_exp.rows_differ(ref, split_launch(case, *TODAY, split=128)[1])
        print(f"== {name}: split vs serial schedule differs in {vs_serial} rows; control "
              f"(SPLIT 128) differs in {control} rows", flush=True)
        for split in args.splits:  # as the engine launches it: the page ids per split
            run, out = split_launch(case, *TODAY, split=split,
                                    pages=tap.pages_per_split(rows_exp.PAGE, split))
            rows.append(dict(case=name, split_warps=TODAY[0], split_stages=TODAY[1],
                             rows_differ=rows_exp.rows_differ(ref, out), us=device_us(run),
                             vs_serial=vs_serial, control_rows_differ=control, error=None,
                             split=split))
            print(f"   SPLIT {split} (auto only): {rows[-1]['us']:.1f} us, differ "
                  f"{rows[-1]['rows_differ']} rows", flush=True)
        for cfg in configs:
            n, us, err = measure(split_launch, case, cfg, ref)
            rows.append(dict(case=name, split_warps=cfg[0], split_stages=cfg[1],
                             tpp=cfg[2] if len(cfg) > 2 else None, rows_differ=n,
                             block_n=cfg[3] if len(cfg) > 3 else None,
                             cfg_split=cfg[4] if len(cfg) > 4 else None,
                             us=us, vs_serial=vs_serial, control_rows_differ=control, error=err))
            report("split", cfg, n, us, err)
    def line(r):
        us = "-" if r["us"] is None else f"{r['us']:.1f}"
        return (f"| {r['case']}{' SPLIT %d' % r['split'] if 'split' in r else ''} | "
                f"{r['split_warps']} / {r['split_stages']}{_launch_label(r, 'cfg_split')} | "
                f"{r['rows_differ'] if r['error'] is None else r['error']} | "
                f"{r['vs_serial']} | {us} |\n")
    return write_results(args, "attention_split", rows, "| case | split warps / stages | rows "
                         "differing from today | today vs serial | µs per layer |\n"
                         "|---|---|---|---|---|\n", line)


if __name__ == "__main__":
    sys.exit(main())
