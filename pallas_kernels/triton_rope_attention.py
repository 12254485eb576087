"""("attention", "rope_paged") on the GPU: RoPE and the KV write inside the split attention launch
(planned by default; pallas_kernels/rope_attention.py says how a model plans it).

A decode step's layer runs two launches: rope_write (triton_rope_write.py) and, at <= SPLIT_MAX_ROWS
token rows, the split attention launch (triton_attention.py); 32 launches and gaps per step of an
8B model. `attention_rope_split_kernel` (_triton_rope_attention_kernels.py, which says how it
never reads back a slot it writes) does both in one, with the two launches' helpers, so the same
bits: tests/test_triton_rope_attention.py compares it with them under Triton's interpreter, and
scripts/gpu_rope_attention.py on the GPU. The engine's leaf launches it at <= FUSED_MAX_ROWS
rows over a block table of <= FUSED_MAX_POSITIONS positions; other steps run the two launches,
unchanged.

Measured (H100, thirty-second session, Llama-3-8B heads, ctx 1024, bf16, µs a layer, one launch /
two): bs 1 16.9 / 17.9, bs 16 42.9 / 43.8, bs 32 78.7 / 69.9; every bit the two launches' (out, both
pools: bf16 and f32, merged and not, decode at page boundaries, mixed and padded steps), and the
goldens unchanged with it planned. Hence FUSED_MAX_ROWS = 16. At bs 16 x ctx 8192 the model's step
runs slower with it (one H100, thirty-third session, `rope_attention_ab_long`, pipelined ms two
launches / fused: auto 13.10 / 13.89, rl-bitwise 13.54 / 14.08), hence FUSED_MAX_POSITIONS. What the
compiler says (scripts/triton_aot_check.py --rope-attention, sm_90): the rotation is rope_write's
operations per element (mul.rn x2, neg, add.rn, no fma); bf16 takes 247 registers (the split launch
160), no spill; f32 255 registers and 608 bytes spilled per thread (the split launch 110; f32 not
timed). The loop over the tiles holding fresh positions is what costs them (without it 128 / 112):
it is not pipelined (one stage, so no more shared memory than the split launch), and its K/V tile
and the rows it rotates live in registers -- which is what loses at 32 rows.

Two leaves, each the composition of the two leaves it gives the bits of:
* `triton_fused_split` (rl-bitwise): triton_fused's rope_write + triton_fixed_split's attention;
* `triton_fused_split_qkv` (auto): q / k / v read from their concatenation, the projections'
  merged output, as triton_fused_qkv reads them + triton_wide_prefill's attention (at <= 32 rows
  the very split launch triton_fixed_split makes: widening needs WIDE_MIN_TOKENS rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import triton_attention as ta
from pallas_kernels import triton_rope_write as trw
from pallas_kernels._triton_launch import (INVARIANT, Counters, cdiv, contiguous, jax_launch,
                                           require_cuda_tensors, torch_launch, triton_available)
from pallas_kernels.gemm_epilogues import composes
from pallas_kernels.registry import Priority, register
from pallas_kernels.triton_attention_plan import (MERGE_STAGES, head_dim_supported, plan,
                                                 schedule_for)


def kernels():
    from pallas_kernels import _triton_rope_attention_kernels

    return _triton_rope_attention_kernels


def layout(hq: int, hkv: int, d: int, merged: bool) -> dict:
    """Where the kernel finds each token's q / k / v heads (its QS, KVS, KO, VO constexprs): three
    [T, H, D] arrays, or (merged) one [T, (hq + 2 hkv) * d] row per token: q's heads, k's, v's."""
    if merged:
        row = (hq + 2 * hkv) * d
        return dict(QS=row, KVS=row, KO=hq * d, VO=(hq + hkv) * d)
    return dict(QS=hq * d, KVS=hkv * d, KO=0, VO=0)


def fresh_rows_jax(tiles, token_req, positions, page, num_pages: int):
    """tiles [4, T] (ta.tiles_jax) and, per tile, its run: the first token of the run of equal
    token_req it belongs to, that token's position, and how many positions the run writes -- its
    length, or 0 where its first token's page is outside [0, num_pages) (padding) -> [7, T]."""
    t = token_req.shape[0]
    _, _, run_start = ta.runs_jax(token_req.astype(jnp.int32))
    run_len = jnp.zeros(t, jnp.int32).at[run_start].add(1)
    t0 = run_start[tiles[0]]
    writes = (page[t0] >= 0) & (page[t0] < num_pages) & (tiles[1] > 0)
    fresh = jnp.where(writes, run_len[t0], 0)
    return jnp.concatenate([tiles, jnp.stack([t0, positions.astype(jnp.int32)[t0], fresh])])


