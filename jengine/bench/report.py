"""Markdown for `jengine bench` results: measured numbers against the roofline of the same run
(jengine/bench/measures.py says what each counts), then each goal of issue #19 with its status
(jengine/bench/targets.py).

Every section reads its part with .get: a bench.json of an older bench, or one whose part stopped,
renders what it has and says "not measured (why)" for the rest.
"""

from __future__ import annotations

from jengine.bench.measures import (LAYER_PARAMS, ROOFLINE_SHAPE, at, by_numerics, decode_rows,
                                    dispatch_ms, experts_read, fmt, hbm_percent, not_measured,
                                    numerics_ratio, pipelined_ms, prefill_stats, shape_label,
                                    vs_engine, workload_bound)
from jengine.bench.targets import targets_section

def _stopped(name: str, r: dict) -> list[str]:
    if "error" not in r:
        return []
    return [f"- `{name}`: stopped ({r['error']}); what it measured before that is below", "",
            "```", str(r.get("tail", ""))[-1500:], "```", ""]


# -- model: decode rows and prefill ----------------------------------------------------------------


def _model_section(models: dict, bw, peak) -> list[str]:
    if not models:
        return []
    lines = ["## Model steps (ModelRunner, random bf16 weights)", ""]
    for name, r in models.items():
        lines += _stopped(f"model --numerics {name}", r)
    others = {shape_label(r) for r in models.values()
              if r.get("shape", ROOFLINE_SHAPE) != ROOFLINE_SHAPE}
    if others:
        counted = all(r.get("step_model") for r in models.values()
                      if r.get("shape", ROOFLINE_SHAPE) != ROOFLINE_SHAPE)
        lines += [f"(shape {', '.join(sorted(others))}: " + (
            "its roofline percentages count its own weights, a MoE step's experts as the "
            "(layer, expert) pairs its rows were routed to -- see the experts table)" if counted
            else "no roofline percentages)"), ""]
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
                cells += [fmt(ms, ".2f"), fmt(bs / ms * 1e3 if ms else None, ".0f"),
                          fmt(pct, ".0f") + (" %" if pct is not None else ""), fmt(pms, ".2f"),
                          fmt(ppct, ".0f") + (" %" if ppct is not None else "")]
            ratio = numerics_ratio({n: ms for n, (ms, _) in per.items()})
            lines.append(f"| decode bs {bs}, ctx {ctx} | " + " | ".join(cells)
                         + f" | {fmt(ratio, '.2f')} |")
        lines.append("")
        if any(r.get("decode_dispatch_ms") for r in models.values()):
            lines += ["Host dispatch: how long a step's calls take to return with the device "
                      "idle (argument handling and XLA launching every kernel). A pipelined step "
                      "cannot be shorter.", "",
                      "| row | " + " | ".join(f"{n} dispatch ms" for n in names) + " |",
                      "|---|" + "---|" * len(names)]
            for (bs, ctx), per in rows.items():
                lines.append(f"| decode bs {bs}, ctx {ctx} | " + " | ".join(
                    fmt(dispatch_ms(per.get(n, (None, {}))[1], bs, ctx), ".2f") for n in names)
                    + " |")
            lines.append("")
    lines += _experts_lines(models, rows, names)
    prefill = {n: prefill_stats(r, peak) for n, r in models.items()}
    if any(prefill.values()):
        lines += [f"| prefill (one chunk) | tokens | ms | tok/s | TFLOP/s | % of GEMM peak "
                  f"({fmt(peak, '.0f')} TFLOP/s) |", "|---|---|---|---|---|---|"]
        for n, st in prefill.items():
            if st:
                tokens, ms, tok_s, tflops, pct = st
                lines.append(f"| `{n}` | {tokens} | {ms:.1f} | {tok_s:.0f} | {fmt(tflops, '.0f')} | "
                             + (f"{pct:.0f} %" if pct is not None else "-") + " |")
        lines.append("")
    for n, r in models.items():
        if r.get("kernels"):
            lines.append(f"`{n}` kernels: {r['kernels']}")
    return lines + [""]


