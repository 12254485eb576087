"""RoPE + the KV write inside the split attention launch (pallas_kernels/triton_rope_attention.py,
an experiment off by default): the same bits as the two launches it replaces, and what one launch
saves on the device.

    python scripts/gpu_rope_attention.py [--out DIR] [--smoke]

Bits: the one launch (torch host) against rope_write's launch + the split attention launch, on the
output and both pages, for decode steps (bs 1 padded to the runner's 16 rows, 16, 32) at contexts
around page / KV tile / split boundaries and for mixed steps (decode rows + a 20-token prompt
chunk across a KV tile or the split), bf16 and f32, on three q / k / v arrays and on their
concatenation (auto's merged read), Llama-3-8B heads (32 q / 8 KV, head_dim 128), the engine's
16-position pages shuffled over the pool. Control (must DIVERGE): the same launch with fp fusion
on, which contracts the rotation's x * cos + rotate_half(x) * sin into an fma. Where jax-triton
imports, the JAX leaf (the engine's launch, pages aliased in place) against the two JAX leaves
too. Timings: device µs of the one launch and of the two, each captured in a CUDA graph and
replayed, at bs 1 / 16 / 32 x context 1024 (block table as wide as an 8k-context launch's, as the
engine's). Writes rope_attention.json / .md to --out. --smoke: the bits part on the CPU under
Triton's interpreter, small heads (tests/test_triton_rope_attention.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HQ, HKV, D, PAGE = 32, 8, 128, 16
DEV = "cuda"
ENGINE_WIDTH = 8192 // PAGE + 1  # block-table pages of an 8k-context launch
DTYPES = ("bf16", "f32")


def make_step(gen, runs, dtype, pad_to=None, width=None):
    """Pages, block table and one step's inputs: runs = (context, new) per request (the request
    holds `context` positions after the step, the last `new` written by it); pages shuffled over
    the pool, unheld slots NaN; padding rows as the runner pads (token_req pad_to - 1, position
    0, a page out of bounds)."""
    import torch

    dt = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    pages_per = [-(-n // PAGE) for n, _ in runs]
    num_pages = sum(pages_per) + 1
    k = torch.randn(num_pages, PAGE, HKV, D, generator=gen)
    v = torch.randn(num_pages, PAGE, HKV, D, generator=gen)
    k[0] = v[0] = float("nan")  # the null page
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    t = sum(new for _, new in runs)
    t_pad = pad_to or t
    table = torch.zeros(max(len(runs), t_pad), max(width or 0, max(pages_per)), dtype=torch.int32)
    req, pos, used = [], [], 0
    for r, (n, new) in enumerate(runs):
        table[r, :pages_per[r]] = order[used:used + pages_per[r]].to(torch.int32)
        used += pages_per[r]
        for p in range(n, pages_per[r] * PAGE):
            k[table[r, p // PAGE], p % PAGE] = v[table[r, p // PAGE], p % PAGE] = float("nan")
        req += [r] * new
        pos += list(range(n - new, n))
    req += [t_pad - 1] * (t_pad - t)
    pos += [0] * (t_pad - t)
    req, pos = torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)
    page = table[req.long(), (pos // PAGE).long()]
    page = torch.where(page == 0, num_pages, page).to(torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angle = pos[:, None].double() * torch.cat([inv, inv])[None, :]

    def dev(a):
        return a.to(dt).to(DEV) if a.is_floating_point() else a.to(DEV)

    return {name: dev(a) for name, a in dict(
        q=torch.randn(t_pad, HQ, D, generator=gen) * 2, k=torch.randn(t_pad, HKV, D, generator=gen),
        v=torch.randn(t_pad, HKV, D, generator=gen), cos=torch.cos(angle), sin=torch.sin(angle),
        k_pages=k, v_pages=v, page=page, slot=(pos % PAGE).to(torch.int32), table=table,
        req=req, pos=pos).items()}


def two_launches(s, merged):
    from pallas_kernels import triton_attention as ta
    from pallas_kernels import triton_rope_write as trw

    kv = (s["k_pages"].clone(), s["v_pages"].clone())
    q, kv = trw.rope_write_triton_torch(s["q"], s["k"], s["v"], s["cos"], s["sin"], kv,
                                        s["page"], s["slot"], merged=merged)
    out = ta.paged_attention_triton_torch(q, kv, s["table"], s["req"], s["pos"],
                                          scale=D ** -0.5, schedule="split")
    return out, *kv


def one_launch(s, merged, fusion=False):
    """The fused leaf's torch launch; fusion: the control, compiled with fp fusion on."""
    from pallas_kernels import triton_rope_attention as tra

    planned = tra._fused_plan
    if fusion:
        tra._fused_plan = lambda q, k, wide: (lambda c, o: (c, dict(o, enable_fp_fusion=True)))(
            *planned(q, k, wide))
    try:
        kv = (s["k_pages"].clone(), s["v_pages"].clone())
        out, kv = tra.rope_paged_triton_torch(s["q"], s["k"], s["v"], s["cos"], s["sin"], kv,
                                              s["page"], s["slot"], s["table"], s["req"],
                                              s["pos"], scale=D ** -0.5, merged=merged)
    finally:
        tra._fused_plan = planned
    return out, *kv