def fresh_rows_torch(tiles, token_req, positions, page, num_pages: int):
    """fresh_rows_jax from torch (the twin's host)."""
    import torch

    t, dev = token_req.shape[0], token_req.device
    _, _, run_start = ta.runs_torch(token_req.to(torch.int32))
    run_len = torch.zeros(t, dtype=torch.int32, device=dev)
    run_len.index_add_(0, run_start, torch.ones(t, dtype=torch.int32, device=dev))
    t0 = run_start[tiles[0].long()]
    p0 = page.to(torch.int64)[t0.long()]
    writes = (p0 >= 0) & (p0 < num_pages) & (tiles[1] > 0)
    fresh = torch.where(writes, run_len[t0.long()], 0).to(torch.int32)
    rows = torch.stack([t0, positions.to(torch.int32)[t0.long()], fresh])
    return torch.cat([tiles, rows]).contiguous()


# Where the engine's leaf launches the one kernel: steps of at most FUSED_MAX_ROWS token rows
# (the runner's bucket: bs 1-16 decode is 16 rows; a step of 32 ran 13 % slower than the two
# launches on the H100, 16 and fewer faster) whose block table spans at most FUSED_MAX_POSITIONS
# positions (the runner's page bucket: ctx 1024 is 2048; measured there; bs 16 x ctx 8192 ran
# 4-6 % slower -- with 247 registers 2 programs an SM stay resident against the split launch's 3,
# and long contexts keep many programs live). The torch twin launches it at every split-schedule
# step, so the checks cover the rest.
FUSED_MAX_ROWS = 16
FUSED_MAX_POSITIONS = 2048


def _checked(q, k, v, cos, sin, kv):
    """Both leaves' own argument checks (the same refusals as the two launches')."""
    trw._check(q, k, v, cos, sin, kv)
    ta._check(q, *kv)


def _fused_plan(q, k_pages, wide: bool):
    """(constexprs, launch options) of the fused launch: the split launch's, as its leaf plans
    them (triton_attention_plan.plan: KV tile, row sum, page ids, stages; fp fusion off)."""
    schedule, c, launch = plan(q, k_pages, None, wide)
    assert schedule == "split", schedule  # callers launch it at <= SPLIT_MAX_ROWS rows only
    return c, launch


