"""("attention", "mla_paged") and ("attention", "mla_dense_causal") on the GPU: one Triton source,
two hosts.

The portable leaves (pallas_kernels/mla_attention.py) say what the family computes: multi-query
attention over one latent per position, key = the whole latent [R + P], value = its first R
columns. This form runs it with the dense Triton leaf's algorithm (pallas_kernels/triton_attention.py:
fixed splits of SPLIT positions from position 0, online softmax per split, merged in split order),
with the MLA-specific parts in pallas_kernels/_triton_mla_kernels.py: the heads are the M dimension
of a program's dots (every head reads the same latent, so one read serves them all), the score is
two chained dots (R, then the P rotary columns), and the value columns are cut into blocks so the
accumulator fits. Every tile constant is a function of (heads, R, P) only (`geometry`), so a token's
bits do not depend on its batch, its chunking, or prefill vs decode; the `serial` and `split`
schedules give the same bits, so `schedule_for` may pick by the step's row count.

The dense-causal form (the trainer's [B, S, W] latents) is the same kernel reading each sequence as
one page of S positions, so trainer mode's twin (interop/trainer_mla.py, through the twin table)
and the engine's paged leaf agree bit for bit; the twin is the same source launched from torch.

These bits are *not* the portable `fixed_order` leaf's (pallas_kernels/mla_attention.py): that one
takes one max over the whole context in KV blocks of 16 and multiplies an f32 p by v; this one
merges 256-position splits of 32-position tiles and rounds p to the model dtype for the p . v dot.
That is fine: the CPU keeps the portable bits (the goldens), and on a GPU the rl-bitwise plan and
trainer mode's twin table both pick this leaf, so engine and trainer move together.

Shapes: R (kv_lora_rank, the value width) and P (qk_rope_head_dim) must each be a power of two
>= 16 (tl.arange and tl.dot); any head count works (heads are padded to a power of two and cut into
blocks of at most MAX_HEADS_PER_PROGRAM). The paged leaf declares the two widths as plan
constraints, so another model plans the portable leaf; the dense-causal leaf cannot (trainer mode
plans its twin table before it knows a model), so it raises naming the field instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._triton_launch import (INVARIANT, cdiv, contiguous, dtype_name, jax_launch,
                                           require_cuda_tensors, torch_launch, triton_available)
from pallas_kernels.fixed_order import next_pow2
from pallas_kernels.registry import Priority, register
from pallas_kernels.triton_attention import _dense_as_pages, tiles_jax, tiles_torch
from pallas_kernels.triton_attention_plan import head_dim_supported, schedule_for

FORMATS = {"bf16", "f32"}
BLOCK_N = 32  # KV positions per tile
BLOCK_K = 64  # latent columns per score dot (R is scored in R / BLOCK_K chained dots)
SPLIT = 256  # positions per split; a multiple of BLOCK_N
MIN_ROWS = 16  # tl.dot needs >= 16 rows: fewer (padded) heads are packed with more tokens
# At 128 heads in one program the kernel asks for 237,568 bytes of shared memory on the H200 (the
# limit is 232,448; scripts/gpu_mla_attention.py, first H200 run), so DeepSeek-V3's 128 heads run
# as two blocks of 64 (each reads the latent once; head blocking changes no bit).
MAX_HEADS_PER_PROGRAM = 64
# Value columns per program (the f32 accumulator is ROWS x BV). sm_90 compiles (ptxas -v, no GPU
# needed): 128 heads x 128 columns at 8 warps spill nothing; 16 heads spill under 100 bytes; 256
# columns spill more at either head count.
MAX_VALUE_COLUMNS = 128
NUM_WARPS, NUM_STAGES = 8, 2
# Below xla_native (TUNED + 1) until the H200 shows it faster (scripts/gpu_mla_attention.py reports
# both); rl-bitwise plans it on a GPU either way (xla_native is not batch invariant).
PRIORITY = Priority.TUNED


def kernels():
    from pallas_kernels import _triton_mla_kernels

    return _triton_mla_kernels


def geometry(num_heads: int, v_width: int, rope_width: int) -> dict:
    """Static tile constants for (heads, kv_lora_rank, qk_rope_head_dim). Raises naming the field
    if a width is unsupported."""
    if num_heads < 1:
        raise ValueError(f"mla attention (Triton): num_heads={num_heads} must be >= 1")
    if not head_dim_supported(v_width):
        raise ValueError(f"mla attention (Triton): kv_lora_rank (v_width)={v_width} must be a power "
                         "of two >= 16")
    if not head_dim_supported(rope_width):
        raise ValueError(f"mla attention (Triton): qk_rope_head_dim (latent width - v_width)="
                         f"{rope_width} must be a power of two >= 16")
    bh = min(next_pow2(num_heads), MAX_HEADS_PER_PROGRAM)
    tpp = max(1, MIN_ROWS // bh)
    return dict(H=num_heads, BH=bh, TPP=tpp, R=v_width, P=rope_width,
                BV=min(v_width, MAX_VALUE_COLUMNS), BLOCK_K=min(v_width, BLOCK_K))


def _constexprs(q, latent_pages, v_width: int) -> dict:
    if dtype_name(q.dtype) not in FORMATS:
        raise ValueError(f"mla attention: q.dtype={dtype_name(q.dtype)} must be one of "
                         f"{sorted(FORMATS)}")
    if latent_pages.dtype != q.dtype or latent_pages.shape[-1] != q.shape[-1]:
        raise ValueError(f"mla attention: latent {tuple(latent_pages.shape)} ({latent_pages.dtype}) "
                         f"must have q's width {q.shape[-1]} and dtype {q.dtype}")
    geo = geometry(q.shape[1], v_width, q.shape[-1] - v_width)
    return dict(geo, BLOCK_N=BLOCK_N, SPLIT=SPLIT, IEEE=dtype_name(q.dtype) == "f32")


def _combine_constexprs(c: dict) -> dict:
    return {k: v for k, v in c.items() if k not in ("P", "BLOCK_K", "BLOCK_N", "IEEE")}


def _launches(t: int, page_size: int, table_width: int, c: dict):
    """Grid sizes: head blocks, value blocks, splits, and the partials' row count."""
    hb, vb = cdiv(c["H"], c["BH"]), c["R"] // c["BV"]
    nsplit = cdiv(page_size * table_width, SPLIT)
    return hb, vb, nsplit, t * hb * vb * nsplit * c["TPP"] * c["BH"]


