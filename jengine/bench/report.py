"""Markdown for `jengine bench` results: measured numbers against the roofline of the same run, and
each goal of issue #19 with its status (met, missed by how much, or not measured and why).

Byte and FLOP counts (Llama-3-8B shape, bf16):
  decode step reads every projection weight once, the LM head once, and each request's KV:
    weights = 32 * (2*4096*4096 + 2*1024*4096 + 3*14336*4096) + vocab*4096 parameters, 2 bytes each
    KV      = batch * context * 32 layers * 2 (K, V) * 8 heads * 128 * 2 bytes
  prefill of n tokens (one request, LM head on the last row only):
    2 * 32 * (projection parameters) * n  +  attention 2 * 2 * n^2/2 * 4096 * 32

Every section reads its part with .get: a bench.json of an older bench, or one whose part stopped,
renders what it has and says "not measured (why)" for the rest.
"""

from __future__ import annotations

LAYER_PARAMS = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
ROOFLINE_SHAPE = "llama3-8b"  # the byte and FLOP counts above are for this shape only

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


def decode_bytes(batch: int, context: int, vocab: int) -> float:
    return (32 * LAYER_PARAMS + vocab * 4096) * 2 + batch * context * KV_BYTES_PER_TOKEN


def prefill_flops(n: int) -> float:
    return 2 * 32 * LAYER_PARAMS * n + 2 * 2 * (n * n / 2) * 4096 * 32


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def _at(d: dict, key):
    """d[key] for an int key that JSON turned into a string."""
    return d.get(str(key), d.get(key)) if d else None


def status(value, target: float, *, at_least: bool, unit: str = "") -> str:
    """'**met**' or '**missed** by <gap><unit>' (None: 'not measured')."""
    if value is None:
        return "not measured"
    if (value >= target) if at_least else (value <= target):
        return "**met**"
    return f"**missed** by {abs(target - value):.2f}{unit}"


def _not_measured(part: dict | None, what: str = "part not run") -> str:
    if part and "error" in part:
        return f"not measured ({part['error']})"
    return f"not measured ({what})"


def _by_numerics(results: dict, part: str) -> dict:
    return {k.split(":", 1)[1]: r for k, r in results.items()
            if k.startswith(part + ":") and isinstance(r, dict)}


def _stopped(name: str, r: dict) -> list[str]:
    if "error" not in r:
        return []
    return [f"- `{name}`: stopped ({r['error']}); what it measured before that is below", "",
            "```", str(r.get("tail", ""))[-1500:], "```", ""]


# -- model: decode rows and prefill ----------------------------------------------------------------


def decode_rows(models: dict) -> dict:
    """{(batch, context): {numerics: (ms, model result)}} over the normal and the long-context rows."""
    rows: dict = {}
    for name, r in models.items():
        for bs, ms in (r.get("decode_ms") or {}).items():
            rows.setdefault((int(bs), r.get("context", 1024)), {})[name] = (ms, r)
        long = r.get("long_decode")
        if long and long.get("ms"):
            rows.setdefault((long["batch"], long["context"]), {})[name] = (long["ms"], r)
    return dict(sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])))


def pipelined_ms(r: dict, bs: int, ctx: int):
    """The row's step time dispatched back to back (jengine/bench/model.py), None if not measured."""
    long = r.get("long_decode") or {}
    if (long.get("batch"), long.get("context")) == (bs, ctx):
        return long.get("pipelined_ms")
    return _at(r.get("decode_pipelined_ms") or {}, bs) if r.get("context", 1024) == ctx else None


def dispatch_ms(r: dict, bs: int, ctx: int):
    """How long the row's step calls took to return with the device idle (the host's share)."""
    long = r.get("long_decode") or {}
    if (long.get("batch"), long.get("context")) == (bs, ctx):
        return long.get("dispatch_ms")
    return _at(r.get("decode_dispatch_ms") or {}, bs) if r.get("context", 1024) == ctx else None