def _experts_lines(models: dict, rows: dict, names: list) -> list[str]:
    """A MoE shape's decode rows: the (layer, expert) pairs each step's rows were routed to (the
    experts whose weights a routed step reads: its HBM bound counts these; the token bucket's
    padding rows reach no expert)."""
    cells = {(bs, ctx): [experts_read(per.get(n, (None, {}))[1], bs, ctx) for n in names]
             for (bs, ctx), per in rows.items()}
    if not any(e for row in cells.values() for e in row):
        return []
    total = next((r["step_model"]["moe_layers"] * r["step_model"]["experts"]
                  for r in models.values() if (r.get("step_model") or {}).get("experts")), None)
    lines = ["Experts read per decode step: (layer, expert) pairs its rows are routed to (the "
             "token bucket's padding rows reach none; the portable backend reads every expert"
             + (f", {total} in the model" if total else "") + "); in brackets, the rows each "
             "grouped GEMM of the routed backend runs (a static layout for any routing).", "",
             "| row | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def cell(e):
        return "-" if not e else str(e["rows"]) + (
            f" [{e['layout_rows']}]" if "layout_rows" in e else "")

    for (bs, ctx), per in cells.items():
        lines.append(f"| decode bs {bs}, ctx {ctx} | " + " | ".join(map(cell, per)) + " |")
    return lines + [""]


# -- engine and hf ---------------------------------------------------------------------------------


def _counts(d) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) if isinstance(d, dict) else "-"


def _latency(r: dict, name: str) -> str:
    return " / ".join(fmt(r.get(f"{name}_{p}_ms"), ".1f") for p in ("p50", "p90", "p99"))


def _engine_section(engines: dict, bw=None, peak=None) -> list[str]:
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
                    f"{fmt(run.get('output_tok_s'), '.0f')} | {fmt(run.get('total_tok_s'), '.0f')} "
                    f"| {fmt(run.get('req_s'), '.2f')} | {run.get('compiles_in_timing', '-')} "
                    f"programs, {fmt(run.get('compile_s_in_timing'), '.1f')} s "
                    f"| {_counts(run.get('finish_reasons'))} | {_latency(run, 'ttft')} "
                    f"| {_latency(run, 'itl')} |")
        ratio = numerics_ratio({n: r["wall_s"] for n, r in done.items()})
        if ratio:
            lines += ["", f"rl-bitwise / auto wall time: {ratio:.2f}"]
        for n, r in done.items():
            bound = workload_bound(r, bw, peak)
            if bound:
                lines += ["", f"`{n}`: the workload's roofline (measures.workload_bound_s, this "
                          f"run's roofline): {bound[0]:.2f} s, at most {bound[1]:.0f} output tok/s; "
                          f"measured {100 * bound[0] / r['wall_s']:.0f} % of it"]
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
            phases = " / ".join(fmt(host.get(f"{p}_ms"), ".2f")
                                for p in ("schedule", "dispatch", "commit", "process", "emit"))
            lines.append(f"| `{n}` | {name.replace('_', ' ')} | {row.get('batch')}, "
                         f"{row.get('context')} | {fmt(row.get('engine_step_ms'), '.2f')} | "
                         f"{fmt(row.get('model_step_ms'), '.2f')} | "
                         f"{fmt(row.get('overhead_pct'), '.1f')} % | "
                         f"{fmt(host.get('host_ms'), '.2f')} | {phases} |")
        lines.append("")
    return lines


