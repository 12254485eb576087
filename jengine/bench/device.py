"""Parts `roofline` (HBM copy, bf16 GEMM peak) and `leaves` (every projection GEMM, auto's XLA dot
vs rl-bitwise's Triton tile, at each M)."""

from __future__ import annotations

from jengine.bench.common import LLAMA3_8B, PADDED_VOCAB, _checkpoint, _median_time


def part_roofline(args) -> dict:
    import jax
    import jax.numpy as jnp

    out = {}
    x = jnp.ones((2**31 // 2,), jnp.bfloat16) * 1.5  # 2 GiB... doubled below to 4 GiB
    x = jnp.concatenate([x, x])
    bump = jax.jit(lambda a: a + jnp.bfloat16(1))  # one read + one write of every byte
    t = _median_time(lambda: bump(x).block_until_ready(), args.iters)
    out["jax_elementwise_copy_TBps"] = 2 * x.nbytes / t / 1e12
    del x
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t = _median_time(lambda: mm(a, b).block_until_ready(), args.iters)
    out["jax_gemm_bf16_TFLOPs"] = 2 * 8192**3 / t / 1e12
    try:
        import torch
        import triton

        src = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
        out["torch_copy_TBps"] = 2 * src.numel() * 2 / (ms * 1e-3) / 1e12
        del src, dst
        ta = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        tb = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ms = triton.testing.do_bench(lambda: ta @ tb, warmup=50, rep=200, return_mode="median")
        out["torch_gemm_bf16_TFLOPs"] = 2 * 8192**3 / (ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001 - torch is optional on the bench machine
        out["torch_error"] = repr(exc)[:200]
    out["hbm_TBps"] = max(v for k, v in out.items() if k.endswith("TBps"))
    out["gemm_TFLOPs"] = max(v for k, v in out.items() if k.endswith("TFLOPs"))
    return out


def _layer_shapes(vocab: int) -> dict:
    h, i, kv = 4096, 14336, 8 * 128
    return {"q/o_proj": (h, h, 2), "k/v_proj": (kv, h, 2), "gate/up_proj": (i, h, 2),
            "down_proj": (h, i, 1), "lm_head": (vocab, h, 0)}  # (N, K, uses per layer)


def part_leaves(args) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gemm import gemm_xla_native
    from pallas_kernels.triton_gemm import gemm_triton, tile_for

    from pallas_kernels.triton_gemm import GemmTile

    impls = {"auto (XLA dot)": gemm_xla_native, "rl-bitwise (Triton fixed tile)": gemm_triton}
    # Extra tiles (BM,BN,BK,GROUP_M,WARPS,STAGES) timed on the projection shapes, through the very
    # path the model uses (jax-triton inside jit): the data behind the tile tables
    # (pallas_kernels/triton_gemm_tiles.json).
    extra = {}
    for spec in args.tile_candidates or ():  # "BM,BN,BK,G,W,S[,KSPLIT][:split|:serial]"
        fields, _, schedule = spec.partition(":")
        tile = GemmTile(*map(int, fields.split(",")))
        label = "Triton " + tile.describe() + (f" {schedule} at every M" if schedule else "")
        extra[label] = (lambda x, w, out_dtype, tile=tile, schedule=schedule or None:
                        gemm_triton(x, w, out_dtype=out_dtype, tile=tile, schedule=schedule))
    out = {"per_gemm_us": {}, "tiles": {}}
    for vocab_label, vocab in (("auto", LLAMA3_8B["vocab_size"]), ("rl-bitwise", PADDED_VOCAB)):
        for name, (n, k, _) in _layer_shapes(vocab).items():
            if name != "lm_head" and vocab_label == "rl-bitwise":
                continue
            if args.leaf_shapes and name not in args.leaf_shapes:
                continue
            label = f"{name} N={n} K={k}"
            out["tiles"][label] = tile_for(n, k, jnp.bfloat16).describe()
            layers = max(2, min(32, (2**31) // (n * k * 2)))  # >= 2 GiB of distinct weights
            keys = jax.random.split(jax.random.key(n + k), layers)
            ws = [jax.random.normal(kk, (k, n), jnp.bfloat16) * (k ** -0.5) for kk in keys]
            todo = dict(impls, **(extra if name != "lm_head" else {}))
            for impl_name, fn in todo.items():
                for m in args.rows:
                    x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                    chain = jax.jit(lambda x, ws, fn=fn: tuple(fn(x, w, out_dtype=jnp.bfloat16)
                                                             for w in ws))
                    t = _median_time(lambda: chain(x, ws), args.iters, back_to_back=3,
                                     sync=jax.block_until_ready)
                    out["per_gemm_us"].setdefault(label, {}).setdefault(impl_name, {})[m] = (
                        t / layers * 1e6)
                    _checkpoint(args, out)
            del ws
    # GEMM share of one decode/prefill step: 32 layers of projections + the LM head.
    step = {}
    for impl_name, vocab in (("auto (XLA dot)", LLAMA3_8B["vocab_size"]),
                             ("rl-bitwise (Triton fixed tile)", PADDED_VOCAB)):
        for m in args.rows:
            total = 0.0
            if args.leaf_shapes:  # a partial sweep has no whole step to add up
                break
            for name, (n, k, uses) in _layer_shapes(vocab).items():
                per = out["per_gemm_us"][f"{name} N={n} K={k}"][impl_name][m]
                total += per * (uses * 32 if uses else 1)
            step.setdefault(impl_name, {})[m] = total
    out["step_gemm_us"] = step
    return out
