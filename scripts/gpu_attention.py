"""The Triton attention leaf on the GPU: bitwise checks, accuracy, and per-layer timings.

    python scripts/gpu_attention.py [--out DIR] [--skip-timing]

Bitwise (float bits, bf16 and f32, Llama-3-8B heads 32/8/128 and the tiny model's 4/2/16, 16-token
pages shuffled over the pool, unused slots NaN):
  serial == split schedule (JAX launch); JAX launch == torch launch (both schedules);
  a request's rows alone == chunked (1, 7, 16 tokens) == packed with other requests' rows;
  a decode row alone == the same row in a 256-row decode step; dense-causal twin == paged form.
Negative controls: SPLIT 256 -> 64 must change bits; XLA's own attention (the auto leaf) computed
alone vs packed is reported (its divergence is not guaranteed, so it is informational).
Accuracy: relative L2 error against a float64 reference. --numerics auto's wide-tile leaf
(triton_wide_prefill): JAX == torch launch, its error, and how many rows differ from the engine's
launch (information: it is not batch-invariant).
Timing (median of 10 after warm-up; per layer = one jit over 8 distinct KV pools / 8; ctx 1024): decode at batch 1/16/64/256 for the
serial and split schedules and the XLA leaves; prefill of 4096 tokens (serial).
Writes attention.json and attention.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import attention as xla_attention  # noqa: E402
from pallas_kernels import triton_attention as ta  # noqa: E402
from pallas_kernels import triton_attention_plan as tap  # noqa: E402
from pallas_kernels._triton_launch import bits  # noqa: E402

PAGE = 16


def differ(a, b) -> int:
    a, b = bits(a), bits(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.count_nonzero(a != b))


def make_pool(rng, lengths, hkv, d, dtype, spare_pages=8):
    need = sum(-(-n // PAGE) for n in lengths) + spare_pages + 1
    k = np.full((need, PAGE, hkv, d), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    free = list(rng.permutation(np.arange(1, need)))
    width = max(-(-n // PAGE) for n in lengths)
    tables = []
    for n in lengths:
        pages = [int(free.pop()) for _ in range(-(-n // PAGE))]
        for pos in range(n):
            k[pages[pos // PAGE], pos % PAGE] = rng.standard_normal((hkv, d))
            v[pages[pos // PAGE], pos % PAGE] = rng.standard_normal((hkv, d))
        tables.append(pages + [0] * (width - len(pages)))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), np.asarray(tables, np.int32)


def run(fn, q_all, pool, rows, **kw):
    """rows: (request, position) in step order -> [T, Hq, D]."""
    k, v, table = pool
    req = np.asarray([r for r, _ in rows], np.int32)
    pos = np.asarray([p for _, p in rows], np.int32)
    q = jnp.stack([q_all[r][p] for r, p in rows])
    return fn(q, (k, v), jnp.asarray(table), jnp.asarray(req), jnp.asarray(pos), **kw)


def torch_run(q_all, pool, rows, **kw):
    import torch

    k, v, table = pool
    req = torch.tensor([r for r, _ in rows], dtype=torch.int32, device="cuda")
    pos = torch.tensor([p for _, p in rows], dtype=torch.int32, device="cuda")
    q = jnp.stack([q_all[r][p] for r, p in rows])
    t = lambda x: torch.from_dlpack(x)  # noqa: E731
    out = ta.paged_attention_triton_torch(t(q), (t(k), t(v)), torch.from_numpy(table).cuda(), req, pos,
                                          **kw)
    torch.cuda.synchronize()
    return jnp.asarray(out.float().cpu().numpy()).astype(q.dtype)


def reference(q_all, pool_np, lengths, rows, hq, hkv, scale):
    k, v, table = pool_np
    outs = []
    for r, p in rows:
        kk = np.stack([k[table[r][c // PAGE], c % PAGE] for c in range(p + 1)]).astype(np.float64)
        vv = np.stack([v[table[r][c // PAGE], c % PAGE] for c in range(p + 1)]).astype(np.float64)
        kk, vv = np.repeat(kk, hq // hkv, 1), np.repeat(vv, hq // hkv, 1)
        qq = np.asarray(q_all[r][p].astype(jnp.float32), np.float64)
        s = np.einsum("hd,chd->hc", qq, kk) * scale
        e = np.exp(s - s.max(-1, keepdims=True))
        outs.append(np.einsum("hc,chd->hd", e / e.sum(-1, keepdims=True), vv))
    return np.stack(outs)


def checks(hq, hkv, d, dtype, label) -> list[dict]:
    rng = np.random.default_rng(hq * 1000 + d)
    lengths = [1, 17, 300, 1030, 2100]
    pool = make_pool(rng, lengths, hkv, d, dtype)
    q_all = [jnp.asarray(rng.standard_normal((n, hq, d)), dtype) for n in lengths]
    scale = d ** -0.5
    fn = ta.paged_attention_triton
    res = []

    def add(name, n, expect_zero=True):
        res.append(dict(geometry=label, check=name, differing=n,
                        ok=(n == 0) if expect_zero else (n > 0)))

    every = [(r, p) for r, n in enumerate(lengths) for p in range(n)]
    serial = run(fn, q_all, pool, every, scale=scale, schedule="serial")
    split = run(fn, q_all, pool, every, scale=scale, schedule="split")
    add("serial == split (JAX, every row of 5 requests)", differ(serial, split))
    some = [(3, p) for p in range(1000, 1030)] + [(4, 2099), (0, 0), (2, 299)]
    for sched in ("serial", "split"):
        add(f"JAX == torch launch ({sched})",
            differ(run(fn, q_all, pool, some, scale=scale, schedule=sched),
                   torch_run(q_all, pool, some, scale=scale, schedule=sched)))
    whole_rows = [(3, p) for p in range(966, 1030)]
    whole = run(fn, q_all, pool, whole_rows, scale=scale)
    for chunk in (1, 7, 16):
        pieces = []
        for start in range(966, 1030, chunk):
            mine = [(3, p) for p in range(start, min(start + chunk, 1030))]
            rows = [(4, 2000 + start % 50)] + mine + [(1, 16), (2, start % 300)]
            pieces.append(run(fn, q_all, pool, rows, scale=scale)[1:1 + len(mine)])
        add(f"chunked by {chunk} + co-batched == whole", differ(whole, jnp.concatenate(pieces)))
    decode_rows = [(int(rng.integers(0, 5)), 0) for _ in range(255)]
    decode_rows = [(r, int(rng.integers(0, lengths[r]))) for r, _ in decode_rows]
    alone = run(fn, q_all, pool, [(4, 2099)], scale=scale)
    packed = run(fn, q_all, pool, decode_rows[:100] + [(4, 2099)] + decode_rows[100:], scale=scale)
    add("decode row alone == in a 256-row step", differ(alone[0], packed[100]))
    import torch

    kk = np.asarray(pool[0].astype(jnp.float32))
    dense_k = np.stack([kk[pool[2][3][c // PAGE], c % PAGE] for c in range(1030)])[None]
    dense_v = np.stack([np.asarray(pool[1].astype(jnp.float32))[pool[2][3][c // PAGE], c % PAGE]
                        for c in range(1030)])[None]
    tdt = {jnp.bfloat16: torch.bfloat16, jnp.float32: torch.float32}[dtype]
    dense = ta.dense_causal_attention_triton_torch(
        torch.from_dlpack(q_all[3][None]), torch.from_numpy(dense_k).to(tdt).cuda(),
        torch.from_numpy(dense_v).to(tdt).cuda(), scale=scale)
    paged = run(fn, q_all, pool, [(3, p) for p in range(1030)], scale=scale)
    add("dense-causal twin (torch) == paged (JAX)",
        differ(jnp.asarray(dense[0].float().cpu().numpy()).astype(dtype), paged))
    # Negative controls.
    add("NEGATIVE: SPLIT 64 instead of 256 changes bits",
        differ(run(fn, q_all, pool, some, scale=scale), _with_split(64, fn, q_all, pool, some, scale)),
        expect_zero=False)
    xa_alone = run(xla_attention.paged_xla_native, q_all, pool, [(4, 2099)], scale=scale)
    xa_packed = run(xla_attention.paged_xla_native, q_all, pool,
                    decode_rows[:100] + [(4, 2099)] + decode_rows[100:], scale=scale)
    res.append(dict(geometry=label, check="info: XLA native attention alone vs packed",
                    differing=differ(xa_alone[0], xa_packed[100]), ok=True))
    # Accuracy.
    pool_np = (np.asarray(pool[0].astype(jnp.float32)), np.asarray(pool[1].astype(jnp.float32)), pool[2])
    ref = reference(q_all, pool_np, lengths, some, hq, hkv, scale)
    out = np.asarray(run(fn, q_all, pool, some, scale=scale).astype(jnp.float32), np.float64)
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5  # bf16 output rounding (2^-9) and bf16 p . v
    res.append(dict(geometry=label, check=f"rel. L2 error vs float64 (tol {tol})", differing=err,
                    ok=err <= tol))
    # --numerics auto's leaf (triton_wide_prefill): WIDE_ROWS rows per program on this
    # 3448-row step. Deterministic, not batch-invariant: its rows against the engine's launch are
    # information, its two launches must agree and its error must be the leaf's.
    wide = run(ta.paged_attention_triton_wide, q_all, pool, every, scale=scale)
    add("auto wide tile: JAX == torch launch (every row)",
        differ(wide, torch_run(q_all, pool, every, scale=scale, wide=True)))
    res.append(dict(geometry=label, check="info: auto wide tile vs the engine's launch (tokens, any head)",
                    differing=int((bits(wide) != bits(serial)).reshape(len(every), -1).any(1).sum()),
                    ok=True))
    at = {row: i for i, row in enumerate(every)}
    wide_some = np.asarray(wide[np.asarray([at[row] for row in some])].astype(jnp.float32), np.float64)
    err = float(np.linalg.norm(wide_some - ref) / np.linalg.norm(ref))
    res.append(dict(geometry=label, check=f"auto wide tile: rel. L2 error vs float64 (tol {tol})",
                    differing=err, ok=err <= tol))
    return res


def _with_split(split, fn, q_all, pool, rows, scale):
    old, tap.SPLIT = tap.SPLIT, split
    try:
        return run(fn, q_all, pool, rows, scale=scale)
    finally:
        tap.SPLIT = old


def median_ms(f, iters=10):
    from jengine.bench.common import _median_time

    return _median_time(f, iters, warmup=1, sync=jax.block_until_ready) * 1e3


LAYERS = 8  # distinct KV pools per timed call, as in a model step (no L2 reuse between calls)


def timings() -> list[dict]:
    """Per-layer ms: one jit runs the leaf over LAYERS distinct KV pools; median / LAYERS."""
    rng = np.random.default_rng(0)
    hq, hkv, d, ctx = 32, 8, 128, 1024
    out = []
    for bs in (1, 16, 64, 256):
        pages = -(-(ctx + 1) // PAGE)
        num_pages = bs * pages + 1
        ks = [jnp.asarray(rng.standard_normal((num_pages, PAGE, hkv, d)), jnp.bfloat16)
              for _ in range(LAYERS)]
        vs = [jnp.asarray(rng.standard_normal((num_pages, PAGE, hkv, d)), jnp.bfloat16)
              for _ in range(LAYERS)]
        table = jnp.asarray(1 + np.arange(bs * pages, dtype=np.int32).reshape(bs, pages))
        t = max(16, bs)
        table = jnp.pad(table, ((0, t - bs), (0, 128 - pages)))
        q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
        req = jnp.asarray(np.concatenate([np.arange(bs), np.full(t - bs, t - 1)]), jnp.int32)
        pos = jnp.asarray(np.concatenate([np.full(bs, ctx), np.zeros(t - bs)]), jnp.int32)
        kv_bytes = bs * (ctx + 1) * hkv * d * 2 * 2
        impls = {"triton serial": lambda *a, **kw: ta.paged_attention_triton(*a, **kw, schedule="serial"),
                 "triton split": lambda *a, **kw: ta.paged_attention_triton(*a, **kw, schedule="split"),
                 "xla native": xla_attention.paged_xla_native}
        if bs <= 16:
            impls["xla fixed_order"] = xla_attention.paged_fixed_order
        for name, fn in impls.items():
            f = jax.jit(lambda q, ks, vs, tb, rq, ps, fn=fn: [fn(q, (k, v), tb, rq, ps, scale=d ** -0.5)
                                                              for k, v in zip(ks, vs)])
            try:
                ms = median_ms(lambda: f(q, ks, vs, table, req, pos)) / LAYERS
                out.append(dict(case=f"decode bs {bs} ctx {ctx}", impl=name, ms=ms,
                                kv_TBps=kv_bytes / (ms * 1e-3) / 1e12))
            except Exception as exc:  # noqa: BLE001 - report, keep timing the others
                out.append(dict(case=f"decode bs {bs} ctx {ctx}", impl=name, error=repr(exc)[:200]))
            print(out[-1], flush=True)
        del ks, vs
    n = 4096
    k = jnp.asarray(rng.standard_normal((n // PAGE + 1, PAGE, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((n // PAGE + 1, PAGE, hkv, d)), jnp.bfloat16)
    table = jnp.asarray(1 + np.arange(n // PAGE, dtype=np.int32))[None]
    table = jnp.pad(table, ((0, n - 1), (0, 0)))
    q = jnp.asarray(rng.standard_normal((n, hq, d)), jnp.bfloat16)
    flops = 4 * hq * d * n * (n + 1) / 2
    for name, fn in (("triton serial", ta.paged_attention_triton),
                     ("triton wide (auto)", ta.paged_attention_triton_wide)):
        f = jax.jit(lambda q, k, v, tb, fn=fn: fn(
            q, (k, v), tb, jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32), scale=d ** -0.5))
        ms = median_ms(lambda: f(q, k, v, table), iters=5)
        out.append(dict(case=f"prefill {n}", impl=name, ms=ms, TFLOPs=flops / (ms * 1e-3) / 1e12))
        print(out[-1], flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-checks", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    geometries = () if args.skip_checks else (
        (32, 8, 128, jnp.bfloat16, "32/8/128 bf16"), (4, 2, 16, jnp.bfloat16, "4/2/16 bf16"),
        (32, 8, 128, jnp.float32, "32/8/128 f32"))
    for hq, hkv, d, dtype, label in geometries:
        new = checks(hq, hkv, d, dtype, label)
        results += new
        for r in new:
            print(r, flush=True)
    times = [] if args.skip_timing else timings()
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump({"checks": results, "timings": times}, f, indent=1, default=str)
    lines = ["| geometry | check | differing / error | ok |", "|---|---|---|---|"]
    lines += [f"| {r['geometry']} | {r['check']} | {r['differing']} | {'PASS' if r['ok'] else 'FAIL'} |"
              for r in results]
    lines += ["", "| case | impl | ms | KV TB/s or TFLOP/s |", "|---|---|---|---|"]
    lines += [f"| {t['case']} | {t['impl']} | {t.get('ms', t.get('error'))} | "
              f"{t.get('kv_TBps', t.get('TFLOPs', ''))} |" for t in times]
    md = "\n".join(lines)
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