def differ(a, b) -> list[int]:
    """Elements whose bits differ, per tensor (NaN payloads and zero signs count)."""
    import torch

    def bits(x):
        return x.view(torch.int16 if x.element_size() == 2 else torch.int32)
    return [int((bits(x) != bits(y)).sum()) for x, y in zip(a, b)]


def jax_leaves(s, merged) -> list[int] | str:
    """The engine's JAX launch against the two JAX leaves (outputs and pages), or why not run."""
    try:
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels._triton_launch import import_jax_triton
        import_jax_triton()
    except ImportError as exc:
        return f"skipped: {exc}"
    from pallas_kernels import triton_attention as ta
    from pallas_kernels import triton_rope_attention as tra
    from pallas_kernels import triton_rope_write as trw

    def j(x):
        if x.dtype.is_floating_point:
            return jnp.asarray(x.float().cpu().numpy()).astype(
                jnp.bfloat16 if x.dtype.itemsize == 2 else jnp.float32)
        return jnp.asarray(x.cpu().numpy())
    a = {name: j(x) for name, x in s.items()}
    kv = (a["k_pages"], a["v_pages"])
    fused = tra.rope_paged_triton(a["q"], a["k"], a["v"], a["cos"], a["sin"], kv, a["page"],
                                  a["slot"], a["table"], a["req"], a["pos"], scale=D ** -0.5,
                                  merged=merged, wide=merged)
    q, kv2 = trw.rope_write_triton(a["q"], a["k"], a["v"], a["cos"], a["sin"], kv, a["page"],
                                   a["slot"], merged=merged)
    out = ta.paged_attention_triton(q, kv2, a["table"], a["req"], a["pos"], scale=D ** -0.5)
    left, right = (fused[0], *fused[1]), (out, *kv2)
    return [int((np.asarray(x.astype(jnp.float32)).view(np.uint32)
                 != np.asarray(y.astype(jnp.float32)).view(np.uint32)).sum())
            for x, y in zip(left, right)]


def bits_rows(gen, smoke: bool) -> list[dict]:
    ctx = [256, 257, 258, 16, 17, 33, 64, 65] if not smoke else [256, 257, 17]
    cases = {"decode bs 1 (padded to 16)": ([(1025, 1)], 16),
             "decode bs 16 at boundaries": ([(ctx[i % len(ctx)], 1) for i in range(16)], None),
             "decode bs 32 x ctx 1024": ([(1024 + i % 3, 1) for i in range(32)], None),
             "mixed: chunk across a KV tile": ([(257, 1), (200, 20), (65, 1)], None),
             "mixed: chunk across the split": ([(40, 1), (266, 20), (17, 1)], None)}
    if smoke:
        cases = {name: cases[name] for name in ("decode bs 1 (padded to 16)",
                                                "mixed: chunk across the split")}
        cases["decode bs 1 (padded to 16)"] = ([(257, 1)], 16)
    rows = []
    for name, (runs, pad) in cases.items():
        for dtype in DTYPES:
            for merged in (False, True):
                s = make_step(gen, runs, dtype, pad, None if smoke else ENGINE_WIDTH)
                want = two_launches(s, merged)
                got = differ(one_launch(s, merged), want)
                # the interpreter has no fp fusion: there the control cannot diverge
                control = "skipped: --smoke" if smoke else differ(
                    one_launch(s, merged, fusion=True), want)
                jx = "skipped: --smoke" if smoke else jax_leaves(s, merged)
                rows.append(dict(case=name, dtype=dtype, merged=merged, out_k_v_differ=got,
                                 control_fusion_on_differ=control, jax_out_k_v_differ=jx))
                print(f"{name} {dtype}{' qkv' if merged else ''}: differ {got} (control, fusion "
                      f"on: {control}; JAX leaves: {jx})", flush=True)
    return rows


