"""The dense-model leaves: row invariance, chunk invariance, accuracy, and their torch twins.

Row invariance compares a row computed inside a batch of 64 with the same row computed in a batch
of M, bit for bit. The negative control runs the same checker on XLA's own dot, which is known to
change a row's bits with M on the CPU (platform-facts.md), and must see a difference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import activation, attention, gemm, rmsnorm
from pallas_kernels.fixed_order import fixed_exp, split_product
from tests.bits import count_bit_differences

ROWS = (1, 2, 3, 4, 7)
RNG = np.random.default_rng(1234)


def bf16(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale, jnp.bfloat16)


def row_invariance_failures(fn, full_inputs, row_axis_args, rows=ROWS):
    """{M: differing elements} for rows [offset, offset+M) of a 64-row call vs an M-row call."""
    full = np.asarray(jnp.asarray(fn(*full_inputs)).astype(jnp.float32))
    failures = {}
    for m in rows:
        for offset in (0, 64 - m):
            sliced = [a[offset:offset + m] if i in row_axis_args else a
                      for i, a in enumerate(full_inputs)]
            part = np.asarray(jnp.asarray(fn(*sliced)).astype(jnp.float32))
            diff = count_bit_differences(full[offset:offset + m], part)
            if diff:
                failures[(m, offset)] = diff
    return failures


@pytest.fixture(scope="module")
def gemm_inputs():
    return bf16(64, 96), bf16(96, 160, scale=0.1), bf16(160, scale=0.1)


def test_gemm_fixed_order_is_row_invariant(gemm_inputs):
    x, w, b = gemm_inputs
    fn = jax.jit(lambda x, w, b: gemm.gemm_fixed_order(x, w, b, out_dtype=jnp.float32))
    assert row_invariance_failures(fn, (x, w, b), {0}) == {}


def test_checker_catches_xla_native_dot(gemm_inputs):
    """Negative control: XLA's own dot changes row bits with M on the CPU; the checker sees it."""
    x, w, _ = gemm_inputs
    fn = jax.jit(lambda x, w: gemm.gemm_xla_native(x, w, out_dtype=jnp.float32))
    failures = row_invariance_failures(fn, (x, w), {0})
    assert failures, "the row-invariance checker found nothing on a known batch-variant dot"


def test_gemm_accuracy_against_float64(gemm_inputs):
    x, w, b = gemm_inputs
    out = np.asarray(gemm.gemm_fixed_order(x, w, b, out_dtype=jnp.float32))
    ref = (np.asarray(x, np.float64) @ np.asarray(w, np.float64)) + np.asarray(b, np.float64)
    # f32 accumulation of 96 exact bf16 products: error ~ K * 2^-24 * sum|x_k w_k|.
    bound = 96 * 2.0 ** -24 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)))
    assert np.all(np.abs(out - ref) <= bound + 1e-30)


@pytest.mark.parametrize("eps", [1e-6])
def test_rmsnorm_row_invariant_and_accurate(eps):
    x, weight = bf16(64, 80, scale=3.0), bf16(80)
    fn = jax.jit(lambda x, w: rmsnorm.rmsnorm(x, w, eps=eps))
    assert row_invariance_failures(fn, (x, weight), {0}) == {}
    out = np.asarray(fn(x, weight).astype(jnp.float32), np.float64)
    xf = np.asarray(x, np.float64)
    ref = np.asarray(weight, np.float64) * xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + eps)
    # Two bf16 roundings (normalised value, then the weight product): relative 2 * 2^-8.
    assert np.all(np.abs(out - ref) <= 2 * 2.0 ** -8 * np.abs(ref) + 1e-6)


def test_add_rmsnorm_row_invariant():
    x, r, weight = bf16(64, 80), bf16(64, 80), bf16(80)
    fn = jax.jit(lambda x, r, w: rmsnorm.add_rmsnorm(x, r, w, eps=1e-5)[0])
    assert row_invariance_failures(fn, (x, r, weight), {0, 1}) == {}


