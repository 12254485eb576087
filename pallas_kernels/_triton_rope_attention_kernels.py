"""The @triton.jit source of RoPE + the KV write inside the split attention launch (planned by
default at steps of <= 16 rows and 2048 positions: pallas_kernels/triton_rope_attention.py). One
launch where a layer's decode step runs two: `rope_write_kernel` (rotates q and k, writes k and v
to the pages) and then `attention_split_kernel`; both in
pallas_kernels/_triton_attention_kernels.py.

The bits must be the two launches' exactly, so this kernel runs their helpers: the same `rope`
(three rounded operations per element), the same tile loop body (`_pool_tile`, `_online_step`),
the same partials, merge and output store, and it is compiled with the same launch options (fp
fusion off: nothing can contract differently here than there).

**No slot written in this launch is ever read back from the pool.** A launch has no grid-wide
order: a program cannot know whether the program writing a K/V slot has run. And a step of <= 32
rows is not only one decode token per request: it may carry a prompt chunk (its tiles read each
other's new K/V), tiles that straddle a split, and padding rows. So the launch takes every
position that is new in this step from its inputs instead:

* a tile's tokens belong to one *run*: its request's consecutive tokens of the step, at
  consecutive positions run_pos0, run_pos0 + 1, ... (engine/scheduler.py builds steps so). The
  host gives each tile its run's first token, run_pos0, and how many positions the run writes
  (`fresh`: the run's length, 0 for a padding run, whose page is outside [0, num_pages));
* a tile's positions below run_pos0 were written by earlier steps: read from the pages, as the
  split kernel reads them, in the same pipelined loop;
* positions from run_pos0 on (at most two KV tiles: a run of <= 32 tokens) are read by a second
  loop that masks them out of the page load, rotates the writing token's k from the inputs (the
  writer's own `rope` on the same values: the same bits as the stored k) and selects them into
  the tile with tl.where (exact);
* the pages are written by exactly one program per (token, KV head): the program of its tile's
  last split (always live), which rotates the tile's k for its head and stores k and v, dropping
  a padding row's write as rope_write_kernel does. Nobody reads what it stores until the next
  launch.

q is rotated in every live split program of a tile (the same pure arithmetic each time) and the
rows a tile does not hold are zeros, as the split kernel's masked load gives them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pallas_kernels._triton_attention_kernels import (_merge_partials, _online_step, _pool_tile,
                                                      _split_pages, _store_out, _store_partials,
                                                      _tile, _tile_rows)
from pallas_kernels._triton_kernels import last_to_arrive
from pallas_kernels._triton_rope_write_kernels import rope


@triton.jit
def _run(tiles_ptr, num_tiles, tile):
    """The tile's run (rows 4..6 of the [7, num_tiles] tiles): its first token, that token's
    position, and how many positions from there the step writes (0: none)."""
    run_t0 = tl.load(tiles_ptr + 4 * num_tiles + tile)
    run_pos0 = tl.load(tiles_ptr + 5 * num_tiles + tile)
    fresh = tl.load(tiles_ptr + 6 * num_tiles + tile)
    return run_t0, run_pos0, fresh


@triton.jit
def _rotated(src_ptr, tok, off, stride, cos_ptr, sin_ptr, ok, D: tl.constexpr):
    """Rows [R, D] at element tok * stride + off of src (off: a head's place in its token's row),
    rotated with each row's token's cos / sin row, as rope_write_kernel's `_rotate` rotates
    them. Rows not ok are loaded as zeros and come out of `rope` as +-0: callers mask them."""
    d = tl.arange(0, D)
    HALF: tl.constexpr = D // 2
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    row = tok.to(tl.int64) * stride + off
    x = tl.load(src_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    xr = tl.load(src_ptr + row[:, None] + partner[None, :], mask=ok[:, None], other=0.0)
    cs = tok.to(tl.int64)[:, None] * D + d[None, :]
    c = tl.load(cos_ptr + cs, mask=ok[:, None], other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs, mask=ok[:, None], other=0.0).to(tl.float32)
    return rope(x, xr, c, s, d, D)


@triton.jit
def _write_tile_kv(k_ptr, v_ptr, cos_ptr, sin_ptr, page_ptr, slot_ptr, num_pages, page_size,
                   kc_out_ptr, vc_out_ptr, t0, n_tok, h, HKV: tl.constexpr, D: tl.constexpr,
                   TPP: tl.constexpr, KVS: tl.constexpr, KO: tl.constexpr, VO: tl.constexpr):
    """rope_write's page write for the tile's tokens and KV head h: k rotated, k and v stored at
    each token's (page, slot); a page outside [0, num_pages) (a padding row's) writes nothing."""
    d = tl.arange(0, D)
    j = tl.arange(0, TPP)
    tok = t0 + j
    ok = j < n_tok
    k = _rotated(k_ptr, tok, KO + h * D, KVS, cos_ptr, sin_ptr, ok, D)
    v = tl.load(v_ptr + (tok.to(tl.int64) * KVS + VO + h * D)[:, None] + d[None, :],
                mask=ok[:, None])
    page = tl.load(page_ptr + tok, mask=ok, other=-1)
    slot = tl.load(slot_ptr + tok, mask=ok, other=0)
    write = ok & (page >= 0) & (page < num_pages)
    dst = ((page.to(tl.int64) * page_size + slot) * HKV + h) * D
    tl.store(kc_out_ptr + dst[:, None] + d[None, :], k.to(kc_out_ptr.dtype.element_ty),
             mask=write[:, None])
    tl.store(vc_out_ptr + dst[:, None] + d[None, :], v.to(vc_out_ptr.dtype.element_ty),
             mask=write[:, None])


@triton.jit
def _split_state_fresh(q, row_pos, max_pos, req, split, bt_ptr, kc_ptr, vc_ptr, page_size,
                       table_width, scale, h, k_ptr, v_ptr, cos_ptr, sin_ptr, run_t0, fresh_lo,
                       HKV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                       ROWSUM: tl.constexpr, PAGES: tl.constexpr, KVS: tl.constexpr,
                       KO: tl.constexpr, VO: tl.constexpr):
    """`_split_state` (the split kernel's) with positions >= fresh_lo -- those this step writes,
    written by token run_t0 + (position - fresh_lo) -- taken from the inputs, not the pages.

    Two loops over the split's KV tiles in order, the same tile body: the tiles before the first
    one holding a fresh position read only the pages (today's pipelined loop); the rest, at most
    two of them in a step of <= 32 rows, select the fresh rows into the tile."""
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, max_pos + 1)
    first = lo // page_size
    split_pages = _split_pages(bt_ptr, req, first, max_pos, page_size, table_width, PAGES)
    # the first tile holding a fresh position (none: every tile reads only the pages)
    mid = tl.where(fresh_lo > max_pos, hi,
                   tl.minimum(tl.maximum(fresh_lo // BLOCK_N * BLOCK_N, lo), hi))
    for start in range(lo, mid, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        in_tile = c <= max_pos
        k, v = _pool_tile(kc_ptr, vc_ptr, split_pages, first, c, in_tile, req, bt_ptr, page_size,
                          table_width, h, HKV, D, PAGES)
        m, l, acc = _online_step(q, k, v, c, start, row_pos, m, l, acc, scale, ROWS, BLOCK_N,
                                 IEEE, ROWSUM)
    d = tl.arange(0, D)
    for start in tl.range(mid, hi, BLOCK_N, num_stages=1):
        c = start + tl.arange(0, BLOCK_N)
        in_tile = c <= max_pos
        new = in_tile & (c >= fresh_lo)
        k, v = _pool_tile(kc_ptr, vc_ptr, split_pages, first, c, in_tile & (c < fresh_lo), req,
                          bt_ptr, page_size, table_width, h, HKV, D, PAGES)
        writer = tl.where(new, run_t0 + (c - fresh_lo), 0)
        k_new = _rotated(k_ptr, writer, KO + h * D, KVS, cos_ptr, sin_ptr, new, D)
        v_new = tl.load(v_ptr + (writer.to(tl.int64) * KVS + VO + h * D)[:, None] + d[None, :],
                        mask=new[:, None], other=0.0)
        k = tl.where(new[:, None], k_new, k)
        v = tl.where(new[:, None], v_new, v)
        m, l, acc = _online_step(q, k, v, c, start, row_pos, m, l, acc, scale, ROWS, BLOCK_N,
                                 IEEE, ROWSUM)
    return m, l, acc


@triton.jit(do_not_specialize=["num_pages", "num_tiles", "page_size", "table_width"])
def attention_rope_split_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, page_ptr, slot_ptr, kc_ptr, vc_ptr, bt_ptr, pos_ptr,
    tiles_ptr, num_pages, num_tiles, page_size, table_width, scale,
    sem_in_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, kc_out_ptr, vc_out_ptr, sem_ptr,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, TPP: tl.constexpr,
    D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ROWSUM: tl.constexpr, PAGES: tl.constexpr, NSPLIT: tl.constexpr,
    MERGE_STAGES: tl.constexpr, QS: tl.constexpr, KVS: tl.constexpr, KO: tl.constexpr,
    VO: tl.constexpr,
):
    """Grid (tiles, HKV, NSPLIT), as attention_split_kernel's, on the unrotated q / k / v.

    q / k / v: element t * QS + (head) * D of q_ptr is token t's q head (t * KVS + KO + h * D of
    k_ptr its k head h, t * KVS + VO + h * D of v_ptr its v head): three [T, H, D] arrays (KO =
    VO = 0), or the projections' merged [T, (HQ + 2 HKV) * D] rows passed three times (auto's
    triton_fused_qkv layout). cos / sin [T, D]; page / slot [T]: where token t's k and v go.
    kc / vc and kc_out / vc_out: the same pages (updated in place). tiles [7, num_tiles]: the
    split kernel's four rows, then each tile's run (`_run`)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    t0, n_tok, req, max_pos = _tile(tiles_ptr, num_tiles, tile)
    if n_tok > 0:
        g, ok, tok, row_pos = _tile_rows(pos_ptr, t0, n_tok, G, GP, TPP)
        if split == max_pos // SPLIT:  # the tile's last split: its K/V writer (one per head)
            _write_tile_kv(k_ptr, v_ptr, cos_ptr, sin_ptr, page_ptr, slot_ptr, num_pages,
                           page_size, kc_out_ptr, vc_out_ptr, t0, n_tok, h, HKV, D, TPP, KVS, KO,
                           VO)
        if split * SPLIT <= max_pos:
            ROWS: tl.constexpr = TPP * GP
            q = _rotated(q_ptr, tok, (h * G + g) * D, QS, cos_ptr, sin_ptr, ok, D)
            q = tl.where(ok[:, None], q, 0.0)  # the split kernel's masked load: +0 rows
            run_t0, run_pos0, fresh = _run(tiles_ptr, num_tiles, tile)
            fresh_lo = tl.where(fresh > 0, run_pos0, max_pos + 1)
            m, l, acc = _split_state_fresh(q, row_pos, max_pos, req, split, bt_ptr, kc_ptr,
                                           vc_ptr, page_size, table_width, scale, h, k_ptr,
                                           v_ptr, cos_ptr, sin_ptr, run_t0, fresh_lo, HKV, D,
                                           ROWS, BLOCK_N, SPLIT, IEEE, ROWSUM, PAGES, KVS, KO,
                                           VO)
            base0 = (tile.to(tl.int64) * HKV + h) * NSPLIT * ROWS
            _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base0 + split * ROWS, m, l,
                            acc, ROWS, D)
            if last_to_arrive(sem_ptr + tile * HKV + h, max_pos // SPLIT + 1):
                big_l, big_acc = _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base0,
                                                 max_pos, row_pos, ROWS, D, SPLIT, ".cg",
                                                 MERGE_STAGES)
                _store_out(out_ptr, big_l, big_acc, g, ok, tok, h, HQ, G, D)