def launches(s, merged):
    """(one, rope_write, split): closures making each launch on buffers made once -- the tiles
    and partials precomputed, the counters zeroed once (each launch leaves them zero) -- so a
    graph times the kernels alone, as the engine's step runs them."""
    import torch

    from pallas_kernels import triton_attention as ta
    from pallas_kernels import triton_rope_attention as tra
    from pallas_kernels import triton_rope_write as trw
    from pallas_kernels._triton_launch import cdiv, torch_launch
    from pallas_kernels.triton_attention_plan import MERGE_STAGES

    q, k, v = s["q"], s["k"], s["v"]
    t = q.shape[0]
    c, launch = tra._fused_plan(q, s["k_pages"], merged)
    src = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1) if merged \
        else None
    qs, ks, vs = (src, src, src) if merged else (q, k, v)
    kp, vp = s["k_pages"].clone(), s["v_pages"].clone()
    num_pages, width = kp.shape[0], s["table"].shape[1]
    tiles = ta.tiles_torch(s["req"], s["pos"], c["TPP"])
    fresh = tra.fresh_rows_torch(tiles, s["req"], s["pos"], s["page"], num_pages)
    nsplit = cdiv(PAGE * width, c["SPLIT"])
    n = t * HKV * nsplit * c["TPP"] * c["GP"]
    parts = (torch.empty(n, device=DEV), torch.empty(n, device=DEV),
             torch.empty(n, D, device=DEV))
    out, rotated = torch.empty_like(q), torch.empty_like(q)
    sems = torch.zeros(t * HKV, dtype=torch.int32, device=DEV)
    table = (s["table"], s["pos"])
    consts = dict(c, NSPLIT=nsplit, MERGE_STAGES=MERGE_STAGES)

    def one():
        torch_launch(tra.kernels().attention_rope_split_kernel,
                     (qs, ks, vs, s["cos"], s["sin"], s["page"], s["slot"], kp, vp, *table, fresh,
                      num_pages, t, PAGE, width, D ** -0.5, sems),
                     (*parts, out, kp, vp, sems), (t, HKV, nsplit), **launch, **consts,
                     **tra.layout(HQ, HKV, D, merged))

    def rope_write():
        torch_launch(trw.kernels().rope_write_kernel,
                     (qs, ks, vs, s["cos"], s["sin"], s["page"], s["slot"], kp, vp, num_pages,
                      PAGE), (rotated, kp, vp), (t,), num_warps=trw.NUM_WARPS, num_stages=1,
                     enable_fp_fusion=False, **trw._constexprs(q, k, merged))

    def split():
        torch_launch(ta.kernels().attention_split_kernel,
                     (rotated, kp, vp, *table, tiles, t, PAGE, width, D ** -0.5, sems),
                     (*parts, out, sems), (t, HKV, nsplit), **launch, **consts)
    return one, rope_write, split, out


def timing_rows(gen, smoke: bool) -> list[dict]:
    """Device µs of the timed launches, after checking that they compute the same output (the
    closures pass their arguments by hand: a wrong one would time another computation)."""
    from gpu_attention_split import device_us  # the split study's CUDA-graph timing

    rows = []
    for bs in (1, 4) if smoke else (1, 16, 32):
        s = make_step(gen, [(300 if smoke else 1024, 1)] * bs, "bf16", 16 if bs < 16 else None,
                      None if smoke else ENGINE_WIDTH)
        for merged in (False, True):
            one, rope_write, split, out = launches(s, merged)
            one()
            fused = out.clone()
            out.fill_(float("nan"))  # so a launch writing nothing cannot pass
            rope_write()
            split()
            same = differ([fused], [out])[0] == 0
            us = dict(one=float("nan"), two=float("nan"), rope_write=float("nan"),
                      split=float("nan")) if smoke else dict(
                one=device_us(one), two=device_us(lambda: (rope_write(), split())),
                rope_write=device_us(rope_write), split=device_us(split))
            rows.append(dict(bs=bs, merged=merged, same_output=same, **us))
            print(f"bs {bs}{' qkv' if merged else ''}: one launch {us['one']:.2f} us, two "
                  f"{us['two']:.2f} (rope_write {us['rope_write']:.2f} + split "
                  f"{us['split']:.2f}); same output: {same}", flush=True)
    return rows


def main() -> int:
    global HQ, HKV, D, DEV
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/rope_attention")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, small heads")
    args = p.parse_args()
    if args.smoke:  # before the kernels' module is imported: the interpreter is chosen then
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import triton_interpreter  # noqa: F401
        HQ, HKV, D, DEV = 4, 2, 16, "cpu"
    import torch

    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    bits = bits_rows(gen, args.smoke)
    times = timing_rows(gen, args.smoke)
    with open(os.path.join(args.out, "rope_attention.json"), "w") as f:
        json.dump(dict(bits=bits, timings_us=times), f, indent=1)
    with open(os.path.join(args.out, "rope_attention.md"), "w") as f:
        f.write("| case | dtype | q/k/v | out, k, v elements differing (0) | control: fp fusion "
                "on (> 0) | JAX leaves |\n|---|---|---|---|---|---|\n")
        f.writelines(f"| {r['case']} | {r['dtype']} | {'merged' if r['merged'] else 'three'} | "
                     f"{r['out_k_v_differ']} | {r['control_fusion_on_differ']} | "
                     f"{r['jax_out_k_v_differ']} |\n" for r in bits)
        f.write("\n| bs x ctx 1024 | q/k/v | one launch µs | two launches µs (rope_write + "
                "split) | same output |\n|---|---|---|---|---|\n")
        f.writelines(f"| {r['bs']} | {'merged' if r['merged'] else 'three'} | {r['one']:.2f} | "
                     f"{r['two']:.2f} ({r['rope_write']:.2f} + {r['split']:.2f}) | "
                     f"{r['same_output']} |\n" for r in times)
    def run(value):  # a comparison that ran (not skipped)
        return not isinstance(value, str)
    ok = all(sum(r["out_k_v_differ"]) == 0
             and (not run(c := r["control_fusion_on_differ"]) or sum(c) > 0)
             and (not run(j := r["jax_out_k_v_differ"]) or sum(j) == 0) for r in bits) and all(
                 r["same_output"] for r in times)
    print("bits:", "OK" if ok else "FAILED (see the table)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
