"""("attention", "paged") and ("attention", "dense_causal") on the GPU: one Triton source, two hosts.

The algorithm and why its bits cannot depend on the batch are in
pallas_kernels/_triton_attention_kernels.py: fixed splits of SPLIT positions from position 0, each
an online softmax over KV tiles of BLOCK_N positions, merged in split order; a program holds a tile
of TPP consecutive tokens of one request x the query heads of one KV head.

Two schedules give the same bits: `serial` (one program walks every split of its tile) and `split`
(one program per split; the last of a tile's programs to finish merges them, in the same launch).
`schedule_for` picks by the step's row count, which is allowed precisely because the bits do not
change with it (tests/test_triton_attention.py checks both schedules against each other under the
Triton interpreter on the CPU, and scripts/gpu_validate.py on the GPU).

The dense-causal form (the trainer's [B, S, H, D] layout) is the same kernel reading each sequence
as one KV page of S positions, so the trainer's twin and the engine's paged leaf agree bit for bit.

head_dim must be a power of two >= 16. The paged leaf declares that as a plan constraint, so a
model with another head_dim plans the next attention leaf at construction. The dense-causal leaf
does not (trainer mode plans its twin table per device, before it knows a model): its twin raises
naming head_dim, rather than silently giving bits the engine does not produce.

`--numerics auto` plans a third leaf, `triton_wide_prefill`: the same kernels, but a step of at
least WIDE_MIN_TOKENS token rows (a prefill chunk) runs the serial schedule on WIDE_ROWS rows per
program, which reads each KV tile for 4x the query rows (H200, a 4096-token prefill: 1.11 vs 1.82 ms
per layer; docs/performance.md), in bf16 on KV tiles of WIDE_BLOCK_N positions (another algorithm,
which auto may run: it has no bit contract). It is deterministic but not batch-invariant: ROWS 64 on
4 warps gives a few rows other bits than ROWS 16 on 4 warps (69 of 131,072 in that prefill), so a
row's bits would depend on its step's size. rl-bitwise never plans it (no batch_invariant feature).
Measured on the H200 (scripts/gpu_attention_rows.py): ROWS 16 on 1 warp, 64 on 4 and 128 on 8 agree
bit for bit, as do ROWS 16 on 4 and 32 on 8 -- consistent with a row's sum over a KV tile being
reduced across the warps that share the row (4 today, 1 in the wide launch). So rl-bitwise could
have the wide tile too by running every step on one warp per 16 rows, but that decode schedule
measured 1.3-1.8x slower (split kernel at bs 1: 28.5 vs 16.0 us per layer; serial at bs 64: 108 vs
81). Or by a row sum whose order no layout can change: `JENGINE_ATTENTION_ROWSUM=tree` or `dot`
(below). On the H200 the tree does make one class (every (ROWS, warps) launch 0 rows differing,
trainer alignment MATCH with the twin on the wide tile), but its reduction costs the narrow serial
launch: decode bs 64 +10 %, so it stays off (docs/performance.md, eighteenth session). The dot (the
row sum taken by an MMA, the nineteenth session's) is **the definition since the twenty-second
session**: on the H200 every (ROWS, warps) launch gives 0 differing rows, the trainer alignment
MATCHes with the twin on the wide tile, the production harness passes, and rl-bitwise's 4096-token
prefill takes the wide tile (172.6 -> 147.9 ms) for decode +0-3 % (docs/performance.md).
`JENGINE_ATTENTION_ROWSUM=triton` gives back Triton's own sum (the older definition).

Where the K/V rows come from is not part of the algorithm: with the page ids per split (the
default, planned per launch by `paged`: JENGINE_ATTENTION_PAGES below) a split's page ids are
loaded once instead of each tile's inside the tile loop, so Triton's pipeliner can issue a tile's
K/V copies while the previous tile computes, and the split launch's last program loads split
s + 1's stored state before merging split s (`_merge_partials`, AHEAD). Every launch's sm_90 PTX
keeps the same float instructions in the same order (scripts/triton_aot_check.py
--same-float-ops, in CI), the interpreter gives the same bits, and the H200's goldens are unchanged
under it (docs/performance.md, twenty-third session: decode -2 to -6 %, prefill -1 %, both modes).

These bits are *not* the portable `fixed_order` leaf's (pallas_kernels/attention.py, f32 p . v, one
max over the whole context): on a GPU the rl-bitwise plan and trainer mode's twin table both pick
this leaf, so engine and trainer move together. It is also registered above `xla_native` so that
`--numerics auto` uses it on a GPU: it reads paged KV directly instead of gathering each request's
context twice, and is the faster of the two there.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._triton_launch import (INVARIANT, Counters, cdiv, contiguous, dtype_name,
                                           jax_launch, require_cuda_tensors, torch_launch,
                                           triton_available)
from pallas_kernels.fixed_order import next_pow2
from pallas_kernels.registry import Priority, register

FORMATS = {"bf16", "f32"}
BLOCK_N = 32  # KV positions per tile (one tl.dot each for q.k and p.v)
SPLIT = 256  # positions per split; a multiple of BLOCK_N
MIN_ROWS = 16  # tl.dot needs >= 16 rows: GQA groups smaller than 16 are packed with more tokens
SPLIT_MAX_ROWS = 32  # steps of at most this many token rows use the split schedule (H200: split
# wins at 1 and 16 decode rows, serial at 64 and 256; docs/performance.md)
NUM_WARPS, NUM_STAGES = 4, 2
# JENGINE_ATTENTION_ROWSUM=dot (the default) / tree / triton -- a numerics definition each: every
# launch, the engine's and the trainer twin's alike, sums a row's p over a KV tile with an MMA or
# the halving tree (the kernels' ROWSUM codes, _row_sum), or with Triton's reduction, whose order
# follows the (ROWS, warps) layout. The first two make a row's bits independent of the layout
# (H200: attention_rows_tree / _dot, accept_llama_tree / _dot), so under them rl-bitwise's
# prefill steps take the wide tile too (gpu_run.sh rowsum_ab_<form>). The docstring says why dot.
ROWSUM_ENV = "JENGINE_ATTENTION_ROWSUM"
# JENGINE_ATTENTION_PAGES -- where a launch's K/V page ids come from; never the bits (only the
# addresses' source changes: tests/test_triton_attention.py under the interpreter, goldens_check
# and goldens_check_pages on the GPU). "tile": each tile's page ids loaded inside the tile loop
# (the only form before the twenty-third session; Triton's pipeliner then cannot overlap a tile's
# copies with the previous tile's compute: the kernels' _split_state). "split": each split's page
# ids loaded once, every tile's K/V copies issued a tile ahead on PAGES_STAGES stages, and the
# split merge's loads a split ahead (_merge_partials). "planned" (the default) per launch, from
# the µs per layer measured (twenty-second session H200 on Triton's sum, twenty-third H100 on the
# dot; tile -> split): the split schedule (H200 bs 1 x 1024 15.7 -> 13.5; H100 14.1 -> 14.2) and
# rl-bitwise's wide tile (H100 4096-token prefill 1103.7 -> 996.9) as "split"; the narrow serial
# launch under a bound of PAGES_MAXNREG registers (unbounded it took 154, 3 programs per SM where 4
# fit, and lost on the H200: 81.3 -> 102.1 at 64 rows; bounded 76.3, 256 rows 306.2 -> 279.8; H100
# 101.1 -> 100.2, 379.5 -> 368.3); auto's wide tile (64-position KV tiles) on NUM_STAGES stages (on
# 3 it lost, H100 949.4 -> 1327.9; on 2 916.6). Not planned anywhere: a wide tile at SPLIT 512
# with the page ids per split hit an illegal memory access (H200 and H100; the narrow tile at
# SPLIT 512 did not; cause not found: gpu_run.sh pages_crash).
PAGES_ENV, PAGES_STAGES, PAGES_MAXNREG = "JENGINE_ATTENTION_PAGES", 3, 128
PAGES_FORMS = ("planned", "tile", "split")
# triton_wide_prefill (auto only): query rows per program on steps of >= WIDE_MIN_TOKENS rows. At
# 256 decode rows the wide tile measured 2x slower (630 vs 306 us per layer: one token per tile).
# Auto has no bit contract, so its wide tile also reads KV in tiles of WIDE_BLOCK_N positions: -4
# to -7 % of its time on the H200 (eighteenth session, attention_auto_tiles: a 4096-token prompt
# 1.733 -> 1.606 ms per layer, 4 x 1024 1.227 -> 1.183, a 2 x 2048 chunk 1.343 -> 1.272; error vs
# f32: max equal, mean +1 %). 128 positions, or 8 warps, measured slower. bf16 only: the f32 (IEEE)
# launch would spill 23 KB per thread at 64 positions (ptxas -v, sm_90; 2 KB at 32).
WIDE_ROWS, WIDE_MIN_TOKENS, WIDE_BLOCK_N = 64, 512, 64


def kernels():
    from pallas_kernels import _triton_attention_kernels

    return _triton_attention_kernels


def head_dim_supported(d) -> bool:
    """tl.arange and tl.dot need a power of two >= 16 along the head dimension."""
    return d >= 16 and d & (d - 1) == 0


def geometry(hq: int, hkv: int, d: int) -> dict:
    """Static tile constants for a head layout. Raises naming the field if it is unsupported."""
    if hq % hkv:
        raise ValueError(f"attention: num_attention_heads={hq} is not a multiple of "
                         f"num_key_value_heads={hkv}")
    if not head_dim_supported(d):
        raise ValueError(f"attention (Triton): head_dim={d} must be a power of two >= 16")
    g = hq // hkv
    gp = next_pow2(g)
    rows = max(MIN_ROWS, gp)
    return dict(HQ=hq, HKV=hkv, G=g, GP=gp, TPP=rows // gp, D=d)


def schedule_for(num_tokens: int) -> str:
    return "split" if num_tokens <= SPLIT_MAX_ROWS else "serial"


# -- tiles: which tokens each program holds -------------------------------------------------------


def tiles_jax(token_req, positions, tpp: int):
    """int32 [4, T]: each tile's first token, token count, request row and largest position
    (tiles past the last have count 0).

    A tile is at most `tpp` consecutive tokens of one run of equal token_req (one request's rows
    are contiguous in a step). Which tokens share a tile never changes a row's bits.
    """
    t = token_req.shape[0]
    token_req = token_req.astype(jnp.int32)
    idx = jnp.arange(t, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), token_req[1:] != token_req[:-1]])
    run_start = jax.lax.cummax(jnp.where(new_run, idx, 0))
    head = new_run | ((idx - run_start) % tpp == 0)
    tile_id = jnp.cumsum(head.astype(jnp.int32)) - 1
    start = jnp.zeros(t, jnp.int32).at[jnp.where(head, tile_id, t)].set(idx, mode="drop")
    count = jnp.zeros(t, jnp.int32).at[tile_id].add(1)
    max_pos = jnp.zeros(t, jnp.int32).at[tile_id].max(positions.astype(jnp.int32))
    return jnp.stack([start, count, token_req[start], max_pos])


def tiles_torch(token_req, positions, tpp: int):
    """The same tiles from torch (the twin's host)."""
    import torch

    t, dev = token_req.shape[0], token_req.device
    token_req = token_req.to(torch.int32)
    idx = torch.arange(t, dtype=torch.int32, device=dev)
    new_run = torch.ones(t, dtype=torch.bool, device=dev)
    new_run[1:] = token_req[1:] != token_req[:-1]
    run_start = torch.cummax(torch.where(new_run, idx, 0), dim=0).values
    head = new_run | ((idx - run_start) % tpp == 0)
    tile_id = torch.cumsum(head.to(torch.int64), 0) - 1
    start = torch.zeros(t, dtype=torch.int32, device=dev)
    start[tile_id[head]] = idx[head]
    count = torch.zeros(t, dtype=torch.int32, device=dev)
    count.index_add_(0, tile_id, torch.ones(t, dtype=torch.int32, device=dev))
    max_pos = torch.zeros(t, dtype=torch.int32, device=dev).scatter_reduce(
        0, tile_id, positions.to(torch.int32), reduce="amax")
    return torch.stack([start, count, token_req[start.long()], max_pos]).contiguous()


# -- JAX host ---------------------------------------------------------------------------------------


def _check(q, k_cache, v_cache):
    if dtype_name(q.dtype) not in FORMATS:
        raise ValueError(f"attention: q.dtype={dtype_name(q.dtype)} must be one of {sorted(FORMATS)}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"attention: k/v caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} "
                         f"({k_cache.dtype}/{v_cache.dtype}) must match each other and q's dtype "
                         f"{q.dtype}")