def _server_section(servers: dict, engines: dict) -> list[str]:
    if not servers:
        return []
    lines = ["## Server (streaming `/generate` clients, one request each, on 127.0.0.1)", ""]
    if any(r.get("stream") is False for r in servers.values()):
        lines += ["**Unstreamed** (`--server-stream off`): the clients asked for whole responses; "
                  "no token latency is measured.", ""]
    for name, r in servers.items():
        lines += _stopped(f"server --numerics {name}", r)
    done = {n: r for n, r in servers.items() if r.get("wall_s")}
    if done:
        lines += ["| numerics | clients x (input + output) | wall s | output tok/s | vs in-process "
                  "Engine | compiled inside the timing | TTFT ms p50 / p90 / p99 "
                  "| ITL ms p50 / p90 / p99 |", "|---|---|---|---|---|---|---|---|"]
        for n, r in done.items():
            ours, engine = vs_engine(r, engines, n)
            # No engine row of this numerics in the results: merge the engine part's bench.json
            # (`jengine bench --merge`) to get the ratio.
            ratio = f"{ours / engine:.2f}x" if ours and engine else "- (no engine row)"
            lines.append(f"| `{n}` | {r.get('clients')} x ({r.get('input_tokens')} + "
                         f"{r.get('output_tokens')}) | {r['wall_s']:.2f} | {fmt(ours, '.0f')} | "
                         f"{ratio} | {r.get('compiles_in_timing', '-')} programs, "
                         f"{fmt(r.get('compile_s_in_timing'), '.1f')} s | "
                         f"{_latency(r, 'ttft')} | {_latency(r, 'itl')} |")
        lines.append("")
        lines += _server_time_split(done, engines)
    return lines


_LOOP_PHASES = ("schedule", "dispatch", "commit", "wait", "process", "emit", "other")


def _server_time_split(servers: dict, engines: dict) -> list[str]:
    """Where a timed run's time went: the engine loop's phases summed over the run (server and
    in-process Engine, same workload), the server process's CPU per thread, the clients' CPU."""
    rows = []
    for n, r in servers.items():
        engine = (engines.get(n) or {}).get("host_phases") or {}
        for label, wall, phases in (("server", r.get("wall_s"), r.get("host_phases") or {}),
                                    ("Engine", (engines.get(n) or {}).get("wall_s"), engine)):
            total = phases.get("total_s")
            if not total:
                continue
            held = (f"{fmt(phases.get('output_held_s'), '.2f')} ({phases.get('output_holds', '-')}"
                    f" / {phases.get('output_hold_timeouts', '-')})")
            rows.append(f"| `{n}` | {label} | {fmt(wall, '.2f')} | {phases.get('turns')} | "
                        + " | ".join(fmt(total.get(p), ".2f") for p in _LOOP_PHASES)
                        + f" | {held} |")
    lines = []
    if rows:
        lines += ["Where the run's time went, engine loop (seconds summed over the run's turns; "
                  "`wait` is the device's, the rest the engine thread's; "
                  "jengine/engine/loop_clock.py; outputs held: seconds the output processor "
                  "waited for the engine thread to reach its wait (holds / gave up after "
                  "--output-hold-ms), jengine/engine/host_gate.py):", "",
                  "| numerics | loop | wall s | turns | " + " | ".join(_LOOP_PHASES)
                  + " | outputs held s (holds / timeouts) |",
                  "|---|---|---|---|" + "---|" * (len(_LOOP_PHASES) + 1)]
        lines += rows + [""]
    cpu = {n: r for n, r in servers.items() if r.get("server_cpu_s")}
    if cpu:
        names = sorted({k for r in cpu.values() for k in r["server_cpu_s"]})
        lines += ["CPU seconds during the timed run: the server process per thread (/proc), and "
                  "the bench's client processes together (each one event loop; "
                  "`--server-client-procs`):", "",
                  "| numerics | " + " | ".join(names) + " | clients |",
                  "|---|" + "---|" * (len(names) + 1)]
        for n, r in cpu.items():
            lines.append(f"| `{n}` | " + " | ".join(fmt(r["server_cpu_s"].get(k), ".2f")
                                                     for k in names)
                         + f" | {fmt(r.get('client_cpu_s'), '.2f')} ({r.get('client_procs', 1)} "
                         "procs) |")
        lines.append("")
    return lines


