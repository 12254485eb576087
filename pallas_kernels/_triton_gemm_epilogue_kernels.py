"""The @triton.jit sources of three experiments (issue #19) that run a projection and a
neighbouring elementwise step in one launch: o_proj / down_proj with the layer boundary's add +
norm after it (pallas_kernels/triton_gemm_add_norm.py), gate/up with SwiGLU's activation after it
(pallas_kernels/triton_gemm_swiglu.py), and down_proj with that activation before it, in the
loads of its A (scripts/gpu_silu_down.py; wired into no leaf). Each is the GEMM's own tile body
(_triton_gemm_kernels.py) with the standalone kernel's operations (_triton_kernels.py) on the same
values, so each output has the bits of the launches it would replace. A model runs the first two
only on request (JENGINE_GEMM_EPILOGUES; pallas_kernels/gemm_epilogues.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pallas_kernels._triton_gemm_kernels import (_gemm_tile, _serial_sum, _sum_stored_chunks,
                                                 _tile_of)
from pallas_kernels._triton_kernels import (add_rmsnorm_row, last_to_arrive, silu_rounded,
                                            times_rounded)


@triton.jit(do_not_specialize=["M"])
def gemm_add_rmsnorm_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, nw_ptr, eps, M, sem_in_ptr, part_ptr, h_ptr, out_ptr,
    new_res_ptr, sem_ptr,
    N: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    KSPLIT: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr,
):
    """fixed_tile_gemm_fused_kernel, then the layer boundary after it, in the same launch:
    h = x @ w (+ bias) rounded to h's dtype, then per row norm(h + residual) with the sum rounded
    first (add_rmsnorm_kernel's ROUND_SUM: the unfused boundary) and that rounded sum as the new
    residual. sem_ptr: one counter per output tile, then one per row block (sem_in_ptr is the same
    buffer). The program that closes a tile counts it in its row block's counter; the one that
    closes the block's last tile norms the block's rows, one at a time, with add_rmsnorm_row --
    the standalone kernel's operations on the same values, so its bits (the squares of a rounded
    sum are exact in f32, so no mul + add contraction the compiler may choose per layout can
    reach them). One program per row block: for decode steps of few rows (a block of BM rows is
    normed serially), where the boundary's own launch is a share of the step."""
    num_pid_n: tl.constexpr = (N + BN - 1) // BN
    pid_m, pid_n = _tile_of(tl.program_id(0), M, num_pid_n, BM, GROUP_M)
    EVEN_N: tl.constexpr = N % BN == 0
    closed = _gemm_tile(x_ptr, w_ptr, bias_ptr, part_ptr, M, pid_m, pid_n, tl.program_id(1), N, K,
                        HAS_BIAS, IEEE_F32, BM, BN, BK, KSPLIT, True, EVEN_N,
                        h_ptr, sem_ptr, pid_m * num_pid_n + pid_n, True)
    if closed:
        row_blocks_base = tl.cdiv(M, BM) * num_pid_n  # the tile counters come first
        if last_to_arrive(sem_ptr + row_blocks_base + pid_m, num_pid_n):
            for row in range(pid_m * BM, tl.minimum(pid_m * BM + BM, M)):
                # tl.cast: under the interpreter the loop counter is a Python int (no .to)
                add_rmsnorm_row(h_ptr, res_ptr, nw_ptr, eps, out_ptr, new_res_ptr,
                                tl.cast(row, tl.int64), N, BLOCK, LOG2, True, ".cg")


@triton.jit(do_not_specialize=["M"])
def gemm_swiglu_kernel(
    x_ptr, wg_ptr, wu_ptr, M, sem_in_ptr, gate_ptr, up_ptr, out_ptr, sem_ptr,
    N: tl.constexpr, K: tl.constexpr, IEEE_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    KSPLIT: tl.constexpr, FLAT_K: tl.constexpr,
):
    """SwiGLU's act = silu(x @ wg) * (x @ wu) in one launch, on the grouped gate/up launch's
    programs: each computes one gate or one up tile -- the serial schedule's tile (`_serial_sum`:
    the same K chunks, so its own launch's bits), rounded to out's dtype and stored to gate / up
    -- and counts itself on its pair's counter (sem_ptr: one per (row tile, column tile);
    sem_in_ptr is the same buffer). The pair's last program reads the other tile back and applies
    silu_rounded and times_rounded, silu_kernel's operations on those values, to the pair. The
    column tiles are interleaved (gate j, up j, gate j + 1, ...) so that a pair's programs run
    side by side. What it saves is SiLU's own launch (32 per decode step of an 8B model, each
    with a gap before it). The eighteenth session's form, where one program computed both tiles,
    halved the programs and lost 33-38 %."""
    T: tl.constexpr = (N + BN - 1) // BN
    pid_m, col = _tile_of(tl.program_id(0), M, 2 * T, BM, GROUP_M)
    pid_n = col // 2
    is_up = col % 2 == 1
    EVEN_N: tl.constexpr = N % BN == 0
    x_ptr += pid_m.to(tl.int64) * (BM * K)
    rm = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    row_ok = rm[:, None] < M - pid_m * BM
    col_ok = offs_n[None, :] < N
    out_ty: tl.constexpr = out_ptr.dtype.element_ty
    w_ptr = tl.where(is_up, wu_ptr, wg_ptr)
    mine = _serial_sum(x_ptr, w_ptr, w_ptr, rm, offs_n, row_ok, col_ok, N, K, False, IEEE_F32,
                       BM, BN, BK, KSPLIT, EVEN_N, FLAT_K).to(out_ty)
    tile = pid_m.to(tl.int64) * (BM * N) + rm[:, None] * N + offs_n[None, :]
    tl.store(tl.where(is_up, up_ptr, gate_ptr) + tile, mine, mask=row_ok & col_ok)
    if last_to_arrive(sem_ptr + pid_m * T + pid_n, 2):
        other = tl.load(tl.where(is_up, gate_ptr, up_ptr) + tile, mask=row_ok & col_ok,
                        other=0.0, cache_modifier=".cg")
        gate = tl.where(is_up, other, mine)
        up = tl.where(is_up, mine, other)
        act = times_rounded(silu_rounded(gate, out_ty), up, out_ty)
        tl.store(out_ptr + tile, act, mask=row_ok & col_ok)