ROWSUM_FORMS = {"triton": 0, "tree": 1, "dot": 2}  # the kernels' ROWSUM_* codes
DEFAULT_ROWSUM = "dot"  # the definition since the twenty-second session (H200: one bit class)


def rowsum_form() -> int:
    """The row sum JENGINE_ATTENTION_ROWSUM asks for, as the kernels' ROWSUM code: unset or ""
    the default; "tree" or "dot" one whose order no layout reaches. Another value is an error
    naming the variable and the value."""
    value = os.environ.get(ROWSUM_ENV) or DEFAULT_ROWSUM
    if value not in ROWSUM_FORMS:
        raise ValueError(f"{ROWSUM_ENV}={value!r}: expected one of {sorted(ROWSUM_FORMS)} "
                         f"(the default: {DEFAULT_ROWSUM!r})")
    return ROWSUM_FORMS[value]


def pages_form() -> str:
    """JENGINE_ATTENTION_PAGES (see there): unset or "" the default ("planned"). Another value is
    an error naming the variable and the value."""
    value = os.environ.get(PAGES_ENV) or PAGES_FORMS[0]
    if value not in PAGES_FORMS:
        raise ValueError(f"{PAGES_ENV}={value!r}: expected one of {list(PAGES_FORMS)} "
                         f"(the default: {PAGES_FORMS[0]!r})")
    return value