def hf_comparison(results: dict) -> dict:
    """{numerics: (jengine decode tok/s, HF decode tok/s est., HF tok/s with prefill)} at the HF
    batch, or {numerics: reason} where it cannot be compared."""
    hf = results.get("hf") or {}
    out = {}
    for name, r in by_numerics(results, "model").items():
        ms = at(r.get("decode_ms") or {}, hf.get("batch"))
        if "decode_tok_s" not in hf:
            out[name] = not_measured(results.get("hf"))
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
        return ["## HF transformers `generate` (the peer)", "", not_measured(hf), ""]
    lines = ["## HF transformers `generate` (the peer, random weights, greedy)", "",
             "| batch x (prompt + new) | cache | device, dtype | generate s | 1-token generate s "
             "| tok/s incl. prefill | decode tok/s (est.) |", "|---|---|---|---|---|---|---|",
             f"| {hf['batch']} x ({hf['context']} + {hf['new_tokens']}) | {hf.get('cache')} | "
             f"{hf.get('device')}, {hf.get('dtype')} | {hf['generate_s']:.2f} | "
             f"{fmt(hf.get('generate_1_s'), '.2f')} | {fmt(hf.get('tok_s_with_prefill'), '.0f')} | "
             f"{fmt(hf.get('decode_tok_s'), '.0f')} |", "",
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
                         f"{fmt(ours / with_prefill if with_prefill else None, '.2f')}x |")
    return lines + [""]


# -- roofline and leaves ---------------------------------------------------------------------------


def _roofline_section(roof: dict) -> list[str]:
    if not roof or "error" in roof:
        return [f"roofline: {not_measured(roof)}", ""]
    return ["## Roofline (this run)", "", "| quantity | XLA | torch |", "|---|---|---|",
            "| HBM copy bandwidth, TB/s (read + write) | "
            f"{fmt(roof.get('jax_elementwise_copy_TBps'), '.2f')} "
            f"| {fmt(roof.get('torch_copy_TBps'), '.2f')} |",
            f"| bf16 8192^3 GEMM, TFLOP/s | {fmt(roof.get('jax_gemm_bf16_TFLOPs'))} "
            f"| {fmt(roof.get('torch_gemm_bf16_TFLOPs'))} |", ""]


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
                         + " | ".join(fmt(at(d[impl], m)) for m in rows) + " |")
    step = leaves.get("step_gemm_us") or {}  # empty for a --leaf-shapes sweep
    if len(impls) < 2 or not all(i in step for i in impls[:2]):
        return lines + [""]
    lines += ["", "GEMM share of one step (32 layers + LM head; auto: vocab 128256, rl-bitwise: "
              "131072), µs, and the rl-bitwise/auto ratio:", "",
              "| M | auto (XLA dot) | rl-bitwise (Triton) | ratio | auto % of HBM bound |",
              "|---|---|---|---|---|"]
    bound = (32 * LAYER_PARAMS + 128256 * 4096) * 2 / (bw * 1e12) * 1e6 if bw else None
    for m in rows:
        a, b = at(step[impls[0]], m), at(step[impls[1]], m)
        pct = f"{100 * bound / a:.0f} %" if bound and a and m <= 256 else "-"
        ratio = b / a if a and b else None
        lines.append(f"| {m} | {fmt(a)} | {fmt(b)} | {fmt(ratio, '.2f')} | {pct} |")
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
    lines += _model_section(by_numerics(results, "model"), roof.get("hbm_TBps"),
                            roof.get("gemm_TFLOPs"))
    lines += _engine_section(by_numerics(results, "engine"), roof.get("hbm_TBps"),
                             roof.get("gemm_TFLOPs"))
    lines += _server_section(by_numerics(results, "server"), by_numerics(results, "engine"))
    lines += _hf_section(results)
    lines += targets_section(results)
    return "\n".join(lines)
