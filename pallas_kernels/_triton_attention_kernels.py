"""The @triton.jit sources of the GPU attention leaf (pallas_kernels/triton_attention.py); the
step before it, RoPE and the K/V page write, is in _triton_rope_write_kernels.py.

The numbers a query row gets are defined by one algorithm, whatever the schedule:

* the context is cut into fixed *splits* of SPLIT positions counted from position 0, each split
  into KV tiles of BLOCK_N positions; a row reads positions 0..its own position and nothing else;
* inside a split, an online softmax over the tiles in order: scores s = (q . k) * scale from one
  tl.dot per tile, m = running max, p = exp(s - m) (libdevice expf), l = l * alpha + sum(p),
  acc = acc * alpha + dot(p in the model dtype, v), alpha = exp(m_old - m_new);
* the splits' (m, l, acc) are merged in split order with `merge` (explicit fma), and the output is
  acc / l (IEEE division), rounded once to the model dtype.

Two schedules run it: `attention_serial_kernel` walks a row's splits in one program (big steps:
prefill chunks, many decode rows); `attention_split_kernel` computes every split in its own program
(few rows, long context: more programs in flight), and the last of a tile's split programs to
finish merges the stored splits. Both use the same helpers on the same tile shapes, every kernel is
compiled with fp fusion off (no contraction the compiler could choose differently per kernel), so
the two schedules give the same bits; the leaf's tests check it.

Why a row's bits cannot depend on its batch: one program holds a *tile* of up to TPP consecutive
tokens of one request times the GP (padded) query heads of one KV head -- always ROWS = TPP * GP
rows, whatever the step's size -- and every row's arithmetic is per row (a row of an MMA never
touches its neighbours; maxima, sums and the merge are per row). Tiles past a row's position are
skipped with `tl.where` (not by adding zeros, which could turn -0.0 into +0.0), and positions past
the tile's last row are loaded as zeros, so garbage in unused KV slots never enters a product.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pallas_kernels._triton_kernels import expf as _expf
from pallas_kernels._triton_kernels import last_to_arrive


@triton.jit
def _tile_rows(pos_ptr, t0, n_tok, G: tl.constexpr, GP: tl.constexpr, TPP: tl.constexpr):
    """Rows r = j * GP + g of a tile: token t0 + j, query head h * G + g. Returns (g, row ok,
    token, the token's position)."""
    rows = tl.arange(0, TPP * GP)
    j = rows // GP
    g = rows % GP
    ok = (j < n_tok) & (g < G)
    tok = t0 + j
    return g, ok, tok, tl.load(pos_ptr + tok, mask=ok, other=0)


@triton.jit
def _row_ptrs(ptr, tok, g, h, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """[ROWS, D] addresses of (token, query head h * G + g) in a [T, HQ, D] array (q and out)."""
    d = tl.arange(0, D)
    return ptr + (tok.to(tl.int64) * HQ + h * G + g)[:, None] * D + d[None, :]


# The row sum's forms (the ROWSUM constexpr; pallas_kernels/triton_attention.py chooses one).
ROWSUM_TRITON, ROWSUM_TREE, ROWSUM_DOT = 0, 1, 2


@triton.jit
def _row_sum(p, v, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ROWSUM: tl.constexpr,
             IEEE: tl.constexpr):
    """Each row's sum over a KV tile. ROWSUM_TRITON (every launch today): tl.sum of p, whose order
    follows how the launch spreads a row over threads and warps -- the two bit classes of (ROWS,
    warps) measured on the H200 (docs/performance.md, sixteenth session). ROWSUM_TREE (an
    experiment, other bits): p summed by the halving tree, p[:, :h] + p[:, h:] until one column
    is left -- every add is of the same two values in any layout; it costs the narrow serial
    launch its reductions' layout changes. ROWSUM_DOT (an experiment, other bits): the sum of
    p in v's dtype, the p the numerator's p . v uses, taken by the same MMA as p . v (a dot
    with a ones matrix, whose columns are all the row's sum; their max is that sum exactly). An
    MMA never splits K across threads or warps, so no layout reaches it either (the H200's
    p . v and q . k already agree across every (ROWS, warps)), and the weights the output
    averages with then sum to exactly the l it is divided by."""
    if ROWSUM == 0:
        total = tl.sum(p, axis=1)
    elif ROWSUM == 1:
        part = p
        for level in tl.static_range(16):  # log2(BLOCK_N) halvings; BLOCK_N is a power of two
            if (BLOCK_N >> (level + 1)) > 0:
                part = tl.sum(tl.reshape(part, (ROWS, 2, BLOCK_N >> (level + 1))), axis=1)
        total = tl.sum(part, axis=1)  # one column left
    else:
        tl.static_assert(ROWSUM == 2, "ROWSUM must be 0 (Triton), 1 (tree) or 2 (dot)")
        ones = tl.full((BLOCK_N, 16), 1.0, tl.float32).to(v.dtype)  # exact in any dtype
        if IEEE:
            by_col = tl.dot(p.to(v.dtype), ones, input_precision="ieee")
        else:
            by_col = tl.dot(p.to(v.dtype), ones)
        total = tl.max(by_col, axis=1)
    return total


@triton.jit
def _split_state(q, row_pos, max_pos, req, split, bt_ptr, k_ptr, v_ptr, page_size, table_width,
                 scale, h, HKV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                 ROWSUM: tl.constexpr, PAGES: tl.constexpr):
    """Online softmax over the KV tiles of one split, for every row. Returns (m, l, acc).

    Where a tile's K/V rows are: PAGES 0 (JENGINE_ATTENTION_PAGES=tile) loads each tile's page ids
    inside the tile loop, so its K/V copies wait on a load issued in the same iteration and
    Triton's pipeliner cannot run them ahead of the compute (sm_90 TTGIR: every iteration begins
    by waiting for all its copies). PAGES > 0 (every launch by default since the twenty-third
    session; triton_attention_plan.paged plans it): the split's PAGES page ids (a power of two
    covering the pages a split spans) in one load before the loop, each tile's taken from them
    with tl.gather; with 3 stages the copies of tile i + 1 are then in flight while tile i
    computes. Only where the addresses come from changes: the
    same K/V values enter the same arithmetic (the same bits)."""
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, max_pos + 1)
    first = lo // page_size
    split_pages = _split_pages(bt_ptr, req, first, max_pos, page_size, table_width, PAGES)
    for start in range(lo, hi, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        in_tile = c <= max_pos  # positions some row of the tile may read
        k, v = _pool_tile(k_ptr, v_ptr, split_pages, first, c, in_tile, req, bt_ptr, page_size,
                          table_width, h, HKV, D, PAGES)
        m, l, acc = _online_step(q, k, v, c, start, row_pos, m, l, acc, scale, ROWS, BLOCK_N,
                                 IEEE, ROWSUM)
    return m, l, acc


@triton.jit
def _split_pages(bt_ptr, req, first, max_pos, page_size, table_width, PAGES: tl.constexpr):
    """PAGES > 0: the PAGES page ids of a split from its first page on, in one load (its tiles
    gather theirs from them: _pool_tile); PAGES 0: none (each tile loads its own)."""
    if PAGES > 0:
        sp = first + tl.arange(0, PAGES)
        split_pages = tl.load(bt_ptr + req * table_width + sp,
                              mask=(sp < table_width) & (sp * page_size <= max_pos), other=0)
    else:
        split_pages = first  # unused
    return split_pages


@triton.jit
def _pool_tile(k_ptr, v_ptr, split_pages, first, c, mask, req, bt_ptr, page_size, table_width, h,
               HKV: tl.constexpr, D: tl.constexpr, PAGES: tl.constexpr):
    """The K and V rows [len(c), D] of KV head h at positions c of request req, read from the
    pages; zeros where `mask` is false."""
    d = tl.arange(0, D)
    index = c // page_size  # each position's entry in the request's block table
    if PAGES > 0:
        # The two asserts compile only with Triton's debug on (TRITON_DEBUG=1: gpu_run.sh
        # pages_crash, whose launches faulted before the clamp): the window index in range, each
        # gathered id the block table's.
        at = index - first
        tl.device_assert((at >= 0) & (at < PAGES), "attention: page window index out of range")
        # Software pipelining runs this gather for the tiles past a split's end too (only their
        # copies are masked): unclamped, up to 4 ids past the window on the wide serial tiles
        # (memcheck: invalid shared reads), 8 at SPLIT 512 (a fault). The clamp leaves every real
        # tile's index as it is (docs/performance.md, 2026-12-06 and 2026-12-07).
        page = tl.gather(split_pages, tl.minimum(tl.maximum(at, 0), PAGES - 1), 0)
        tl.device_assert(page == tl.load(bt_ptr + req * table_width + index, mask=mask, other=0),
                         "attention: gathered page id differs from the block table's", mask=mask)
    else:
        page = tl.load(bt_ptr + req * table_width + index, mask=mask, other=0)
    slot = c % page_size
    kv_off = ((page.to(tl.int64) * page_size + slot) * HKV + h) * D
    k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    return k, v


@triton.jit
def _online_step(q, k, v, c, start, row_pos, m, l, acc, scale, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, IEEE: tl.constexpr, ROWSUM: tl.constexpr):
    """One KV tile (positions c = start + 0..BLOCK_N-1, rows k / v) of the online softmax:
    (m, l, acc) after it, for every row."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    valid = c[None, :] <= row_pos[:, None]
    s = tl.where(valid, s * scale, float("-inf"))
    live = start <= row_pos  # the row reads at least one position of this tile
    m_new = tl.where(live, tl.maximum(m, tl.max(s, axis=1)), m)
    alpha = _expf(m - m_new)
    p = tl.where(valid, _expf(s - m_new[:, None]), 0.0)
    l_new = tl.fma(l, alpha, _row_sum(p, v, ROWS, BLOCK_N, ROWSUM, IEEE))
    if IEEE:
        acc_new = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc_new = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    l = tl.where(live, l_new, l)
    acc = tl.where(live[:, None], acc_new, acc)
    return m_new, l, acc


@triton.jit
def _merge(big_m, big_l, big_acc, m, l, acc, live):
    """Fold one split's state into the running one (rows where the split is live)."""
    m_new = tl.maximum(big_m, m)
    ea = _expf(big_m - m_new)
    eb = _expf(m - m_new)
    l_new = tl.fma(big_l, ea, l * eb)
    acc_new = tl.fma(big_acc, ea[:, None], acc * eb[:, None])
    return (tl.where(live, m_new, big_m), tl.where(live, l_new, big_l),
            tl.where(live[:, None], acc_new, big_acc))


@triton.jit
def _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base, m, l, acc, ROWS: tl.constexpr,
                    W: tl.constexpr):
    """One split's state at partial rows [base, base + ROWS); acc rows are W wide."""
    rows = tl.arange(0, ROWS)
    tl.store(part_m_ptr + base + rows, m)
    tl.store(part_l_ptr + base + rows, l)
    w = tl.arange(0, W)
    tl.store(part_acc_ptr + (base + rows)[:, None] * W + w[None, :], acc)


@triton.jit
def _load_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base, ROWS: tl.constexpr,
                   W: tl.constexpr, CACHE: tl.constexpr):
    """One split's stored state at partial rows [base, base + ROWS)."""
    rows = tl.arange(0, ROWS)
    w = tl.arange(0, W)
    m = tl.load(part_m_ptr + base + rows, cache_modifier=CACHE)
    l = tl.load(part_l_ptr + base + rows, cache_modifier=CACHE)
    acc = tl.load(part_acc_ptr + (base + rows)[:, None] * W + w[None, :], cache_modifier=CACHE)
    return m, l, acc


