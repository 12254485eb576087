"""The Triton absorbed-MLA leaf's logic, on the CPU, under Triton's interpreter.

What the interpreter shows (its fixed-order dot, tests/triton_interpreter.py; numpy arithmetic, not
the GPU's): the kernels compute MLA (against a float64 reference), the engine's paged leaf equals
the trainer's dense-causal twin bit for bit, a token's row is the same prefilled, chunked (co-batched
with another request) or decoded alone at any block-table width, the serial and split schedules
agree, cutting heads and value columns into more program blocks moves no bit, and unused latent
slots (NaN) never leak in. The GPU's own bits, JAX launch == torch launch included, are
scripts/gpu_mla_attention.py's (the lead runs it on the H200); jax-triton is not installed here.

Shapes are tiny but keep the production structure: R = 128 (two BLOCK_K score dots), P = 16, 4 heads
(packed 4 tokens per program), 300 positions (two 256-position splits), bf16, shuffled 8-slot pages.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_mla_attention as tm  # noqa: E402
from pallas_kernels.registry import REGISTRY  # noqa: E402

# Rows not live in a split compute exp(-inf - -inf) = NaN, which tl.where then discards.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")

H, R, P, PAGE, N = 4, 128, 16, 8, 300
W = R + P
SCALE = W ** -0.5


def _bf16(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)


class Case:
    """Request 0: N positions on shuffled pages; request 1: another 40 to co-batch with."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.lat = _bf16(rng.standard_normal((N, W)) * 1.5)
        self.q = _bf16(rng.standard_normal((N, H, W)) * 1.5)
        self.other = _bf16(rng.standard_normal((40, W)))
        need = -(-N // PAGE) + -(-40 // PAGE)
        self.pool = torch.full((need + 9, PAGE, W), float("nan"), dtype=torch.bfloat16)
        order = rng.permutation(np.arange(1, need + 9))  # page 0 is the null page
        self.pages = [order[:-(-N // PAGE)], order[-(-N // PAGE):need]]
        for req, seq in enumerate((self.lat, self.other)):
            for pos in range(seq.shape[0]):
                self.pool[self.pages[req][pos // PAGE], pos % PAGE] = seq[pos]

    def step(self, rows, width=None, schedule=None):
        """rows: [(request, position)] in step order -> output [T, H, R] (bf16 widened to f32,
        exactly)."""
        width = width or len(self.pages[0])
        tables = torch.zeros((2, width), dtype=torch.int32)
        for req, pages in enumerate(self.pages):
            tables[req, :len(pages)] = torch.from_numpy(pages.astype(np.int32))
        q = torch.stack([self.q[p] if r == 0 else -self.q[p] for r, p in rows])
        req = torch.tensor([r for r, _ in rows], dtype=torch.int32)
        pos = torch.tensor([p for _, p in rows], dtype=torch.int32)
        return tm.mla_paged_attention_triton_torch(q, self.pool, tables, req, pos, v_width=R,
                                                   scale=SCALE, schedule=schedule).float().numpy()


@pytest.fixture(scope="module")
def case():
    return Case()


@pytest.fixture(scope="module")
def prefill(case):
    return case.step([(0, p) for p in range(N)])


def test_matches_float64_reference(case, prefill):
    """Not a bitwise claim. Tolerance: bf16 output (8 bits) of an f32 computation whose p is
    rounded to bf16 before p . v: 2e-2 relative L2 (measured ~3e-3)."""
    lat, q = case.lat.double().numpy(), case.q.double().numpy()
    s = np.einsum("thw,cw->htc", q, lat) * SCALE
    s = np.where(np.tril(np.ones((N, N), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("htc,cr->thr", p / p.sum(-1, keepdims=True), lat[:, :R])
    got = prefill.astype(np.float64)
    assert np.isfinite(got).all(), "NaN from an unused latent slot leaked into the output"
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2


def test_paged_leaf_equals_the_trainer_twin(case):
    """Request 1 (40 positions): the twin reads it as one 40-slot page, the leaf as five 8-slot
    pages. The slow sibling compares request 0 across the split."""
    paged = case.step([(1, p) for p in range(40)])
    dense = tm.mla_dense_causal_attention_triton_torch(-case.q[None, :40], case.other[None],
                                                       v_width=R, scale=SCALE)[0]
    assert count_bit_differences(dense.float().numpy(), paged) == 0


@pytest.mark.slow
def test_paged_leaf_equals_the_trainer_twin_across_the_split(case, prefill):
    dense = tm.mla_dense_causal_attention_triton_torch(case.q[None], case.lat[None], v_width=R,
                                                       scale=SCALE)[0]
    assert count_bit_differences(dense.float().numpy(), prefill) == 0


@pytest.mark.parametrize("chunk, first, last", [(1, 250, 262), (7, 236, N)])
def test_chunked_and_co_batched_rows_equal_prefill(case, prefill, chunk, first, last):
    """Rows across the 256-position split, each step led by another request's decode row."""
    pieces = []
    for start in range(first, last, chunk):
        mine = [(0, p) for p in range(start, min(start + chunk, last))]
        pieces.append(case.step([(1, start % 40)] + mine)[1:])
    assert count_bit_differences(np.concatenate(pieces), prefill[first:last]) == 0


def test_decode_rows_alone_equal_prefill_at_any_table_width(case, prefill):
    for width in (len(case.pages[0]), 64):
        for p in (0, 1, 31, 32, 255, 256, 257, N - 1):
            out = case.step([(0, p)], width=width)
            assert count_bit_differences(out[0], prefill[p]) == 0, (width, p)


def test_serial_and_split_schedules_agree_bitwise(case):
    rows = [(1, 39), (0, 3)] + [(0, p) for p in range(280, N)]
    serial = case.step(rows, schedule="serial")
    assert count_bit_differences(serial, case.step(rows, schedule="split")) == 0


def test_head_and_value_blocking_do_not_change_a_row(case, prefill, monkeypatch):
    """Two heads per program (so 8 tokens per tile) and 32 value columns per program: more
    programs, the same arithmetic per row and column."""
    monkeypatch.setattr(tm, "MAX_HEADS_PER_PROGRAM", 2)
    monkeypatch.setattr(tm, "MAX_VALUE_COLUMNS", 32)
    geo = tm.geometry(H, R, P)
    assert (geo["BH"], geo["TPP"], geo["BV"]) == (2, 8, 32)
    rows = [(0, p) for p in range(250, 262)]
    for schedule in ("serial", "split"):
        assert count_bit_differences(case.step(rows, schedule=schedule), prefill[250:262]) == 0


def test_negative_control_another_split_size_changes_the_bits(case, prefill, monkeypatch):
    """The comparisons above can fail: the same rows with SPLIT = 64 instead of 256 differ."""
    monkeypatch.setattr(tm, "SPLIT", 64)
    rows = [(0, p) for p in range(280, N)]
    assert count_bit_differences(case.step(rows), prefill[280:]) > 0


def test_geometry_names_the_bad_field():
    with pytest.raises(ValueError, match=r"kv_lora_rank \(v_width\)=96"):
        tm.geometry(16, 96, 64)
    with pytest.raises(ValueError, match="qk_rope_head_dim .*=48"):
        tm.geometry(16, 512, 48)
    # DeepSeek-V3's 128 heads: two blocks of 64 (128 in one program is over the H200's shared
    # memory), 4 value blocks of 128.
    assert {k: tm.geometry(128, 512, 64)[k] for k in ("BH", "TPP", "BV")} == dict(BH=64, TPP=1,
                                                                               BV=128)
    assert {k: tm.geometry(16, 512, 64)[k] for k in ("BH", "TPP", "BV")} == dict(BH=16, TPP=1,
                                                                              BV=128)


# -- planning: the leaf as a GPU would register it --------------------------------------------------


@pytest.fixture
def registered(monkeypatch):
    """The two leaves registered as on a machine with jax-triton (here it is missing), then
    removed: what the engine and the trainer's twin table would plan on a GPU."""
    yield from triton_interpreter.registered_as_on_a_gpu(
        monkeypatch, tm, [("attention", "mla_paged", "triton_fixed_split"),
                          ("attention", "mla_dense_causal", "triton_fixed_split")])


def test_gpu_plans_pick_the_triton_leaf_and_the_cpu_keeps_its_own(registered):
    import jax.numpy as jnp

    from interop.twins import find_twin
    from jengine.models.mla_decoder import ModelKernels

    def mla(hardware, **widths):
        return ModelKernels.plan_for(dtype=jnp.bfloat16, hardware=hardware,
                                     features=frozenset({"batch_invariant"}), **widths).mla_attention

    deepseek = dict(head_dim=64, kv_lora_rank=512)
    assert mla("gpu", **deepseek).leaf.impl == "triton_fixed_split"
    assert mla("gpu-sm90", **deepseek).leaf.impl == "triton_fixed_split"
    assert mla("cpu", **deepseek).leaf.impl == "fixed_order"  # the goldens' leaf
    # Widths the kernel cannot take, or a plan that does not give them, plan the portable leaf.
    assert mla("gpu", head_dim=64, kv_lora_rank=96).leaf.impl == "fixed_order"
    assert mla("gpu").leaf.impl == "fixed_order"
    # The trainer's twin table plans the dense-causal family the same way and finds this twin.
    dense = REGISTRY.plan("attention", "mla_dense_causal", formats={"bf16"}, hardware="gpu-sm90",
                          features={"batch_invariant"})
    assert dense.leaf.impl == "triton_fixed_split"
    assert find_twin(dense.leaf.fn) is registered.mla_dense_causal_attention_triton_torch