def hbm_percent(ms, bs: int, ctx: int, r: dict, bw) -> float | None:
    """% of the HBM-bound step time reached (None off the Llama-3-8B shape or without a roofline)."""
    if not (ms and bw) or r.get("shape", ROOFLINE_SHAPE) != ROOFLINE_SHAPE:
        return None
    return 100 * decode_bytes(bs, ctx, r.get("vocab", 128256)) / (bw * 1e12) / (ms * 1e-3)


def prefill_stats(r: dict, peak) -> tuple | None:
    """(tokens, ms, tok/s, TFLOP/s, % of peak) of a model result's prefill chunk; the last two
    are None off the Llama-3-8B shape (the FLOP count is its), the last without a roofline."""
    ms, n = r.get("prefill_ms"), r.get("prefill_tokens")
    if not (ms and n):
        return None
    if r.get("shape", ROOFLINE_SHAPE) != ROOFLINE_SHAPE:
        return n, ms, n / ms * 1e3, None, None
    tflops = prefill_flops(n) / (ms * 1e-3) / 1e12
    return n, ms, n / ms * 1e3, tflops, 100 * tflops / peak if peak else None


def _ratio(times: dict):
    a, b = times.get("auto"), times.get("rl-bitwise")
    return b / a if a and b else None


def _model_section(models: dict, bw, peak) -> list[str]:
    if not models:
        return []
    lines = ["## Model steps (ModelRunner, random bf16 weights)", ""]
    for name, r in models.items():
        lines += _stopped(f"model --numerics {name}", r)
    if any(r.get("shape", ROOFLINE_SHAPE) != ROOFLINE_SHAPE for r in models.values()):
        lines += ["(not the Llama-3-8B shape: no roofline percentages)", ""]
    rows = decode_rows(models)
    names = [n for n in models if any(n in v for v in rows.values())]
    if rows:
        lines += ["Each step is timed twice: blocked on (host time adds to the device's, as the "
                  "loop without overlap runs it) and pipelined (8 steps dispatched back to back, "
                  "as the overlapped Engine loop runs them).", "",
                  "| row | " + " | ".join(f"{n} ms | {n} tok/s | {n} % HBM bound | {n} pipelined "
                                        f"ms | {n} pipelined % HBM bound" for n in names)
                  + " | rl-bitwise / auto |", "|---|" + "---|---|---|---|---|" * len(names) + "---|"]
        for (bs, ctx), per in rows.items():
            cells = []
            for n in names:
                ms, r = per.get(n, (None, {}))
                pct = hbm_percent(ms, bs, ctx, r, bw)
                pms = pipelined_ms(r, bs, ctx)
                ppct = hbm_percent(pms, bs, ctx, r, bw)
                cells += [_fmt(ms, ".2f"), _fmt(bs / ms * 1e3 if ms else None, ".0f"),
                          _fmt(pct, ".0f") + (" %" if pct is not None else ""), _fmt(pms, ".2f"),
                          _fmt(ppct, ".0f") + (" %" if ppct is not None else "")]
            ratio = _ratio({n: ms for n, (ms, _) in per.items()})
            lines.append(f"| decode bs {bs}, ctx {ctx} | " + " | ".join(cells)
                         + f" | {_fmt(ratio, '.2f')} |")
        lines.append("")
        if any(r.get("decode_dispatch_ms") for r in models.values()):
            lines += ["Host dispatch: how long a step's calls take to return with the device "
                      "idle (argument handling and XLA launching every kernel). A pipelined step "
                      "cannot be shorter.", "",
                      "| row | " + " | ".join(f"{n} dispatch ms" for n in names) + " |",
                      "|---|" + "---|" * len(names)]
            for (bs, ctx), per in rows.items():
                lines.append(f"| decode bs {bs}, ctx {ctx} | " + " | ".join(
                    _fmt(dispatch_ms(per.get(n, (None, {}))[1], bs, ctx), ".2f") for n in names)
                    + " |")
            lines.append("")
    prefill = {n: prefill_stats(r, peak) for n, r in models.items()}
    if any(prefill.values()):
        lines += [f"| prefill (one chunk) | tokens | ms | tok/s | TFLOP/s | % of GEMM peak "
                  f"({_fmt(peak, '.0f')} TFLOP/s) |", "|---|---|---|---|---|---|"]
        for n, st in prefill.items():
            if st:
                tokens, ms, tok_s, tflops, pct = st
                lines.append(f"| `{n}` | {tokens} | {ms:.1f} | {tok_s:.0f} | {_fmt(tflops, '.0f')} | "
                             + (f"{pct:.0f} %" if pct is not None else "-") + " |")
        lines.append("")
    for n, r in models.items():
        if r.get("kernels"):
            lines.append(f"`{n}` kernels: {r['kernels']}")
    return lines + [""]