@pytest.mark.parametrize("impl", ["add_rmsnorm", "add_rmsnorm_xla_native"])
def test_add_rmsnorm_round_sum_is_the_separate_add_then_the_norm(impl):
    """round_sum (the unfused layer boundary in one leaf): the bits of `residual + x` in bf16 and
    the family's rmsnorm of it, normed output and new residual alike. Control: without round_sum
    the norm reads the f32 sum and some rows differ."""
    fused = getattr(rmsnorm, impl)
    norm = rmsnorm.rmsnorm if impl == "add_rmsnorm" else rmsnorm.rmsnorm_xla_native
    x, r, weight = bf16(64, 80, scale=3.0), bf16(64, 80, scale=3.0), bf16(80)
    got, new_res = jax.jit(lambda x, r, w: fused(x, r, w, eps=1e-5, round_sum=True))(x, r, weight)
    summed = jax.jit(lambda x, r: r + x)(x, r)
    want = jax.jit(lambda h, w: norm(h, w, eps=1e-5))(summed, weight)
    assert count_bit_differences(new_res, summed) == 0
    assert count_bit_differences(got, want) == 0
    f32_sum = jax.jit(lambda x, r, w: fused(x, r, w, eps=1e-5)[0])(x, r, weight)
    assert count_bit_differences(f32_sum, want) > 0


