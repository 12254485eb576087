"""RoPE + the KV write inside the split attention launch (pallas_kernels/triton_rope_attention.py,
planned by default), on the CPU, under Triton's interpreter.

The contract: the one launch gives exactly the bits of the two it replaces -- rope_write's launch
and then the split attention launch -- on the output and on both pages. Both sides run here under
the interpreter (numpy arithmetic, in bf16 too: the same conversions on both sides), so any
difference is the fused kernel's logic: which K/V each row reads, which rotation, which slots it
writes. The GPU's own bits: scripts/gpu_rope_attention.py.

The steps are the engine's shapes at <= 32 rows: decode rows at positions around page (16), KV
tile (32 / 64) and split (256) boundaries, a prompt chunk crossing tile and split boundaries
next to decode rows (its tiles read each other's new K/V), and a step padded to 16 rows as the
runner pads it (padding rows: token_req T - 1, position 0, a page out of bounds).

Negative controls: the slots the step writes are poisoned (NaN) in the pages the launch reads,
its writes going to other pages -- the results do not move (no read reaches a fresh slot); with
the substitution of fresh positions off the output differs; with the writes dropped the pages
differ while the output does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_attention as ta  # noqa: E402
from pallas_kernels import triton_attention_plan as tap  # noqa: E402
from pallas_kernels import triton_rope_attention as tra  # noqa: E402
from pallas_kernels import triton_rope_write as trw  # noqa: E402

# Rows not live in a split compute exp(-inf - -inf) = NaN, which tl.where then discards.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")

HKV, D, PAGE = 2, 16, 16  # PAGE: the engine's default page size
SCALE = D ** -0.5
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def make_step(seed, runs, *, g=4, dtype="bf16", pad_to=None):
    """A step and the pages it runs on. runs: (context, new) per request: the request holds
    `context` positions after this step, the last `new` of them written by it (decode: new = 1).
    The pages of every request are shuffled over the pool; slots no request holds are NaN.
    pad_to: the runner's token bucket (padding rows: token_req pad_to - 1, position 0, their
    page out of bounds). Returns a dict of torch tensors."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    hq = HKV * g
    pages_per = [-(-n // PAGE) for n, _ in runs]
    num_pages = sum(pages_per) + 1  # + the null page, 0
    pool = rng.standard_normal((2, num_pages, PAGE, HKV, D)).astype(np.float32)
    pool[:, 0] = np.nan  # the null page: what a padding row's tile reads, never a real row
    order = rng.permutation(np.arange(1, num_pages))
    t = sum(new for _, new in runs)
    t_pad = pad_to or t
    rows = max(len(runs), t_pad)  # the runner's block table has one row per token bucket slot
    table = np.zeros((rows, max(pages_per)), np.int32)
    req, pos, used = [], [], 0
    for r, (n, new) in enumerate(runs):
        table[r, :pages_per[r]] = order[used:used + pages_per[r]]
        used += pages_per[r]
        last = pages_per[r] * PAGE
        for p in range(n, last):  # the tail of the request's last page: nobody's slots
            pool[:, table[r, p // PAGE], p % PAGE] = np.nan
        req += [r] * new
        pos += list(range(n - new, n))
    req += [t_pad - 1] * (t_pad - t)
    pos += [0] * (t_pad - t)
    req, pos = np.array(req, np.int32), np.array(pos, np.int32)
    page = table[req, pos // PAGE]
    page = np.where(page == 0, num_pages, page).astype(np.int32)  # padding: out of bounds
    slot = (pos % PAGE).astype(np.int32)
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    angle = pos[:, None].astype(np.float64) * np.concatenate([inv, inv])[None, :]

    def tensor(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(dt)

    return dict(q=tensor(rng.standard_normal((t_pad, hq, D))),
                k=tensor(rng.standard_normal((t_pad, HKV, D))),
                v=tensor(rng.standard_normal((t_pad, HKV, D))),
                cos=tensor(np.cos(angle)), sin=tensor(np.sin(angle)),
                k_pages=tensor(pool[0]), v_pages=tensor(pool[1]),
                page=torch.from_numpy(page), slot=torch.from_numpy(slot),
                table=torch.from_numpy(table), req=torch.from_numpy(req),
                pos=torch.from_numpy(pos))


def two_launches(s, merged=False):
    """Today's layer: rope_write's launch, then the split attention launch -> (out, k, v pages)."""
    kv = (s["k_pages"].clone(), s["v_pages"].clone())
    q, kv = trw.rope_write_triton_torch(s["q"], s["k"], s["v"], s["cos"], s["sin"], kv,
                                        s["page"], s["slot"], merged=merged)
    out = ta.paged_attention_triton_torch(q, kv, s["table"], s["req"], s["pos"], scale=SCALE,
                                          schedule="split")
    return out, *kv


def fused(s, merged=False, pages=None, pages_out=None):
    """The one launch -> (out, k, v pages written). pages: the pages it reads (default: s's);
    pages_out: where it writes (default: in place)."""
    kv = pages or (s["k_pages"].clone(), s["v_pages"].clone())
    out, kv = tra.rope_paged_triton_torch(s["q"], s["k"], s["v"], s["cos"], s["sin"], kv,
                                          s["page"], s["slot"], s["table"], s["req"], s["pos"],
                                          scale=SCALE, merged=merged, pages_out=pages_out)
    return out, *kv


def differences(a, b) -> list[int]:
    return [count_bit_differences(x.float().numpy(), y.float().numpy()) for x, y in zip(a, b)]


def poisoned(s):
    """s's pages with NaN in every slot this step writes (a padding row's write goes nowhere)."""
    k, v = s["k_pages"].clone(), s["v_pages"].clone()
    real = s["page"] < k.shape[0]
    k[s["page"][real].long(), s["slot"][real].long()] = float("nan")
    v[s["page"][real].long(), s["slot"][real].long()] = float("nan")
    return k, v


# -- the steps ---------------------------------------------------------------------------------

BOUNDARY_CONTEXTS = [256, 257, 258, 16, 17, 33, 64, 65]  # position = context - 1: split, page, tile


def decode(bs, contexts=BOUNDARY_CONTEXTS):
    return [(contexts[i % len(contexts)], 1) for i in range(bs)]


MIXED = [(257, 1), (200, 20), (65, 1)]  # a 20-token chunk at 180..199: across a KV tile (192)
MIXED_SPLIT = [(40, 1), (266, 20), (17, 1)]  # 246..265: across the split (256)


EVERY_FORM = [("bf16", False), ("bf16", True), ("f32", False), ("f32", True)]
TWO_FORMS = [("bf16", False), ("f32", True)]


@pytest.mark.parametrize("name, runs, pad_to, dtype, merged", [
    *[("decode bs 1", decode(1), None, *form) for form in TWO_FORMS],
    *[("decode bs 3", decode(3, [256, 257, 258]), None, *form) for form in TWO_FORMS],
    *[("mixed: a chunk across a KV tile", MIXED, None, *form) for form in TWO_FORMS],
    *[("mixed: a chunk across the split", MIXED_SPLIT, None, *form) for form in EVERY_FORM],
    *[("bs 1 padded to 16", decode(1, [257]), 16, *form) for form in EVERY_FORM],
])
def test_one_launch_gives_the_two_launches_bits(name, runs, pad_to, dtype, merged):
    """Output and both pages, bit for bit, in bf16 and f32, on three q / k / v arrays and on
    their concatenation (auto's merged read: both sides read it)."""
    s = make_step(1, runs, dtype=dtype, pad_to=pad_to)
    assert s["q"].shape[0] <= tap.SPLIT_MAX_ROWS
    assert differences(fused(s, merged), two_launches(s, merged)) == [0, 0, 0], name


GQA = [(g, name, runs) for g in (1, 8) for name, runs in (
    ("decode bs 16", decode(16)), ("mixed", MIXED_SPLIT))]


@pytest.mark.parametrize("g, name, runs", GQA)
@pytest.mark.parametrize("dtype, merged", [("bf16", False), ("f32", True)])
def test_every_gqa_group_size_gives_the_two_launches_bits(g, name, runs, dtype, merged):
    """A KV head's group of 1 query head (16 tokens per tile: a prompt chunk fills one) or 8 (2
    tokens per tile), as the 4 above."""
    s = make_step(2, runs, g=g, dtype=dtype)
    assert differences(fused(s, merged), two_launches(s, merged)) == [0, 0, 0], (g, name)


@pytest.mark.slow
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("merged", [False, True])
def test_thirty_two_decode_rows_give_the_two_launches_bits(g, dtype, merged):
    """The largest step the one launch takes: 32 decode rows around every boundary."""
    s = make_step(3, decode(32), g=g, dtype=dtype)
    assert differences(fused(s, merged), two_launches(s, merged)) == [0, 0, 0]


def test_a_mixed_padded_step_gives_the_two_launches_bits():
    """Decode rows and a 10-token chunk, padded to the runner's 16-row bucket."""
    s = make_step(4, [(257, 1), (30, 10), (64, 1)], pad_to=16)
    assert differences(fused(s), two_launches(s)) == [0, 0, 0]


# -- negative controls: the comparisons above can fail ----------------------------------------

CONTROL_STEPS = {"decode": decode(4), "mixed": MIXED_SPLIT}


@pytest.mark.parametrize("step", sorted(CONTROL_STEPS))
def test_no_read_reaches_a_slot_the_step_writes(step):
    """The one launch reading pages whose fresh slots are NaN (and writing clean copies): the
    same bits as the two launches on clean pages -- so every fresh K/V a row uses came from the
    inputs, which is what makes the launch safe without any order between its programs."""
    s = make_step(5, CONTROL_STEPS[step])
    clean = (s["k_pages"].clone(), s["v_pages"].clone())
    got = fused(s, pages=poisoned(s), pages_out=clean)
    assert differences(got, two_launches(s)) == [0, 0, 0]


def _without_fresh_rows(monkeypatch):
    real = tra.fresh_rows_torch

    def no_fresh(tiles, token_req, positions, page, num_pages):
        out = real(tiles, token_req, positions, page, num_pages)
        out[6] = 0  # no run writes: every position read from the pages
        return out
    monkeypatch.setattr(tra, "fresh_rows_torch", no_fresh)


@pytest.mark.parametrize("step", sorted(CONTROL_STEPS))
def test_control_without_the_substitution_the_poisoned_slots_are_read(step, monkeypatch):
    """The check above can fail: with no position taken from the inputs the rows read the
    poisoned slots and the output differs (the pages it writes do not)."""
    s = make_step(5, CONTROL_STEPS[step])
    want = two_launches(s)
    _without_fresh_rows(monkeypatch)
    clean = (s["k_pages"].clone(), s["v_pages"].clone())
    got = fused(s, pages=poisoned(s), pages_out=clean)
    out, k, v = differences(got, want)
    assert out > 0 and (k, v) == (0, 0)


def test_control_without_the_writes_the_pages_differ(monkeypatch):
    """The page comparison can fail: the same launch with every write dropped (each row's page
    out of bounds, the runs' fresh positions still taken from the real pages) gives the same
    output and pages that differ from the two launches'."""
    s = make_step(6, MIXED)
    want = two_launches(s)
    real = tra.fresh_rows_torch
    monkeypatch.setattr(tra, "fresh_rows_torch", lambda tiles, req, pos, page, n: real(
        tiles, req, pos, s["page"], n))
    dropped = dict(s, page=torch.full_like(s["page"], s["k_pages"].shape[0]))
    out, k, v = differences(fused(dropped), want)
    assert out == 0 and k > 0 and v > 0


def test_steps_past_the_split_schedule_run_the_two_launches():
    """More than SPLIT_MAX_ROWS rows: the leaf makes the two launches themselves (the serial
    schedule's), so the same bits as they give."""
    s = make_step(7, [(60, 34)], g=8, dtype="f32")
    assert s["q"].shape[0] > tap.SPLIT_MAX_ROWS
    kv = (s["k_pages"].clone(), s["v_pages"].clone())
    q, kv = trw.rope_write_triton_torch(s["q"], s["k"], s["v"], s["cos"], s["sin"], kv,
                                        s["page"], s["slot"])
    want = (ta.paged_attention_triton_torch(q, kv, s["table"], s["req"], s["pos"], scale=SCALE),
            *kv)
    assert differences(fused(s), want) == [0, 0, 0]


LONGEST = tra.FUSED_MAX_POSITIONS  # a request holding this many positions fills the block table


@pytest.mark.parametrize("runs,one_launch", [
    (decode(1), True), (decode(tra.FUSED_MAX_ROWS), True), (decode(tra.FUSED_MAX_ROWS + 1), False),
    (decode(tap.SPLIT_MAX_ROWS), False), ([(LONGEST, 1)], True), ([(LONGEST + 1, 1)], False),
    (decode(tra.FUSED_MAX_ROWS - 1) + [(LONGEST + 1, 1)], False)])
def test_the_engines_leaf_launches_one_kernel_on_small_short_steps(runs, one_launch, monkeypatch):
    """The JAX leaf (a GPU's; its launches recorded here, not run): the one kernel at <=
    FUSED_MAX_ROWS rows over a block table of <= FUSED_MAX_POSITIONS positions (measured faster
    there), rope_write's and attention's own leaves otherwise (the one launch was slower at 32
    rows, and looked slower at 16 x 8192). Either way the bits are the two launches'."""
    import jax.numpy as jnp

    calls = []
    monkeypatch.setattr(tra, "jax_launch", lambda kernel, inputs, outs, *a, **kw: (
        calls.append(kernel.__name__) or tuple(jnp.zeros(o.shape, o.dtype) for o in outs)))
    monkeypatch.setattr(trw, "rope_write_triton", lambda q, k, v, cos, sin, kv, *a, **kw: (
        calls.append("rope_write") or (q, kv)))
    monkeypatch.setattr(ta, "paged_attention_triton", lambda q, *a, **kw: (
        calls.append("attention") or q))
    s = make_step(8, runs, dtype="bf16")
    j = {name: jnp.asarray(s[name].float().numpy(), jnp.bfloat16) if s[name].is_floating_point()
         else jnp.asarray(s[name].numpy()) for name in s if hasattr(s[name], "numpy")}
    tra.rope_paged_triton(j["q"], j["k"], j["v"], j["cos"], j["sin"],
                          (j["k_pages"], j["v_pages"]), j["page"], j["slot"], j["table"],
                          j["req"], j["pos"], scale=SCALE)
    assert calls == (["attention_rope_split_kernel"] if one_launch else
                     ["rope_write", "attention"])


# -- planning: JENGINE_ATTENTION_ROPE, and only over the leaves a fused leaf composes -----------

INVARIANT = frozenset({"batch_invariant"})


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The Triton attention, rope_write and fused leaves registered as on a GPU machine."""
    gens = [triton_interpreter.registered_as_on_a_gpu(monkeypatch, module, leaves) for module,
            leaves in ((ta, [("attention", "paged", "triton_fixed_split"),
                             ("attention", "dense_causal", "triton_fixed_split"),
                             ("attention", "paged", "triton_wide_prefill")]),
                       (trw, [("attention", "rope_write", "triton_fused"),
                              ("attention", "rope_write", "triton_fused_qkv")]),
                       (tra, [("attention", "rope_paged", "triton_fused_split"),
                              ("attention", "rope_paged", "triton_fused_split_qkv")]))]
    for gen in gens:
        next(gen)
    yield
    for gen in reversed(gens):
        next(gen, None)


def _kern(features, hardware="gpu", head_dim=128):
    import jax.numpy as jnp

    from jengine.models.dense import ModelKernels

    return ModelKernels.plan_for(dtype=jnp.bfloat16, hardware=hardware, features=features,
                                 head_dim=head_dim)


def _impls(kern):
    return tuple(None if p is None else p.leaf.impl
                 for p in (kern.attention, kern.rope_write, kern.rope_paged))


def test_the_switch_plans_each_modes_fused_leaf_unless_off(monkeypatch, on_a_gpu):
    """Unset, empty or JENGINE_ATTENTION_ROPE=fused: rl-bitwise plans triton_fused_split over its
    two leaves, auto triton_fused_split_qkv over its own; on the CPU rl-bitwise plans the
    portable composition and auto (XLA's attention: no fused form) nothing; a head_dim the
    Triton leaves refuse plans the portable leaves and their composition. =off: no fused leaf in
    either mode."""
    from pallas_kernels import rope_attention

    for value in (None, "", "fused"):
        if value is None:
            monkeypatch.delenv(rope_attention.ENV, raising=False)
        else:
            monkeypatch.setenv(rope_attention.ENV, value)
        assert _impls(_kern(INVARIANT)) == ("triton_fixed_split", "triton_fused",
                                            "triton_fused_split")
        assert _impls(_kern(frozenset())) == ("triton_wide_prefill", "triton_fused_qkv",
                                              "triton_fused_split_qkv")
        assert _impls(_kern(INVARIANT, "cpu")) == ("fixed_order", "xla", "xla_fixed_order")
        assert _impls(_kern(frozenset(), "cpu")) == ("xla_native", "xla", None)
        assert _impls(_kern(INVARIANT, head_dim=96)) == ("fixed_order", "xla",
                                                         "xla_fixed_order")
    monkeypatch.setenv(rope_attention.ENV, "off")
    for features, hardware in ((INVARIANT, "gpu"), (frozenset(), "gpu"), (INVARIANT, "cpu")):
        assert _impls(_kern(features, hardware))[2] is None


def test_a_fused_leaf_over_other_leaves_is_never_planned(monkeypatch, on_a_gpu):
    """A stand-in ranked above every leaf that composes triton_fixed_split with the portable
    rope_write: rl-bitwise on a GPU planned triton_fused, so it keeps triton_fused_split.
    Control: declaring the planned composition, the stand-in is planned."""
    from pallas_kernels import rope_attention
    from pallas_kernels.gemm_epilogues import composes
    from pallas_kernels.registry import REGISTRY, Priority

    monkeypatch.setenv(rope_attention.ENV, "fused")
    for rope_write, want in (("xla", "triton_fused_split"), ("triton_fused", "standin")):
        REGISTRY.register("attention", "rope_paged", "standin", formats={"bf16"},
                          hardware={"gpu"}, priority=Priority.VENDOR, features={
                              "batch_invariant", composes(attention="triton_fixed_split",
                                                          rope_write=rope_write)})(
            rope_attention.rope_paged_portable)
        try:
            assert _impls(_kern(INVARIANT))[2] == want
        finally:
            REGISTRY.unregister("attention", "rope_paged", "standin")


def test_a_miss_warns_only_where_fused_was_asked_for(monkeypatch, caplog):
    """auto on the CPU (XLA's attention: no fused form) plans no fused leaf: a warning naming the
    variable where JENGINE_ATTENTION_ROPE=fused asked for it, nothing at the default (unset)."""
    import logging

    from pallas_kernels import rope_attention

    for value, warned in (("fused", True), (None, False)):
        if value is None:
            monkeypatch.delenv(rope_attention.ENV, raising=False)
        else:
            monkeypatch.setenv(rope_attention.ENV, value)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=rope_attention.__name__):
            assert _impls(_kern(frozenset(), "cpu"))[2] is None
        levels = {r.levelno for r in caplog.records if "rope_paged not planned" in r.getMessage()}
        assert levels == ({logging.WARNING} if warned else {logging.DEBUG}), (value, levels)


def test_an_unknown_value_is_refused_naming_the_variable_and_value(monkeypatch):
    from pallas_kernels import rope_attention

    monkeypatch.setenv(rope_attention.ENV, "one_launch")
    with pytest.raises(ValueError, match="JENGINE_ATTENTION_ROPE='one_launch'"):
        _kern(INVARIANT, "cpu")


@pytest.mark.slow  # 17 s: the bits it checks are the cases above, through the script
def test_the_gpu_scripts_bits_part_runs_and_agrees(tmp_path):
    """scripts/gpu_rope_attention.py --smoke (its bits part and its timed launches' outputs,
    small heads, under this interpreter): every comparison 0 elements, the timed one launch and
    two launches the same output."""
    doc = triton_interpreter.run_smoke("gpu_rope_attention.py", tmp_path, "rope_attention")
    assert doc["bits"] and all(r["out_k_v_differ"] == [0, 0, 0] for r in doc["bits"])
    assert doc["timings_us"] and all(r["same_output"] for r in doc["timings_us"])
