"""The Triton attention leaf's logic, on the CPU, under Triton's interpreter.

What the interpreter can show (numpy arithmetic, not the GPU's): the kernels compute attention
(against a float64 reference), the serial and split schedules give the same bits, a token's output
does not change with how its request is chunked or what shares the step, unused KV slots (NaN here)
never leak in, and the dense-causal twin equals the paged form. The GPU's own bits are checked by
scripts/gpu_validate.py on the H200 (docs/gpu-validation.md). Skipped where triton or torch is
missing; `tiles_jax == tiles_torch` needs only torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences, numpy_halving_tree

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pallas_kernels import triton_attention as ta  # noqa: E402
from pallas_kernels import triton_attention_plan as tap  # noqa: E402

# Rows not live in a split compute exp(-inf - -inf) = NaN, which tl.where then discards.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")

HQ, HKV, D, PAGE = 4, 2, 16, 8
SCALE = D ** -0.5


def _pool(rng, lengths, num_pages=64):
    """K/V pool [num_pages, PAGE, HKV, D] (f32, unused slots NaN), each request on shuffled pages."""
    k = np.full((num_pages, PAGE, HKV, D), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    free = list(rng.permutation(np.arange(1, num_pages)))  # page 0 is the null page
    tables, seqs = [], []
    width = max(-(-n // PAGE) for n in lengths)
    for n in lengths:
        pages = [free.pop() for _ in range(-(-n // PAGE))]
        kk = rng.standard_normal((n, HKV, D)).astype(np.float32)
        vv = rng.standard_normal((n, HKV, D)).astype(np.float32)
        for pos in range(n):
            k[pages[pos // PAGE], pos % PAGE] = kk[pos]
            v[pages[pos // PAGE], pos % PAGE] = vv[pos]
        tables.append(pages + [0] * (width - len(pages)))
        seqs.append((kk, vv))
    return torch.from_numpy(k), torch.from_numpy(v), torch.tensor(tables, dtype=torch.int32), seqs


def _req_pos(rows):
    """rows: list of (request, position) in step order -> the step's token_req, positions."""
    return (torch.tensor([r for r, _ in rows], dtype=torch.int32),
            torch.tensor([p for _, p in rows], dtype=torch.int32))


def _step(q_rows, table, rows, schedule=None):
    """rows: list of (request, position) in step order -> output [T, HQ, D] (numpy)."""
    req, pos = _req_pos(rows)
    return ta.paged_attention_triton_torch(q_rows, table[:2], table[2], req, pos, scale=SCALE,
                                           schedule=schedule).numpy()


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    lengths = [45, 300, 17]  # 300 > SPLIT: several splits
    k, v, tables, seqs = _pool(rng, lengths)
    q = {r: rng.standard_normal((n, HQ, D)).astype(np.float32) for r, n in enumerate(lengths)}
    return k, v, tables, seqs, q, lengths


def _q(q, rows):
    return torch.from_numpy(np.stack([q[r][p] for r, p in rows]))


