"""--numerics auto on a GPU plans the xla_gate_up_triton pair (pallas_kernels/triton_gemm.py):
XLA's dots, except the MLP's gate/up of a decode step (two members, no biases, <= 64 rows, a
tuned tile), which run the grouped Triton launch. rl-bitwise keeps its invariant leaf. Which call
takes which path is checked here by tracing (no GPU); the timings are docs/performance.md's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.triton_interpreter import registered_as_on_a_gpu, triton_gemm_leaves


@pytest.fixture
def triton_gemm_on_a_gpu(monkeypatch):
    from pallas_kernels import triton_gemm

    yield from registered_as_on_a_gpu(monkeypatch, triton_gemm, triton_gemm_leaves())


def test_auto_plans_the_pair_and_rl_bitwise_its_invariant_leaf(triton_gemm_on_a_gpu):
    from pallas_kernels.registry import plan

    kw = dict(formats={"bf16"}, hardware="gpu")
    for name in ("gemm", "gemm_group"):
        assert plan("linear", name, **kw).leaf.impl == "xla_gate_up_triton"
        assert plan("linear", name, features={"batch_invariant"}, **kw).leaf.impl == \
            "triton_fixed_tile"
        assert plan("linear", name, formats={"bf16"}, hardware="cpu").leaf.impl == "xla_native"


def _route(monkeypatch, triton_gemm, m, ns, k=4096, biases=False):
    """Which path gemm_group_auto takes for x[m, k] and members of widths ns (traced only)."""
    taken = []

    def grouped(x, ws, biases=None, *, out_dtype):
        taken.append("triton")
        return tuple(jnp.zeros((x.shape[0], w.shape[1]), out_dtype) for w in ws)

    monkeypatch.setattr(triton_gemm, "gemm_group_triton", grouped)
    args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            *(jax.ShapeDtypeStruct((k, n), jnp.bfloat16) for n in ns)]
    bs = tuple(jnp.zeros(n, jnp.bfloat16) for n in ns) if biases else None
    outs = jax.eval_shape(lambda x, *ws: triton_gemm.gemm_group_auto(x, ws, bs,
                                                                      out_dtype=jnp.bfloat16),
                          *args)
    assert [o.shape for o in outs] == [(m, n) for n in ns]
    return taken[0] if taken else "xla"


def test_only_gate_up_at_decode_rows_takes_the_grouped_launch(monkeypatch, triton_gemm_on_a_gpu):
    triton_gemm = triton_gemm_on_a_gpu
    gate_up = (14336, 14336)
    assert _route(monkeypatch, triton_gemm, 1, gate_up) == "triton"
    assert _route(monkeypatch, triton_gemm, triton_gemm.AUTO_GATE_UP_MAX_M, gate_up) == "triton"
    # the controls: each condition alone sends the group to XLA
    assert _route(monkeypatch, triton_gemm, triton_gemm.AUTO_GATE_UP_MAX_M + 1, gate_up) == "xla"
    assert _route(monkeypatch, triton_gemm, 1, (4096, 1024, 1024)) == "xla"  # q/k/v
    assert _route(monkeypatch, triton_gemm, 1, gate_up, biases=True) == "xla"
    assert _route(monkeypatch, triton_gemm, 1, (12288, 12288)) == "xla"  # no tuned tile
