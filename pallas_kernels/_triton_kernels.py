"""The @triton.jit sources of the GPU leaves: one source each, launched from JAX and from torch.

Here: the helpers every kernel shares (libdevice exp / rsqrt, the exact f32 multiply, the arrival
counter, the halving tree) and the norm, SiLU and block_sumexp kernels. The GEMM's kernels are in
_triton_gemm_kernels.py, the attention's in _triton_attention_kernels.py, RoPE + the KV write's in
_triton_rope_write_kernels.py (the two in one launch: _triton_rope_attention_kernels.py) and
MLA's in _triton_mla_kernels.py, each beside the helpers it takes from here.

This module imports triton at the top, so only the leaf modules (triton_gemm.py, triton_norm.py,
triton_activation.py, triton_sampling.py) import it, lazily, on first call. Everything here is a
pure function of static shapes: no autotuning, nothing that reaches the bits chosen by the row
count (a GEMM's launch shape may follow M, its K chunks may not), and where a kernel has two
schedules (split-K GEMM, split attention) both give the same bits.

Why one source and not two implementations: jax-triton compiles a `triton.jit` function with the
installed Triton, and torch launches the same function through Triton's own launcher, so the two
hosts run the same PTX (measured: 0 differing outputs; platform-facts.md). A trainer that calls the
torch launchers gets the engine's bits, not a re-implementation's.

Arithmetic choices that keep the bits independent of the row count and faithful to the HF forms:
* GEMM: KSPLIT fixed K chunks, summed in order (_triton_gemm_kernels.py).
* exp and rsqrt are libdevice's (__nv_expf, __nv_rsqrtf): the functions torch CUDA and XLA call;
  Triton's own tl.exp is ex2.approx. Division is div_rn (IEEE); Triton's `/` is div.full (approx).
* Sums over a row are the lead's halving tree (pallas_kernels/fixed_order.tree_sum): pad to a power
  of two with zeros, then repeatedly add the upper half onto the lower half.

Argument order: inputs (arrays, then scalars; a launch's counters -- `_triton_launch.Counters` --
last), then outputs, then constexprs, because jax-triton appends the output pointers after every
positional input.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from pallas_kernels._triton_launch import interpreting

if interpreting():
    # Triton's interpreter (the CPU tests' logic checks) has no libdevice; numpy's exp and
    # 1 / sqrt stand in.
    @triton.jit
    def expf(x):
        return tl.exp(x)

    @triton.jit
    def rsqrtf(x):
        return tl.rsqrt(x)

    @triton.jit
    def mul_f32(a, b):
        return a * b
else:
    @triton.jit
    def expf(x):
        """libdevice __nv_expf: the exp torch CUDA and XLA call (tl.exp is ex2.approx)."""
        return libdevice.exp(x)

    @triton.jit
    def rsqrtf(x):
        """libdevice __nv_rsqrtf: the function XLA and torch call."""
        return libdevice.rsqrt(x)

    @triton.jit
    def mul_f32(a, b):
        """a * b in f32, rounded to f32 (mul.rn.f32), whatever is done with it next. Written as
        PTX because the compiler narrows `(a.to(f32) * b.to(f32)).to(bf16)` of bf16 a, b to one
        bf16 multiply (mul.bf16, seen in the sm_90 PTX): one rounding where torch's bf16 multiply
        (f32 math, then a rounding to bf16) has two -- different bits where the f32 product is
        subnormal."""
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def last_to_arrive(sem_ptr, count):
    """Count this program in the int32 at sem_ptr (zero when the launch starts); True in the
    `count`-th to arrive, which also puts the counter back to zero -- every other program has
    counted by then, so the launch leaves its counters as it found them and the next launch may
    count in the same buffer without a memset (_triton_launch.Counters). Every thread's stores
    happen before the count (barrier), the count releases them to the GPU and the last program's
    count acquires every other program's: it may then read what they stored (bypassing L1: .cg
    loads). A launch that splits one output over programs merges it in its last program this
    way -- the GEMM's fused split-K reduce, the split attention's merge."""
    tl.debug_barrier()
    last = tl.atomic_add(sem_ptr, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.atomic_xchg(sem_ptr, 0, sem="relaxed", scope="gpu")
    return last


# -- the halving tree ------------------------------------------------------------------------------


@triton.jit
def halving_tree_sum(v, WIDTH: tl.constexpr, LOG2: tl.constexpr):
    """Sum of a [WIDTH] vector, WIDTH = 2**LOG2: v[:h] + v[h:] until one element is left.

    tl.reshape keeps row-major order (can_reorder=False), so row 0 of the [2, h] view is v[:h] and
    row 1 is v[h:]; the size-2 sum is one IEEE add (commutative), i.e. exactly fixed_order.tree_sum.
    """
    for level in tl.static_range(LOG2):
        v = tl.sum(tl.reshape(v, (2, WIDTH >> (level + 1))), axis=0)
    return tl.sum(v, axis=0)  # one element left


# -- RMSNorm ---------------------------------------------------------------------------------------


@triton.jit
def _rmsnorm_row(xf, w_ptr, offs, ok, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                 LOG2: tl.constexpr, out_ty: tl.constexpr):
    sq = tl.where(ok, xf * xf, 0.0)
    var = tl.math.div_rn(halving_tree_sum(sq, BLOCK, LOG2), H * 1.0)
    return _normed_times_weight(xf, var, eps, w_ptr, offs, ok, out_ty)


@triton.jit
def _normed_times_weight(xf, var, eps, w_ptr, w_offs, w_ok, out_ty: tl.constexpr):
    """The norm after its variance: xf * rsqrt(var + eps) rounded to out_ty, times the weight
    (w_ptr + w_offs, rounded to out_ty), rounded again. var and w_offs arrive shaped to broadcast
    against xf (a row, or a [ROWS, H] tile)."""
    # eps arrives as f32 from both launchers (jax-triton would type a Python float as fp64 and
    # promote the sum: triton_norm.py passes np.float32). No .to here: under the interpreter a
    # Python float arrives as itself; the sm_90 PTX is the same as with the cast (compared).
    normed = (xf * rsqrtf(var + eps)).to(out_ty)
    w = tl.load(w_ptr + w_offs, mask=w_ok, other=0.0).to(out_ty)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(out_ty)


@triton.jit
def mean_kernel(x_ptr, out_ptr, H: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr):
    """One f32 row's mean, as _rmsnorm_row takes it: the halving tree, then div_rn by H. The
    trainer's `pow(2).mean(-1)` runs this on the GPU, so its variance is the norm kernel's."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row, tl.math.div_rn(halving_tree_sum(x, BLOCK, LOG2), H * 1.0))


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, eps, out_ptr,
                   H: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr):
    """One row per program: HF RMSNorm (widen, mean of squares, rsqrt, round, * weight, round)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=ok, other=0.0)
    y = _rmsnorm_row(x.to(tl.float32), w_ptr, offs, ok, eps, H, BLOCK, LOG2,
                     x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * H + offs, y, mask=ok)


@triton.jit
def add_rmsnorm_row(x_ptr, res_ptr, w_ptr, eps, out_ptr, new_res_ptr, row,
                    H: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr,
                    ROUND_SUM: tl.constexpr, CACHE: tl.constexpr):
    """One row of the fused layer boundary: total = x + residual in f32 feeds the norm
    (ROUND_SUM: the total rounded to x's dtype does, the bits of a separate add then
    rmsnorm_kernel); the rounded total is the new residual stream. row: int64. CACHE: x's load
    modifier ("" in a kernel of its own; ".cg" where other programs of the launch wrote x)."""
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=ok, other=0.0, cache_modifier=CACHE)
    r = tl.load(res_ptr + row * H + offs, mask=ok, other=0.0)
    total = x.to(tl.float32) + r.to(tl.float32)
    out_ty: tl.constexpr = x_ptr.dtype.element_ty
    if ROUND_SUM:
        total = total.to(out_ty).to(tl.float32)
    y = _rmsnorm_row(total, w_ptr, offs, ok, eps, H, BLOCK, LOG2, out_ty)
    tl.store(out_ptr + row * H + offs, y, mask=ok)
    tl.store(new_res_ptr + row * H + offs, total.to(out_ty), mask=ok)


@triton.jit
def add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, eps, out_ptr, new_res_ptr,
                       H: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr,
                       ROUND_SUM: tl.constexpr):
    """Fused layer boundary, one row per program (add_rmsnorm_row; pallas_kernels/rmsnorm.
    add_rmsnorm)."""
    add_rmsnorm_row(x_ptr, res_ptr, w_ptr, eps, out_ptr, new_res_ptr,
                    tl.program_id(0).to(tl.int64), H, BLOCK, LOG2, ROUND_SUM, "")


@triton.jit
def halving_tree_sum_rows(v, ROWS: tl.constexpr, WIDTH: tl.constexpr, LOG2: tl.constexpr):
    """halving_tree_sum of each row of a [ROWS, WIDTH] tile: the same size-2 sums, so the same
    bits as a row alone, whatever layout the compiler gives the tile."""
    for level in tl.static_range(LOG2):
        v = tl.sum(tl.reshape(v, (ROWS, 2, WIDTH >> (level + 1))), axis=1)
    return tl.sum(v, axis=1)  # one element left per row


@triton.jit
def add_rmsnorm_rows_kernel(x_ptr, res_ptr, w_ptr, eps, M, out_ptr, new_res_ptr,
                            H: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr,
                            ROWS: tl.constexpr):
    """The unfused layer boundary (add_rmsnorm_row with ROUND_SUM) on ROWS rows per program: at
    prefill M one row per program ran at ~1.1 TB/s on the H200 (rl-bitwise's 4096-token prefill:
    64 launches, 7.3 ms). Only for the rounded sum: its square is exact in f32 (a bf16 value's),
    so whether the compiler contracts a square into the tree's first add (an FMA, which it does
    by layout) cannot reach the bits; the f32 sum of the fused boundary has no such guarantee."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    ok = (rows < M)[:, None] & (offs < H)[None, :]
    at = rows[:, None] * H + offs[None, :]
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    r = tl.load(res_ptr + at, mask=ok, other=0.0)
    out_ty: tl.constexpr = x_ptr.dtype.element_ty
    total = (x.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tf = total.to(tl.float32)
    sq = tl.where(ok, tf * tf, 0.0)
    var = tl.math.div_rn(halving_tree_sum_rows(sq, ROWS, BLOCK, LOG2), H * 1.0)
    y = _normed_times_weight(tf, var[:, None], eps, w_ptr, offs[None, :], (offs < H)[None, :],
                             out_ty)
    tl.store(out_ptr + at, y, mask=ok)
    tl.store(new_res_ptr + at, total, mask=ok)


# -- SiLU ------------------------------------------------------------------------------------------


@triton.jit
def silu_rounded(x, out_ty: tl.constexpr):
    """x / (1 + exp(-x)) in f32 of x's values, rounded once to out_ty: torch's
    ActivationSiluKernel form."""
    xf = x.to(tl.float32)
    return tl.math.div_rn(xf, 1.0 + expf(-xf)).to(out_ty)


@triton.jit
def times_rounded(y, up, out_ty: tl.constexpr):
    """y * up in f32, rounded to out_ty: SwiGLU's act(gate) * up after the SiLU's own rounding
    (two roundings, as torch's two ops)."""
    return mul_f32(y.to(tl.float32), up.to(tl.float32)).to(out_ty)


@triton.jit
def silu_kernel(x_ptr, up_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                HAS_TIMES: tl.constexpr):
    """silu_rounded over a flat array of N elements, BLOCK per program; HAS_TIMES: times_rounded
    by up after it. N is a constant so that the compiler can prove the mask uniform over a
    thread's 16 bytes and load them as one vector: as a runtime scalar from jax-triton (which
    declares no scalar divisible by 16, where Triton's own launcher does) every element was a
    load of its own."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    y = silu_rounded(x, out_ptr.dtype.element_ty)
    if HAS_TIMES:
        up = tl.load(up_ptr + offs, mask=ok, other=0.0)
        y = times_rounded(y, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=ok)


# -- block_sumexp ----------------------------------------------------------------------------------


@triton.jit
def _exp_chunk(row_ptr, block_start, c: tl.constexpr, CHUNK: tl.constexpr, V: tl.constexpr):
    """exp of one chunk; columns past the vocabulary are -inf logits (exp = +0.0): the last block
    is completed, not truncated."""
    offs = block_start + c * CHUNK + tl.arange(0, CHUNK)
    return expf(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")))


@triton.jit
def block_sumexp_kernel(shifted_ptr, out_ptr, V: tl.constexpr, BLOCK: tl.constexpr,
                        CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr):
    """out[r, j] = halving-tree sum of exp(shifted[r, j*BLOCK:(j+1)*BLOCK]), j < cdiv(V, BLOCK).

    The first levels of a halving tree over BLOCK elements add chunk c to chunk c + n/2, so over
    NCH = BLOCK / CHUNK chunks the tree is T(c) = T(even chunks) + T(odd chunks); it is written
    out for NCH <= 8 below, then the remaining levels run inside one CHUNK-wide vector.
    """
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    NCH: tl.constexpr = BLOCK // CHUNK
    row_ptr = shifted_ptr + row * V
    start = blk * BLOCK
    if NCH == 1:
        v = _exp_chunk(row_ptr, start, 0, CHUNK, V)
    elif NCH == 2:
        v = _exp_chunk(row_ptr, start, 0, CHUNK, V) + _exp_chunk(row_ptr, start, 1, CHUNK, V)
    elif NCH == 4:
        v = ((_exp_chunk(row_ptr, start, 0, CHUNK, V) + _exp_chunk(row_ptr, start, 2, CHUNK, V))
             + (_exp_chunk(row_ptr, start, 1, CHUNK, V) + _exp_chunk(row_ptr, start, 3, CHUNK, V)))
    else:
        tl.static_assert(NCH == 8, "block_sumexp: BLOCK / CHUNK must be 1, 2, 4 or 8")
        v = (((_exp_chunk(row_ptr, start, 0, CHUNK, V) + _exp_chunk(row_ptr, start, 4, CHUNK, V))
              + (_exp_chunk(row_ptr, start, 2, CHUNK, V) + _exp_chunk(row_ptr, start, 6, CHUNK, V)))
             + ((_exp_chunk(row_ptr, start, 1, CHUNK, V) + _exp_chunk(row_ptr, start, 5, CHUNK, V))
                + (_exp_chunk(row_ptr, start, 3, CHUNK, V) + _exp_chunk(row_ptr, start, 7, CHUNK, V))))
    total = halving_tree_sum(v, CHUNK, LOG2_CHUNK)
    tl.store(out_ptr + row * tl.cdiv(V, BLOCK) + blk, total)