def rope_paged_triton(q, k, v, cos, sin, kv, page, slot, block_tables, token_req, positions, *,
                      scale, merged: bool = False, wide: bool = False):
    """merged: read q / k / v from their concatenation (triton_fused_qkv's layout); wide: the
    attention of triton_wide_prefill (auto's) at steps of more than SPLIT_MAX_ROWS rows."""
    _checked(q, k, v, cos, sin, kv)
    t, positions_held = q.shape[0], kv[0].shape[1] * block_tables.shape[1]
    if (t == 0 or t > FUSED_MAX_ROWS or positions_held > FUSED_MAX_POSITIONS
            or schedule_for(t) != "split"):
        q, kv = trw.rope_write_triton(q, k, v, cos, sin, kv, page, slot, merged=merged)
        attend = ta.paged_attention_triton_wide if wide else ta.paged_attention_triton
        return attend(q, kv, block_tables, token_req, positions, scale=scale), kv
    k_pages, v_pages = kv
    c, launch = _fused_plan(q, k_pages, wide)
    hq, hkv, d, dtype = q.shape[1], k.shape[1], q.shape[2], q.dtype
    if merged:  # the kernel reads all three from the one array (passed three times)
        q = k = v = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
    num_pages, page_size, width = k_pages.shape[0], k_pages.shape[1], block_tables.shape[1]
    positions = positions.astype(jnp.int32)
    page = page.astype(jnp.int32)
    tiles = fresh_rows_jax(ta.tiles_jax(token_req, positions, c["TPP"]), token_req, positions,
                           page, num_pages)
    inputs = (q, k, v, cos, sin, page, slot.astype(jnp.int32), k_pages, v_pages,
              block_tables.astype(jnp.int32), positions, tiles, num_pages, t, page_size, width,
              np.float32(scale), Counters(t * hkv))
    nsplit = cdiv(page_size * width, c["SPLIT"])
    n = t * hkv * nsplit * c["TPP"] * c["GP"]
    outs = (jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((t, hq, d), dtype),
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    *_, out, k_pages, v_pages = jax_launch(
        kernels().attention_rope_split_kernel, inputs, outs, (t, hkv, nsplit), **launch, **c,
        NSPLIT=nsplit, MERGE_STAGES=MERGE_STAGES, **layout(hq, hkv, d, merged),
        input_output_aliases={7: 4, 8: 5})  # the pages, in place (as rope_write's)
    return out, (k_pages, v_pages)


def rope_paged_triton_qkv(q, k, v, cos, sin, kv, page, slot, block_tables, token_req, positions,
                          *, scale):
    """triton_fused_split_qkv (--numerics auto): merged q / k / v, auto's attention leaf."""
    return rope_paged_triton(q, k, v, cos, sin, kv, page, slot, block_tables, token_req,
                             positions, scale=scale, merged=True, wide=True)


def rope_paged_triton_torch(q, k, v, cos, sin, kv, page, slot, block_tables, token_req,
                            positions, *, scale, merged: bool = False, wide: bool = False,
                            pages_out=None):
    """The same launch on torch tensors: returns (output, kv), the pages written in place. For
    the checks (tests, scripts/gpu_rope_attention.py) and a trainer's twin. pages_out: (k, v)
    pages the fused launch writes instead of kv's, which it then only reads -- so a check can
    poison the slots a step writes in kv and see that no read reaches them (a step of more
    than SPLIT_MAX_ROWS rows, two launches, ignores it)."""
    import torch

    _checked(q, k, v, cos, sin, kv)
    k_pages, v_pages = kv
    k_out, v_out = pages_out or kv
    require_cuda_tensors("rope_paged_triton_torch", q, k, v, cos, sin, k_pages, v_pages,
                         block_tables)
    t = q.shape[0]
    if t == 0 or schedule_for(t) != "split":
        q, kv = trw.rope_write_triton_torch(q, k, v, cos, sin, kv, page, slot, merged=merged)
        return ta.paged_attention_triton_torch(q, kv, block_tables, token_req, positions,
                                               scale=scale, wide=wide), kv
    q, k, v, cos, sin = (contiguous(a) for a in (q, k, v, cos, sin))
    c, launch = _fused_plan(q, k_pages, wide)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    out = torch.empty_like(q)
    if merged:
        q = k = v = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
    num_pages, page_size, width = k_pages.shape[0], k_pages.shape[1], block_tables.shape[1]
    positions = contiguous(positions.to(torch.int32))
    page = contiguous(page.to(torch.int32))
    tiles = fresh_rows_torch(ta.tiles_torch(token_req, positions, c["TPP"]), token_req,
                             positions, page, num_pages)
    nsplit = cdiv(page_size * width, c["SPLIT"])
    n = t * hkv * nsplit * c["TPP"] * c["GP"]
    dev = out.device
    parts = (torch.empty(n, dtype=torch.float32, device=dev),
             torch.empty(n, dtype=torch.float32, device=dev),
             torch.empty(n, d, dtype=torch.float32, device=dev))
    torch_launch(kernels().attention_rope_split_kernel,
                 (q, k, v, cos, sin, page, contiguous(slot.to(torch.int32)), k_pages, v_pages,
                  contiguous(block_tables.to(torch.int32)), positions, tiles, num_pages, t,
                  page_size, width, float(scale), Counters(t * hkv)),
                 (*parts, out, k_out, v_out), (t, hkv, nsplit), **launch, **c,
                 NSPLIT=nsplit, MERGE_STAGES=MERGE_STAGES, **layout(hq, hkv, d, merged))
    return out, (k_out, v_out)


if triton_available():
    # rl-bitwise's: the bits of triton_fused + triton_fixed_split (their batch_invariant feature
    # too), so the plan requiring that composition can take it
    register("attention", "rope_paged", "triton_fused_split", formats=ta.FORMATS,
             hardware={"gpu"}, priority=Priority.TUNED,
             constraints={"head_dim": head_dim_supported}, traits=INVARIANT["traits"],
             features={*INVARIANT["features"],
                       composes(attention="triton_fixed_split", rope_write="triton_fused")},
             )(rope_paged_triton)
    # auto's: deterministic, not batch-invariant (triton_wide_prefill is not)
    register("attention", "rope_paged", "triton_fused_split_qkv", formats=ta.FORMATS,
             hardware={"gpu"}, priority=Priority.TUNED + 1,
             constraints={"head_dim": head_dim_supported},
             traits={"deterministic": True, "batch_invariant": False},
             features={composes(attention="triton_wide_prefill",
                                rope_write="triton_fused_qkv")})(rope_paged_triton_qkv)
