"""("attention", "paged") and ("attention", "dense_causal") on the GPU: one Triton source, two
hosts.

How each launch is planned (its tile, schedule, row sum, page ids, launch options) is
pallas_kernels/triton_attention_plan.py; the algorithm and why its bits cannot depend on the batch
are in pallas_kernels/_triton_attention_kernels.py: fixed splits of SPLIT positions from position
0, each an online softmax over KV tiles (DEFAULT_KV_TILE positions in bf16, BLOCK_N in f32),
merged in split order; a program holds a tile of TPP consecutive tokens of one request x the
query heads of one KV head.

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
Every bf16 launch, engine and twin, reads 64-position KV tiles: the definition since the
twenty-eighth session (triton_attention_plan's DEFAULT_KV_TILE; H100: rl-bitwise's prefill 1.12x ->
1.10x auto's, decode unchanged; on the H200 the trainer alignment MATCHes and the production
harness passes on it). `JENGINE_ATTENTION_KV_TILE=32` gives back the older definition.

Where the K/V rows come from is not part of the algorithm: with the page ids per split (the
default, planned per launch by `paged`: JENGINE_ATTENTION_PAGES below) a split's page ids are
loaded once instead of each tile's inside the tile loop, so Triton's pipeliner can issue a tile's
K/V copies while the previous tile computes. Every launch's sm_90 PTX keeps the same float
instructions in the same order (scripts/triton_aot_check.py --same-float-ops, in CI), the
interpreter gives the same bits, and the H200's goldens are unchanged under it
(docs/performance.md, twenty-third session: decode at 64 / 256 rows -3 / -6 %, prefill -1 %, both
modes). Nor is how the split launch's last program loads the stored splits it merges: on
MERGE_STAGES stages of Triton's pipeliner, several splits ahead of the fold (`_merge_partials`;
H100 goldens unchanged, twenty-ninth session).

These bits are *not* the portable `fixed_order` leaf's (pallas_kernels/attention.py, f32 p . v, one
max over the whole context): on a GPU the rl-bitwise plan and trainer mode's twin table both pick
this leaf, so engine and trainer move together. It is also registered above `xla_native` so that
`--numerics auto` uses it on a GPU: it reads paged KV directly instead of gathering each request's
context twice, and is the faster of the two there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._triton_launch import (INVARIANT, Counters, cdiv, contiguous, dtype_name,
                                           jax_launch, require_cuda_tensors, torch_launch,
                                           triton_available)
from pallas_kernels.registry import Priority, register
from pallas_kernels.triton_attention_plan import MERGE_STAGES, head_dim_supported, plan

FORMATS = {"bf16", "f32"}
def kernels():
    from pallas_kernels import _triton_attention_kernels

    return _triton_attention_kernels


# -- tiles: which tokens each program holds -------------------------------------------------------


def runs_jax(token_req):
    """A step's runs of equal token_req (one request's rows are contiguous): each token's index,
    whether it starts a run, and its run's first token."""
    idx = jnp.arange(token_req.shape[0], dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), token_req[1:] != token_req[:-1]])
    return idx, new_run, jax.lax.cummax(jnp.where(new_run, idx, 0))


def runs_torch(token_req):
    """runs_jax from torch (the twin's host)."""
    import torch

    t, dev = token_req.shape[0], token_req.device
    idx = torch.arange(t, dtype=torch.int32, device=dev)
    new_run = torch.ones(t, dtype=torch.bool, device=dev)
    new_run[1:] = token_req[1:] != token_req[:-1]
    return idx, new_run, torch.cummax(torch.where(new_run, idx, 0), dim=0).values


def tiles_jax(token_req, positions, tpp: int):
    """int32 [4, T]: each tile's first token, token count, request row and largest position
    (tiles past the last have count 0).

    A tile is at most `tpp` consecutive tokens of one run of equal token_req (one request's rows
    are contiguous in a step). Which tokens share a tile never changes a row's bits.
    """
    t = token_req.shape[0]
    token_req = token_req.astype(jnp.int32)
    idx, new_run, run_start = runs_jax(token_req)
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
    idx, new_run, run_start = runs_torch(token_req)
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


def paged_attention_triton(q, kv, block_tables, token_req, positions, *, scale,
                           schedule: str | None = None, wide: bool = False):
    """q [T, Hq, D]; kv = (k_pages, v_pages), each [Np, page_size, Hkv, D]; block_tables [R, P];
    token_req, positions [T]. wide: triton_wide_prefill's tiles (not batch-invariant)."""
    k_cache, v_cache = kv
    _check(q, k_cache, v_cache)
    t = q.shape[0]
    schedule, c, launch = plan(q, k_cache, schedule, wide)
    page_size, width = k_cache.shape[1], block_tables.shape[1]
    positions = positions.astype(jnp.int32)
    tiles = tiles_jax(token_req, positions, c["TPP"])
    inputs = (q, k_cache, v_cache, block_tables.astype(jnp.int32), positions, tiles, t, page_size,
              width, np.float32(scale))
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    k = kernels()
    if schedule == "serial":
        return jax_launch(k.attention_serial_kernel, inputs, out, (t, c["HKV"]), **launch, **c)
    nsplit = cdiv(page_size * width, c["SPLIT"])
    rows = c["TPP"] * c["GP"]
    n = t * c["HKV"] * nsplit * rows
    *_, out = jax_launch(k.attention_split_kernel, (*inputs, Counters(t * c["HKV"])),
                         (jax.ShapeDtypeStruct((n,), jnp.float32),
                          jax.ShapeDtypeStruct((n,), jnp.float32),
                          jax.ShapeDtypeStruct((n, c["D"]), jnp.float32), out),
                         (t, c["HKV"], nsplit), **launch, **c, NSPLIT=nsplit,
                         MERGE_STAGES=MERGE_STAGES)
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
    schedule, c, launch = plan(q, k_cache, schedule, wide)
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
    nsplit = cdiv(page_size * width, c["SPLIT"])
    n = t * c["HKV"] * nsplit * c["TPP"] * c["GP"]
    parts = (torch.empty(n, dtype=torch.float32, device=q.device),
             torch.empty(n, dtype=torch.float32, device=q.device),
             torch.empty(n, c["D"], dtype=torch.float32, device=q.device))
    torch_launch(k.attention_split_kernel, (*inputs, Counters(t * c["HKV"])), (*parts, out),
                 (t, c["HKV"], nsplit), **launch, **c, NSPLIT=nsplit, MERGE_STAGES=MERGE_STAGES)
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