def _reference(q, kk, vv, pos):
    qd = q.astype(np.float64)
    kr = np.repeat(kk[: pos + 1].astype(np.float64), HQ // HKV, axis=1)
    vr = np.repeat(vv[: pos + 1].astype(np.float64), HQ // HKV, axis=1)
    s = np.einsum("hd,chd->hc", qd, kr) * SCALE
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hc,chd->hd", p / p.sum(-1, keepdims=True), vr)


def test_matches_float64_reference(setup):
    k, v, tables, seqs, q, lengths = setup
    rows = [(1, p) for p in range(0, 300, 37)] + [(0, 44), (2, 0), (2, 16)]
    out = _step(_q(q, rows), (k, v, tables), rows)
    assert np.isfinite(out).all(), "NaN from an unused KV slot leaked into the output"
    for i, (r, p) in enumerate(rows):
        ref = _reference(q[r][p], *seqs[r], p)
        # f32 inputs, f32 arithmetic over <= 300 positions: 1e-5 absolute is ~100 ulp of |o| <= 4.
        np.testing.assert_allclose(out[i], ref, atol=1e-5, rtol=0)


def test_serial_and_split_schedules_agree_bitwise(setup):
    k, v, tables, seqs, q, lengths = setup
    rows = [(0, p) for p in range(45)] + [(1, p) for p in range(250, 300)] + [(2, p) for p in range(17)]
    serial = _step(_q(q, rows), (k, v, tables), rows, schedule="serial")
    split = _step(_q(q, rows), (k, v, tables), rows, schedule="split")
    assert count_bit_differences(serial, split) == 0


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunking_and_co_batching_do_not_change_a_row(setup, chunk):
    k, v, tables, seqs, q, lengths = setup
    whole_rows = [(1, p) for p in range(260, 300)]
    whole = _step(_q(q, whole_rows), (k, v, tables), whole_rows)
    pieces = []
    for start in range(260, 300, chunk):
        mine = [(1, p) for p in range(start, min(start + chunk, 300))]
        others = [(0, 44), (0, 43)] if start % 2 else [(2, 5)]  # different neighbours each step
        rows = others[:1] + mine + others[1:]
        out = _step(_q(q, rows), (k, v, tables), rows)
        pieces.append(out[1:1 + len(mine)])
    assert count_bit_differences(whole, np.concatenate(pieces)) == 0


def test_dense_causal_twin_equals_the_paged_form(setup):
    k, v, tables, seqs, q, lengths = setup
    n = lengths[0]
    kk, vv = seqs[0]
    dense = ta.dense_causal_attention_triton_torch(
        torch.from_numpy(q[0][None]), torch.from_numpy(kk[None]), torch.from_numpy(vv[None]),
        scale=SCALE).numpy()[0]
    rows = [(0, p) for p in range(n)]
    paged = _step(_q(q, rows), (k, v, tables), rows)
    assert count_bit_differences(dense, paged) == 0


def test_negative_control_another_split_size_changes_the_bits(setup, monkeypatch):
    """The comparisons above can fail: the same rows with SPLIT = 64 instead of 256 differ."""
    k, v, tables, seqs, q, lengths = setup
    rows = [(1, p) for p in range(280, 300)]
    before = _step(_q(q, rows), (k, v, tables), rows)
    monkeypatch.setattr(tap, "SPLIT", 64)
    after = _step(_q(q, rows), (k, v, tables), rows)
    assert count_bit_differences(before, after) > 0


def _split_launch(setup, rows, sems):
    """attention_split_kernel over `rows` on the given counters (an int: all of them start there):
    (output, counters after the launch)."""
    k, v, tables, seqs, q, lengths = setup
    qr = _q(q, rows)
    req = torch.ones(len(rows), dtype=torch.int32)
    pos = torch.tensor([p for _, p in rows], dtype=torch.int32)
    c = tap.constexprs(qr, k)
    t, page_size, width = len(rows), k.shape[1], tables.shape[1]
    tiles = ta.tiles_torch(req, pos, c["TPP"])
    nsplit = ta.cdiv(page_size * width, tap.SPLIT)
    n = t * c["HKV"] * nsplit * c["TPP"] * c["GP"]
    parts = (torch.zeros(n), torch.zeros(n), torch.zeros(n, c["D"]))
    out = torch.zeros_like(qr)
    if isinstance(sems, int):
        sems = torch.full((t * c["HKV"],), sems, dtype=torch.int32)
    ta.torch_launch(ta.kernels().attention_split_kernel,
                    (qr, k, v, tables, pos, tiles, t, page_size, width, SCALE, sems),
                    (*parts, out, sems), (t, c["HKV"], nsplit), num_warps=tap.NUM_WARPS,
                    num_stages=tap.NUM_STAGES, enable_fp_fusion=False, **c, NSPLIT=nsplit,
                    MERGE_STAGES=tap.MERGE_STAGES)
    return out.numpy(), sems


def test_the_split_merge_leaves_its_counters_zero(setup):
    """The merging program puts its (tile, KV head) counter back to zero, so the step threads one
    counter buffer through its launches without a memset between them (_triton_launch.Counters):
    a second launch on the same counters, not re-zeroed, gives the same bits."""
    k, v, tables, seqs, q, lengths = setup
    rows = [(1, p) for p in range(280, 300)]  # positions past SPLIT: two splits per row
    split = _step(_q(q, rows), (k, v, tables), rows, schedule="split")
    out, sems = _split_launch(setup, rows, 0)
    assert count_bit_differences(split, out) == 0 and int(sems.abs().sum()) == 0
    again, sems = _split_launch(setup, rows, sems)
    assert count_bit_differences(split, again) == 0 and int(sems.abs().sum()) == 0


def test_negative_control_the_split_merge_waits_for_every_split(setup):
    """The split schedule's merge runs in the last of a tile's programs to count itself (an int32
    per tile and KV head, zero at the start). With every counter starting at 1 instead, the
    next-to-last program merges -- one split's state not yet stored (zeros here) -- and the rows
    differ: the schedules' agreement above is not an accident of program order. And the counters
    end at 1 (the last split counts after the reset), so the zero check above can fail too."""
    k, v, tables, seqs, q, lengths = setup
    rows = [(1, p) for p in range(280, 300)]
    split = _step(_q(q, rows), (k, v, tables), rows, schedule="split")
    out, sems = _split_launch(setup, rows, 1)
    assert count_bit_differences(split, out) > 0
    assert (sems == 1).all()


def test_tiles_are_the_same_from_jax_and_torch():
    import jax.numpy as jnp

    token_req = np.array([0, 0, 0, 0, 0, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 7, 7, 7], np.int32)
    positions = np.concatenate([np.arange(5), [9, 10], np.arange(20, 28), [0, 0, 0]]).astype(np.int32)
    for tpp in (1, 2, 4, 8):
        a = np.asarray(ta.tiles_jax(jnp.asarray(token_req), jnp.asarray(positions), tpp))
        b = ta.tiles_torch(torch.from_numpy(token_req), torch.from_numpy(positions), tpp).numpy()
        np.testing.assert_array_equal(a, b)
        count = a[1]
        assert count.sum() == len(token_req) and (count <= tpp).all()
        for start, n, req, max_pos in a.T[count > 0]:
            assert (token_req[start:start + n] == req).all()  # one request per tile
            assert max_pos == positions[start:start + n].max()


def test_geometry_names_the_bad_field():
    with pytest.raises(ValueError, match="head_dim=96"):
        tap.geometry(8, 2, 96)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        tap.geometry(8, 3, 64)
    assert tap.geometry(32, 8, 128)["TPP"] * tap.geometry(32, 8, 128)["GP"] == 16


def test_auto_wide_tile_computes_every_row_of_a_prefill_step(setup, monkeypatch):
    """triton_wide_prefill (auto only) runs prefill-sized serial steps on WIDE_ROWS rows per
    program: every row of such a step is attention over its own positions (a row left out of a
    tile, or given another request's, would be off by O(1), not 1e-5). Not compared bit for bit
    with the engine's 16-row launch: on the H200 a few rows round differently (it is not
    batch-invariant), so equality under the interpreter would show nothing the GPU keeps."""
    k, v, tables, seqs, q, lengths = setup
    monkeypatch.setattr(tap, "WIDE_MIN_TOKENS", 40)  # the interpreter is slow: a 62-row "prefill"
    rows = [(0, 44), (2, 3)] + [(1, p) for p in range(240, 300)]
    c = tap.constexprs(_q(q, rows), k)
    assert (tap.wide_tpp(c, len(rows), "serial"), c["TPP"]) == (tap.WIDE_ROWS // c["GP"], 8)
    assert tap.wide_tpp(c, 39, "serial") == tap.wide_tpp(c, len(rows), "split") == c["TPP"]
    assert tap.widened(c, len(rows), "serial", auto=True)["BLOCK_N"] == (
        tap.BLOCK_N if c["IEEE"] else tap.WIDE_BLOCK_N)
    req, pos = _req_pos(rows)
    wide = ta.paged_attention_triton_wide_torch(_q(q, rows), (k, v), tables, req, pos,
                                                scale=SCALE).numpy()
    for i, (r, p) in enumerate(rows):
        np.testing.assert_allclose(wide[i], _reference(q[r][p], *seqs[r], p), atol=1e-5, rtol=0)


def _bf16(setup):
    """The setup's pool and queries rounded to bf16, and its sequences rounded alike for the
    float64 reference (which then measures the kernel's own bf16 arithmetic only)."""
    k, v, tables, seqs, q, lengths = setup

    def rounded(a):
        return torch.from_numpy(a).to(torch.bfloat16)

    return (k.to(torch.bfloat16), v.to(torch.bfloat16), tables,
            [tuple(rounded(a).float().numpy() for a in seq) for seq in seqs],
            {r: rounded(a).float().numpy() for r, a in q.items()}, lengths)


def _bf16_step(setup, rows, schedule=None, wide=False):
    """_step on a _bf16 setup (wide: auto's triton_wide_prefill leaf)."""
    k, v, tables, _, q, _ = setup
    qb = torch.from_numpy(np.stack([q[r][p] for r, p in rows])).to(torch.bfloat16)
    req, pos = _req_pos(rows)
    out = ta.paged_attention_triton_torch(qb, (k, v), tables, req, pos, scale=SCALE,
                                          schedule=schedule, wide=wide)
    return out.float().numpy()


def test_auto_wide_tile_in_bf16_reads_kv_in_its_own_tiles(setup, monkeypatch):
    """In bf16 auto's wide tile also takes its own KV tile (WIDE_BLOCK_N, another algorithm than
    the f32 case above runs): every row is still attention over exactly its own positions (rows
    on both sides of the first split boundary, at 256). The reference is float64 over the same
    bf16-rounded q / k / v, so what is left is the kernel's bf16 (p rounded for p . v, the output
    rounded once): under the interpreter the largest error is 0.011 with either KV tile (32 or
    64 positions; |o| <= 1.61), so 3e-2 absolute, still below what a row given wrong tiles is off
    by (the control below fails it)."""
    b = _bf16(setup)
    monkeypatch.setattr(tap, "WIDE_MIN_TOKENS", 40)
    rows = [(0, 44), (2, 3)] + [(1, p) for p in range(230, 290)]
    c = tap.constexprs(torch.zeros((len(rows), HQ, D), dtype=torch.bfloat16), b[0])
    assert tap.widened(c, len(rows), "serial", auto=True)["BLOCK_N"] == tap.WIDE_BLOCK_N
    wide = _bf16_step(b, rows, wide=True)
    for i, (r, p) in enumerate(rows):
        np.testing.assert_allclose(wide[i], _reference(b[4][r][p], *b[3][r], p), atol=3e-2,
                                   rtol=0)


def test_negative_control_the_bf16_wide_check_fails_on_wrong_tiles(setup, monkeypatch):
    real = ta.tiles_torch
    monkeypatch.setattr(ta, "tiles_torch", lambda req, pos, tpp: real(req, pos, 2 * tpp))
    with pytest.raises(AssertionError):
        test_auto_wide_tile_in_bf16_reads_kv_in_its_own_tiles(setup, monkeypatch)


def test_negative_control_tiles_the_kernel_does_not_expect_fail_the_wide_check(setup, monkeypatch):
    """The check above can fail: tiles cut at twice the kernel's TPP leave rows it never writes."""
    real = ta.tiles_torch
    monkeypatch.setattr(ta, "tiles_torch", lambda req, pos, tpp: real(req, pos, 2 * tpp))
    with pytest.raises(AssertionError):
        test_auto_wide_tile_computes_every_row_of_a_prefill_step(setup, monkeypatch)


@pytest.fixture
def registered(monkeypatch):
    """The leaves registered as on a GPU machine with jax-triton (here it is missing)."""
    yield from triton_interpreter.registered_as_on_a_gpu(
        monkeypatch, ta, [("attention", "paged", "triton_fixed_split"),
                          ("attention", "dense_causal", "triton_fixed_split"),
                          ("attention", "paged", "triton_wide_prefill")])


def test_auto_plans_the_wide_tile_and_rl_bitwise_never_does(registered):
    from pallas_kernels.registry import REGISTRY

    def plan(features):
        return REGISTRY.plan("attention", "paged", formats={"bf16"}, hardware="gpu",
                               geometry={"head_dim": 128}, features=features).leaf.impl

    assert plan(frozenset()) == "triton_wide_prefill"  # --numerics auto
    assert plan(frozenset({"batch_invariant"})) == "triton_fixed_split"  # rl-bitwise
    leaf = next(l for l in REGISTRY.leaves("attention", "paged") if l.impl == "triton_wide_prefill")
    assert leaf.traits == {"deterministic": True, "batch_invariant": False}


# -- the layout-free row sums (ROWSUM tree / dot: experiments, other bits, planned only on request) --

_row_sum = ta.kernels()._row_sum


@triton.jit
def _row_sum_kernel(p_ptr, out_ptr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    ROWSUM: tl.constexpr):
    r = tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_N)
    p = tl.load(p_ptr + r[:, None] * BLOCK_N + c[None, :])
    tl.store(out_ptr + r, _row_sum(p, p.to(tl.bfloat16), ROWS, BLOCK_N, ROWSUM, False))  # v: bf16


def _row_sums(p: np.ndarray, form: str) -> np.ndarray:
    out = torch.empty(p.shape[0], dtype=torch.float32)
    _row_sum_kernel[(1,)](torch.from_numpy(p), out, ROWS=p.shape[0], BLOCK_N=p.shape[1],
                          ROWSUM=tap.ROWSUM_FORMS[form])
    return out.numpy()


def test_the_tree_row_sum_is_the_halving_tree():
    """"tree": each row's sum is v[:h] + v[:h] until one element is left, bit for bit. Control:
    the same values summed left to right (numpy's elementwise adds, so no reduction order numpy
    or the processor chooses) are another number in some row."""
    rows, width = 16, tap.BLOCK_N
    rng = np.random.default_rng(3)
    p = (rng.standard_normal((rows, width)) * np.logspace(-4, 4, width)).astype(np.float32)
    out = _row_sums(p, "tree")
    assert count_bit_differences(out, numpy_halving_tree(p)) == 0
    left_to_right = p[:, 0].copy()
    for c in range(1, width):
        left_to_right = left_to_right + p[:, c]
    assert count_bit_differences(out, left_to_right) > 0


def test_the_dot_row_sum_sums_the_rounded_p():
    """"dot": each row's sum is the sum of p rounded to bf16 (the p that p . v averages with).
    The values are 1 + k / 128 times a power of two within a 2**6 range, so every partial sum is
    exact in f32 and the float64 sum is the answer in any order. Control: p's own (unrounded)
    sum is another number in every row."""
    rows, width = 16, tap.BLOCK_N
    rng = np.random.default_rng(5)
    rounded = ((1 + rng.integers(0, 128, (rows, width)) / 128)
               * 2.0 ** rng.integers(-6, 0, (rows, width)))
    p = (rounded * (1 + 2.0 ** -12)).astype(np.float32)  # rounds to `rounded` in bf16
    assert (torch.from_numpy(p).to(torch.bfloat16).double().numpy() == rounded).all()
    out = _row_sums(p, "dot")
    assert count_bit_differences(out, rounded.sum(axis=1).astype(np.float32)) == 0
    assert count_bit_differences(out, p.astype(np.float64).sum(axis=1).astype(np.float32)) == rows


@pytest.fixture(params=["tree", "dot"])
def layout_free_rowsum(request, monkeypatch):
    """The leaf's launches with a layout-free row sum (JENGINE_ATTENTION_ROWSUM=tree / dot)."""
    monkeypatch.setenv(tap.ROWSUM_ENV, request.param)
    return request.param


def test_the_rowsum_switch_plans_the_form_and_the_wide_prefill_tile(monkeypatch):
    """JENGINE_ATTENTION_ROWSUM: unset, the dot (the default); "triton", every launch sums
    Triton's way and only auto's leaf widens a prefill (its rows and its KV tile); "tree" or
    "dot", every launch (engine and twin: one _plan) takes that form and the batch-invariant
    leaf's prefill steps the wide rows too, on the definition's KV tile, while decode steps keep
    theirs. Another value is refused, naming the variable and the value."""
    q = torch.zeros((512, 32, 128), dtype=torch.bfloat16)
    pool = torch.zeros((8, 16, 8, 128), dtype=torch.bfloat16)
    monkeypatch.delenv(tap.ROWSUM_ENV, raising=False)  # unset: the default, the dot
    assert tap.plan(q, pool, None, False)[1]["ROWSUM"] == tap.ROWSUM_FORMS["dot"] == 2
    monkeypatch.setenv(tap.ROWSUM_ENV, "triton")
    schedule, c, _ = tap.plan(q, pool, None, False)
    assert (schedule, c["ROWSUM"], c["TPP"] * c["GP"], c["BLOCK_N"]) == (
        "serial", 0, tap.MIN_ROWS, tap.DEFAULT_KV_TILE)
    auto = tap.plan(q, pool, None, True)[1]  # auto's leaf: its own rows and KV tile
    assert (auto["TPP"] * auto["GP"], auto["BLOCK_N"]) == (tap.WIDE_ROWS, tap.WIDE_BLOCK_N)
    auto = tap.plan(q[:1], pool, None, True)[1]  # ... on prefill-sized steps only
    assert (auto["TPP"] * auto["GP"], auto["BLOCK_N"]) == (tap.MIN_ROWS, tap.DEFAULT_KV_TILE)
    for form, code in (("tree", 1), ("dot", 2)):
        monkeypatch.setenv(tap.ROWSUM_ENV, form)
        schedule, c, _ = tap.plan(q, pool, None, False)  # wide rows, the definition's KV tile
        assert (schedule, c["ROWSUM"], c["TPP"] * c["GP"], c["BLOCK_N"]) == (
            "serial", code, tap.WIDE_ROWS, tap.DEFAULT_KV_TILE)
        assert tap.plan(q, pool, None, True)[1]["BLOCK_N"] == tap.WIDE_BLOCK_N
        schedule, c, _ = tap.plan(q[:1], pool, None, False)
        assert (schedule, c["ROWSUM"], c["TPP"] * c["GP"]) == ("split", code, tap.MIN_ROWS)
    monkeypatch.setenv(tap.ROWSUM_ENV, "halving")
    with pytest.raises(ValueError, match="JENGINE_ATTENTION_ROWSUM='halving'"):
        tap.plan(q, pool, None, False)


def test_with_a_layout_free_row_sum_it_is_still_attention_and_one_algorithm(setup,
                                                                             layout_free_rowsum):
    """Either experiment keeps the leaf's contract: float64's attention within the same 1e-5, and
    the serial and split schedules bit-identical."""
    k, v, tables, seqs, q, lengths = setup
    rows = [(0, p) for p in range(45)] + [(1, p) for p in range(250, 300)] + [(2, 0), (2, 16)]
    serial = _step(_q(q, rows), (k, v, tables), rows, schedule="serial")
    assert count_bit_differences(serial, _step(_q(q, rows), (k, v, tables), rows,
                                               schedule="split")) == 0
    for i, (r, p) in enumerate(rows):
        np.testing.assert_allclose(serial[i], _reference(q[r][p], *seqs[r], p), atol=1e-5, rtol=0)


# -- the KV tile (JENGINE_ATTENTION_KV_TILE: 64 positions by default, 32 another definition) --


def _planned(rows, auto=False, dtype=torch.bfloat16):
    """(schedule, TPP, BLOCK_N, PAGES, stages, register bound) the leaf plans for a step of
    `rows` token rows of this module's heads (auto: triton_wide_prefill)."""
    pool = torch.zeros((8, PAGE, HKV, D), dtype=dtype)
    schedule, c, launch = tap.plan(torch.zeros((rows, HQ, D), dtype=dtype), pool, None, auto)
    return (schedule, c["TPP"], c["BLOCK_N"], c["PAGES"], launch["num_stages"],
            launch.get("maxnreg"))


def test_the_kv_tile_switch_plans_every_bf16_launch_and_is_refused_by_name(monkeypatch):
    """JENGINE_ATTENTION_KV_TILE: unset (DEFAULT_KV_TILE) or "64", every bf16 launch of both
    leaves -- split, narrow serial, rl-bitwise's and auto's wide tile -- on 64-position KV tiles
    and NUM_STAGES stages (what auto's wide tile measured best on them), while f32 keeps BLOCK_N;
    "32", BLOCK_N in every launch but auto's wide tile (the definition before the twenty-eighth
    session). Another value is refused, naming the variable and the value."""
    monkeypatch.setattr(tap, "WIDE_MIN_TOKENS", 40)
    monkeypatch.delenv(tap.PAGES_ENV, raising=False)

    def plan(rows, auto=False, dtype=torch.bfloat16):  # (BLOCK_N, stages) of each launch
        planned = _planned(rows, auto, dtype)
        return planned[2], planned[4]

    steps = ((4, False), (33, False), (64, False), (64, True))  # split, narrow, wide x 2
    assert tap.DEFAULT_KV_TILE == 64
    for value in (None, "64"):
        if value is None:
            monkeypatch.delenv(tap.KV_TILE_ENV, raising=False)
        else:
            monkeypatch.setenv(tap.KV_TILE_ENV, value)
        assert [plan(*step) for step in steps] == [(64, tap.NUM_STAGES)] * 4
        assert [plan(*step, dtype=torch.float32)[0] for step in steps] == [tap.BLOCK_N] * 4
    monkeypatch.setenv(tap.KV_TILE_ENV, "32")
    assert [plan(*step)[0] for step in steps] == [32, 32, 32, tap.WIDE_BLOCK_N]
    monkeypatch.setenv(tap.KV_TILE_ENV, "128")
    with pytest.raises(ValueError, match="JENGINE_ATTENTION_KV_TILE='128'"):
        plan(4)


def test_on_64_position_kv_tiles_it_is_still_attention_and_one_algorithm(setup, monkeypatch):
    """On 64-position KV tiles (the default since the twenty-eighth session) the leaf keeps its
    contract in bf16: every row within
    3e-2 of float64 attention over the same bf16 inputs (the bf16 p and the output's rounding; the
    wide-tile test above says why that bound), the serial and split schedules bit-identical across
    a split boundary, a request's rows the same whatever its chunks and neighbours, and the
    dense-causal twin equal to the paged form -- and the bits are not the 32-position tile's
    (JENGINE_ATTENTION_KV_TILE=32 is another definition: the control that the switch reaches the
    kernel)."""
    b = _bf16(setup)
    monkeypatch.setenv(tap.KV_TILE_ENV, "64")
    rows = [(0, 44), (2, 3)] + [(1, p) for p in range(236, 290, 3)]
    serial = _bf16_step(b, rows, "serial")
    assert count_bit_differences(serial, _bf16_step(b, rows, "split")) == 0
    for i, (r, p) in enumerate(rows):
        np.testing.assert_allclose(serial[i], _reference(b[4][r][p], *b[3][r], p), atol=3e-2,
                                   rtol=0)
    mine = [(1, p) for p in range(270, 290)]
    whole = _bf16_step(b, mine)
    pieces = [_bf16_step(b, [(0, 40 + i % 3)] + mine[i:i + 7])[1:] for i in range(0, 20, 7)]
    assert count_bit_differences(whole, np.concatenate(pieces)) == 0
    k, v, _, seqs, q, lengths = b
    dense = ta.dense_causal_attention_triton_torch(  # 300 positions: 5 tiles, 2 splits
        *(torch.from_numpy(a[None]).to(torch.bfloat16) for a in (q[1], *seqs[1])),
        scale=SCALE).float().numpy()[0]
    assert count_bit_differences(dense, _bf16_step(b, [(1, p) for p in range(lengths[1])])) == 0
    monkeypatch.setenv(tap.KV_TILE_ENV, "32")
    assert count_bit_differences(serial, _bf16_step(b, rows, "serial")) > 0


# -- the page ids per split (JENGINE_ATTENTION_PAGES; planned per launch by default): same bits --


def test_pages_per_split_covers_every_page_a_split_spans():
    """PAGES is a power of two >= the pages a split of SPLIT positions spans, whatever the page
    size: aligned (a divisor or a multiple of SPLIT) and not (a split starting inside a page).
    Checked against counting the pages of every split of a long context directly."""
    for page_size in (1, 8, 16, 48, 100, 256, 300, 512, 4096):
        spans = {(lo + tap.SPLIT - 1) // page_size - lo // page_size + 1
                 for lo in range(0, 64 * tap.SPLIT, tap.SPLIT)}
        pages = tap.pages_per_split(page_size)
        assert pages >= max(spans) and pages & (pages - 1) == 0, (page_size, pages, spans)
        assert pages < 2 * max(spans), (page_size, pages, spans)  # and not wastefully more


def test_the_pages_switch_plans_each_launch_and_is_refused_by_name(monkeypatch):
    """JENGINE_ATTENTION_PAGES: unset ("planned", the default) every launch takes the page ids per
    split on NUM_STAGES stages (what auto's wide tile measured best on 64-position KV tiles, which
    every bf16 launch reads by default), the narrow serial launch under a register bound; on
    32-position KV tiles the split schedule and rl-bitwise's wide tile keep PAGES_STAGES; "tile"
    none of them, "split" every launch as it is. Another value is refused, naming the variable and
    the value."""
    pages = tap.pages_per_split(PAGE)
    monkeypatch.setattr(tap, "WIDE_MIN_TOKENS", 40)

    geo = tap.geometry(HQ, HKV, D)
    narrow, wide = geo["TPP"], tap.WIDE_ROWS // geo["GP"]
    steps = ((4, False), (33, False), (64, False), (64, True))  # split, narrow serial, wide x 2
    monkeypatch.delenv(tap.PAGES_ENV, raising=False)
    monkeypatch.delenv(tap.KV_TILE_ENV, raising=False)
    kv = tap.DEFAULT_KV_TILE
    assert [_planned(*step) for step in steps] == [
        ("split", narrow, kv, pages, tap.NUM_STAGES, None),
        ("serial", narrow, kv, pages, tap.NUM_STAGES, tap.PAGES_MAXNREG),
        ("serial", wide, kv, pages, tap.NUM_STAGES, None),
        ("serial", wide, tap.WIDE_BLOCK_N, pages, tap.NUM_STAGES, None)]
    monkeypatch.setenv(tap.KV_TILE_ENV, "32")
    assert [_planned(*step) for step in steps] == [
        ("split", narrow, tap.BLOCK_N, pages, tap.PAGES_STAGES, None),
        ("serial", narrow, tap.BLOCK_N, pages, tap.PAGES_STAGES, tap.PAGES_MAXNREG),
        ("serial", wide, tap.BLOCK_N, pages, tap.PAGES_STAGES, None),
        ("serial", wide, tap.WIDE_BLOCK_N, pages, tap.NUM_STAGES, None)]
    monkeypatch.delenv(tap.KV_TILE_ENV)
    monkeypatch.setenv(tap.PAGES_ENV, "tile")
    assert [_planned(*step)[3:] for step in steps] == [(0, tap.NUM_STAGES, None)] * 4
    monkeypatch.setenv(tap.PAGES_ENV, "split")
    assert [_planned(*step)[3:] for step in steps] == [(pages, tap.PAGES_STAGES, None)] * 4
    monkeypatch.setenv(tap.PAGES_ENV, "ahead")
    with pytest.raises(ValueError, match="JENGINE_ATTENTION_PAGES='ahead'"):
        _planned(4)


def _page_launches(setup, tables):
    """Every launch the leaf makes over rows across the first split boundary: the serial (wide
    rows) and split schedules, auto's wide tile, the dense-causal twin (one page of S = 300
    positions, not a multiple of SPLIT) and the narrow serial launch (callers set
    WIDE_MIN_TOKENS to 40)."""
    k, v, _, seqs, q, lengths = setup
    rows = [(0, 44), (2, 3)] + [(1, p) for p in range(230, 290)]
    req, pos = _req_pos(rows)
    kk, vv = seqs[1]
    outs = [_step(_q(q, rows), (k, v, tables), rows, schedule=s) for s in ("serial", "split")]
    outs.append(ta.paged_attention_triton_wide_torch(_q(q, rows), (k, v), tables, req, pos,
                                                     scale=SCALE).numpy())
    outs.append(ta.dense_causal_attention_triton_torch(
        torch.from_numpy(q[1][None]), torch.from_numpy(kk[None]), torch.from_numpy(vv[None]),
        scale=SCALE).numpy()[0])
    few = rows[:30]  # fewer than WIDE_MIN_TOKENS: the narrow serial launch (register-bounded)
    outs.append(_step(_q(q, few), (k, v, tables), few, schedule="serial"))
    return outs


def test_page_ids_per_split_give_every_launch_the_same_bits(setup, monkeypatch):
    """With the page ids loaded once per split and gathered per tile -- in every launch ("split")
    or where the plan puts them, the narrow serial launch register-bounded (the default) --
    every launch gives the bits of page ids loaded per tile (requests on shuffled pages with NaN
    in their unused slots)."""
    monkeypatch.setattr(tap, "WIDE_MIN_TOKENS", 40)
    monkeypatch.setenv(tap.PAGES_ENV, "tile")
    tile = _page_launches(setup, setup[2])
    for form in ("split", "planned"):
        monkeypatch.setenv(tap.PAGES_ENV, form)
        outs = _page_launches(setup, setup[2])
        assert [count_bit_differences(a, b) for a, b in zip(tile, outs)] == [0] * 5, form


def test_negative_control_other_page_ids_fail_the_comparison(setup, monkeypatch):
    """The comparison above can fail: the same launches given request 1's pages past its first
    split in another order (so tiles of the second split read other K/V) differ wherever the
    table is read -- every launch but the dense twin, which has none."""
    monkeypatch.setattr(tap, "WIDE_MIN_TOKENS", 40)
    monkeypatch.setenv(tap.PAGES_ENV, "tile")
    today = _page_launches(setup, setup[2])
    tables = setup[2].clone()
    first_split_pages = tap.SPLIT // PAGE
    tables[1, first_split_pages:] = tables[1, first_split_pages:].flip(0)
    monkeypatch.setenv(tap.PAGES_ENV, "split")
    moved = _page_launches(setup, tables)
    differ = [count_bit_differences(a, b) for a, b in zip(today, moved)]
    assert all(n > 0 for n in differ[:3] + differ[4:]) and differ[3] == 0, differ


@pytest.fixture
def triton_debug(monkeypatch):
    """The interpreter with Triton's debug on (device asserts evaluated, as TRITON_DEBUG=1
    compiles them on the GPU: gpu_run.sh pages_crash)."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.interpreter_builder, "options",
                        interpreter.InterpreterOptions(debug=True))


def test_the_page_window_asserts_pass_on_every_launch(setup, monkeypatch, triton_debug):
    """With debug on, every page-ids-per-split launch checks each tile's window index and that
    each gathered page id is the block table's: none fires, and the bits are those of the page
    ids per tile."""
    monkeypatch.setattr(tap, "WIDE_MIN_TOKENS", 40)
    monkeypatch.setenv(tap.PAGES_ENV, "tile")
    tile = _page_launches(setup, setup[2])
    monkeypatch.setenv(tap.PAGES_ENV, "split")
    outs = _page_launches(setup, setup[2])
    assert [count_bit_differences(a, b) for a, b in zip(tile, outs)] == [0] * 5


def test_negative_control_a_short_page_window_fires_its_assert(setup, monkeypatch, triton_debug):
    """The window assert can fire: launches given half the pages a split spans."""
    monkeypatch.setattr(tap, "WIDE_MIN_TOKENS", 40)
    monkeypatch.setenv(tap.PAGES_ENV, "split")
    whole = tap.pages_per_split
    monkeypatch.setattr(tap, "pages_per_split", lambda *a, **kw: whole(*a, **kw) // 2)
    from triton.runtime.errors import InterpreterError

    with pytest.raises(InterpreterError, match="page window index out of range"):
        _page_launches(setup, setup[2])