_LAUNCH = dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=False)


# -- JAX host ---------------------------------------------------------------------------------------


def mla_paged_attention_triton(q, latent_pages, block_tables, token_req, positions, *, v_width,
                               scale, schedule: str | None = None):
    """q [T, H, W]; latent_pages [Np, page_size, W]; block_tables [R, P]; token_req, positions [T]
    -> [T, H, v_width]."""
    c = _constexprs(q, latent_pages, v_width)
    t = q.shape[0]
    page_size, width = latent_pages.shape[1], block_tables.shape[1]
    positions = positions.astype(jnp.int32)
    tiles = tiles_jax(token_req, positions, c["TPP"])
    inputs = (q, latent_pages, block_tables.astype(jnp.int32), positions, tiles, t, page_size,
              width, np.float32(scale))
    out = jax.ShapeDtypeStruct((t, q.shape[1], v_width), q.dtype)
    k = kernels()
    hb, vb, nsplit, n = _launches(t, page_size, width, c)
    if (schedule or schedule_for(t)) == "serial":
        return jax_launch(k.mla_serial_kernel, inputs, out, (t, hb, vb), **_LAUNCH, **c)
    parts = jax_launch(k.mla_split_kernel, inputs,
                       (jax.ShapeDtypeStruct((n,), jnp.float32),
                        jax.ShapeDtypeStruct((n,), jnp.float32),
                        jax.ShapeDtypeStruct((n, c["BV"]), jnp.float32)),
                       (t, hb * vb, nsplit), **_LAUNCH, **c, HB=hb, NSPLIT=nsplit)
    return jax_launch(k.mla_combine_kernel, (positions, tiles, t, *parts), out, (t, hb, vb),
                      **_LAUNCH, **_combine_constexprs(c), HB=hb, NSPLIT=nsplit)


