"""The @triton.jit sources of the GPU absorbed-MLA leaf (pallas_kernels/triton_mla_attention.py).

MLA with W_UK absorbed is multi-query attention: every head scores the same latent vector per
position, ``latent = concat(c [R], k_rope [P])``, and reads back its first R columns. So a program
holds a tile of TPP consecutive tokens of one request x a block of BH (padded) heads -- up to 64,
two blocks for DeepSeek-V3's 128 -- as the M dimension of its dots (ROWS = TPP * BH), and reads
each latent once for them.

The algorithm is the dense leaf's (pallas_kernels/_triton_attention_kernels.py), with its helpers:
fixed splits of SPLIT positions from position 0, KV tiles of BLOCK_N positions, an online softmax
per split, splits merged in split order (`_merge`, explicit fma), acc / l by IEEE division. Only the
score and the value differ:

* score = q_latent . c + q_rope . k_rope, as chained tl.dots into one f32 accumulator: R in chunks
  of BLOCK_K columns, then the P rotary columns (two widths that are each a power of two, where
  R + P = 576 is not), then times scale;
* the value is the latent's columns [v0, v0 + BV): the R output columns are cut into blocks of BV
  (program axis 2) so a program's f32 accumulator stays ROWS x BV; each block recomputes the same
  scores with the same instructions, so every block sees the same p.

Every constant (BH, TPP, BV, BLOCK_K, BLOCK_N, SPLIT) is a function of the static head count and
widths only, never of the step, so a token's bits do not depend on its batch, its chunk, or whether
it was prefilled or decoded. Masking is as in the dense leaf: tiles past a row's position are
skipped with tl.where, positions past the tile's last row load as zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pallas_kernels._triton_attention_kernels import _merge, _merge_partials, _store_partials, _tile
from pallas_kernels._triton_kernels import expf as _expf


@triton.jit
def _tile_rows(pos_ptr, t0, n_tok, hb, H: tl.constexpr, BH: tl.constexpr, TPP: tl.constexpr):
    """Rows r = j * BH + i of a tile: token t0 + j, head hb * BH + i. Returns (head, row ok,
    token, the token's position)."""
    rows = tl.arange(0, TPP * BH)
    j = rows // BH
    head = hb * BH + rows % BH
    ok = (j < n_tok) & (head < H)
    tok = t0 + j
    return head, ok, tok, tl.load(pos_ptr + tok, mask=ok, other=0)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _split_state(q_ptr, head, ok, tok, row_pos, max_pos, req, split, bt_ptr, lat_ptr, page_size,
                 table_width, scale, v0, H: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                 ROWS: tl.constexpr, BV: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over the KV tiles of one split, for every row and the value columns
    [v0, v0 + BV). Returns (m, l, acc)."""
    W: tl.constexpr = R + P
    q_row = q_ptr + (tok.to(tl.int64) * H + head) * W  # [ROWS] row starts in q [T, H, W]
    kk = tl.arange(0, BLOCK_K)
    pp = tl.arange(0, P)
    vv = tl.arange(0, BV)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BV), tl.float32)
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, max_pos + 1)
    for start in range(lo, hi, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        in_tile = c <= max_pos  # positions some row of the tile may read
        page = tl.load(bt_ptr + req * table_width + c // page_size, mask=in_tile, other=0)
        lat_row = lat_ptr + (page.to(tl.int64) * page_size + c % page_size) * W  # [BLOCK_N]
        s = tl.zeros((ROWS, BLOCK_N), tl.float32)
        for k0 in tl.static_range(0, R, BLOCK_K):
            q = tl.load(q_row[:, None] + k0 + kk[None, :], mask=ok[:, None], other=0.0)
            ck = tl.load(lat_row[:, None] + k0 + kk[None, :], mask=in_tile[:, None], other=0.0)
            s = _dot(q, tl.trans(ck), s, IEEE)
        q = tl.load(q_row[:, None] + R + pp[None, :], mask=ok[:, None], other=0.0)
        kr = tl.load(lat_row[:, None] + R + pp[None, :], mask=in_tile[:, None], other=0.0)
        s = _dot(q, tl.trans(kr), s, IEEE)
        valid = c[None, :] <= row_pos[:, None]
        s = tl.where(valid, s * scale, float("-inf"))
        live = start <= row_pos  # the row reads at least one position of this tile
        m_new = tl.where(live, tl.maximum(m, tl.max(s, axis=1)), m)
        alpha = _expf(m - m_new)
        p = tl.where(valid, _expf(s - m_new[:, None]), 0.0)
        l_new = tl.fma(l, alpha, tl.sum(p, axis=1))
        v = tl.load(lat_row[:, None] + v0 + vv[None, :], mask=in_tile[:, None], other=0.0)
        acc_new = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        l = tl.where(live, l_new, l)
        acc = tl.where(live[:, None], acc_new, acc)
        m = m_new
    return m, l, acc


@triton.jit
def _store_out(out_ptr, big_l, big_acc, head, ok, tok, v0, H: tl.constexpr, R: tl.constexpr,
               BV: tl.constexpr):
    o = tl.math.div_rn(big_acc, big_l[:, None])
    vv = tl.arange(0, BV)
    ptrs = out_ptr + ((tok.to(tl.int64) * H + head) * R + v0)[:, None] + vv[None, :]
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit(do_not_specialize=["num_tiles", "page_size", "table_width"])
def mla_serial_kernel(
    q_ptr, lat_ptr, bt_ptr, pos_ptr, tiles_ptr, num_tiles, page_size, table_width, scale,
    out_ptr,
    H: tl.constexpr, BH: tl.constexpr, TPP: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
    BV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid (tiles, head blocks, value blocks): every split of a tile's rows in one program,
    merged in order."""
    tile = tl.program_id(0)
    hb = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    t0, n_tok, req, max_pos = _tile(tiles_ptr, num_tiles, tile)
    if n_tok > 0:
        head, ok, tok, row_pos = _tile_rows(pos_ptr, t0, n_tok, hb, H, BH, TPP)
        ROWS: tl.constexpr = TPP * BH
        big_m = tl.full((ROWS,), float("-inf"), tl.float32)
        big_l = tl.zeros((ROWS,), tl.float32)
        big_acc = tl.zeros((ROWS, BV), tl.float32)
        for split in range(0, max_pos // SPLIT + 1):
            m, l, acc = _split_state(q_ptr, head, ok, tok, row_pos, max_pos, req, split, bt_ptr,
                                     lat_ptr, page_size, table_width, scale, v0, H, R, P, ROWS,
                                     BV, BLOCK_K, BLOCK_N, SPLIT, IEEE)
            big_m, big_l, big_acc = _merge(big_m, big_l, big_acc, m, l, acc,
                                           split * SPLIT <= row_pos)
        _store_out(out_ptr, big_l, big_acc, head, ok, tok, v0, H, R, BV)


@triton.jit
def _part_base(tile, hb, vb, split, HB: tl.constexpr, VB: tl.constexpr, NSPLIT: tl.constexpr,
               ROWS: tl.constexpr):
    """First row of one split's partials, laid out [tile, head block, value block, split, row]."""
    return (((tile.to(tl.int64) * HB + hb) * VB + vb) * NSPLIT + split) * ROWS


@triton.jit(do_not_specialize=["num_tiles", "page_size", "table_width"])
def mla_split_kernel(
    q_ptr, lat_ptr, bt_ptr, pos_ptr, tiles_ptr, num_tiles, page_size, table_width, scale,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    H: tl.constexpr, BH: tl.constexpr, TPP: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
    BV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, HB: tl.constexpr, NSPLIT: tl.constexpr,
):
    """Grid (tiles, head blocks * value blocks, NSPLIT): one split of one tile per program."""
    VB: tl.constexpr = R // BV
    tile = tl.program_id(0)
    hb = tl.program_id(1) // VB
    vb = tl.program_id(1) % VB
    split = tl.program_id(2)
    t0, n_tok, req, max_pos = _tile(tiles_ptr, num_tiles, tile)
    if n_tok > 0:
        if split * SPLIT <= max_pos:
            head, ok, tok, row_pos = _tile_rows(pos_ptr, t0, n_tok, hb, H, BH, TPP)
            ROWS: tl.constexpr = TPP * BH
            m, l, acc = _split_state(q_ptr, head, ok, tok, row_pos, max_pos, req, split, bt_ptr,
                                     lat_ptr, page_size, table_width, scale, vb * BV, H, R, P,
                                     ROWS, BV, BLOCK_K, BLOCK_N, SPLIT, IEEE)
            base = _part_base(tile, hb, vb, split, HB, VB, NSPLIT, ROWS)
            _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, base, m, l, acc, ROWS, BV)


@triton.jit(do_not_specialize=["num_tiles"])
def mla_combine_kernel(
    pos_ptr, tiles_ptr, num_tiles, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    H: tl.constexpr, BH: tl.constexpr, TPP: tl.constexpr, R: tl.constexpr, BV: tl.constexpr,
    SPLIT: tl.constexpr, HB: tl.constexpr, NSPLIT: tl.constexpr,
):
    """Grid (tiles, head blocks, value blocks): merge mla_split_kernel's partials in split order,
    as the serial kernel does."""
    VB: tl.constexpr = R // BV
    tile = tl.program_id(0)
    hb = tl.program_id(1)
    vb = tl.program_id(2)
    t0, n_tok, req, max_pos = _tile(tiles_ptr, num_tiles, tile)
    if n_tok > 0:
        ROWS: tl.constexpr = TPP * BH
        head, ok, tok, row_pos = _tile_rows(pos_ptr, t0, n_tok, hb, H, BH, TPP)
        big_l, big_acc = _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr,
                                         _part_base(tile, hb, vb, 0, HB, VB, NSPLIT, ROWS),
                                         max_pos, row_pos, ROWS, BV, SPLIT, "", 0)
        _store_out(out_ptr, big_l, big_acc, head, ok, tok, vb * BV, H, R, BV)
