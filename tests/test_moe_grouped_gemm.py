"""("moe", "grouped_gemm") and routed expert compute (jengine/models/layers/moe_routed.py): every
routed (token, slot) pair gets exactly the bits of the dense path -- every expert on every row
through the ("linear", "gemm") plan, then selected -- whatever the routing. Bits, never allclose.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.models.layers.moe_routed import routed_expert_outputs
from pallas_kernels import moe_grouped_gemm
from pallas_kernels._triton_launch import dtype_name
from pallas_kernels._twin import to_torch
from pallas_kernels.moe_grouped_gemm import (EMPTY_TILE, block_rows_for, num_tiles,
                                             plan_expert_tiles)
from pallas_kernels.registry import REGISTRY, plan
from tests.bits import count_bit_differences

E, H, I, K = 5, 24, 40, 3  # 5 experts: a multiple of nothing


def _plans(dtype):
    kw = dict(formats={dtype_name(dtype)}, hardware="cpu", features={"batch_invariant"})
    return SimpleNamespace(gemm=plan("linear", "gemm", **kw), silu=plan("activation", "silu", **kw),
                           grouped_gemm=plan("moe", "grouped_gemm", **kw))


def _routing(kind: str, t: int, seed: int):
    rng = np.random.default_rng(seed)
    if kind == "skewed":  # every token's first slot to expert 3: one expert holds a third of pairs
        rest = np.stack([rng.permutation([0, 1, 2, 4])[:K - 1] for _ in range(t)])
        return np.concatenate([np.full((t, 1), 3), rest], axis=1).astype(np.int32)
    return np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)


# -- the layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("t, kind, block_rows", [(1, "random", 4), (7, "random", 4),
                                                 (9, "skewed", 4), (6, "one_expert", 2)])
def test_plan_puts_each_pair_in_a_tile_of_its_expert(t, kind, block_rows):
    ids = (np.zeros((t, 1), np.int32) if kind == "one_expert" else _routing(kind, t, t))
    order, tile_expert, row_of_pair = map(np.asarray, jax.jit(
        plan_expert_tiles, static_argnums=(1, 2))(jnp.asarray(ids), E, block_rows))
    pairs = ids.size
    assert order.shape == (num_tiles(pairs, E, block_rows) * block_rows,)
    assert tile_expert.shape == (len(order) // block_rows,)
    flat = row_of_pair.reshape(-1)
    assert np.array_equal(order[flat], np.arange(pairs))  # order and row_of_pair are inverse
    assert np.array_equal(tile_expert[flat // block_rows], ids.reshape(-1))
    assert (order[np.setdiff1d(np.arange(len(order)), flat)] == pairs).all()  # padding rows
    for e in range(E):  # within an expert, pairs keep their flat order
        rows = flat[ids.reshape(-1) == e]
        assert np.array_equal(rows, np.sort(rows))
    used = tile_expert != EMPTY_TILE
    assert used.sum() == sum(-(-np.count_nonzero(ids == e) // block_rows) for e in range(E))
    assert np.array_equal(used, np.sort(used)[::-1])  # empty tiles come last
    if t == 1:
        assert len(tile_expert) == K  # one tile per routed expert: the bound is tight at decode


def test_block_rows_follow_the_triton_tiles():
    assert block_rows_for([(768, 2048), (2048, 768)], jnp.bfloat16) == 64  # Qwen3-30B-A3B
    assert block_rows_for([(768, 2048), (2048, 768)], jnp.float32) == 32
    assert block_rows_for([(768, 2048), (4096, 4096)], "bf16") == 128  # a BM-128 tuned tile


# -- the leaf --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_rows_have_the_gemm_leafs_bits_and_empty_tiles_are_zeros(dtype):
    kern = _plans(dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((12, H)), dtype)  # 3 tiles of 4 rows, garbage everywhere
    w = jnp.asarray(rng.standard_normal((E, H, I)) / 5, dtype)
    tile_expert = jnp.asarray([4, 0, EMPTY_TILE], jnp.int32)
    out = jax.jit(lambda x, w, te: kern.grouped_gemm(x, w, te, block_rows=4, out_dtype=dtype))(
        x, w, tile_expert)
    gemm = jax.jit(lambda x, w: kern.gemm(x, w, out_dtype=dtype))
    assert count_bit_differences(out[:4], gemm(x, w[4])[:4]) == 0
    assert count_bit_differences(out[4:8], gemm(x[4:8], w[0])) == 0
    assert count_bit_differences(out[8:], jnp.zeros((4, I), dtype)) == 0
    twin = moe_grouped_gemm.grouped_gemm_fixed_order_torch
    t_out = twin(to_torch(x), to_torch(w), to_torch(tile_expert), block_rows=4, out_dtype=dtype)
    assert count_bit_differences(np.asarray(jax.dlpack.from_dlpack(t_out)), out) == 0


def test_grouped_leaves_mirror_the_gemm_leaves():
    """Each grouped leaf has its gemm leaf's impl name and declarations: one request plans both."""
    def declared(leaf):
        return (leaf.formats, leaf.hardware, leaf.priority, dict(leaf.traits), leaf.features)

    gemm = {leaf.impl: declared(leaf) for leaf in REGISTRY.leaves("linear", "gemm")}
    grouped = REGISTRY.leaves("moe", "grouped_gemm")
    assert grouped and all(declared(leaf) == gemm[leaf.impl] for leaf in grouped)
    assert _plans(jnp.bfloat16).grouped_gemm.leaf.impl == "fixed_order"
    with pytest.raises(TypeError, match="moe.grouped_gemm: missing a required argument"):
        _plans(jnp.bfloat16).grouped_gemm(jnp.zeros((4, H)), jnp.zeros((E, H, I)), out_dtype="f32")