def mla_dense_causal_attention_triton(q, latent, *, v_width, scale, schedule: str | None = None):
    """q [B, S, H, W], latent [B, S, W] -> [B, S, H, v_width]; query i attends to 0..i."""
    b, s, h, w = q.shape
    token_req, positions, table = _dense_as_pages(b, s)
    out = mla_paged_attention_triton(q.reshape(b * s, h, w), latent, jnp.asarray(table),
                                     jnp.asarray(token_req), jnp.asarray(positions),
                                     v_width=v_width, scale=scale, schedule=schedule)
    return out.reshape(b, s, h, v_width)


# -- torch host (the trainer's twin) ---------------------------------------------------------------


def mla_paged_attention_triton_torch(q, latent_pages, block_tables, token_req, positions, *,
                                     v_width, scale, schedule: str | None = None):
    """The same kernels launched on torch tensors (CUDA; CPU under TRITON_INTERPRET=1)."""
    import torch

    c = _constexprs(q, latent_pages, v_width)
    require_cuda_tensors("mla_paged_attention_triton_torch", q, latent_pages, block_tables)
    q, latent_pages = contiguous(q), contiguous(latent_pages)
    block_tables = contiguous(block_tables.to(torch.int32))
    positions = contiguous(positions.to(torch.int32))
    t = q.shape[0]
    page_size, width = latent_pages.shape[1], block_tables.shape[1]
    out = torch.empty((t, q.shape[1], v_width), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    tiles = tiles_torch(token_req, positions, c["TPP"])
    inputs = (q, latent_pages, block_tables, positions, tiles, t, page_size, width, float(scale))
    k = kernels()
    hb, vb, nsplit, n = _launches(t, page_size, width, c)
    if (schedule or schedule_for(t)) == "serial":
        torch_launch(k.mla_serial_kernel, inputs, (out,), (t, hb, vb), **_LAUNCH, **c)
        return out
    parts = (torch.empty(n, dtype=torch.float32, device=q.device),
             torch.empty(n, dtype=torch.float32, device=q.device),
             torch.empty(n, c["BV"], dtype=torch.float32, device=q.device))
    torch_launch(k.mla_split_kernel, inputs, parts, (t, hb * vb, nsplit), **_LAUNCH, **c, HB=hb,
                 NSPLIT=nsplit)
    torch_launch(k.mla_combine_kernel, (positions, tiles, t, *parts), (out,), (t, hb, vb),
                 **_LAUNCH, **_combine_constexprs(c), HB=hb, NSPLIT=nsplit)
    return out


def mla_dense_causal_attention_triton_torch(q, latent, *, v_width, scale,
                                            schedule: str | None = None):
    """The trainer's twin of mla_dense_causal_attention_triton (same kernels, torch tensors)."""
    import torch

    b, s, h, w = q.shape
    token_req, positions, table = (torch.from_numpy(a).to(q.device) for a in _dense_as_pages(b, s))
    out = mla_paged_attention_triton_torch(q.reshape(b * s, h, w), latent, table, token_req,
                                           positions, v_width=v_width, scale=scale,
                                           schedule=schedule)
    return out.reshape(b, s, h, v_width)


if triton_available():
    register("attention", "mla_paged", "triton_fixed_split", formats=FORMATS, hardware={"gpu"},
             priority=PRIORITY, constraints={"kv_lora_rank": head_dim_supported,
                                             "qk_rope_head_dim": head_dim_supported},
             **INVARIANT)(mla_paged_attention_triton)
    register("attention", "mla_dense_causal", "triton_fixed_split", formats=FORMATS,
             hardware={"gpu"}, priority=PRIORITY, **INVARIANT)(mla_dense_causal_attention_triton)