def pages_per_split(page_size: int, split: int = SPLIT) -> int:
    """PAGES of the "split" form: a power of two >= the pages any split of `split` positions
    spans (splits start at multiples of `split`; a page of page_size positions)."""
    if split % page_size == 0 or page_size % split == 0:
        spanned = max(split // page_size, 1)
    else:  # a split may start inside a page and end inside another
        spanned = (split - 1) // page_size + 2
    return next_pow2(spanned)


def _constexprs(q, k_cache) -> dict:
    """The constexprs of a launch on the narrow tile, page ids per tile (_plan sets the rest)."""
    geo = geometry(q.shape[1], k_cache.shape[2], q.shape[2])
    return dict(geo, BLOCK_N=BLOCK_N, SPLIT=SPLIT, IEEE=dtype_name(q.dtype) == "f32",
                ROWSUM=rowsum_form(), PAGES=0)


def launch_options(c: dict, maxnreg: int | None = None, stages: int | None = None) -> dict:
    """num_warps / num_stages / fp fusion (and a register bound) of a launch with constexprs c,
    both hosts; stages: another count than the page-ids form's."""
    stages = stages or (PAGES_STAGES if c["PAGES"] else NUM_STAGES)
    bound = {"maxnreg": maxnreg} if maxnreg else {}
    return dict(num_warps=NUM_WARPS, num_stages=stages, enable_fp_fusion=False, **bound)


def paged(c: dict, schedule: str, page_size: int) -> tuple[dict, dict]:
    """(constexprs, launch options) of a launch with constexprs c on `schedule`, with its page ids
    where JENGINE_ATTENTION_PAGES puts them (the "planned" form: see there)."""
    form = pages_form()
    if form == "tile":
        return c, launch_options(c)
    c = dict(c, PAGES=pages_per_split(page_size, c["SPLIT"]))
    if form == "split":
        return c, launch_options(c)
    narrow_serial = schedule == "serial" and c["TPP"] * c["GP"] == max(MIN_ROWS, c["GP"])
    autos_kv_tile = c["BLOCK_N"] == WIDE_BLOCK_N != BLOCK_N
    return c, launch_options(c, PAGES_MAXNREG if narrow_serial else None,
                             NUM_STAGES if autos_kv_tile else None)


def wide_tpp(c: dict, num_tokens: int, schedule: str) -> int:
    """Tokens per program of triton_wide_prefill: WIDE_ROWS rows on prefill-sized serial steps."""
    if schedule == "serial" and num_tokens >= WIDE_MIN_TOKENS and c["GP"] < WIDE_ROWS:
        return WIDE_ROWS // c["GP"]
    return c["TPP"]


def widened(c: dict, num_tokens: int, schedule: str, auto: bool) -> dict:
    """The constexprs of a prefill-sized serial step on the wide tile: WIDE_ROWS rows per program,
    and for auto's own leaf (`auto`) KV tiles of WIDE_BLOCK_N positions. The batch-invariant leaf
    widens only under a layout-free row sum, and keeps BLOCK_N: the KV tile is part of the
    numerics definition (kernels' docstring), the rows per program are not. (f32 keeps BLOCK_N
    in auto too: see WIDE_BLOCK_N.)"""
    tpp = wide_tpp(c, num_tokens, schedule)
    if tpp == c["TPP"]:
        return c
    own_kv_tile = auto and not c["IEEE"]
    return dict(c, TPP=tpp, BLOCK_N=WIDE_BLOCK_N if own_kv_tile else c["BLOCK_N"])


def _plan(q, k_cache, schedule: str | None, wide: bool) -> tuple[str, dict, dict]:
    """(schedule, constexprs, launch options) of a step of q.shape[0] token rows: both hosts launch
    from this."""
    t = q.shape[0]
    c = _constexprs(q, k_cache)
    schedule = schedule or schedule_for(t)
    if wide or c["ROWSUM"]:  # under a layout-free row sum, every leaf's prefill is wide
        c = widened(c, t, schedule, auto=wide)
    return (schedule, *paged(c, schedule, k_cache.shape[1]))


def paged_attention_triton(q, kv, block_tables, token_req, positions, *, scale,
                           schedule: str | None = None, wide: bool = False):
    """q [T, Hq, D]; kv = (k_pages, v_pages), each [Np, page_size, Hkv, D]; block_tables [R, P];
    token_req, positions [T]. wide: triton_wide_prefill's tiles (not batch-invariant)."""
    k_cache, v_cache = kv
    _check(q, k_cache, v_cache)
    t = q.shape[0]
    schedule, c, launch = _plan(q, k_cache, schedule, wide)
    page_size, width = k_cache.shape[1], block_tables.shape[1]
    positions = positions.astype(jnp.int32)
    tiles = tiles_jax(token_req, positions, c["TPP"])
    inputs = (q, k_cache, v_cache, block_tables.astype(jnp.int32), positions, tiles, t, page_size,
              width, np.float32(scale))
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    k = kernels()
    if schedule == "serial":
        return jax_launch(k.attention_serial_kernel, inputs, out, (t, c["HKV"]), **launch, **c)
    nsplit = cdiv(page_size * width, SPLIT)
    rows = c["TPP"] * c["GP"]
    n = t * c["HKV"] * nsplit * rows
    *_, out = jax_launch(k.attention_split_kernel, (*inputs, Counters(t * c["HKV"])),
                         (jax.ShapeDtypeStruct((n,), jnp.float32),
                          jax.ShapeDtypeStruct((n,), jnp.float32),
                          jax.ShapeDtypeStruct((n, c["D"]), jnp.float32), out),
                         (t, c["HKV"], nsplit), **launch, **c, NSPLIT=nsplit)
    return out


def paged_attention_triton_wide(q, kv, block_tables, token_req, positions, *, scale,
                                schedule: str | None = None):
    """triton_wide_prefill (--numerics auto): paged_attention_triton on WIDE_ROWS rows per program
    for prefill-sized steps. Deterministic, not batch-invariant (module docstring)."""
    return paged_attention_triton(q, kv, block_tables, token_req, positions, scale=scale,
                                  schedule=schedule, wide=True)


def _dense_as_pages(b: int, s: int):
    """A [B, S, ...] tensor read as B pages of S positions: token_req, positions, block table."""
    return (np.repeat(np.arange(b, dtype=np.int32), s), np.tile(np.arange(s, dtype=np.int32), b),
            np.arange(b, dtype=np.int32)[:, None])


def dense_causal_attention_triton(q, k, v, *, scale, schedule: str | None = None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D]; query i attends to 0..i."""
    b, s, hq, d = q.shape
    token_req, positions, table = _dense_as_pages(b, s)
    out = paged_attention_triton(q.reshape(b * s, hq, d), (k, v), jnp.asarray(table),
                                 jnp.asarray(token_req), jnp.asarray(positions), scale=scale,
                                 schedule=schedule)
    return out.reshape(b, s, hq, d)


# -- torch host (the trainer's twin) ---------------------------------------------------------------


def paged_attention_triton_torch(q, kv, block_tables, token_req, positions, *, scale,
                                 schedule: str | None = None, wide: bool = False):
    import torch

    k_cache, v_cache = kv
    _check(q, k_cache, v_cache)
    require_cuda_tensors("paged_attention_triton_torch", q, k_cache, v_cache, block_tables)
    q, k_cache, v_cache = contiguous(q), contiguous(k_cache), contiguous(v_cache)
    block_tables = contiguous(block_tables.to(torch.int32))
    positions = contiguous(positions.to(torch.int32))
    t = q.shape[0]
    schedule, c, launch = _plan(q, k_cache, schedule, wide)
    page_size, width = k_cache.shape[1], block_tables.shape[1]
    tiles = tiles_torch(token_req, positions, c["TPP"])
    inputs = (q, k_cache, v_cache, block_tables, positions, tiles, t, page_size, width,
              float(scale))
    out = torch.empty_like(q)
    if t == 0:
        return out
    k = kernels()
    if schedule == "serial":
        torch_launch(k.attention_serial_kernel, inputs, (out,), (t, c["HKV"]), **launch, **c)
        return out
    nsplit = cdiv(page_size * width, SPLIT)
    n = t * c["HKV"] * nsplit * c["TPP"] * c["GP"]
    parts = (torch.empty(n, dtype=torch.float32, device=q.device),
             torch.empty(n, dtype=torch.float32, device=q.device),
             torch.empty(n, c["D"], dtype=torch.float32, device=q.device))
    torch_launch(k.attention_split_kernel, (*inputs, Counters(t * c["HKV"])), (*parts, out),
                 (t, c["HKV"], nsplit), **launch, **c, NSPLIT=nsplit)
    return out


def paged_attention_triton_wide_torch(q, kv, block_tables, token_req, positions, *, scale,
                                      schedule: str | None = None):
    """triton_wide_prefill from torch (the same launch; used to check it on the CPU)."""
    return paged_attention_triton_torch(q, kv, block_tables, token_req, positions, scale=scale,
                                        schedule=schedule, wide=True)


def dense_causal_attention_triton_torch(q, k, v, *, scale, schedule: str | None = None):
    """The trainer's twin of dense_causal_attention_triton (same kernel, torch tensors)."""
    import torch

    b, s, hq, d = q.shape
    token_req, positions, table = (torch.from_numpy(a).to(q.device) for a in _dense_as_pages(b, s))
    out = paged_attention_triton_torch(q.reshape(b * s, hq, d), (k, v), table, token_req, positions,
                                       scale=scale, schedule=schedule)
    return out.reshape(b, s, hq, d)


if triton_available():
    # TUNED + 2: above xla_native (TUNED + 1), so --numerics auto plans it on a GPU too. A model
    # whose head_dim it cannot take plans the next leaf at construction instead.
    register("attention", "paged", "triton_fixed_split", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED + 2, constraints={"head_dim": head_dim_supported},
             **INVARIANT)(paged_attention_triton)
    register("attention", "dense_causal", "triton_fixed_split", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED + 2, **INVARIANT)(dense_causal_attention_triton)
    # TUNED + 3: auto's pick on a GPU; rl-bitwise asks for the batch_invariant feature it lacks.
    register("attention", "paged", "triton_wide_prefill", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED + 3, constraints={"head_dim": head_dim_supported},
             traits={"deterministic": True, "batch_invariant": False})(paged_attention_triton_wide)
