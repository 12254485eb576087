"""How each launch of the Triton attention leaf is planned: its tile, schedule, row sum, page ids
and launch options. pallas_kernels/triton_attention.py launches from `plan` on both hosts (JAX and
torch), so the engine and the trainer's twin plan every step alike; the algorithm the constants
name is in pallas_kernels/_triton_attention_kernels.py.

Three environment switches are read per launch, so a device run can A/B them:
JENGINE_ATTENTION_ROWSUM and JENGINE_ATTENTION_KV_TILE (parts of the numerics definition) and
JENGINE_ATTENTION_PAGES (never the bits). Each is refused, naming the variable and the value, if
it is not one of its forms.
"""

from __future__ import annotations

import os

from pallas_kernels._triton_launch import dtype_name
from pallas_kernels.fixed_order import next_pow2

BLOCK_N = 32  # KV positions per tile (one tl.dot each for q.k and p.v) of f32 launches; bf16's
# default is DEFAULT_KV_TILE (below)
SPLIT = 256  # positions per split; a multiple of every KV tile
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
# JENGINE_ATTENTION_KV_TILE=64 (the default, DEFAULT_KV_TILE) / 32 (BLOCK_N, the definition until
# the twenty-eighth session) -- KV positions per tile of every bf16 launch, the engine's and the
# twin's: a numerics definition each (the online softmax steps a tile at a time). Measured in the
# model (H100, twenty-sixth session, kvtile_ab_rl / _auto): rl-bitwise's 4096-token prefill
# 142.4 -> 139.7 ms on 64, 1.12x -> 1.10x auto's (auto's prefill attention reads 64 already);
# decode within the runs' spread (rl-bitwise bs 1 / 64 / 256 7.05 / 10.37 / 22.61 -> 7.03 / 10.39
# / 22.71 ms pipelined). Adopted after the H200 (twenty-eighth session) aligned it with the
# trainer at production widths (accept_llama_kv64: MATCH on every variant, stock torch
# MISMATCH), passed the production harness on it (harness_prod_llama_kv64) and recorded its
# goldens (tests/goldens/h200.json; the 32-position goldens are h200_kv32.json). The decode
# launches on 64 take more registers (sm_90 ptxas: narrow serial 168 unbounded, split 152 vs
# 104-128 on 32). f32 keeps BLOCK_N: its launch would spill 23 KB per thread at 64.
KV_TILE_ENV = "JENGINE_ATTENTION_KV_TILE"
DEFAULT_KV_TILE = 64
KV_TILES = (BLOCK_N, DEFAULT_KV_TILE)
# JENGINE_ATTENTION_PAGES -- where a launch's K/V page ids come from; never the bits (only the
# addresses' source changes: tests/test_triton_attention.py under the interpreter, goldens_check
# and goldens_check_pages on the GPU). "tile": each tile's page ids loaded inside the tile loop
# (the only form before the twenty-third session; Triton's pipeliner then cannot overlap a tile's
# copies with the previous tile's compute: the kernels' _split_state). "split": each split's page
# ids loaded once, every tile's K/V copies issued a tile ahead on PAGES_STAGES stages (and, until
# MERGE_STAGES below, the split merge's loads a split ahead). "planned" (the default) per launch,
# from the µs per layer measured on the dot sum (twenty-third session, H200; tile -> split): the
# split schedule (bs 16 x 8192 187.8 -> 174.1; bs 1 x 1024 14.2 -> 14.3) and rl-bitwise's wide tile
# (4096-token prefill 1119.1 -> 996.8) as "split"; the narrow serial launch (decode at 64 / 256
# rows: 88.3 -> 78.2, 327.0 -> 287.0) under a bound of PAGES_MAXNREG registers (on Triton's sum it
# took 154 unbounded, 3 programs per SM where 4 fit, and lost; on the dot the bound is neutral:
# 77.9 / 284.2 unbounded; in the model, H100, twenty-ninth session, unbounded costs bs 64 / 256
# +0.9 / +1.0 ms pipelined in both modes); auto's wide tile (64-position KV tiles) on NUM_STAGES
# stages (949.3 -> 915.7; on 3 stages 1346.8). Not planned anywhere: a wide tile at SPLIT 512 with
# the page ids per split. It faulted (illegal memory access, H200 and H100: the pipelined window
# gather read past its window) until the gather's index was clamped (_pool_tile, thirty-fifth
# session); since, it runs with the same bits, and is no faster on auto's 3 stages (H100, µs per
# layer, per tile -> per split: 64 rows 154.5 -> 179.9, 256 rows 569.1 -> 667.5, prefill 999.8 ->
# 1239.4).
PAGES_ENV, PAGES_STAGES, PAGES_MAXNREG = "JENGINE_ATTENTION_PAGES", 3, 128
PAGES_FORMS = ("planned", "tile", "split")
# The split launch's merge (its last program per tile folds the stored splits in a chain of loads)
# on MERGE_STAGES stages of Triton's pipeliner: MERGE_STAGES - 1 splits' states in flight ahead of
# the fold where a hand-written load ahead kept one (removed since; MERGE_STAGES = 0 is the plain
# loop, one load at a time). Never the bits: the same values folded in the same order
# (_merge_partials; H100 goldens unchanged, twenty-ninth session). sm_90 ptxas: 160 registers on
# 64-position tiles (152 before), no spills. H100, pipelined ms, 4 / 0 / 4 (gpu_run.sh
# merge_stages_ab): 16 x 8k (33 splits to fold) rl-bitwise 13.44 / 13.63 / 13.42, auto 13.24 /
# 13.45 / 13.21; bs 1 x 1024 (4 splits) rl-bitwise 7.01 / 7.05 / 6.99, auto 6.80 / 6.75 / 6.75
# (within the runs' spread).
MERGE_STAGES = 4
# triton_wide_prefill (auto only): query rows per program on steps of >= WIDE_MIN_TOKENS rows. At
# 256 decode rows the wide tile measured 2x slower (630 vs 306 us per layer: one token per tile).
# Auto has no bit contract, so its wide tile also reads KV in tiles of WIDE_BLOCK_N positions: -4
# to -7 % of its time on the H200 (eighteenth session, attention_auto_tiles: a 4096-token prompt
# 1.733 -> 1.606 ms per layer, 4 x 1024 1.227 -> 1.183, a 2 x 2048 chunk 1.343 -> 1.272; error vs
# f32: max equal, mean +1 %). 128 positions, or 8 warps, measured slower. bf16 only: the f32 (IEEE)
# launch would spill 23 KB per thread at 64 positions (ptxas -v, sm_90; 2 KB at 32).
WIDE_ROWS, WIDE_MIN_TOKENS, WIDE_BLOCK_N = 64, 512, 64


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
    return dict(HQ=hq, HKV=hkv, G=g, GP=gp, TPP=narrow_tpp(gp), D=d)


