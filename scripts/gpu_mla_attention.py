"""The Triton absorbed-MLA leaf on the GPU: bitwise checks at DeepSeek's widths, and decode timings.

    python scripts/gpu_mla_attention.py [--out DIR] [--skip-checks] [--skip-timing]

Bitwise (float bits; bf16; kv_lora_rank 512, rope 64; 16 and 128 heads; one request of 1k and of
4k positions on shuffled 16-slot pages, unused slots NaN, beside 63 other requests):
  paged prefill == the trainer's dense-causal form; JAX launch == torch launch (paged, both
  schedules, and dense-causal); serial == split schedule; a decode row alone == its prefill row at
  positions across splits; the last rows chunked by 64 and co-batched == prefill; a decode row
  packed among 63 other requests' rows (a bs-64 step) == alone.
Negative control: SPLIT 256 -> 128 must change bits.
Plans: the engine's MLA plan and trainer mode's twin table pick the Triton leaf on this GPU.
Timing (median of 20 after warm-up): the paged leaf at decode, bs 64, ctx 1k and 4k, Triton vs the
portable fixed_order and xla_native leaves, as microseconds and achieved bytes/s of latent read
(bs x ctx x 576 x 2 bytes; the H200 streams ~4.8e12 B/s).
Writes mla_attention.json and mla_attention.md to --out; exits 1 if a bitwise check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import mla_attention as portable  # noqa: E402
from pallas_kernels import triton_mla_attention as tm  # noqa: E402
from pallas_kernels._triton_launch import bits  # noqa: E402

R, P, PAGE, BATCH = 512, 64, 16, 64
W = R + P
SCALE = (128 + P) ** -0.5  # DeepSeek-V3's qk_head_dim ** -0.5 (no YaRN mscale)
HEADS, CONTEXTS = (16, 128), (1024, 4096)


def differ(a, b) -> int:
    a, b = bits(a), bits(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.count_nonzero(a != b))


class Case:
    """BATCH requests of `ctx` positions each on shuffled pages (request 0 is the one checked)."""

    def __init__(self, heads: int, ctx: int, seed: int = 0):
        self.heads, self.ctx = heads, ctx
        pages = ctx // PAGE
        num_pages = BATCH * pages + 9
        order = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
        self.tables = order[:BATCH * pages].reshape(BATCH, pages).astype(np.int32)
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        lat = jax.random.normal(k1, (BATCH, ctx, W), jnp.float32).astype(jnp.bfloat16)
        pool = jnp.full((num_pages, PAGE, W), jnp.nan, jnp.bfloat16)
        self.pool = pool.at[self.tables.reshape(-1)].set(lat.reshape(-1, PAGE, W))
        self.latent0 = lat[0]
        self.q0 = (jax.random.normal(k2, (ctx, heads, W), jnp.float32) * 2).astype(jnp.bfloat16)
        self.q_decode = jax.random.normal(k3, (BATCH, heads, W), jnp.float32).astype(jnp.bfloat16)

    def rows(self, rows):
        """[(request, position)] -> (q, block_tables, token_req, positions): request 0's rows
        take q0[position], the others their decode query."""
        req = np.asarray([r for r, _ in rows], np.int32)
        pos = np.asarray([p for _, p in rows], np.int32)
        q = jnp.where(jnp.asarray(req == 0)[:, None, None], self.q0[pos], self.q_decode[req])
        return q, jnp.asarray(self.tables), jnp.asarray(req), jnp.asarray(pos)

    def jax(self, rows, **kw):
        q, tables, req, pos = self.rows(rows)
        return tm.mla_paged_attention_triton(q, self.pool, tables, req, pos, v_width=R,
                                             scale=SCALE, **kw)

    def torch(self, rows, **kw):
        import torch

        t = torch.from_dlpack
        q, tables, req, pos = self.rows(rows)
        out = tm.mla_paged_attention_triton_torch(t(q), t(self.pool), t(tables), t(req), t(pos),
                                                  v_width=R, scale=SCALE, **kw)
        torch.cuda.synchronize()
        return out


def checks(heads: int, ctx: int) -> list[dict]:
    import torch

    c = Case(heads, ctx)
    label = f"h={heads} ctx={ctx}"
    res = []

    def add(name, n, expect_zero=True):
        res.append(dict(geometry=label, check=name, differing=n,
                        ok=(n == 0) if expect_zero else (n > 0)))

    every = [(0, p) for p in range(ctx)]
    prefill = c.jax(every)  # serial (more than 32 rows)
    dense = tm.mla_dense_causal_attention_triton(c.q0[None], c.latent0[None], v_width=R,
                                                 scale=SCALE)[0]
    add("paged prefill == dense-causal (JAX)", differ(prefill, dense))
    dense_t = tm.mla_dense_causal_attention_triton_torch(
        torch.from_dlpack(c.q0)[None], torch.from_dlpack(c.latent0)[None], v_width=R, scale=SCALE)
    add("dense-causal JAX == torch launch", differ(dense, dense_t[0]))
    add("paged prefill JAX == torch launch (serial)", differ(prefill, c.torch(every)))
    tail = [(0, p) for p in range(ctx - 48, ctx)]
    add("serial == split (JAX, last 48 rows)",
        differ(c.jax(tail, schedule="serial"), c.jax(tail, schedule="split")))
    add("JAX == torch launch (split, last 48 rows)",
        differ(c.jax(tail, schedule="split"), c.torch(tail, schedule="split")))
    positions = [0, 1, 255, 256, 257, ctx // 2, ctx - 1]
    alone = jnp.concatenate([c.jax([(0, p)]) for p in positions])
    add(f"decode rows alone == prefill at {positions}", differ(alone, prefill[jnp.asarray(positions)]))
    pieces = []
    for start in range(ctx - 128, ctx, 64):
        pieces.append(c.jax([(BATCH - 1, ctx - 1)] + [(0, p) for p in range(start, start + 64)])[1:])
    add("last 128 rows chunked by 64, co-batched == prefill",
        differ(jnp.concatenate(pieces), prefill[ctx - 128:]))
    others = [(r, ctx - 1) for r in range(1, BATCH)]
    mid = len(others) // 2
    packed = c.jax(others[:mid] + [(0, ctx - 1)] + others[mid:])
    add(f"a decode row in a bs-{BATCH} step == alone", differ(packed[mid], alone[-1]))
    first = others[:min(mid, 4)]
    add(f"a bs-{BATCH} step's first {len(first)} rows == alone",
        differ(packed[:len(first)], jnp.concatenate([c.jax([row]) for row in first])))
    split = tm.SPLIT
    try:
        tm.SPLIT = 128
        add("negative control: SPLIT 128 changes the last rows", differ(c.jax(tail), prefill[-48:]),
            expect_zero=False)
    finally:
        tm.SPLIT = split
    ref = reference(c, ctx - 1)
    got = np.asarray(prefill[-1].astype(jnp.float32), np.float64)
    res.append(dict(geometry=label, check="relative L2 error, last row vs float64 (< 2e-2)",
                    differing=float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                    ok=bool(np.linalg.norm(got - ref) < 2e-2 * np.linalg.norm(ref))))
    return res


def reference(c: Case, pos: int) -> np.ndarray:
    lat = np.asarray(c.latent0[:pos + 1].astype(jnp.float32), np.float64)
    q = np.asarray(c.q0[pos].astype(jnp.float32), np.float64)
    s = q @ lat.T * SCALE
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ lat[:, :R]


def plans() -> list[dict]:
    from interop.twins import plan_twin_table
    from jengine.models.mla_decoder import ModelKernels

    res = []
    for hardware in ("gpu", "gpu-sm90"):
        plan = ModelKernels.plan_for(dtype=jnp.bfloat16, hardware=hardware,
                                     features=frozenset({"batch_invariant"}), head_dim=P,
                                     kv_lora_rank=R).mla_attention
        res.append(dict(geometry=hardware, check=f"engine's MLA plan: {plan.leaf.impl}", differing=0,
                        ok=plan.leaf.impl == "triton_fixed_split"))
    twin = plan_twin_table("cuda", "bf16").provenance["mla_attention"]
    res.append(dict(geometry="cuda", check=f"twin table: {twin}", differing=0,
                    ok="triton_mla_attention" in twin))
    return res


def median_us(f, iters=20) -> float:
    jax.block_until_ready(f())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def timings() -> list[dict]:
    leaves = {"triton": tm.mla_paged_attention_triton,
              "fixed_order": portable.mla_paged_fixed_order,
              "xla_native": portable.mla_paged_xla_native}
    res = []
    for heads in HEADS:
        for ctx in CONTEXTS:
            c = Case(heads, ctx, seed=1)
            q, tables, req, pos = c.rows([(r, ctx - 1) for r in range(BATCH)])
            latent_bytes = BATCH * ctx * W * 2
            for name, fn in leaves.items():
                step = jax.jit(lambda q, pool, fn=fn: fn(q, pool, tables, req, pos, v_width=R,
                                                         scale=SCALE))
                try:
                    us = median_us(lambda: step(q, c.pool))
                except Exception as exc:  # noqa: BLE001 - one leaf failing must not hide the rest
                    res.append(dict(heads=heads, ctx=ctx, leaf=name, error=str(exc)[:200]))
                    continue
                res.append(dict(heads=heads, ctx=ctx, leaf=name, us=round(us, 1),
                                latent_bytes_per_s=latent_bytes / (us * 1e-6)))
            del c
    return res


def markdown(check_rows, timing_rows) -> str:
    lines = ["| geometry | check | differing | ok |", "|---|---|---|---|"]
    lines += [f"| {r['geometry']} | {r['check']} | {r['differing']} | {r['ok']} |"
              for r in check_rows]
    lines += ["", f"Decode, bs {BATCH}, latent {W} bf16 (us; achieved bytes/s of latent read):", "",
              "| heads | ctx | leaf | us | latent B/s |", "|---|---|---|---|---|"]
    for r in timing_rows:
        if "error" in r:
            lines.append(f"| {r['heads']} | {r['ctx']} | {r['leaf']} | error: {r['error']} | |")
        else:
            lines.append(f"| {r['heads']} | {r['ctx']} | {r['leaf']} | {r['us']} | "
                         f"{r['latent_bytes_per_s']:.3g} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args()
    check_rows, timing_rows = [], []
    if not args.skip_checks:
        check_rows += plans()
        for heads in HEADS:
            for ctx in CONTEXTS:
                try:
                    rows = checks(heads, ctx)
                except Exception as exc:  # one geometry's failure is a row, not a lost run
                    rows = [dict(geometry=f"h={heads} ctx={ctx}", check="ran",
                                 differing=f"{type(exc).__name__}: {str(exc)[:160]}", ok=False)]
                check_rows += rows
                for r in rows:
                    print(f"| {r['geometry']} | {r['check']} | {r['differing']} | {r['ok']} |",
                          flush=True)
    if not args.skip_timing:
        timing_rows = timings()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mla_attention.json"), "w") as f:
        json.dump(dict(checks=check_rows, timings=timing_rows), f, indent=1)
    text = markdown(check_rows, timing_rows)
    with open(os.path.join(args.out, "mla_attention.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(r["ok"] for r in check_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
