"""Issue #19's goals, each with its status in a `jengine bench` result: met, missed by how much,
or not measured and why (a part that did not run or stopped, a row an older bench lacks)."""

from __future__ import annotations

from jengine.bench.measures import (ROOFLINE_SHAPE, by_numerics, decode_rows, hbm_percent,
                                    not_measured, numerics_ratio, pipelined_ms, prefill_stats,
                                    shape_label, status, vs_engine, workload_bound)

# Issue #19's goals.
# (numerics, batch, context, min % of the HBM bound) of a decode step
DECODE_HBM_TARGETS = (("auto", 1, 1024, 75.0), ("auto", 64, 1024, 70.0),
                      ("rl-bitwise", 1, 1024, 70.0))
PREFILL_GEMM_TARGET = 60.0  # min % of the measured GEMM peak, both numerics
DECODE_RATIO_TARGET = 1.05  # max rl-bitwise / auto step time, every decode row
PREFILL_RATIO_TARGET = 1.10  # max rl-bitwise / auto prefill chunk time
E2E_BASELINE_TOK_S = 3956.0  # the Engine workload's auto output tok/s, 2026-11-30 (performance.md)
E2E_SPEEDUP_TARGET = 2.0  # min output tok/s over the baseline, both numerics
LOOP_OVERHEAD_TARGET = 5.0  # max % the overlapped Engine's decode step adds over the model's
SERVER_RATIO_TARGET = 0.90  # min server / in-process Engine output tok/s


# -- targets ---------------------------------------------------------------------------------------


def _decode_targets(models: dict, rows: dict, bw) -> list[tuple[str, str, str]]:
    out = []
    for name, bs, ctx, want in DECODE_HBM_TARGETS:
        ms, r = rows.get((bs, ctx), {}).get(name, (None, {}))
        for how, t in (("blocked on", ms), ("pipelined", pipelined_ms(r, bs, ctx) if ms else None)):
            target = f"`{name}` decode bs {bs}, ctx {ctx} >= {want:.0f} % of HBM bound ({how})"
            pct = hbm_percent(t, bs, ctx, r, bw)
            if pct is None:
                why = ("no pipelined time (a bench from before it was measured)" if ms and not t
                       else "no roofline in this run" if t and not bw
                       else f"shape {r.get('shape')}" if t
                       else f"no {name} row at bs {bs}, ctx {ctx}" if name in models
                       else f"no {name} model part in this run")
                out.append((target, "-", not_measured(models.get(name) or None, why)))
            else:
                out.append((target, f"{pct:.0f} % ({t:.2f} ms)",
                            status(pct, want, at_least=True, unit=" points")))
    return out


def _prefill_targets(models: dict, peak) -> list[tuple[str, str, str]]:
    out = []
    for name, r in (models or {"": {}}).items():
        st = prefill_stats(r, peak)
        target = f"`{name}` prefill" if name else "prefill"
        target += f" >= {PREFILL_GEMM_TARGET:.0f} % of measured GEMM peak"
        if st and st[4] is not None:
            out.append((target, f"{st[4]:.0f} % ({st[3]:.0f} TFLOP/s of {peak:.0f})",
                        status(st[4], PREFILL_GEMM_TARGET, at_least=True, unit=" points")))
        else:
            why = ("no model part in this run" if not r else "no prefill row" if not st
                   else f"shape {r.get('shape')}" if st[3] is None else "no roofline in this run")
            out.append((target, "-", not_measured(r or None, why)))
    return out


def _ratio_targets(models: dict, rows: dict) -> list[tuple[str, str, str]]:
    """rl-bitwise / auto per decode row, blocked on and pipelined (as the HBM goals are), and the
    prefill's. Three decimals: the goals are 1.05 and 1.10, and a row at 1.051 must not read
    "1.05x, missed by 0.00x"."""
    out = []
    for (bs, ctx), per in rows.items():
        for how, times in (("blocked on", {n: ms for n, (ms, _) in per.items()}),
                           ("pipelined", {n: pipelined_ms(r, bs, ctx) if ms else None
                                          for n, (ms, r) in per.items()})):
            ratio = numerics_ratio(times)
            if ratio is not None:
                target = (f"rl-bitwise step <= {DECODE_RATIO_TARGET:.2f} x auto, decode bs {bs}, "
                          f"ctx {ctx} ({how})")
                out.append((target, f"{ratio:.3f}x", status(ratio, DECODE_RATIO_TARGET,
                                                            at_least=False, unit="x", digits=3)))
    if not out:
        out.append((f"rl-bitwise step <= {DECODE_RATIO_TARGET:.2f} x auto, every decode row", "-",
                    "not measured (needs model rows of both auto and rl-bitwise)"))
    target = f"rl-bitwise prefill <= {PREFILL_RATIO_TARGET:.2f} x auto"
    ratio = numerics_ratio({n: r.get("prefill_ms") for n, r in models.items()})
    out.append((target, f"{ratio:.3f}x", status(ratio, PREFILL_RATIO_TARGET, at_least=False,
                                                 unit="x", digits=3)) if ratio else
               (target, "-", "not measured (needs prefill rows of both auto and rl-bitwise)"))
    return out


