"""SwiGLU's projections and activation in one launch (pallas_kernels/triton_gemm_swiglu.py, an
experiment planned only on request) on the CPU, under Triton's interpreter: its output has the
bits of the two launches it replaces -- the grouped gate/up GEMM, then silu(gate, times=up) -- for
one and several row tiles, masked columns, k_split 1 / 2 / 4, and the flat K loop; the check fails
when the activation reads the f32 projections instead of the rounded ones, and when a pair's
activation runs before both its tiles are stored (the controls). The interpreter checks the
logic; the GPU's bits and time are scripts/gpu_gemm_swiglu.py's to measure."""

from __future__ import annotations

import dataclasses

import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_activation, triton_gemm, triton_gemm_swiglu  # noqa: E402

K, N = 256, 80  # N not a multiple of BN: masked columns
TILES = {split: triton_gemm.GemmTile(16, 32, 32, num_warps=4, num_stages=2, k_split=split)
         for split in (1, 2, 4)}


@pytest.fixture(scope="module")
def operands():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, K, generator=gen).to(torch.bfloat16)
    wg, wu = ((torch.randn(K, N, generator=gen) / 8).to(torch.bfloat16) for _ in range(2))
    return x, wg, wu


def _two_launches(x, wg, wu, tile):
    gate, up = triton_gemm.gemm_group_triton_torch(x, (wg, wu), out_dtype=torch.bfloat16,
                                                   tile=tile)
    return triton_activation.silu_triton_torch(gate, times=up)


def _differ(a, b) -> int:
    return count_bit_differences(a.float().numpy(), b.float().numpy())


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 17, 40])  # 17, 40: a partial second / third row tile
def test_one_launch_has_the_two_launches_bits(operands, split, m):
    x, wg, wu = operands
    tile = TILES[split]
    want = _two_launches(x[:m], wg, wu, tile)
    got = triton_gemm_swiglu.gemm_swiglu_triton_torch(x[:m], wg, wu, out_dtype=torch.bfloat16,
                                                      tile=tile)
    assert _differ(got, want) == 0
    if split > 1:  # the flat K loop (a tile's flat_k) keeps them too
        flat = dataclasses.replace(tile, flat_k=True)
        got = triton_gemm_swiglu.gemm_swiglu_triton_torch(x[:m], wg, wu, out_dtype=torch.bfloat16,
                                                          tile=flat)
        assert _differ(got, want) == 0


def test_negative_control_the_activation_of_unrounded_projections_differs(operands):
    """The check above can fail: SiLU and the product on the f32 projections (one rounding at the
    end, what a fused kernel that skipped HF's intermediate roundings would compute) differ."""
    x, wg, wu = operands
    gate, up = (triton_gemm.gemm_triton_torch(x, w, out_dtype="f32", tile=TILES[2])
                for w in (wg, wu))
    unrounded = (gate / (1 + torch.exp(-gate)) * up).to(torch.bfloat16)
    assert _differ(unrounded, _two_launches(x, wg, wu, TILES[2])) > 0


def _launch_on_counters(x, wg, wu, tile, start: int):
    """The leaf's launch with every pair counter starting at `start`: (act, counters after)."""
    from pallas_kernels import _triton_launch

    m, n, tile, grid, consts = triton_gemm_swiglu._plan(x, wg, wu, torch.bfloat16, tile)
    gate, up, act = (torch.zeros((m, n), dtype=torch.bfloat16) for _ in range(3))
    sems = torch.full((triton_gemm_swiglu._pairs(m, n, tile).size,), start, dtype=torch.int32)
    _triton_launch.torch_launch(triton_gemm_swiglu.kernels().gemm_swiglu_kernel,
                                (x, wg, wu, m, sems), (gate, up, act, sems), grid,
                                num_warps=tile.num_warps, num_stages=tile.num_stages, **consts)
    return act, sems


