"""Measurements of sharding/ on 8 fake CPU devices, printed as one JSON object.

Run by tests/test_sharding.py in a subprocess: XLA reads --xla_force_host_platform_device_count
once per process, and the pytest process has already started jax with one device. Every entry is
a measured count or bit pattern; the assertions live in the test.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from sharding.collectives import (ordered_all_reduce, ordered_reduce_scatter,  # noqa: E402
                                  route)
from sharding.mesh import make_mesh  # noqa: E402

ILL_CONDITIONED = np.array([1e8, 1, -1e8, 1, 3, -3, 1e-3, 7], np.float32)  # 8.001 vs 7.001


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return a.view(np.uint16)
    return a.astype(np.float32).view(np.uint32)


def differing(a, b) -> int:
    return int(np.count_nonzero(bits(a) != bits(b)))


def numpy_left_fold(parts: np.ndarray) -> np.ndarray:
    """The reference: fp32, ranks 0..W-1 left to right, starting from +0.0."""
    acc = np.zeros(parts.shape[1:], np.float32)
    for part in parts:
        acc = acc + part.astype(np.float32)
    return acc


def jax_tree_fold(parts):
    """Negative control: pairwise tree order, the order a psum is allowed to use."""
    level = [parts[r].astype(jnp.float32) for r in range(parts.shape[0])]
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def payload(rng, ranks, rows, width) -> np.ndarray:
    """[ranks, rows, width] f32 over 8 decades, with the ill-conditioned column and signed
    zeros planted in row 0. No subnormals: XLA:CPU flushes them (measured separately)."""
    x = rng.standard_normal((ranks, rows, width)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-4, 4, (ranks, rows, width))).astype(np.float32)
    x[:, 0, 0] = ILL_CONDITIONED[:ranks]
    x[:, 0, 1] = -0.0  # every term -0.0
    x[:, 0, 2] = [-0.0] * (ranks - 1) + [0.0]
    return x


def on_ranks(mesh, fn, x, axis="tensor", out_spec=None):
    """Run fn(local) under shard_map, the leading dim of x split over `axis` (one slice/rank)."""
    in_spec = P(axis) if x.ndim == 1 else P(*((axis,) + (None,) * (x.ndim - 1)))
    sharded = jax.device_put(x, NamedSharding(mesh, in_spec))
    out_spec = P() if out_spec is None else out_spec
    mapped = jax.shard_map(lambda local: fn(local[0]), mesh=mesh, in_specs=in_spec,
                           out_specs=out_spec)
    return np.asarray(jax.jit(mapped)(sharded))


def main():
    rng = np.random.default_rng(0)
    out = {"jax_version": jax.__version__, "devices": jax.device_count()}
    mesh8 = make_mesh(tp=8)
    out["mesh8"] = {"axes": list(mesh8.axis_names), "shape": dict(mesh8.shape),
                    "device_ids": [d.id for d in mesh8.devices.flat]}
    out["mesh1"] = dict(make_mesh().shape)
    x = payload(rng, 8, 64, 128)
    ref = numpy_left_fold(x)

    # The fold == numpy's left fold, f32 and bf16 (one rounding of the f32 fold).
    folded = on_ranks(mesh8, lambda v: ordered_all_reduce(v, "tensor"), x)
    out["all_reduce_f32_differing"] = differing(folded, ref)
    xb = x.astype(ml_dtypes.bfloat16)
    folded_b = on_ranks(mesh8, lambda v: ordered_all_reduce(v, "tensor"), xb)
    out["all_reduce_bf16_differing"] = differing(folded_b,
                                                 numpy_left_fold(xb).astype(ml_dtypes.bfloat16))
    out["all_reduce_dtype"] = str(folded_b.dtype)
    out["signed_zero_bits"] = {"fold": int(bits(folded[0, 1])), "numpy": int(bits(ref[0, 1])),
                               "fold_mixed": int(bits(folded[0, 2]))}

    # Subnormals: XLA:CPU runs with flush-to-zero / denormals-are-zero, the fold included.
    tiny = np.float32(1e-40) * np.arange(1, 9, dtype=np.float32)[:, None]
    out["subnormal"] = {
        "fold": float(on_ranks(mesh8, lambda v: ordered_all_reduce(v, "tensor"), tiny)[0]),
        "numpy": float(numpy_left_fold(tiny)[0]),
        "plain_jit_add": float(jax.jit(jnp.add)(tiny[0], tiny[1])[0]),
    }

    # Batch invariance: rows of a 1-, 3- and 64-row call (three compiled programs) vs numpy.
    out["batch_invariance_differing"] = {}
    for rows in (1, 3, 64):
        got = on_ranks(mesh8, lambda v: ordered_all_reduce(v, "tensor"), x[:, :rows])
        out["batch_invariance_differing"][rows] = differing(got, ref[:rows])

    # Negative control: a tree fold on the same gathered parts differs, and the checker says so.
    def tree(v):
        return jax_tree_fold(jax.lax.all_gather(v, "tensor", tiled=False, to="invarying"))
    tree_result = on_ranks(mesh8, tree, x)
    out["tree_differing"] = differing(tree_result, ref)
    out["ill_conditioned"] = {"left_fold": float(folded[0, 0]), "tree": float(tree_result[0, 0]),
                              "numpy_left_fold": float(ref[0, 0])}

    # Reduce-scatter over the width: rank r's block r of the fold, at 1, 3 and 64 rows.
    def scatter(v):
        return ordered_reduce_scatter(v, "tensor", scatter_dimension=1)
    out["reduce_scatter_differing"] = {}
    for rows in (1, 3, 64):
        got = on_ranks(mesh8, scatter, x[:, :rows], out_spec=P(None, "tensor"))
        out["reduce_scatter_differing"][rows] = differing(got, ref[:rows])
    got_b = on_ranks(mesh8, scatter, xb, out_spec=P(None, "tensor"))
    out["reduce_scatter_bf16_differing"] = differing(
        got_b, numpy_left_fold(xb).astype(ml_dtypes.bfloat16))

    # A 2 (data) x 4 (tensor) mesh: the fold runs within each data rank's own tensor group.
    mesh24 = make_mesh(tp=4, dp=2)
    x24 = payload(rng, 8, 4, 32).reshape(2, 4, 4, 32)
    sharded = jax.device_put(x24, NamedSharding(mesh24, P("data", "tensor")))
    grouped = jax.jit(jax.shard_map(
        lambda v: ordered_all_reduce(v[0, 0], "tensor")[None], mesh=mesh24,
        in_specs=P("data", "tensor"), out_specs=P("data")))(sharded)
    want = np.stack([numpy_left_fold(x24[d]) for d in range(2)])
    out["grouped_mesh_differing"] = differing(np.asarray(grouped), want)

    # Measurement: XLA:CPU's psum / psum_scatter against the rank-order fold.
    psum = on_ranks(mesh8, lambda v: jax.lax.psum(v, "tensor"), x)
    out["psum_vs_fold_differing"] = differing(psum, ref)
    out["psum_ill_conditioned"] = float(psum[0, 0])
    out["psum_signed_zero_bits"] = int(bits(psum[0, 1]))
    psum_b = on_ranks(mesh8, lambda v: jax.lax.psum(v, "tensor"), xb)
    out["psum_bf16_vs_fold_differing"] = differing(
        psum_b, numpy_left_fold(xb).astype(ml_dtypes.bfloat16))
    ps = on_ranks(mesh8, lambda v: jax.lax.psum_scatter(v, "tensor", scatter_dimension=1,
                                                       tiled=True), x, out_spec=P(None, "tensor"))
    out["psum_scatter_vs_fold_differing"] = differing(ps, ref)

    # Every route's fn runs under shard_map on this mesh.
    runs = {}
    for op, kind in (("all_reduce", "sum"), ("all_reduce", "max"), ("all_reduce", "min"),
                     ("reduce_scatter", "sum")):
        for bic in (False, True):
            r = route(op, batch_invariant_collectives=bic, op_kind=kind)
            if op == "reduce_scatter":
                got = on_ranks(mesh8, lambda v: r.fn(v, "tensor", scatter_dimension=1), x,
                               out_spec=P(None, "tensor"))
            else:
                got = on_ranks(mesh8, lambda v: r.fn(v, "tensor"), x)
            if kind == "sum":
                entry = {"differing": differing(got, ref)}
            else:  # exact in value; the sign of a zero result follows the order (see below)
                want = x.max(axis=0) if kind == "max" else x.min(axis=0)
                entry = {"unequal_values": int(np.count_nonzero(got != want)),
                         "differing": differing(got, want)}
            runs[f"{op}/{kind}/{bic}"] = {"path": r.path, **entry}
    gather = route("all_gather", batch_invariant_collectives=True, op_kind="data")
    got = on_ranks(mesh8, lambda v: gather.fn(v, "tensor", tiled=False, to="invarying"), x)
    runs["all_gather/data/True"] = {"path": gather.path, "differing": differing(got, x)}
    out["routes"] = runs

    # Max over mixed signed zeros: -0.0 == +0.0, so which one comes back depends on the order.
    zeros = np.zeros((8, 2), np.float32)
    zeros[:7, 0] = -0.0  # -0.0 on ranks 0..6, +0.0 on rank 7
    zeros[1:, 1] = -0.0  # +0.0 on rank 0, -0.0 on ranks 1..7
    pmax = on_ranks(mesh8, lambda v: jax.lax.pmax(v, "tensor"), zeros)
    out["pmax_mixed_zero_bits"] = [int(b) for b in bits(pmax)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