def narrow_tpp(gp: int) -> int:
    """Tokens per program of the narrow tile: MIN_ROWS rows (or one token's GP padded heads)."""
    return max(MIN_ROWS, gp) // gp


def schedule_for(num_tokens: int) -> str:
    return "split" if num_tokens <= SPLIT_MAX_ROWS else "serial"


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


def kv_tile(ieee: bool) -> int:
    """The KV tile JENGINE_ATTENTION_KV_TILE asks for (unset or "": DEFAULT_KV_TILE); f32 (ieee)
    launches keep BLOCK_N. Another value is an error naming the variable and the value."""
    value = os.environ.get(KV_TILE_ENV) or str(DEFAULT_KV_TILE)
    if value not in {str(n) for n in KV_TILES}:
        raise ValueError(f"{KV_TILE_ENV}={value!r}: expected one of {[str(n) for n in KV_TILES]} "
                         f"(the default: '{DEFAULT_KV_TILE}')")
    return BLOCK_N if ieee else int(value)


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


def constexprs(q, k_cache) -> dict:
    """The constexprs of a launch on the narrow tile, page ids per tile (`plan` sets the rest)."""
    geo = geometry(q.shape[1], k_cache.shape[2], q.shape[2])
    ieee = dtype_name(q.dtype) == "f32"
    return dict(geo, BLOCK_N=kv_tile(ieee), SPLIT=SPLIT, IEEE=ieee, ROWSUM=rowsum_form(), PAGES=0)