def test_silu_matches_torch_form_and_is_elementwise():
    x = bf16(64, 50, scale=4.0)
    fn = jax.jit(activation.silu)
    assert row_invariance_failures(fn, (x,), {0}) == {}
    ref = np.asarray(x, np.float64) / (1 + np.exp(-np.asarray(x, np.float64)))
    out = np.asarray(fn(x).astype(jnp.float32), np.float64)
    assert np.all(np.abs(out - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-30)


@pytest.mark.parametrize("hardware", ["cpu", "gpu"])
def test_auto_plans_silu_for_xla_fusion_and_rl_bitwise_keeps_the_contract_leaf(hardware):
    """--numerics auto (no required feature) gets the xla_native SiLU, which XLA fuses and keeps
    inside its command buffers; a batch_invariant request never does (on a GPU its division is
    not torch's): it gets the portable leaf, or on a GPU the Triton leaf where triton is here."""
    from pallas_kernels.registry import REGISTRY

    def plan(**kw):
        return REGISTRY.plan("activation", "silu", formats={"bf16"}, hardware=hardware,
                             **kw).leaf.impl

    assert plan() == "xla_native"
    impls = {leaf.impl for leaf in REGISTRY.leaves("activation", "silu")}
    gpu_leaf = "triton_elementwise" if "triton_elementwise" in impls else "elementwise"
    assert plan(features={"batch_invariant"}) == (gpu_leaf if hardware == "gpu" else "elementwise")


def test_xla_native_silu_is_the_portable_leafs_program_on_the_cpu():
    """The same expression: on the CPU, auto's SiLU bits are the rl-bitwise leaf's. Negative
    control: XLA's own x * sigmoid(x) (jax.nn.silu) differs in f32, so the comparison can fail."""
    for x in (bf16(64, 50, scale=4.0), bf16(64, 50, scale=4.0).astype(jnp.float32)):
        want = np.asarray(jax.jit(activation.silu)(x).astype(jnp.float32))
        got = np.asarray(jax.jit(activation.silu_xla_native)(x).astype(jnp.float32))
        assert count_bit_differences(want, got) == 0
    other = np.asarray(jax.jit(jax.nn.silu)(x))
    assert count_bit_differences(want, other) > 0


def test_silu_times_is_the_silu_then_the_multiply():
    """SwiGLU's act(gate) * up in one leaf (the portable and auto's xla_native forms, and the torch
    twin): the bits of the SiLU rounded to the dtype, then the product rounded again -- the
    trainer's two ops. Control: the SiLU left unrounded before the product differs."""
    from pallas_kernels._twin import to_torch

    gate, up = bf16(64, 50, scale=4.0), bf16(64, 50)
    want = np.asarray((jax.jit(activation.silu)(gate) * up).astype(jnp.float32))
    for fn in (activation.silu, activation.silu_xla_native):
        got = np.asarray(jax.jit(lambda g, u, fn=fn: fn(g, times=u))(gate, up).astype(jnp.float32))
        assert count_bit_differences(want, got) == 0
    twin = activation.silu_torch(to_torch(gate), times=to_torch(up))
    assert count_bit_differences(want, twin.float().numpy()) == 0
    g = np.asarray(gate, np.float32)
    unrounded = (g / (1 + np.exp(-g)) * np.asarray(up, np.float32)).astype(jnp.bfloat16)
    assert count_bit_differences(want, np.asarray(unrounded, np.float32)) > 0
    with pytest.raises(ValueError, match="times has shape"):
        activation.silu(gate, times=up[:3])


# -- attention ------------------------------------------------------------------------------------

PAGE, HQ, HKV, D = 4, 4, 2, 16


def _paged_sequence(seq_len, num_pages=48, garbage=np.nan):
    """One request's K/V scattered over shuffled pages; every other slot holds garbage."""
    q, k, v = bf16(seq_len, HQ, D), bf16(seq_len, HKV, D), bf16(seq_len, HKV, D)
    k_cache = np.full((num_pages, PAGE, HKV, D), garbage, np.float32)
    v_cache = np.full_like(k_cache, garbage)
    pages = RNG.permutation(np.arange(1, num_pages))[: -(-seq_len // PAGE)]
    for t in range(seq_len):
        k_cache[pages[t // PAGE], t % PAGE] = np.asarray(k[t], np.float32)
        v_cache[pages[t // PAGE], t % PAGE] = np.asarray(v[t], np.float32)
    return q, k, v, jnp.asarray(k_cache, jnp.bfloat16), jnp.asarray(v_cache, jnp.bfloat16), pages


_paged = jax.jit(attention.paged_fixed_order, static_argnames="scale")


def _run_chunks(q, k_cache, v_cache, pages, seq_len, chunk, extra_pages=0):
    outs = []
    table = np.concatenate([pages, np.zeros(extra_pages, np.int64)]).astype(np.int32)
    for start in range(0, seq_len, chunk):
        stop = min(seq_len, start + chunk)
        n = stop - start
        outs.append(np.asarray(_paged(q[start:stop], (k_cache, v_cache), jnp.asarray(table[None]),
                                      jnp.zeros(n, jnp.int32),
                                      jnp.arange(start, stop, dtype=jnp.int32),
                                      scale=D ** -0.5).astype(jnp.float32)))
    return np.concatenate(outs)


def test_attention_chunk_invariance_prefill_equals_decode():
    """Chunks of 1 (= decode), 3, 16 and all rows give the same bits; NaN garbage never leaks."""
    seq_len = 37
    q, _, _, k_cache, v_cache, pages = _paged_sequence(seq_len)
    whole = _run_chunks(q, k_cache, v_cache, pages, seq_len, seq_len)
    assert np.isfinite(whole).all()
    for chunk in (1, 3, 16):
        assert count_bit_differences(whole, _run_chunks(q, k_cache, v_cache, pages, seq_len, chunk)) == 0
    # More pages gathered (a larger page bucket) changes nothing either.
    assert count_bit_differences(whole, _run_chunks(q, k_cache, v_cache, pages, seq_len, 5,
                                                    extra_pages=7)) == 0


def test_attention_paged_equals_dense_twin_and_float64():
    seq_len = 29
    q, k, v, k_cache, v_cache, pages = _paged_sequence(seq_len)
    paged = _run_chunks(q, k_cache, v_cache, pages, seq_len, 8)
    dense = jax.jit(attention.dense_causal_fixed_order, static_argnames="scale")
    out = np.asarray(dense(q[None], k[None], v[None], scale=D ** -0.5)[0].astype(jnp.float32))
    assert count_bit_differences(paged, out) == 0
    qf, kf, vf = (np.asarray(a, np.float64) for a in (q, k, v))
    ref = np.zeros((seq_len, HQ, D))
    for t in range(seq_len):
        for h in range(HQ):
            s = kf[: t + 1, h // (HQ // HKV)] @ qf[t, h] * D ** -0.5
            p = np.exp(s - s.max())
            ref[t, h] = (p / p.sum()) @ vf[: t + 1, h // (HQ // HKV)]
    # Output rounded once to bf16 (relative 2^-8) plus f32 accumulation error.
    assert np.all(np.abs(out - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-4)


def test_native_attention_is_only_close():
    """The auto-mode attention agrees to bf16 tolerance (no bitwise claim is made for it)."""
    seq_len = 21
    q, k, v, k_cache, v_cache, pages = _paged_sequence(seq_len, garbage=0.0)
    table = jnp.asarray(pages.astype(np.int32)[None])
    req = jnp.zeros(seq_len, jnp.int32)
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    fixed = _paged(q, (k_cache, v_cache), table, req, pos, scale=0.25)
    native = attention.paged_xla_native(q, (k_cache, v_cache), table, req, pos, scale=0.25)
    np.testing.assert_allclose(np.asarray(native, np.float32), np.asarray(fixed, np.float32),
                               rtol=2 ** -7, atol=2 ** -7)


# -- torch twins ----------------------------------------------------------------------------------

def test_torch_twins_reproduce_the_leaves_bitwise():
    torch = pytest.importorskip("torch")
    from pallas_kernels._twin import to_torch

    x, w = bf16(9, 32), bf16(32, 24)
    want = gemm.gemm_fixed_order(x, w, out_dtype=jnp.bfloat16)
    got = gemm.gemm_fixed_order_torch(to_torch(x), to_torch(w), out_dtype=jnp.bfloat16)
    assert got.dtype == torch.bfloat16
    assert count_bit_differences(np.asarray(want), got.float().numpy()) == 0

    weight = bf16(32)
    want = rmsnorm.rmsnorm(x, weight, eps=1e-6)
    got = rmsnorm.rmsnorm_torch(to_torch(x), to_torch(weight), eps=1e-6)
    assert count_bit_differences(np.asarray(want), got.float().numpy()) == 0

    want = activation.silu(x)
    got = activation.silu_torch(to_torch(x))
    assert count_bit_differences(np.asarray(want), got.float().numpy()) == 0


def test_model_kernels_plan_the_grouped_gemm_of_their_gemm_leaf():
    """ModelKernels plans ("linear", "gemm_group") beside ("linear", "gemm"): the corresponding leaf
    (same impl), and every grouped output has the bits of its own gemm call."""
    from jengine.models.dense import ModelKernels

    kern = ModelKernels.plan_for(dtype=jnp.float32, hardware="cpu",
                                 features=frozenset({"batch_invariant"}))
    assert kern.gemm_group.leaf.impl == kern.gemm.leaf.impl == "fixed_order"
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    ws = tuple(jnp.asarray(rng.standard_normal((16, n)), jnp.float32) for n in (8, 4))
    alone = [kern.gemm(x, w, out_dtype=jnp.float32) for w in ws]
    outs = kern.gemm_group(x, ws, out_dtype=jnp.float32)
    assert [count_bit_differences(a, b) for a, b in zip(alone, outs)] == [0, 0]


# -- fixed_order's exact forms: split_product and fixed_exp -----------------------------------------

def _ulps(a, b) -> np.ndarray:
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return np.abs(ia - ib)


def test_split_product_with_bf16_is_the_rounded_product():
    """bf16 b: split_product is RN(a * b) bit for bit (numpy's f32 multiply, IEEE on any CPU).
    Negative control: the same split with an f32 b is not exact, so it differs somewhere."""
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(1 << 18) * 3).astype(np.float32)
    b = np.asarray(jnp.asarray(rng.standard_normal(1 << 18), jnp.bfloat16).astype(jnp.float32))
    got = jax.jit(lambda a, b: split_product(a, b, jnp.bfloat16))(a, b)
    assert count_bit_differences(got, a * b) == 0
    b32 = rng.standard_normal(1 << 18).astype(np.float32)
    wrong = jax.jit(lambda a, b: split_product(a, b, jnp.bfloat16))(a, b32)
    assert count_bit_differences(wrong, a * b32) > 0
    f32 = np.asarray(jax.jit(lambda a, b: split_product(a, b, jnp.float32))(a, b32))
    assert _ulps(f32, a * b32).max() <= 2  # a fixed function within a few ulp of RN(a * b)


def test_fixed_exp_is_within_one_ulp_and_keeps_the_special_values():
    """Tolerance, not bits: within 1 ulp of exp (float64, rounded) on the normal range; the measured
    share of exact results is ~90 %."""
    rng = np.random.default_rng(6)
    x = np.concatenate([rng.uniform(-87, 88, 1 << 19), rng.uniform(-20, 0, 1 << 19),
                        rng.standard_normal(1 << 16) * 1e-3]).astype(np.float32)
    got = np.asarray(jax.jit(fixed_exp)(x))
    ref = np.exp(x.astype(np.float64)).astype(np.float32)
    assert _ulps(got, ref).max() <= 1
    special = np.asarray(fixed_exp(jnp.array([-np.inf, np.inf, np.nan, 0.0, -0.0, -100.0],
                                             jnp.float32)))
    assert special[0] == 0 and not np.signbit(special[0]) and special[1] == np.inf
    assert np.isnan(special[2]) and special[3] == special[4] == 1 and special[5] == 0


def test_fixed_exp_has_the_same_bits_in_every_program():
    """Alone, in short 1-D arrays (XLA:CPU's vector-tail sizes), fused with a max reduction and under
    a transpose: the same bits. Negative control: the check sees a change of one coefficient."""
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((16, 320)) * 10).astype(np.float32)
    shifted = z - z.max(-1, keepdims=True)
    alone = np.asarray(jax.jit(fixed_exp)(shifted))
    contexts = {
        "fused with the max": jax.jit(lambda z: fixed_exp(z - jnp.max(z, -1, keepdims=True)))(z),
        "transposed": jax.jit(lambda s: fixed_exp(s.T).T)(shifted),
        "one row": np.concatenate([jax.jit(fixed_exp)(shifted[r])[None] for r in range(16)]),
    }
    for name, got in contexts.items():
        assert count_bit_differences(got, alone) == 0, name
    flat = shifted.reshape(-1)
    for n in (1, 3, 5, 7, 11, 13, 15, 17, 33):
        assert count_bit_differences(jax.jit(fixed_exp)(flat[:n]), alone.reshape(-1)[:n]) == 0, n
    import pallas_kernels.fixed_order as fo

    coeffs = fo._EXP_COEFFS
    fo._EXP_COEFFS = coeffs[:3] + (np.nextafter(coeffs[3], np.float32(1)),) + coeffs[4:]
    try:
        changed = np.asarray(fixed_exp(jnp.asarray(shifted)))  # not jitted: no stale trace
    finally:
        fo._EXP_COEFFS = coeffs
    assert count_bit_differences(changed, alone) > 0


@pytest.mark.parametrize("width", [96, 1536])
def test_rmsnorm_variance_is_the_trainers_at_widths_that_are_not_powers_of_two(width):
    """The leaf inside a jit (where XLA fuses it) against the trainer's op-by-op RMSNorm: the
    mean twin, `+ eps` as its own torch op, the rsqrt twin, the multiply. Compared before the bf16
    rounding, so every f32 bit counts. Control: the division as XLA rewrites it (a multiply by the
    reciprocal of H, contracted with `+ eps` on the CPU) does not match; at a power-of-two width
    the reciprocal is exact, which is how the mismatch hid from the dense families."""
    import torch

    rng = np.random.default_rng(width)
    x = jnp.asarray(rng.standard_normal((2048, width)), jnp.bfloat16).astype(jnp.float32)
    eps = 1e-6
    engine = jax.jit(lambda xf: rmsnorm._normalize(xf, eps, rmsnorm._fixed_mean))(x)

    xt = torch.from_numpy(np.array(x))  # a copy: jax arrays are read-only, torch tensors are not
    var = rmsnorm.mean_fixed_order_torch(xt.pow(2))
    trainer = (xt * rmsnorm.rsqrt_torch(var + eps)).numpy()
    assert count_bit_differences(np.asarray(engine), trainer) == 0

    def rewritten_mean(sq):  # what XLA makes of `sum / H` with H a constant
        return (rmsnorm.tree_sum(sq, axis=-1) / jnp.float32(sq.shape[-1]))[..., None]

    control = jax.jit(lambda xf: rmsnorm._normalize(xf, eps, rewritten_mean))(x)
    assert count_bit_differences(np.asarray(control), trainer) > 0
