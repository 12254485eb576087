"""The @triton.jit sources of the GPU GEMM leaves (pallas_kernels/triton_gemm.py, and the routed
experts' triton_moe_grouped_gemm.py): one tile body, its serial and split schedules, the grouped
and expert launches, and the split schedule's reduce. Kernels that run this body and then what
follows the projection are in _triton_gemm_epilogue_kernels.py.

Arithmetic that keeps a row's bits independent of the row count: KSPLIT fixed K chunks per static
(N, K, dtype); each accumulates in order, BK at a time (the MMA itself K 16 at a time), in a fresh
f32 accumulator, and the chunk sums are added in order; rows outside M are loaded as zeros and
never stored. A row is one row of the MMA, so its products and sums never touch its neighbours.
f32 operands use input_precision="ieee" (Triton's default for f32 is TF32).

Argument order as in _triton_kernels.py: inputs (arrays, then scalars; a launch's counters last),
then outputs, then constexprs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pallas_kernels._triton_kernels import last_to_arrive


@triton.jit
def _gemm_chunk(x_ptr, w_ptr, rm, offs_n, row_ok, col_ok, k_lo,
                N, K: tl.constexpr, KC: tl.constexpr, IEEE_F32: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_N: tl.constexpr):
    """x[:, k_lo:k_lo+KC] @ w[k_lo:k_lo+KC, :] for one tile: a fresh f32 accumulator, K in order,
    BK at a time. N (w's row stride) is a constexpr from fixed_tile_gemm_kernel and a runtime
    value from grouped_gemm_kernel: it moves addresses only, never the arithmetic."""
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None] * K + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + (k_lo + offs_k)[:, None] * N + offs_n[None, :]
    EVEN_K: tl.constexpr = KC % BK == 0
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, KC, BK):  # KC is static: a fixed trip count, k blocks in order
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok, other=0.0)
            if EVEN_N:
                b = tl.load(w_ptrs)
            else:
                b = tl.load(w_ptrs, mask=col_ok, other=0.0)
        else:
            k_ok = (k_lo + k0 + offs_k) < K
            a = tl.load(x_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        if IEEE_F32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BK
        w_ptrs += BK * N
    return acc


@triton.jit
def _gemm_flat(x_ptr, w_ptr, rm, offs_n, row_ok, col_ok, N, K: tl.constexpr, KC: tl.constexpr,
               IEEE_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               EVEN_N: tl.constexpr):
    """Every K chunk of a tile in one loop: `_gemm_chunk`'s steps, a chunk's accumulator closed
    into the running total when the chunk ends (the first chunk *is* the total: no 0 + c0, which
    would turn a -0.0 into +0.0) and started again from zero. The serial schedule's operations on
    the same values, so its bits; but one loop, which Triton pipelines across chunk boundaries
    (the serial form's KSPLIT loops each fill and drain their own pipeline). K % (KSPLIT * BK) ==
    0 (_check_tile), so every load is whole in K."""
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] * N + offs_n[None, :]
    CHUNK: tl.constexpr = KC // BK  # K blocks per chunk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, K // BK):
        a = tl.load(x_ptrs, mask=row_ok, other=0.0)
        if EVEN_N:
            b = tl.load(w_ptrs)
        else:
            b = tl.load(w_ptrs, mask=col_ok, other=0.0)
        if IEEE_F32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if (kb + 1) % CHUNK == 0:  # a chunk ends: into the total, in chunk order
            total = tl.where(kb + 1 == CHUNK, acc, total + acc)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        x_ptrs += BK
        w_ptrs += BK * N
    return total


@triton.jit
def _serial_sum(x_ptr, w_ptr, bias_ptr, rm, offs_n, row_ok, col_ok, N, K: tl.constexpr,
                HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, KSPLIT: tl.constexpr, EVEN_N: tl.constexpr,
                FLAT_K: tl.constexpr):
    """The serial schedule's f32 tile: every chunk, summed in order (in one K loop with FLAT_K),
    + bias. x_ptr is the tile's first row."""
    KC: tl.constexpr = K // KSPLIT
    if FLAT_K:
        acc = _gemm_flat(x_ptr, w_ptr, rm, offs_n, row_ok, col_ok, N, K, KC, IEEE_F32,
                         BM, BN, BK, EVEN_N)
    else:
        acc = _gemm_chunk(x_ptr, w_ptr, rm, offs_n, row_ok, col_ok, 0, N, K, KC, IEEE_F32,
                          BM, BN, BK, EVEN_N)
        for c in tl.static_range(1, KSPLIT):
            acc = acc + _gemm_chunk(x_ptr, w_ptr, rm, offs_n, row_ok, col_ok, c * KC, N, K,
                                    KC, IEEE_F32, BM, BN, BK, EVEN_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    return acc


@triton.jit
def _sum_stored_chunks(tile_base, in_tile, mask, M, N, KSPLIT: tl.constexpr):
    """A tile's KSPLIT f32 chunk sums, stored at tile_base + c * M * N + in_tile, added in chunk
    order (gemm_reduce_kernel's operations) by the program that closes the tile. Loaded .cg:
    other programs of the same launch stored them."""
    # M * N in 64 bits (tl.cast: M may arrive as the constant 1, jax-triton specializes it, and
    # a constant has no .to).
    chunk_elems = tl.cast(M, tl.int64) * N
    total = tl.load(tile_base + in_tile, mask=mask, other=0.0, cache_modifier=".cg")
    for c in tl.static_range(1, KSPLIT):
        total = total + tl.load(tile_base + c * chunk_elems + in_tile, mask=mask, other=0.0,
                                cache_modifier=".cg")
    return total


@triton.jit
def _gemm_tile(x_ptr, w_ptr, bias_ptr, out_ptr, M, pid_m, pid_n, chunk,
               N, K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               KSPLIT: tl.constexpr, PARTIAL: tl.constexpr, EVEN_N: tl.constexpr,
               final_ptr=None, sem_ptr=None, tile_id=0, FUSED: tl.constexpr = False,
               FLAT_K: tl.constexpr = False):
    """Output tile (pid_m, pid_n) of out[M, N] = x @ w: every chunk and the epilogue (serial), or
    chunk `chunk`'s f32 sum into out_ptr[chunk, M, N] (split). The one body the GEMM kernels run.

    FLAT_K (serial only, k_split > 1): the chunks in one K loop (`_gemm_flat`), not one loop each.

    FUSED (split only): the reduce runs here instead of in gemm_reduce_kernel. Each program stores
    its chunk, then counts itself in sem_ptr[tile_id] (last_to_arrive); the program that
    arrives last adds the tile's KSPLIT chunks in order -- the reduce kernel's operations on the
    same values -- and writes final_ptr. One launch instead of two. Returns True in that program
    (a kernel with more to do once the tile is whole: gemm_add_rmsnorm_kernel), else False."""
    closed = False
    # 64-bit arithmetic only in the scalar tile base; in-tile offsets stay 32-bit (fewer registers).
    x_ptr += pid_m.to(tl.int64) * (BM * K)
    rows_here = M - pid_m * BM
    rm = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    row_ok = rm[:, None] < rows_here
    col_ok = offs_n[None, :] < N
    KC: tl.constexpr = K // KSPLIT
    if PARTIAL:
        acc = _gemm_chunk(x_ptr, w_ptr, rm, offs_n, row_ok, col_ok, chunk * KC, N, K, KC,
                          IEEE_F32, BM, BN, BK, EVEN_N)
        tile_base = out_ptr + pid_m.to(tl.int64) * (BM * N)
        in_tile = rm[:, None] * N + offs_n[None, :]
        tl.store(tile_base + chunk.to(tl.int64) * M * N + in_tile, acc, mask=row_ok & col_ok)
        if FUSED:
            closed = last_to_arrive(sem_ptr + tile_id, KSPLIT)
            if closed:
                total = _sum_stored_chunks(tile_base, in_tile, row_ok & col_ok, M, N, KSPLIT)
                if HAS_BIAS:
                    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
                    total = total + bias[None, :]
                final_ptr += pid_m.to(tl.int64) * (BM * N)
                tl.store(final_ptr + in_tile, total.to(final_ptr.dtype.element_ty),
                         mask=row_ok & col_ok)
    else:
        acc = _serial_sum(x_ptr, w_ptr, bias_ptr, rm, offs_n, row_ok, col_ok, N, K, HAS_BIAS,
                          IEEE_F32, BM, BN, BK, KSPLIT, EVEN_N, FLAT_K)
        out_ptr += pid_m.to(tl.int64) * (BM * N)
        tl.store(out_ptr + rm[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok & col_ok)
    return closed


@triton.jit
def _tile_of(pid, M, NUM_PID_N: tl.constexpr, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped launch order for L2 reuse. It decides which program computes which tile, never how a
    tile is computed, so it may depend on M."""
    num_pid_m = tl.cdiv(M, BM)
    group = GROUP_M * NUM_PID_N
    first_m = (pid // group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group) % group_rows, (pid % group) // group_rows


@triton.jit(do_not_specialize=["M"])
def fixed_tile_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, M, out_ptr,
    N: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    KSPLIT: tl.constexpr, PARTIAL: tl.constexpr, FLAT_K: tl.constexpr,
):
    """out[M, N] = cast(x[M, K] @ w[K, N] (+ bias[N]) in f32). Row-major, contiguous operands.

    K is cut into KSPLIT fixed chunks; each chunk's product starts from a zero accumulator and the
    chunk sums are added in order: ((c0 + c1) + c2) + ... Serial schedule (PARTIAL=False): one
    program does every chunk and the epilogue. Split schedule (PARTIAL=True, grid axis 1 = chunk):
    each program stores its chunk's f32 sum to out_ptr[chunk, M, N] and gemm_reduce_kernel adds
    them in the same order. Same operations either way, so the same bits. FLAT_K: the serial
    schedule's chunks in one K loop (a tile's `flat_k`).
    """
    pid_m, pid_n = _tile_of(tl.program_id(0), M, (N + BN - 1) // BN, BM, GROUP_M)
    chunk = tl.program_id(1)  # 0 on the serial schedule's 1-D grid
    EVEN_N: tl.constexpr = N % BN == 0
    _gemm_tile(x_ptr, w_ptr, bias_ptr, out_ptr, M, pid_m, pid_n, chunk, N, K, HAS_BIAS, IEEE_F32,
               BM, BN, BK, KSPLIT, PARTIAL, EVEN_N, FLAT_K=FLAT_K)


@triton.jit(do_not_specialize=["M"])
def fixed_tile_gemm_fused_kernel(
    x_ptr, w_ptr, bias_ptr, M, sem_in_ptr, part_ptr, out_ptr, sem_ptr,
    N: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    KSPLIT: tl.constexpr,
):
    """fixed_tile_gemm_kernel's split schedule with its reduce inside (a tile's `fused_reduce`):
    chunks to part_ptr[KSPLIT, M, N], the last of a tile's KSPLIT programs adds them in order into
    out_ptr; sem_ptr: one int32 counter per output tile (_triton_launch.Counters: sem_in_ptr is
    the same buffer). The same operations, so the same bits."""
    num_pid_n: tl.constexpr = (N + BN - 1) // BN
    pid_m, pid_n = _tile_of(tl.program_id(0), M, num_pid_n, BM, GROUP_M)
    EVEN_N: tl.constexpr = N % BN == 0
    _gemm_tile(x_ptr, w_ptr, bias_ptr, part_ptr, M, pid_m, pid_n, tl.program_id(1), N, K,
               HAS_BIAS, IEEE_F32, BM, BN, BK, KSPLIT, True, EVEN_N,
               out_ptr, sem_ptr, pid_m * num_pid_n + pid_n, True)


@triton.jit
def _group_program(M, N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, GROUP_M: tl.constexpr):
    """A grouped launch's program (members' column tiles side by side): its row tile, its column
    tile within its member, its member (in1, in2: for `_pick`), that member's N, and the output
    tile's index over the whole group (a fused reduce's counter)."""
    T0: tl.constexpr = (N0 + BN - 1) // BN
    T1: tl.constexpr = (N1 + BN - 1) // BN
    T2: tl.constexpr = (N2 + BN - 1) // BN
    pid_m, pid_n = _tile_of(tl.program_id(0), M, T0 + T1 + T2, BM, GROUP_M)
    in1 = pid_n >= T0
    in2 = pid_n >= T0 + T1
    n = tl.where(in2, N2, tl.where(in1, N1, N0))
    first = tl.where(in2, T0 + T1, tl.where(in1, T0, 0))
    return pid_m, pid_n - first, in1, in2, n, pid_m * (T0 + T1 + T2) + pid_n


@triton.jit
def _pick(in1, in2, p0, p1, p2):
    """The member's pointer among (p0, p1, p2): selected, not branched on (one K loop per
    program)."""
    return tl.where(in2, p2, tl.where(in1, p1, p0))


@triton.jit(do_not_specialize=["M"])
def grouped_gemm_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, M, out0_ptr, out1_ptr, out2_ptr,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    KSPLIT: tl.constexpr, PARTIAL: tl.constexpr, FLAT_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """Two or three GEMMs of one x (q/k/v, gate/up) in one launch: out_i = x @ w_i (+ b_i).

    The column tiles of the members are laid side by side; a program picks its member's pointers
    and N, then runs _gemm_tile -- the body fixed_tile_gemm_kernel runs, with the same tile -- so
    each output has the bits of its own launch (H200: scripts/gpu_validate.py "gemm group").
    Selecting pointers rather than branching keeps one K loop in the program: a branch per member
    gave each member its own pipeline buffers (2 x 144 KiB of shared memory, over the H200's
    227 KiB). N2 = 0: two members (out2 unused). EVEN_N: every member's N is a multiple of BN.
    """
    pid_m, pid_n, in1, in2, n, _ = _group_program(M, N0, N1, N2, BM, BN, GROUP_M)
    _gemm_tile(x_ptr, _pick(in1, in2, w0_ptr, w1_ptr, w2_ptr),
               _pick(in1, in2, b0_ptr, b1_ptr, b2_ptr),
               _pick(in1, in2, out0_ptr, out1_ptr, out2_ptr), M, pid_m, pid_n, tl.program_id(1), n,
               K, HAS_BIAS, IEEE_F32, BM, BN, BK, KSPLIT, PARTIAL, EVEN_N, FLAT_K=FLAT_K)


@triton.jit(do_not_specialize=["M"])
def grouped_gemm_fused_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, M, sem_in_ptr,
    p0_ptr, p1_ptr, p2_ptr, out0_ptr, out1_ptr, out2_ptr, sem_ptr,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    KSPLIT: tl.constexpr, EVEN_N: tl.constexpr,
):
    """grouped_gemm_kernel's split schedule with the reduce inside (fixed_tile_gemm_fused_kernel's
    scheme per member): chunks to p_i[KSPLIT, M, N_i], the sums to out_i; sem_ptr: one int32
    counter per (row tile, column tile of the whole group), sem_in_ptr the same buffer."""
    pid_m, pid_n, in1, in2, n, tile_id = _group_program(M, N0, N1, N2, BM, BN, GROUP_M)
    _gemm_tile(x_ptr, _pick(in1, in2, w0_ptr, w1_ptr, w2_ptr),
               _pick(in1, in2, b0_ptr, b1_ptr, b2_ptr), _pick(in1, in2, p0_ptr, p1_ptr, p2_ptr),
               M, pid_m, pid_n, tl.program_id(1), n, K, HAS_BIAS, IEEE_F32, BM, BN, BK, KSPLIT,
               True, EVEN_N, _pick(in1, in2, out0_ptr, out1_ptr, out2_ptr), sem_ptr, tile_id, True)


@triton.jit(do_not_specialize=["M"])
def expert_gemm_kernel(
    x_ptr, w_ptr, tile_expert_ptr, M, out_ptr,
    N: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    KSPLIT: tl.constexpr, PARTIAL: tl.constexpr, FLAT_K: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """Routed experts' GEMMs in one launch (pallas_kernels/moe_grouped_gemm.py): out[r] =
    x[r] @ w[e] with e = tile_expert[r // BLOCK_ROWS], w [E, K, N], rows sorted by expert.

    BLOCK_ROWS is a multiple of BM, so a program's rows share one expert: it reads that expert and
    runs _gemm_tile on its [K, N] weight -- the body and the tile fixed_tile_gemm_kernel runs, N a
    constexpr as there -- so every row has the bits of the dense launch on that row. An empty block
    (e = -1, past the last routed pair) skips the K loop and stores zeros. HAS_BIAS is False.
    """
    pid_m, pid_n = _tile_of(tl.program_id(0), M, (N + BN - 1) // BN, BM, GROUP_M)
    chunk = tl.program_id(1)  # 0 on the serial schedule's 1-D grid
    EVEN_N: tl.constexpr = N % BN == 0
    expert = tl.load(tile_expert_ptr + (pid_m * BM) // BLOCK_ROWS)
    if expert >= 0:
        _gemm_tile(x_ptr, w_ptr + expert.to(tl.int64) * (K * N), w_ptr, out_ptr, M, pid_m, pid_n,
                   chunk, N, K, HAS_BIAS, IEEE_F32, BM, BN, BK, KSPLIT, PARTIAL, EVEN_N,
                   FLAT_K=FLAT_K)
    else:
        rm = tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        zeros = tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty)
        if PARTIAL:
            out_ptr += chunk.to(tl.int64) * M * N
        out_ptr += pid_m.to(tl.int64) * (BM * N)
        tl.store(out_ptr + rm[:, None] * N + offs_n[None, :], zeros,
                 mask=(rm[:, None] < M - pid_m * BM) & (offs_n[None, :] < N))


@triton.jit
def _reduce_block(part_ptr, bias_ptr, M, out_ptr, block, N: tl.constexpr, HAS_BIAS: tl.constexpr,
                  KSPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for c in tl.static_range(1, KSPLIT):
        acc = acc + tl.load(part_ptr + c * M * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def gemm_reduce_kernel(part_ptr, bias_ptr, M, out_ptr, N: tl.constexpr, HAS_BIAS: tl.constexpr,
                       KSPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """The split schedule's epilogue: chunk sums added in chunk order, + bias, rounded once."""
    _reduce_block(part_ptr, bias_ptr, M, out_ptr, tl.program_id(0), N, HAS_BIAS, KSPLIT, BLOCK)


@triton.jit(do_not_specialize=["M"])
def grouped_reduce_kernel(p0_ptr, p1_ptr, p2_ptr, b0_ptr, b1_ptr, b2_ptr, M,
                          out0_ptr, out1_ptr, out2_ptr,
                          N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
                          HAS_BIAS: tl.constexpr, KSPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """gemm_reduce_kernel for every member of a grouped GEMM, in one launch."""
    pid = tl.program_id(0)
    g0 = tl.cdiv(M * N0, BLOCK)
    g1 = tl.cdiv(M * N1, BLOCK)
    if pid < g0:
        _reduce_block(p0_ptr, b0_ptr, M, out0_ptr, pid, N0, HAS_BIAS, KSPLIT, BLOCK)
    elif pid < g0 + g1:
        _reduce_block(p1_ptr, b1_ptr, M, out1_ptr, pid - g0, N1, HAS_BIAS, KSPLIT, BLOCK)
    else:
        if N2 > 0:
            _reduce_block(p2_ptr, b2_ptr, M, out2_ptr, pid - g0 - g1, N2, HAS_BIAS, KSPLIT, BLOCK)