@triton.jit
def _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base0, max_pos, row_pos,
                    ROWS: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr,
                    CACHE: tl.constexpr, STAGES: tl.constexpr):
    """Every live split's stored state (split s at base0 + s * ROWS) folded in split order, as the
    serial kernel folds them: the split and the serial schedules share this order and `_merge`.
    CACHE: the loads' cache modifier ("" in a kernel of its own; ".cg" where other programs of
    the same launch wrote the state). The loads are a chain of latencies (a split's merge is a
    few fmas): STAGES > 0 (triton_attention_plan.MERGE_STAGES, the split launch's) runs the loop
    on STAGES stages of Triton's pipeliner, STAGES - 1 splits' states copied ahead (sm_90 TTGIR:
    async copies), the same values merged in the same order (the same bits); STAGES 0 copies
    nothing ahead (the sm_90 PTX of a plain range loop). It replaced a hand-written load one
    split ahead (twenty-ninth session, measured against it: docs/performance.md). MLA's combine
    kernel runs STAGES 0 (not measured pipelined)."""
    big_m = tl.full((ROWS,), float("-inf"), tl.float32)
    big_l = tl.zeros((ROWS,), tl.float32)
    big_acc = tl.zeros((ROWS, W), tl.float32)
    for split in tl.range(0, max_pos // SPLIT + 1, num_stages=STAGES):
        m, l, acc = _load_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base0 + split * ROWS,
                                   ROWS, W, CACHE)
        big_m, big_l, big_acc = _merge(big_m, big_l, big_acc, m, l, acc, split * SPLIT <= row_pos)
    return big_l, big_acc


