"""Markdown for `jengine bench` results: measured numbers against the roofline of the same run.

Byte and FLOP counts (Llama-3-8B shape, bf16):
  decode step reads every projection weight once, the LM head once, and each request's KV:
    weights = 32 * (2*4096*4096 + 2*1024*4096 + 3*14336*4096) + vocab*4096 parameters, 2 bytes each
    KV      = batch * context * 32 layers * 2 (K, V) * 8 heads * 128 * 2 bytes
  prefill of n tokens (one request, LM head on the last row only):
    2 * 32 * (projection parameters) * n  +  attention 2 * 2 * n^2/2 * 4096 * 32
"""

from __future__ import annotations

LAYER_PARAMS = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def decode_bytes(batch: int, context: int, vocab: int) -> float:
    return (32 * LAYER_PARAMS + vocab * 4096) * 2 + batch * context * KV_BYTES_PER_TOKEN


def prefill_flops(n: int) -> float:
    return 2 * 32 * LAYER_PARAMS * n + 2 * 2 * (n * n / 2) * 4096 * 32


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def render(results: dict) -> str:
    v = results.get("versions", {})
    lines = [f"# jengine bench — {v.get('date')}", "",
             "versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if k != "date"),
             f"command: `{results.get('command')}`", ""]
    roof = results.get("roofline", {})
    bw = roof.get("hbm_TBps")
    peak = roof.get("gemm_TFLOPs")
    if "error" in roof or not roof:
        lines += [f"roofline: not measured ({roof.get('error', 'part not run')})", ""]
    else:
        lines += ["## Roofline (this run)", "", "| quantity | XLA | torch |", "|---|---|---|",
                  f"| HBM copy bandwidth, TB/s (read + write) | {_fmt(roof.get('jax_elementwise_copy_TBps'), '.2f')} "
                  f"| {_fmt(roof.get('torch_copy_TBps'), '.2f')} |",
                  f"| bf16 8192^3 GEMM, TFLOP/s | {_fmt(roof.get('jax_gemm_bf16_TFLOPs'))} "
                  f"| {_fmt(roof.get('torch_gemm_bf16_TFLOPs'))} |", ""]
    leaves = results.get("leaves", {})
    if leaves and leaves.get("step_gemm_us"):
        per = leaves["per_gemm_us"]
        impls = list(next(iter(per.values())).keys())
        rows = sorted({int(m) for d in per.values() for i in d.values() for m in i})
        lines += ["## GEMM leaves (µs per GEMM; distinct weights, no L2 reuse)", "",
                  "| shape [tile] | impl | " + " | ".join(f"M={m}" for m in rows) + " |",
                  "|---|---|" + "---|" * len(rows)]
        for shape, d in per.items():
            for impl in impls:
                if impl not in d:
                    continue
                tile = leaves["tiles"].get(shape, "") if impl.startswith("rl-bitwise") else ""
                lines.append(f"| {shape} {('[' + tile + ']') if tile else ''} | {impl} | "
                             + " | ".join(_fmt(d[impl].get(str(m), d[impl].get(m))) for m in rows) + " |")
        step = leaves["step_gemm_us"]
        lines += ["", "GEMM share of one step (32 layers + LM head; auto: vocab 128256, rl-bitwise: "
                  "131072), µs, and the rl-bitwise/auto ratio:", "",
                  "| M | auto (XLA dot) | rl-bitwise (Triton) | ratio | auto % of HBM bound |",
                  "|---|---|---|---|---|"]
        a_name, b_name = impls[0], impls[1]
        for m in rows:
            a = step[a_name].get(str(m), step[a_name].get(m))
            b = step[b_name].get(str(m), step[b_name].get(m))
            bound = (32 * LAYER_PARAMS + 128256 * 4096) * 2 / (bw * 1e12) * 1e6 if bw else None
            pct = f"{100 * bound / a:.0f} %" if bound and m <= 256 else "-"
            lines.append(f"| {m} | {_fmt(a)} | {_fmt(b)} | {b / a:.2f} | {pct} |")
        lines.append("")
    models = {k.split(":", 1)[1]: r for k, r in results.items() if k.startswith("model:")}
    if models:
        lines += ["## Model steps (ModelRunner, Llama-3-8B shape, random bf16 weights)", ""]
        for name, r in models.items():
            if "error" in r:
                lines += [f"- `--numerics {name}`: stopped ({r['error']}); rows below are what it "
                          "measured before that", "", "```", r.get("tail", "")[-1500:], "```", ""]
        ok = {n: r for n, r in models.items() if r.get("decode_ms")}
        context = next((r["context"] for r in ok.values()), 0)
        if any(r.get("shape") != "llama3-8b" for r in ok.values()):
            lines += ["(not the Llama-3-8B shape: the roofline percentages below do not apply)", ""]
        if ok:
            bss = sorted({int(b) for r in ok.values() for b in r["decode_ms"]})
            lines += ["| batch (ctx %d) | " % context + " | ".join(
                f"{n} ms | {n} tok/s | {n} % HBM bound" for n in ok) + " | rl-bitwise / auto |",
                "|---|" + "---|---|---|" * len(ok) + "---|"]
            for bs in bss:
                cells = []
                times = {}
                for n, r in ok.items():
                    t = r["decode_ms"].get(str(bs), r["decode_ms"].get(bs))
                    times[n] = t
                    bound = decode_bytes(bs, context, r["vocab"]) / (bw * 1e12) * 1e3 if bw else None
                    cells += [_fmt(t, ".2f"), _fmt(bs / t * 1e3 if t else None, ".0f"),
                              f"{100 * bound / t:.0f} %" if (bound and t) else "-"]
                ratio = (times.get("rl-bitwise") / times["auto"]
                         if times.get("rl-bitwise") and times.get("auto") else None)
                lines.append(f"| {bs} | " + " | ".join(cells) + f" | {_fmt(ratio, '.2f')} |")
            for n, r in ok.items():
                if r.get("prefill_ms"):
                    n_tok = r["prefill_tokens"]
                    fl = prefill_flops(n_tok) / (r["prefill_ms"] * 1e-3) / 1e12
                    pct = f"{100 * fl / peak:.0f} % of measured GEMM peak" if peak else ""
                    lines.append(f"\nprefill {n_tok} tokens, `--numerics {n}`: {r['prefill_ms']:.1f} ms, "
                                 f"{n_tok / r['prefill_ms'] * 1e3:.0f} tok/s, {fl:.0f} TFLOP/s {pct}")
                lines.append(f"\n`{n}` kernels: {r.get('kernels')}")
        lines.append("")
    return "\n".join(lines)