# -- routed == dense -------------------------------------------------------------------------------


def dense_reference(kern, x, ids, weights, gate_w, up_w, down_w, *, dtype, weight_after=False):
    """Every expert on every row through the gemm plan, then each pair's expert selected. The
    routing weight scales the activation (one rounding), or, with weight_after, the output (the
    HF eager place: the negative control)."""
    t, k = ids.shape
    tokens = jnp.arange(t)[:, None]
    act = jnp.stack([kern.silu(kern.gemm(x, gate_w[e], out_dtype=dtype))
                     * kern.gemm(x, up_w[e], out_dtype=dtype) for e in range(E)])[ids, tokens]
    if not weight_after:
        act = (act.astype(jnp.float32) * weights[:, :, None]).astype(dtype)
    out = []
    for s in range(k):
        every = jnp.stack([kern.gemm(act[:, s], down_w[e], out_dtype=dtype) for e in range(E)])
        out.append(every[ids[:, s], tokens[:, 0]])
    out = jnp.stack(out, axis=1)
    return (out * weights[:, :, None].astype(dtype)) if weight_after else out


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(1)
    return {d: tuple(jnp.asarray(rng.standard_normal(s) / 5, d)
                     for s in ((E, H, I), (E, H, I), (E, I, H)))
            for d in (jnp.bfloat16, jnp.float32)}


@pytest.fixture(scope="module")
def compiled():
    out = {}
    for d in (jnp.bfloat16, jnp.float32):
        kern = _plans(d)
        out[d] = (jax.jit(lambda *a, kern=kern, d=d: routed_expert_outputs(kern, *a, dtype=d)),
                  jax.jit(lambda *a, kern=kern, d=d: dense_reference(kern, *a, dtype=d)),
                  jax.jit(lambda *a, kern=kern, d=d: dense_reference(kern, *a, dtype=d,
                                                                      weight_after=True)))
    return out


@pytest.mark.parametrize("dtype, t, kind", [
    (jnp.bfloat16, 1, "random"), (jnp.bfloat16, 7, "random"), (jnp.bfloat16, 7, "skewed"),
    (jnp.float32, 5, "random"), (jnp.float32, 5, "skewed")])
def test_routed_outputs_have_the_dense_paths_bits(experts, compiled, dtype, t, kind):
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.standard_normal((t, H)), dtype)
    ids = jnp.asarray(_routing(kind, t, seed=t))
    weights = jnp.asarray(rng.random((t, K)), jnp.float32)
    routed, dense, weight_after = compiled[dtype]
    out = routed(x, ids, weights, *experts[dtype])
    assert out.shape == (t, K, H) and out.dtype == dtype
    assert count_bit_differences(out, dense(x, ids, weights, *experts[dtype])) == 0
    if t == 7:  # negative control: the weight after down_proj is another rounding, and it shows
        assert count_bit_differences(out, weight_after(x, ids, weights, *experts[dtype])) > 0