def _loop_targets(results: dict) -> list[tuple[str, str, str]]:
    engines, servers = by_numerics(results, "engine"), by_numerics(results, "server")
    roof = results.get("roofline") or {}
    out = []
    want = E2E_SPEEDUP_TARGET * E2E_BASELINE_TOK_S
    for name in engines or {"": {}}:
        r = engines.get(name, {})
        target = (f"`{name}` " if name else "") + (
            f"Engine workload >= {E2E_SPEEDUP_TARGET:.0f} x {E2E_BASELINE_TOK_S:.0f} output tok/s")
        tok_s = r.get("output_tok_s")
        bound = workload_bound(r, roof.get("hbm_TBps"), roof.get("gemm_TFLOPs")) if r else None
        # The goal can lie above what this GPU allows: then say so beside the status.
        ceiling = (f"; the workload's roofline allows {bound[1]:.0f}"
                   + (" (the goal is above it)" if bound[1] < want else "")) if bound else ""
        out.append((target, f"{tok_s:.0f} tok/s ({tok_s / E2E_BASELINE_TOK_S:.2f}x{ceiling})",
                    status(tok_s, want, at_least=True, unit=" tok/s")) if tok_s else
                   (target, "-", not_measured(r or None)))
        target = (f"`{name}` " if name else "") + (
            f"Engine decode step <= {LOOP_OVERHEAD_TARGET:.0f} % over the model's (overlap on)")
        pct = ((r.get("loop_overhead") or {}).get("overlap") or {}).get("overhead_pct")
        out.append((target, f"{pct:.1f} %", status(pct, LOOP_OVERHEAD_TARGET, at_least=False,
                                                    unit=" points")) if pct is not None else
                   (target, "-", not_measured(r or None, "no loop-overhead row")))
    for name in servers or {"": {}}:
        r = servers.get(name, {})
        target = (f"`{name}` " if name else "") + (
            f"server >= {SERVER_RATIO_TARGET:.2f} x the in-process Engine's output tok/s")
        ours, engine = vs_engine(r, engines, name)
        why = "part not run" if not r else f"no engine:{name} row in this run (--merge one)"
        out.append((target, f"{ours / engine:.2f}x ({ours:.0f} vs {engine:.0f} tok/s)",
                    status(ours / engine, SERVER_RATIO_TARGET, at_least=True, unit="x"))
                   if ours and engine else (target, "-", not_measured(r or None, why)))
    return out


def target_rows(results: dict) -> list[tuple[str, str, str]]:
    """(target, measured, status) for every goal of issue #19."""
    roof = results.get("roofline") or {}
    bw, peak = roof.get("hbm_TBps"), roof.get("gemm_TFLOPs")
    models = by_numerics(results, "model")
    rows = decode_rows(models)
    return (_decode_targets(models, rows, bw) + _prefill_targets(models, peak)
            + _ratio_targets(models, rows) + _loop_targets(results))


def targets_section(results: dict) -> list[str]:
    lines = ["## Targets (issue #19), against this run's roofline", ""]
    shapes = sorted({shape_label(r) for part in ("model", "engine", "server")
                     for r in by_numerics(results, part).values()} - {ROOFLINE_SHAPE})
    if shapes:  # e.g. the MoE shape: its rows are compared, but the goals were set for another
        lines += [f"Issue #19's goals are set on the {ROOFLINE_SHAPE} shape; this run's "
                  f"{', '.join(shapes)} rows are read against them for information only.", ""]
    lines += ["| target | measured | status |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {s} |" for t, m, s in target_rows(results)]
    return lines + [""]