@triton.jit
def _store_out(out_ptr, big_l, big_acc, g, ok, tok, h, HQ: tl.constexpr, G: tl.constexpr,
               D: tl.constexpr):
    o = tl.math.div_rn(big_acc, big_l[:, None])
    tl.store(_row_ptrs(out_ptr, tok, g, h, HQ, G, D), o.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


@triton.jit
def _tile(tiles_ptr, num_tiles, tile):
    """tiles [4, num_tiles]: first token, token count, request row, largest position."""
    t0 = tl.load(tiles_ptr + tile)
    n_tok = tl.load(tiles_ptr + num_tiles + tile)
    req = tl.load(tiles_ptr + 2 * num_tiles + tile)
    max_pos = tl.load(tiles_ptr + 3 * num_tiles + tile)
    return t0, n_tok, req, max_pos


@triton.jit(do_not_specialize=["num_tiles", "page_size", "table_width"])
def attention_serial_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, tiles_ptr, num_tiles, page_size, table_width, scale,
    out_ptr,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, TPP: tl.constexpr,
    D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ROWSUM: tl.constexpr, PAGES: tl.constexpr,
):
    """Grid (tiles, HKV): every split of a tile's rows in one program, merged in order."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    t0, n_tok, req, max_pos = _tile(tiles_ptr, num_tiles, tile)
    if n_tok > 0:
        g, ok, tok, row_pos = _tile_rows(pos_ptr, t0, n_tok, G, GP, TPP)
        q = tl.load(_row_ptrs(q_ptr, tok, g, h, HQ, G, D), mask=ok[:, None], other=0.0)
        ROWS: tl.constexpr = TPP * GP
        big_m = tl.full((ROWS,), float("-inf"), tl.float32)
        big_l = tl.zeros((ROWS,), tl.float32)
        big_acc = tl.zeros((ROWS, D), tl.float32)
        for split in range(0, max_pos // SPLIT + 1):
            m, l, acc = _split_state(q, row_pos, max_pos, req, split, bt_ptr, k_ptr, v_ptr,
                                     page_size, table_width, scale, h, HKV, D,
                                     ROWS, BLOCK_N, SPLIT, IEEE, ROWSUM, PAGES)
            big_m, big_l, big_acc = _merge(big_m, big_l, big_acc, m, l, acc,
                                           split * SPLIT <= row_pos)
        _store_out(out_ptr, big_l, big_acc, g, ok, tok, h, HQ, G, D)


@triton.jit(do_not_specialize=["num_tiles", "page_size", "table_width"])
def attention_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, tiles_ptr, num_tiles, page_size, table_width, scale,
    sem_in_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sem_ptr,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, TPP: tl.constexpr,
    D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ROWSUM: tl.constexpr, PAGES: tl.constexpr, NSPLIT: tl.constexpr,
    MERGE_STAGES: tl.constexpr,
):
    """Grid (tiles, HKV, NSPLIT): one split of one tile per program, its state stored to the
    partials [tile, h, split, row]; sem_ptr: one int32 counter per (tile, h) (last_to_arrive;
    sem_in_ptr is the same buffer: _triton_launch.Counters). The last of a tile's
    live splits to count itself there merges the stored states in split order (the serial
    kernel's `_merge` on the same values: the same bits) and writes out_ptr -- one launch where a
    separate merge kernel took a second (32 launches fewer per decode step of an 8B model)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    t0, n_tok, req, max_pos = _tile(tiles_ptr, num_tiles, tile)
    if n_tok > 0:
        g, ok, tok, row_pos = _tile_rows(pos_ptr, t0, n_tok, G, GP, TPP)
        q = tl.load(_row_ptrs(q_ptr, tok, g, h, HQ, G, D), mask=ok[:, None], other=0.0)
        if split * SPLIT <= max_pos:
            ROWS: tl.constexpr = TPP * GP
            m, l, acc = _split_state(q, row_pos, max_pos, req, split, bt_ptr, k_ptr, v_ptr,
                                     page_size, table_width, scale, h, HKV, D,
                                     ROWS, BLOCK_N, SPLIT, IEEE, ROWSUM, PAGES)
            base0 = (tile.to(tl.int64) * HKV + h) * NSPLIT * ROWS
            _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base0 + split * ROWS, m, l,
                            acc, ROWS, D)
            if last_to_arrive(sem_ptr + tile * HKV + h, max_pos // SPLIT + 1):
                big_l, big_acc = _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base0,
                                                 max_pos, row_pos, ROWS, D, SPLIT, ".cg",
                                                 MERGE_STAGES)
                _store_out(out_ptr, big_l, big_acc, g, ok, tok, h, HQ, G, D)