def test_negative_control_a_pair_activated_before_both_tiles_are_stored_differs(operands):
    """Each pair's activation runs in the second of its two programs to count itself. With the
    counters starting at 1 the first program of each pair activates against the other tile not
    yet stored (zeros here), and the output differs: the check above can fail on the pairing.
    From zero, the counters end at zero (the next launch may count in the same buffer) and the
    output is the two launches'; from 1 they end at 1."""
    x, wg, wu = operands
    tile = TILES[2]
    want = _two_launches(x[:17], wg, wu, tile)
    act, sems = _launch_on_counters(x[:17], wg, wu, tile, 0)
    assert _differ(act, want) == 0 and int(sems.abs().sum()) == 0
    act, sems = _launch_on_counters(x[:17], wg, wu, tile, 1)
    assert _differ(act, want) > 0 and bool((sems == 1).all())


def test_the_jax_launch_passes_the_kernels_arguments_in_order(monkeypatch):
    """The JAX launch (jax-triton, absent here, replaced by a recorder) passes x, the two weights,
    M and the pair counters, then asks for gate, up and the activation -- the kernel's parameters
    in order, the counters last on both sides (_triton_launch.jax_launch) -- and returns the
    activation, the counters kept inside."""
    import inspect

    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import _triton_launch

    calls = []

    def triton_call(*args, kernel, out_shape, input_output_aliases, **consts):
        calls.append((args, out_shape, input_output_aliases, consts))
        return [jnp.full(s.shape, i, s.dtype) for i, s in enumerate(out_shape)]

    monkeypatch.setattr(_triton_launch, "import_jax_triton",
                        lambda: type("JT", (), {"triton_call": staticmethod(triton_call)}))
    monkeypatch.setattr(_triton_launch, "_register_ffi_lowering", lambda jt: None)
    x = jnp.ones((3, K), jnp.bfloat16)
    w = jnp.ones((K, N), jnp.bfloat16)
    act = triton_gemm_swiglu.gemm_swiglu_triton(x, w, w, out_dtype=jnp.bfloat16, tile=TILES[2])
    ((args, outs, aliases, consts),) = calls
    params = [p for p, v in inspect.signature(
        triton_gemm_swiglu.kernels().gemm_swiglu_kernel.fn).parameters.items()
        if v.annotation != "tl.constexpr"]
    assert len(args) + len(outs) == len(params) == 9
    assert args[3] == 3 and [o.shape for o in outs] == [(3, N)] * 3 + [(args[4].shape[0],)]
    assert args[4].shape == (triton_gemm_swiglu._pairs(3, N, TILES[2]).size,)  # one per tile
    assert aliases == {3: 3}  # the counters: array input 3, output 3
    assert consts["grid"] == (2 * 3,)  # a gate and an up program per output tile (1 x 3 tiles)
    assert np.asarray(act).tolist() == np.full((3, N), 2).tolist()  # the third output


def test_bad_input_names_what_is_wrong(operands):
    x, wg, wu = operands
    call = triton_gemm_swiglu.gemm_swiglu_triton_torch
    with pytest.raises(ValueError, match=r"w_up shape/dtype \(256, 79\)"):
        call(x, wg, wu[:, :79], out_dtype=torch.bfloat16, tile=TILES[2])
    with pytest.raises(ValueError, match="out_dtype=f32 must be x's dtype"):
        call(x, wg, wu, out_dtype=torch.float32, tile=TILES[2])


def test_the_h200_script_checks_what_it_says(tmp_path):
    """scripts/gpu_gemm_swiglu.py --smoke: the script's bits part under the interpreter -- every
    launch shape it tries has the two launches' bits, and its control differs."""
    rows = triton_interpreter.run_smoke("gpu_gemm_swiglu.py", tmp_path, "gemm_swiglu")
    assert [r["m"] for r in rows] == [1, 20]
    for r in rows:
        assert sorted(r["shapes"]) == ["BN64", "flat_k", "table"], r
        assert all(e["differ"] == 0 for e in r["shapes"].values()), r
        assert r["control_differ"] > 0, r
        assert r["timed_two_differ"] == 0, r  # the two launches it would time
