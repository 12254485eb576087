"""The @triton.jit sources of RoPE and the K/V page write (pallas_kernels/triton_rope_write.py):
`rope`, the one rotation of every launch that rotates -- rope_write_kernel here and the attention
launch that rotates inside it (_triton_rope_attention_kernels.py) -- so both give the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate(ptr, base, heads, ok, c, s, d, D: tl.constexpr):
    """HF's x * cos + rotate_half(x) * sin for the rows `heads` of the [H, D] block at ptr + base,
    each of its three operations rounded to x's dtype (c, s: the f32-widened cos / sin row)."""
    HALF: tl.constexpr = D // 2
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    rows = base + heads[:, None] * D
    x = tl.load(ptr + rows + d[None, :], mask=ok[:, None], other=0.0)
    xr = tl.load(ptr + rows + partner[None, :], mask=ok[:, None], other=0.0)
    return rope(x, xr, c, s, d, D)  # c, s [D]: broadcast over the rows where they are used


@triton.jit
def rope(x, xr, c, s, d, D: tl.constexpr):
    """x * cos + rotate_half(x) * sin, each of the three operations rounded to x's dtype: x [R, D]
    rows, xr the same rows' partner elements (d + D/2 for d < D/2, d - D/2 after), c / s the
    f32-widened cos / sin broadcastable to [R, D]. The one rotation of every launch that rotates
    (rope_write_kernel, and the attention launch that rotates inside it:
    _triton_rope_attention_kernels.py), so both give the same bits -- compiled with fp fusion
    off, x * c + xr * s cannot contract into an fma in either."""
    HALF: tl.constexpr = D // 2
    # rotate_half's negation, exact: Triton's unary minus is 0 - x, which makes +0 of +0 where
    # torch's and XLA's negation make -0 (and so a sum's zero sign could differ from theirs).
    xr = tl.where(d[None, :] < HALF, xr * -1.0, xr)
    a = (x.to(tl.float32) * c).to(x.dtype)
    b = (xr.to(tl.float32) * s).to(x.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)


@triton.jit(do_not_specialize=["num_pages", "page_size"])
def rope_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, page_ptr, slot_ptr, kc_ptr, vc_ptr, num_pages,
    page_size, q_out_ptr, kc_out_ptr, vc_out_ptr,
    HQ: tl.constexpr, HKV: tl.constexpr, HQP: tl.constexpr, HKVP: tl.constexpr,
    D: tl.constexpr, QKV: tl.constexpr,
):
    """Grid (T,): token t's q and k rotated (q to q_out), its k and v stored at (page[t], slot[t])
    of the pages kc_out / vc_out (the same buffers as kc / vc: the pool is updated in place). A
    page outside [0, num_pages) is a padding row's: its write is dropped, as XLA's scatter drops
    it. Every product is an exact bf16 x bf16 in f32 and every rounding explicit: compiled with fp
    fusion off, the bits of the three rounded ops of pallas_kernels/rope_write.py.
    QKV: q_ptr is the q/k/v projections' merged output [T, (HQ + 2 HKV) * D] (k_ptr and v_ptr
    are not read): the same values from other addresses (triton_rope_write's triton_fused_qkv)."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    c = tl.load(cos_ptr + t * D + d).to(tl.float32)
    s = tl.load(sin_ptr + t * D + d).to(tl.float32)
    row = t * ((HQ + 2 * HKV) * D)  # QKV's row
    hq = tl.arange(0, HQP)
    ok_q = hq < HQ
    if QKV:
        q = _rotate(q_ptr, row, hq, ok_q, c, s, d, D)
    else:
        q = _rotate(q_ptr, t * (HQ * D), hq, ok_q, c, s, d, D)
    tl.store(q_out_ptr + t * (HQ * D) + hq[:, None] * D + d[None, :], q, mask=ok_q[:, None])
    hk = tl.arange(0, HKVP)
    ok_k = hk < HKV
    if QKV:
        k = _rotate(q_ptr, row + HQ * D, hk, ok_k, c, s, d, D)
        v = tl.load(q_ptr + row + (HQ + HKV) * D + hk[:, None] * D + d[None, :],
                    mask=ok_k[:, None])
    else:
        k = _rotate(k_ptr, t * (HKV * D), hk, ok_k, c, s, d, D)
        v = tl.load(v_ptr + t * (HKV * D) + hk[:, None] * D + d[None, :], mask=ok_k[:, None])
    page = tl.load(page_ptr + t)
    slot = tl.load(slot_ptr + t)
    if (page >= 0) & (page < num_pages):
        dst = ((page.to(tl.int64) * page_size + slot) * HKV + hk[:, None]) * D + d[None, :]
        tl.store(kc_out_ptr + dst, k.to(kc_out_ptr.dtype.element_ty), mask=ok_k[:, None])
        tl.store(vc_out_ptr + dst, v.to(vc_out_ptr.dtype.element_ty), mask=ok_k[:, None])