@triton.jit
def _silu_rows_chunk(g_ptr, u_ptr, w_ptr, M, offs_n, col_ok, k_lo,
                     N: tl.constexpr, K: tl.constexpr, KC: tl.constexpr, RB: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_N: tl.constexpr):
    """_gemm_chunk with A made, not loaded: silu_kernel's operations (silu_rounded, then
    times_rounded) on RB rows of gate and up, row r placed at MMA row r * (BM // RB) and the other
    MMA rows zero. Only the real rows (RB >= M) are computed: every column tile's program
    recomputes its chunk's activation, so a full BM-row A would cost BM / RB times the SiLUs.
    Rows never meet in the MMA, so which MMA row a row occupies cannot move its bits."""
    R: tl.constexpr = BM // RB
    offs_k = tl.arange(0, BK)
    rs = tl.arange(0, RB)
    ok = rs[:, None] < M
    g_ptrs = g_ptr + rs[:, None] * K + (k_lo + offs_k)[None, :]
    u_ptrs = u_ptr + rs[:, None] * K + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + (k_lo + offs_k)[:, None] * N + offs_n[None, :]
    keep = (tl.arange(0, BM) % R == 0)[:, None]
    out_ty: tl.constexpr = g_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, KC, BK):  # KC % BK == 0 (the launcher checks): no K mask
        g = tl.load(g_ptrs, mask=ok, other=0.0)
        u = tl.load(u_ptrs, mask=ok, other=0.0)
        act = times_rounded(silu_rounded(g, out_ty), u, out_ty)
        if R == 1:
            a = act
        else:
            a = tl.reshape(tl.broadcast_to(act[:, None, :], (RB, R, BK)), (BM, BK))
            a = tl.where(keep, a, tl.zeros_like(a))
        if EVEN_N:
            b = tl.load(w_ptrs)
        else:
            b = tl.load(w_ptrs, mask=col_ok, other=0.0)
        acc = tl.dot(a, b, acc)
        g_ptrs += BK
        u_ptrs += BK
        w_ptrs += BK * N
    return acc


@triton.jit(do_not_specialize=["M"])
def silu_gemm_rows_kernel(
    g_ptr, u_ptr, w_ptr, M, sem_in_ptr, part_ptr, out_ptr, sem_ptr,
    N: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KSPLIT: tl.constexpr,
    RB: tl.constexpr,
):
    """out = (silu(gate) * up) @ w for M <= RB <= BM rows (one row tile): the SiLU launch and the
    fused-reduce GEMM launch after it (fixed_tile_gemm_fused_kernel) in one. Grid (column tiles,
    KSPLIT); each program makes its chunk of A itself (_silu_rows_chunk), stores its f32 partial
    and the last of a tile's KSPLIT programs adds them in order and rounds once, as
    _gemm_tile's FUSED branch does. sem_ptr: one counter per column tile."""
    R: tl.constexpr = BM // RB
    pid_n = tl.program_id(0)
    chunk = tl.program_id(1)
    EVEN_N: tl.constexpr = N % BN == 0
    rm = tl.arange(0, BM)
    row = rm // R
    offs_n = pid_n * BN + tl.arange(0, BN)
    col_ok = offs_n[None, :] < N
    ok = ((rm % R == 0) & (row < M))[:, None] & col_ok
    KC: tl.constexpr = K // KSPLIT
    acc = _silu_rows_chunk(g_ptr, u_ptr, w_ptr, M, offs_n, col_ok, chunk * KC, N, K, KC, RB,
                           BM, BN, BK, EVEN_N)
    in_tile = row[:, None] * N + offs_n[None, :]
    tl.store(part_ptr + chunk.to(tl.int64) * M * N + in_tile, acc, mask=ok)
    if last_to_arrive(sem_ptr + pid_n, KSPLIT):
        total = _sum_stored_chunks(part_ptr, in_tile, ok, M, N, KSPLIT)
        tl.store(out_ptr + in_tile, total.to(out_ptr.dtype.element_ty), mask=ok)