def launch_options(c: dict, maxnreg: int | None = None, stages: int | None = None) -> dict:
    """num_warps / num_stages / fp fusion (and a register bound) of a launch with constexprs c,
    both hosts; stages: another count than the page-ids form's."""
    stages = stages or (PAGES_STAGES if c["PAGES"] else NUM_STAGES)
    bound = {"maxnreg": maxnreg} if maxnreg else {}
    return dict(num_warps=NUM_WARPS, num_stages=stages, enable_fp_fusion=False, **bound)


def paged(c: dict, schedule: str, page_size: int, form: str | None = None) -> tuple[dict, dict]:
    """(constexprs, launch options) of a launch with constexprs c on `schedule`, with its page ids
    where `form` (by default JENGINE_ATTENTION_PAGES's) puts them ("planned": see there)."""
    form = form or pages_form()
    if form == "tile":
        return c, launch_options(c)
    c = dict(c, PAGES=pages_per_split(page_size, c["SPLIT"]))
    if form == "split":
        return c, launch_options(c)
    narrow_serial = schedule == "serial" and c["TPP"] == narrow_tpp(c["GP"])
    # 64-position KV tiles (every bf16 launch by default, auto's wide tile under either KV tile)
    # on NUM_STAGES: measured on the wide tile only (3 stages 1346.8 vs 915.7 µs), the rest follow
    wide_kv_tile = c["BLOCK_N"] > BLOCK_N
    return c, launch_options(c, PAGES_MAXNREG if narrow_serial else None,
                             NUM_STAGES if wide_kv_tile else None)


def wide_tpp(c: dict, num_tokens: int, schedule: str) -> int:
    """Tokens per program of triton_wide_prefill: WIDE_ROWS rows on prefill-sized serial steps."""
    if schedule == "serial" and num_tokens >= WIDE_MIN_TOKENS and c["GP"] < WIDE_ROWS:
        return WIDE_ROWS // c["GP"]
    return c["TPP"]


def widened(c: dict, num_tokens: int, schedule: str, auto: bool) -> dict:
    """The constexprs of a prefill-sized serial step on the wide tile: WIDE_ROWS rows per program,
    and for auto's own leaf (`auto`) KV tiles of WIDE_BLOCK_N positions. The batch-invariant leaf
    widens only under a layout-free row sum, and keeps c's KV tile (kv_tile): the KV tile is part
    of the numerics definition (kernels' docstring), the rows per program are not. (f32 keeps
    BLOCK_N in auto too: see WIDE_BLOCK_N.)"""
    tpp = wide_tpp(c, num_tokens, schedule)
    if tpp == c["TPP"]:
        return c
    own_kv_tile = auto and not c["IEEE"]
    return dict(c, TPP=tpp, BLOCK_N=WIDE_BLOCK_N if own_kv_tile else c["BLOCK_N"])


def plan(q, k_cache, schedule: str | None, wide: bool) -> tuple[str, dict, dict]:
    """(schedule, constexprs, launch options) of a step of q.shape[0] token rows: both hosts launch
    from this."""
    t = q.shape[0]
    c = constexprs(q, k_cache)
    schedule = schedule or schedule_for(t)
    if wide or c["ROWSUM"]:  # under a layout-free row sum, every leaf's prefill is wide
        c = widened(c, t, schedule, auto=wide)
    return (schedule, *paged(c, schedule, k_cache.shape[1]))