# -- engine and hf ---------------------------------------------------------------------------------


def _counts(d) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) if isinstance(d, dict) else "-"


def _latency(r: dict, name: str) -> str:
    return " / ".join(_fmt(r.get(f"{name}_{p}_ms"), ".1f") for p in ("p50", "p90", "p99"))


def _engine_section(engines: dict) -> list[str]:
    if not engines:
        return []
    lines = ["## End to end (Engine, random weights, all requests submitted at once)", ""]
    for name, r in engines.items():
        lines += _stopped(f"engine --numerics {name}", r)
    done = {n: r for n, r in engines.items() if r.get("wall_s")}
    if done:
        lines += ["| numerics | requests x (input + output) | wall s | output tok/s | total tok/s "
                  "| req/s | compiled inside the timing | finish reasons | TTFT ms p50 / p90 / p99 "
                  "| ITL ms p50 / p90 / p99 |", "|---|---|---|---|---|---|---|---|---|---|"]
        for n, r in done.items():
            for label, run in ((f"`{n}`", r), (f"`{n}`, overlap off", r.get("overlap_off"))):
                if not run or not run.get("wall_s"):
                    continue
                lines.append(
                    f"| {label} | {r.get('requests')} x ({r.get('input_tokens')} + "
                    f"{r.get('output_tokens')}) | {run['wall_s']:.2f} | "
                    f"{_fmt(run.get('output_tok_s'), '.0f')} | {_fmt(run.get('total_tok_s'), '.0f')} "
                    f"| {_fmt(run.get('req_s'), '.2f')} | {run.get('compiles_in_timing', '-')} "
                    f"programs, {_fmt(run.get('compile_s_in_timing'), '.1f')} s "
                    f"| {_counts(run.get('finish_reasons'))} | {_latency(run, 'ttft')} "
                    f"| {_latency(run, 'itl')} |")
        ratio = _ratio({n: r["wall_s"] for n, r in done.items()})
        if ratio:
            lines += ["", f"rl-bitwise / auto wall time: {ratio:.2f}"]
        lines.append("")
    loops = [(n, name, row) for n, r in done.items()
             for name, row in (r.get("loop_overhead") or {}).items()]
    if loops:
        lines += ["Loop overhead: the Engine's decode step (its median inter-token latency, every "
                  "request decoding) against the model's own step (forward + LM head + sampling "
                  "dispatched back to back) at the same batch and context; the goal is <= 5 %. "
                  "Host ms/step: the engine thread's work per step, every loop phase but the wait "
                  "for the device (median; jengine/engine/loop_clock.py).", "",
                  "| numerics | loop | batch, context | Engine ms/step | model ms/step | overhead "
                  "| host ms/step | schedule / dispatch / commit / process / emit ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for n, name, row in loops:
            host = row.get("host_phases") or {}
            phases = " / ".join(_fmt(host.get(f"{p}_ms"), ".2f")
                                for p in ("schedule", "dispatch", "commit", "process", "emit"))
            lines.append(f"| `{n}` | {name.replace('_', ' ')} | {row.get('batch')}, "
                         f"{row.get('context')} | {_fmt(row.get('engine_step_ms'), '.2f')} | "
                         f"{_fmt(row.get('model_step_ms'), '.2f')} | "
                         f"{_fmt(row.get('overhead_pct'), '.1f')} % | "
                         f"{_fmt(host.get('host_ms'), '.2f')} | {phases} |")
        lines.append("")
    return lines


def _vs_engine(server: dict, engines: dict, name: str) -> tuple:
    """(server output tok/s, the in-process Engine's of the same numerics); None where missing."""
    return server.get("output_tok_s"), (engines.get(name) or {}).get("output_tok_s")


def _server_section(servers: dict, engines: dict) -> list[str]:
    if not servers:
        return []
    lines = ["## Server (streaming `/generate` clients, one request each, on 127.0.0.1)", ""]
    for name, r in servers.items():
        lines += _stopped(f"server --numerics {name}", r)
    done = {n: r for n, r in servers.items() if r.get("wall_s")}
    if done:
        lines += ["| numerics | clients x (input + output) | wall s | output tok/s | vs in-process "
                  "Engine | compiled inside the timing | TTFT ms p50 / p90 / p99 "
                  "| ITL ms p50 / p90 / p99 |", "|---|---|---|---|---|---|---|---|"]
        for n, r in done.items():
            ours, engine = _vs_engine(r, engines, n)
            # No engine row of this numerics in the results: merge the engine part's bench.json
            # (`jengine bench --merge`) to get the ratio.
            ratio = f"{ours / engine:.2f}x" if ours and engine else "- (no engine row)"
            lines.append(f"| `{n}` | {r.get('clients')} x ({r.get('input_tokens')} + "
                         f"{r.get('output_tokens')}) | {r['wall_s']:.2f} | {_fmt(ours, '.0f')} | "
                         f"{ratio} | {r.get('compiles_in_timing', '-')} programs, "
                         f"{_fmt(r.get('compile_s_in_timing'), '.1f')} s | "
                         f"{_latency(r, 'ttft')} | {_latency(r, 'itl')} |")
        lines.append("")
    return lines


def hf_comparison(results: dict) -> dict:
    """{numerics: (jengine decode tok/s, HF decode tok/s est., HF tok/s with prefill)} at the HF
    batch, or {numerics: reason} where it cannot be compared."""
    hf = results.get("hf") or {}
    out = {}
    for name, r in _by_numerics(results, "model").items():
        ms = _at(r.get("decode_ms") or {}, hf.get("batch"))
        if "decode_tok_s" not in hf:
            out[name] = _not_measured(results.get("hf"))
        elif not ms:
            out[name] = f"not measured (no jengine decode row at bs {hf.get('batch')})"
        elif r.get("shape", ROOFLINE_SHAPE) != hf.get("shape", ROOFLINE_SHAPE):
            out[name] = "not measured (jengine and HF ran different shapes)"
        else:
            out[name] = (hf["batch"] / ms * 1e3, hf["decode_tok_s"], hf.get("tok_s_with_prefill"))
    return out


def _hf_section(results: dict) -> list[str]:
    hf = results.get("hf")
    if not hf:
        return []
    if "generate_s" not in hf:
        return ["## HF transformers `generate` (the peer)", "", _not_measured(hf), ""]
    lines = ["## HF transformers `generate` (the peer, random weights, greedy)", "",
             "| batch x (prompt + new) | cache | device, dtype | generate s | 1-token generate s "
             "| tok/s incl. prefill | decode tok/s (est.) |", "|---|---|---|---|---|---|---|",
             f"| {hf['batch']} x ({hf['context']} + {hf['new_tokens']}) | {hf.get('cache')} | "
             f"{hf.get('device')}, {hf.get('dtype')} | {hf['generate_s']:.2f} | "
             f"{_fmt(hf.get('generate_1_s'), '.2f')} | {_fmt(hf.get('tok_s_with_prefill'), '.0f')} | "
             f"{_fmt(hf.get('decode_tok_s'), '.0f')} |", "",
             "decode tok/s (est.) = batch x (new - 1) / (generate s - 1-token generate s): the "
             "1-token generate is the prompt's prefill."]
    if hf.get("static_cache_error"):
        lines.append(f"static cache failed: `{hf['static_cache_error']}`")
    cmp = {n: v for n, v in hf_comparison(results).items() if isinstance(v, tuple)}
    if cmp:
        lines += ["", f"| jengine decode (model part) | jengine tok/s (bs {hf['batch']}) | vs HF "
                  "decode est. | vs HF incl. prefill |", "|---|---|---|---|"]
        for n, (ours, theirs, with_prefill) in cmp.items():
            lines.append(f"| `{n}` | {ours:.0f} | {ours / theirs:.2f}x | "
                         f"{_fmt(ours / with_prefill if with_prefill else None, '.2f')}x |")
    return lines + [""]


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
                out.append((target, "-", _not_measured(models.get(name) or None, why)))
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
            out.append((target, "-", _not_measured(r or None, why)))
    return out


def _ratio_targets(models: dict, rows: dict) -> list[tuple[str, str, str]]:
    out = []
    ratios = {key: _ratio({n: ms for n, (ms, _) in per.items()}) for key, per in rows.items()}
    for (bs, ctx), ratio in ratios.items():
        if ratio is not None:
            target = f"rl-bitwise step <= {DECODE_RATIO_TARGET:.2f} x auto, decode bs {bs}, ctx {ctx}"
            out.append((target, f"{ratio:.2f}x",
                        status(ratio, DECODE_RATIO_TARGET, at_least=False, unit="x")))
    if not any(r is not None for r in ratios.values()):
        out.append((f"rl-bitwise step <= {DECODE_RATIO_TARGET:.2f} x auto, every decode row", "-",
                    "not measured (needs model rows of both auto and rl-bitwise)"))
    target = f"rl-bitwise prefill <= {PREFILL_RATIO_TARGET:.2f} x auto"
    ratio = _ratio({n: r.get("prefill_ms") for n, r in models.items()})
    out.append((target, f"{ratio:.2f}x", status(ratio, PREFILL_RATIO_TARGET, at_least=False,
                                                 unit="x")) if ratio else
               (target, "-", "not measured (needs prefill rows of both auto and rl-bitwise)"))
    return out


def _loop_targets(results: dict) -> list[tuple[str, str, str]]:
    engines, servers = _by_numerics(results, "engine"), _by_numerics(results, "server")
    out = []
    want = E2E_SPEEDUP_TARGET * E2E_BASELINE_TOK_S
    for name in engines or {"": {}}:
        r = engines.get(name, {})
        target = (f"`{name}` " if name else "") + (
            f"Engine workload >= {E2E_SPEEDUP_TARGET:.0f} x {E2E_BASELINE_TOK_S:.0f} output tok/s")
        tok_s = r.get("output_tok_s")
        out.append((target, f"{tok_s:.0f} tok/s ({tok_s / E2E_BASELINE_TOK_S:.2f}x)",
                    status(tok_s, want, at_least=True, unit=" tok/s")) if tok_s else
                   (target, "-", _not_measured(r or None)))
        target = (f"`{name}` " if name else "") + (
            f"Engine decode step <= {LOOP_OVERHEAD_TARGET:.0f} % over the model's (overlap on)")
        pct = ((r.get("loop_overhead") or {}).get("overlap") or {}).get("overhead_pct")
        out.append((target, f"{pct:.1f} %", status(pct, LOOP_OVERHEAD_TARGET, at_least=False,
                                                    unit=" points")) if pct is not None else
                   (target, "-", _not_measured(r or None, "no loop-overhead row")))
    for name in servers or {"": {}}:
        r = servers.get(name, {})
        target = (f"`{name}` " if name else "") + (
            f"server >= {SERVER_RATIO_TARGET:.2f} x the in-process Engine's output tok/s")
        ours, engine = _vs_engine(r, engines, name)
        why = "part not run" if not r else f"no engine:{name} row in this run (--merge one)"
        out.append((target, f"{ours / engine:.2f}x ({ours:.0f} vs {engine:.0f} tok/s)",
                    status(ours / engine, SERVER_RATIO_TARGET, at_least=True, unit="x"))
                   if ours and engine else (target, "-", _not_measured(r or None, why)))
    return out


def target_rows(results: dict) -> list[tuple[str, str, str]]:
    """(target, measured, status) for every goal of issue #19."""
    roof = results.get("roofline") or {}
    bw, peak = roof.get("hbm_TBps"), roof.get("gemm_TFLOPs")
    models = _by_numerics(results, "model")
    rows = decode_rows(models)
    return (_decode_targets(models, rows, bw) + _prefill_targets(models, peak)
            + _ratio_targets(models, rows) + _loop_targets(results))


def _targets_section(results: dict) -> list[str]:
    lines = ["## Targets (issue #19), against this run's roofline", "",
             "| target | measured | status |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {s} |" for t, m, s in target_rows(results)]
    return lines + [""]


# -- roofline and leaves ---------------------------------------------------------------------------


def _roofline_section(roof: dict) -> list[str]:
    if not roof or "error" in roof:
        return [f"roofline: {_not_measured(roof)}", ""]
    return ["## Roofline (this run)", "", "| quantity | XLA | torch |", "|---|---|---|",
            "| HBM copy bandwidth, TB/s (read + write) | "
            f"{_fmt(roof.get('jax_elementwise_copy_TBps'), '.2f')} "
            f"| {_fmt(roof.get('torch_copy_TBps'), '.2f')} |",
            f"| bf16 8192^3 GEMM, TFLOP/s | {_fmt(roof.get('jax_gemm_bf16_TFLOPs'))} "
            f"| {_fmt(roof.get('torch_gemm_bf16_TFLOPs'))} |", ""]


def _leaves_section(leaves: dict, bw) -> list[str]:
    if not leaves or not leaves.get("per_gemm_us"):
        return []
    per = leaves["per_gemm_us"]
    impls = list(next(iter(per.values())).keys())
    rows = sorted({int(m) for d in per.values() for i in d.values() for m in i})
    lines = ["## GEMM leaves (µs per GEMM; distinct weights, no L2 reuse)", "",
             "| shape [tile] | impl | " + " | ".join(f"M={m}" for m in rows) + " |",
             "|---|---|" + "---|" * len(rows)]
    for shape, d in per.items():
        for impl in impls:
            if impl not in d:
                continue
            tile = leaves.get("tiles", {}).get(shape, "") if impl.startswith("rl-bitwise") else ""
            lines.append(f"| {shape} {('[' + tile + ']') if tile else ''} | {impl} | "
                         + " | ".join(_fmt(_at(d[impl], m)) for m in rows) + " |")
    step = leaves.get("step_gemm_us") or {}  # empty for a --leaf-shapes sweep
    if len(impls) < 2 or not all(i in step for i in impls[:2]):
        return lines + [""]
    lines += ["", "GEMM share of one step (32 layers + LM head; auto: vocab 128256, rl-bitwise: "
              "131072), µs, and the rl-bitwise/auto ratio:", "",
              "| M | auto (XLA dot) | rl-bitwise (Triton) | ratio | auto % of HBM bound |",
              "|---|---|---|---|---|"]
    bound = (32 * LAYER_PARAMS + 128256 * 4096) * 2 / (bw * 1e12) * 1e6 if bw else None
    for m in rows:
        a, b = _at(step[impls[0]], m), _at(step[impls[1]], m)
        pct = f"{100 * bound / a:.0f} %" if bound and a and m <= 256 else "-"
        ratio = b / a if a and b else None
        lines.append(f"| {m} | {_fmt(a)} | {_fmt(b)} | {_fmt(ratio, '.2f')} | {pct} |")
    return lines + [""]


def render(results: dict) -> str:
    v = results.get("versions", {})
    commands = results.get("commands") or [results.get("command")]
    lines = [f"# jengine bench — {v.get('date')}", "",
             "versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if k != "date"),
             *(f"command: `{c}`" for c in commands), ""]
    roof = results.get("roofline") or {}
    lines += _roofline_section(roof)
    lines += _leaves_section(results.get("leaves"), roof.get("hbm_TBps"))
    lines += _model_section(_by_numerics(results, "model"), roof.get("hbm_TBps"),
                            roof.get("gemm_TFLOPs"))
    lines += _engine_section(_by_numerics(results, "engine"))
    lines += _server_section(_by_numerics(results, "server"), _by_numerics(results, "engine"))
    lines += _hf_section(results)
    lines += _targets_section(results)
    return "\n".join(lines)
