"""The Triton GPU leaves: what can be checked on any machine, and the bitwise checks that need a GPU.

Any machine: the modules import without triton (and then register nothing), each leaf matches its
family's declared signature, tiles are a function of static shapes only and the tile tables give
exactly the tiles of before, bad input names the field, jax-triton's import no longer breaks Triton's
cache for torch in the same process, a GPU launch without jax-triton warns (it would plan the slow
portable leaves), and the bench's byte count matches Llama-3-8B's published size.

GPU (skipped unless triton, jax-triton, torch CUDA and a JAX GPU backend are all present; run on the
GPU machine with ``JAX_PLATFORMS=cuda``): row invariance and torch-vs-jax launch bit equality, with
XLA's own dot as the negative control. A skip validates nothing: the GPU record is
docs/gpu-validation.md, produced by scripts/gpu_validate.py.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types

import numpy as np
import pytest

from pallas_kernels import (triton_activation, triton_attention, triton_gemm, triton_gemm_tiles,
                            triton_mla_attention, triton_moe_grouped_gemm, triton_norm,
                            triton_rope_write, triton_sampling)
from pallas_kernels._triton_launch import bits, dtype_name, import_jax_triton, triton_available
from pallas_kernels.registry import REGISTRY

TRITON_IMPLS = {("linear", "gemm"): "triton_fixed_tile",
                ("linear", "gemm_group"): "triton_fixed_tile",
                ("moe", "grouped_gemm"): "triton_fixed_tile",
                ("norm", "rmsnorm"): "triton_fixed_tree",
                ("norm", "add_rmsnorm"): "triton_fixed_tree",
                ("activation", "silu"): "triton_elementwise",
                ("sampling", "block_sumexp"): "triton_fixed_tree",
                ("attention", "paged"): "triton_fixed_split",
                ("attention", "dense_causal"): "triton_fixed_split",
                ("attention", "mla_paged"): "triton_fixed_split",
                ("attention", "mla_dense_causal"): "triton_fixed_split",
                ("attention", "rope_write"): "triton_fused"}
TRITON_LEAVES = {("linear", "gemm"): triton_gemm.gemm_triton,
                 ("linear", "gemm_group"): triton_gemm.gemm_group_triton,
                 ("moe", "grouped_gemm"): triton_moe_grouped_gemm.grouped_gemm_triton,
                 ("norm", "rmsnorm"): triton_norm.rmsnorm_triton,
                 ("norm", "add_rmsnorm"): triton_norm.add_rmsnorm_triton,
                 ("activation", "silu"): triton_activation.silu_triton,
                 ("sampling", "block_sumexp"): triton_sampling.block_sumexp_triton,
                 ("attention", "paged"): triton_attention.paged_attention_triton,
                 ("attention", "dense_causal"): triton_attention.dense_causal_attention_triton,
                 ("attention", "mla_paged"): triton_mla_attention.mla_paged_attention_triton,
                 ("attention", "mla_dense_causal"):
                     triton_mla_attention.mla_dense_causal_attention_triton,
                 ("attention", "rope_write"): triton_rope_write.rope_write_triton}


# -- any machine -----------------------------------------------------------------------------------


def test_registration_follows_triton_availability():
    for (family, name), impl in TRITON_IMPLS.items():
        leaves = {l.impl: l for l in REGISTRY.leaves(family, name)}
        if not triton_available():
            assert impl not in leaves, f"{family}.{name}: registered without triton"
            continue
        leaf = leaves[impl]
        assert leaf.hardware == frozenset({"gpu"})
        assert "batch_invariant" in leaf.features
        assert leaf.traits == {"deterministic": True, "batch_invariant": True}


def test_every_triton_leaf_matches_its_familys_signature():
    """Registration checks this only where the leaves register (a GPU); checked here anywhere."""
    assert set(TRITON_LEAVES) == set(TRITON_IMPLS)
    for (family, name), fn in TRITON_LEAVES.items():
        REGISTRY.check_signature(family, name, TRITON_IMPLS[(family, name)], fn)


def test_a_gpu_launch_without_jax_triton_says_so(monkeypatch, caplog):
    """A GPU without jax-triton plans the portable leaves (far slower): the runner warns, naming
    what is missing and the extra that installs it; a CPU launch, or a GPU with both, does not."""
    import logging

    from jengine.bench.common import _random_llama, shape_config
    from jengine.config import LaunchConfig
    from jengine.engine.model_runner import ModelRunner
    from jengine.launch import plan_launch
    from jengine.numerics import resolve_launch
    from jengine.profiles import override_profile
    from pallas_kernels import _triton_launch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "jax_triton" else real(n, *a))
    message = _triton_launch.missing_gpu_leaves("gpu-sm90")
    assert "'gpu-sm90'" in message and "jax_triton not importable" in message
    assert "pip install -e '.[gpu]'" in message
    assert _triton_launch.missing_gpu_leaves("cpu") is None
    with monkeypatch.context() as m:  # both importable
        m.setattr(importlib.util, "find_spec", lambda n, *a: object())
        assert _triton_launch.missing_gpu_leaves("gpu") is None

    # the runner of a launch resolved for a GPU (on a CPU machine no Triton leaf registers)
    launch = LaunchConfig(numerics="rl-bitwise", skip_warmup=True, max_running_requests=2,
                          context_length=64, max_total_tokens=512)
    base, padded = shape_config("small", 0)
    loaded = _random_llama(base, padded)
    with override_profile(base["architectures"][0], numerics_envelopes={"rl-bitwise"}):
        plan = plan_launch(resolve_launch(launch, hardware="gpu", probe_xla_flags=False),
                           loaded.config)
    with caplog.at_level(logging.WARNING, logger="jengine.engine.model_runner"):
        ModelRunner(loaded.config, loaded.checkpoint, plan.runner)
    assert "hardware 'gpu' but" in caplog.text and "jax_triton not importable" in caplog.text


def test_only_the_launch_shape_may_follow_m_never_the_k_chunks():
    """A row's bits come from k_split (the K chunks); by_m may change the rest for small M (the
    H200 measured those launch shapes bit-identical: scripts/gpu_gemm_decode_tiles.py)."""
    assert list(inspect.signature(triton_gemm.tile_for).parameters) == ["n", "k", "dtype", "m"]
    tables = triton_gemm_tiles.TILES
    assert tables.by_m, "the Llama-3-8B table gives decode steps their own launch shape"
    for (n, k, d), tile in tables.tuned().items():
        for m in (1, 16, 64, 65, 200, 256, 257, 1023, 1024, 4096):
            assert tables.tile_for(n, k, d, m).k_split == tile.k_split, (n, k, d, m)

    def qo(m=None):
        return triton_gemm.tile_for(4096, 4096, "bf16", m)

    assert qo(16) != qo(65) == qo(512)
    # decode bs 256 (128 < M <= 256) has a launch shape of its own; 256 < M < 1024 the 128 x 128
    # tile again, and a prefill of 1024 rows or more the entry's (128 x 256 output tiles)
    assert qo(256) != qo() and qo(257) == qo(1023) == qo(128)
    for n, k in ((4096, 4096), (1024, 4096), (4096, 14336)):
        wide = triton_gemm.tile_for(n, k, "bf16", 1024)
        assert wide == triton_gemm.tile_for(n, k, "bf16")
        assert wide != triton_gemm.tile_for(n, k, "bf16", 1023)
        assert (wide.block_m, wide.block_n, wide.k_split, wide.flat_k) == (128, 256, 4, True), n
    # q/k/v (and gate/up) keep one launch shape at every M, so they stay one grouped launch.
    for m in (1, 64, 65, 200, 256, 1023, 1024, 4096):
        assert (triton_gemm.tile_for(4096, 4096, "bf16", m)
                == triton_gemm.tile_for(1024, 4096, "bf16", m)), m
    bf16 = [t for (_, _, d), t in tables.tuned().items() if d == "bf16"]
    bf16 += [t for rules in tables.by_m.values() for _, t in rules]
    for t in bf16 + [tile for _, tile in tables.defaults["bf16"]]:
        # bf16 tiles stay on the wgmma path (BM >= 64, the shapes measured) and use power-of-two
        # blocks.
        assert t.block_m >= 64, t
        for v in (t.block_m, t.block_n, t.block_k):
            assert v & (v - 1) == 0, t


# (N, K) -> tile as (block_m, block_n, block_k, group_m, num_warps, num_stages, k_split,
# split_at_every_m), written from triton_gemm.tile_for before the tiles became data: the GPU bits
# of every model depend on them, so the tables must keep giving exactly these.
K4 = (128, 128, 64, 8, 8, 4, 4, True)
BF16_DEFAULT, BF16_WIDE = (64, 128, 64, 8, 4, 4, 1, False), (128, 256, 64, 8, 8, 3, 1, False)
TILES_BEFORE = {
    "bf16": {(4096, 4096): K4, (1024, 4096): K4, (14336, 4096): (128, 128, 64, 8, 8, 4, 2, False),
             (4096, 14336): K4, (4096, 1024): BF16_DEFAULT, (1024, 1024): BF16_DEFAULT,
             (32768, 4096): BF16_WIDE, (32767, 4096): BF16_DEFAULT, (131072, 4096): BF16_WIDE,
             (152064, 3584): BF16_WIDE, (128256, 4096): BF16_WIDE, (14336, 14336): BF16_DEFAULT,
             (8, 16): BF16_DEFAULT, (6144, 4096): BF16_DEFAULT, (28672, 4096): BF16_DEFAULT},
}
TILES_BEFORE["f32"] = {nk: (32, 32, 32, 8, 4, 2, 1, False) for nk in TILES_BEFORE["bf16"]}


def test_the_tile_tables_give_exactly_the_tiles_of_before():
    import dataclasses

    import jax.numpy as jnp

    names = [f.name for f in dataclasses.fields(triton_gemm.GemmTile)]
    names.remove("fused_reduce")  # later than the tiles of before, and off in every entry's tile
    # later too, and the serial schedule's loop form only: the same K chunks, the same bits;
    # likewise which schedule an M takes (the entries stopped splitting at every M with flat_k)
    names.remove("flat_k")
    names.remove("split_at_every_m")
    names.remove("grouped")  # later still: whether a group shares the launch, not the K chunks
    # At 512 rows: prefills of 1024 rows or more have a wider launch shape on the same K chunks
    # since the twenty-fourth session (test_only_the_launch_shape_may_follow_m_never_the_k_chunks).
    for dtype, expected in TILES_BEFORE.items():
        for dt in (dtype, jnp.bfloat16 if dtype == "bf16" else jnp.float32):
            for (n, k), fields in expected.items():
                got = triton_gemm.tile_for(n, k, dt, 512)
                assert {f: getattr(got, f) for f in names} == dict(zip(names, fields)), (n, k, dt)
                assert not got.fused_reduce, (n, k, dt)
    assert sorted(triton_gemm_tiles.TILES.tuned()) == sorted(
        (n, k, "bf16") for n, k in [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)])
    with pytest.raises(ValueError, match="dtype=f16 has no default tile"):
        triton_gemm.tile_for(4096, 4096, "f16")


def _write_tiles(tmp_path, doc) -> str:
    import json

    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(doc))
    return str(path)


TILE = {"block_m": 64, "block_n": 64, "block_k": 64}


def _doc(tables, tiles=None, defaults=None):
    return {"tiles": tiles or {"a": TILE, "b": dict(TILE, k_split=2)}, "tables": tables,
            "defaults": defaults or {"bf16": [{"min_n": 0, "tile": "a"}]}}


def test_tables_may_repeat_an_entry_but_never_disagree(tmp_path):
    entry = {"dtype": "bf16", "n": 256, "k": 512, "tile": "b"}
    same = triton_gemm_tiles.load(_write_tiles(tmp_path, _doc(
        {"one": {"entries": [entry]}, "two": {"entries": [entry]}})))
    assert same.tile_for(256, 512, "bf16").k_split == 2
    assert same.tile_for(256, 1024, "bf16").k_split == 1  # the default
    disagree = {"one": {"entries": [entry]}, "two": {"entries": [dict(entry, tile="a")]}}
    with pytest.raises(triton_gemm_tiles.TileTableError) as info:
        triton_gemm_tiles.load(_write_tiles(tmp_path, _doc(disagree)))
    assert "(N, K, dtype)=(256, 512, 'bf16'): table 'one' gives BM64xBN64xBK64 g8 w4 s4 k2, " \
           "table 'two' BM64xBN64xBK64 g8 w4 s4" in str(info.value), str(info.value)


def test_by_m_rules_pick_a_launch_shape_by_m(tmp_path):
    entry = {"dtype": "bf16", "n": 256, "k": 512, "tile": "b",
             "by_m": [{"max_m": 16, "tile": "c"}, {"max_m": 64, "tile": "d"}]}
    tiles = {"a": TILE, "b": dict(TILE, k_split=2), "c": dict(TILE, block_m=16, k_split=2),
             "d": dict(TILE, block_n=32, k_split=2)}
    t = triton_gemm_tiles.load(_write_tiles(tmp_path, _doc({"t": {"entries": [entry]}}, tiles)))
    assert [t.tile_for(256, 512, "bf16", m).describe() for m in (1, 16, 17, 64, 65, None)] == [
        "BM16xBN64xBK64 g8 w4 s4 k2", "BM16xBN64xBK64 g8 w4 s4 k2", "BM64xBN32xBK64 g8 w4 s4 k2",
        "BM64xBN32xBK64 g8 w4 s4 k2", "BM64xBN64xBK64 g8 w4 s4 k2", "BM64xBN64xBK64 g8 w4 s4 k2"]
    assert t.tile_for(256, 1024, "bf16", 1).describe() == "BM64xBN64xBK64 g8 w4 s4"  # default


def _by_m_doc(rules, dtype="bf16"):
    return _doc({"t": {"entries": [{"dtype": dtype, "n": 1, "k": 2, "tile": "b", "by_m": rules}]}},
                defaults={"bf16": [{"min_n": 0, "tile": "a"}], "f32": [{"min_n": 0, "tile": "a"}]})


@pytest.mark.parametrize("doc, needle", [
    (_by_m_doc([{"max_m": 16, "tile": "a"}]),
     "table 't' entry 0 by_m 0: tile='a' has k_split=1, the entry's tile k_split=2: the K chunks "
     "are the bits"),
    (_by_m_doc([{"max_m": 16, "tile": "b"}, {"max_m": 16, "tile": "b"}]),
     "table 't' entry 0 by_m 1: max_m=16 must be an int above 16"),
    (_by_m_doc([{"max_m": "16", "tile": "b"}]), "by_m 0: max_m='16' must be an int above 0"),
    (_by_m_doc({"max_m": 16}), "table 't' entry 0: by_m={'max_m': 16} must be a list"),
    (_by_m_doc([{"max_m": 16, "tile": "b"}], dtype="f32"),
     "by_m 0: by_m is measured for bf16 only, not dtype=f32"),
    (_doc({}, tiles={"a": dict(TILE, blockm=64)}), "tile 'a': unknown fields ['blockm']"),
    (_doc({}, tiles={"a": dict(TILE, k_split=2.0)}), "tile 'a': k_split=2.0 must be int"),
    (_doc({}, tiles={"a": dict(TILE, fused_reduce=1)}), "tile 'a': fused_reduce=1 must be bool"),
    (_doc({}, tiles={"a": dict(TILE, flat_k="yes")}), "tile 'a': flat_k='yes' must be bool"),
    (_doc({"t": {"entries": [{"dtype": "bf16", "n": 1, "k": 2, "tile": "c"}]}}),
     "table 't' entry 0: tile='c' is not one of the named tiles ['a', 'b']"),
    (_doc({"t": {"entries": [{"dtype": "bf16", "n": 1, "tile": "a"}]}}),
     "table 't' entry 0: needs integer n, k and a dtype"),
    (_doc({}, defaults={"f32": [{"min_n": 4, "tile": "a"}]}),
     "defaults 'f32': the last rule must have min_n=0"),
])
def test_a_malformed_tile_file_names_what_is_wrong(tmp_path, doc, needle):
    with pytest.raises(triton_gemm_tiles.TileTableError) as info:
        triton_gemm_tiles.load(_write_tiles(tmp_path, doc))
    assert needle in str(info.value), str(info.value)


def test_the_tile_file_ships_with_the_package():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "*.json" in data["package-data"]["pallas_kernels"]
    assert triton_gemm_tiles.TILES_PATH.parent.name == "pallas_kernels"


@pytest.mark.parametrize("call, needle", [
    (lambda: triton_gemm.gemm_triton(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32),
                                     out_dtype=np.float32), "x.shape[1]=3"),
    (lambda: triton_gemm.gemm_triton(np.zeros((2, 3), np.float32), np.zeros((3, 5), np.float16),
                                     out_dtype=np.float32), "w.dtype=f16"),
    (lambda: triton_gemm.gemm_triton(np.zeros((2, 3), np.float32), np.zeros((3, 5), np.float32),
                                     np.zeros(4, np.float32), out_dtype=np.float32), "bias.shape"),
    (lambda: triton_norm.rmsnorm_triton(np.zeros((2, 8), np.float32), np.zeros(7, np.float32),
                                        eps=1e-6), "weight.shape=(7,)"),
    (lambda: triton_activation.silu_triton(np.zeros(4, np.int32)), "x.dtype=int32"),
    (lambda: triton_sampling.block_sumexp_triton(np.zeros((2, 10), np.float32), block_size=0),
     "block_size=0"),
])
def test_bad_input_names_the_field(call, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        call()


def test_dtype_names():
    import jax.numpy as jnp

    assert [dtype_name(d) for d in (jnp.bfloat16, jnp.float32, np.float32, "bfloat16", "f32")] == [
        "bf16", "f32", "f32", "bf16", "f32"]


def test_bits_tell_signed_zeros_apart():
    b = bits(np.array([0.0, -0.0], np.float32))
    assert b[0] != b[1]
    assert bits(np.array([1.5], np.float32))[0] == np.float32(1.5).view(np.uint32)


@pytest.fixture
def fake_jax_triton(tmp_path, monkeypatch):
    """A stand-in package that does what jax-triton 0.3.1 does at import: TRITON_CACHE_DIR = ""."""
    pkg = tmp_path / "jax_triton"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('import os\nos.environ["TRITON_CACHE_DIR"] = ""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    importlib.invalidate_caches()
    yield
    sys.modules.pop("jax_triton", None)


def test_plain_import_clobbers_the_cache_dir(fake_jax_triton, monkeypatch):
    # Negative control: without the guard the variable is left empty.
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere")
    import jax_triton  # noqa: F401

    assert os.environ["TRITON_CACHE_DIR"] == ""


@pytest.mark.parametrize("previous", [None, "/somewhere"])
def test_guarded_import_restores_the_cache_dir(fake_jax_triton, monkeypatch, previous):
    if previous is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", previous)
    import_jax_triton()
    assert os.environ.get("TRITON_CACHE_DIR") == previous


def _lowered_custom_call(mode: str, target: str | None = None) -> str:
    """The HLO custom-call line of a toy primitive lowered three ways on the CPU: as jax.ffi spells
    a typed-FFI call to the Triton FFI target ("ref"), as jax-triton spells its legacy call
    ("legacy"), and that legacy call restated by the launcher ("restated")."""
    import zlib

    import jax
    import jax.numpy as jnp
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    from pallas_kernels._triton_launch import FFI_TARGET, LEGACY_TARGET, restate_as_ffi

    proto = zlib.compress(b"\x00a kernel proto\xff")
    prim = Primitive(f"toy_triton_{mode}")
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))

    def lowering(ctx, x):
        if mode == "ref":
            return jax.ffi.ffi_lowering(target or FFI_TARGET,
                                        operand_output_aliases={0: 0})(ctx, x, opaque=proto)
        legacy = jax.ffi.ffi_lowering(LEGACY_TARGET, api_version=2, backend_config=proto,
                                      operand_output_aliases={0: 0})(ctx, x)
        return legacy if mode == "legacy" else restate_as_ffi(legacy[0].owner).results

    mlir.register_lowering(prim, lowering, platform="cpu")
    text = jax.jit(prim.bind).lower(jnp.ones((2, 3), jnp.bfloat16)).as_text(dialect="hlo")
    [line] = [l for l in text.splitlines() if "custom-call(" in l]
    return line.split("=", 1)[1]  # the instruction's name carries the primitive's: drop it


def test_a_legacy_triton_call_is_restated_as_the_ffi_call():
    # The launcher's restated call is exactly what jax.ffi emits for jaxlib's typed-FFI Triton
    # target (the command-buffer-compatible one), proto and aliases included.
    restated = _lowered_custom_call("restated")
    assert restated == _lowered_custom_call("ref")
    assert 'custom_call_target="triton_kernel_call_ffi"' in restated
    assert "API_VERSION_TYPED_FFI" in restated
    # Negative controls: jax-triton's own call, and an FFI call to another target, differ.
    assert restated != _lowered_custom_call("legacy")
    assert restated != _lowered_custom_call("ref", target="triton_kernel_call")


@pytest.mark.parametrize("value, gemm, attention", [
    (None, "triton_kernel_call_ffi", "triton_kernel_call"),  # the default is "layers"
    ("layers", "triton_kernel_call_ffi", "triton_kernel_call"),
    ("ffi", "triton_kernel_call_ffi", "triton_kernel_call_ffi"),
    ("legacy", "triton_kernel_call", "triton_kernel_call")])
def test_the_custom_call_target_follows_the_switch(monkeypatch, value, gemm, attention):
    from pallas_kernels._triton_launch import custom_call_target

    if value is None:
        monkeypatch.delenv("JENGINE_TRITON_CALL", raising=False)
    else:
        monkeypatch.setenv("JENGINE_TRITON_CALL", value)
    assert custom_call_target("grouped_gemm_kernel") == gemm
    assert custom_call_target("attention_split_kernel") == attention


def test_layers_keeps_the_attention_launches_legacy(monkeypatch):
    # JENGINE_TRITON_CALL=layers: the launches that read the step's inputs (attention, RoPE + KV
    # write) end a graph; the layer's GEMMs, norms and activations join XLA's command buffers.
    # The names are the engine's own kernels', taken from the kernel objects jax_launch gets.
    pytest.importorskip("triton")
    from pallas_kernels import (_triton_attention_kernels, _triton_gemm_kernels,
                                _triton_rope_attention_kernels, _triton_rope_write_kernels)
    from pallas_kernels._triton_launch import _kernel_name, custom_call_target

    monkeypatch.setenv("JENGINE_TRITON_CALL", "layers")
    legacy = [_triton_attention_kernels.attention_split_kernel,
              _triton_attention_kernels.attention_serial_kernel,
              _triton_rope_attention_kernels.attention_rope_split_kernel,
              _triton_rope_write_kernels.rope_write_kernel]
    ffi = [_triton_gemm_kernels.grouped_gemm_kernel, _triton_gemm_kernels.fixed_tile_gemm_kernel,
           _triton_gemm_kernels.gemm_reduce_kernel]
    assert [custom_call_target(_kernel_name(k)) for k in legacy] == ["triton_kernel_call"] * 4
    assert [custom_call_target(_kernel_name(k)) for k in ffi] == ["triton_kernel_call_ffi"] * 3
    # The same kernels under the other two settings: one target for all.
    for value, target in (("ffi", "triton_kernel_call_ffi"), ("legacy", "triton_kernel_call")):
        monkeypatch.setenv("JENGINE_TRITON_CALL", value)
        assert {custom_call_target(_kernel_name(k)) for k in legacy + ffi} == {target}


def test_a_bad_custom_call_switch_names_the_variable(monkeypatch):
    from pallas_kernels._triton_launch import custom_call_target

    monkeypatch.setenv("JENGINE_TRITON_CALL", "graph")
    with pytest.raises(ValueError, match="JENGINE_TRITON_CALL='graph'"):
        custom_call_target()


def test_bench_bytes_match_the_published_llama3_8b_size():
    from jengine.bench.measures import decode_bytes

    weights_read = decode_bytes(0, 0, 128256) / 2  # every projection + the LM head, 2 bytes each
    embedding, norms = 128256 * 4096, (2 * 32 + 1) * 4096
    assert weights_read + embedding + norms == 8_030_261_248  # HF model card parameter count


# -- GPU -------------------------------------------------------------------------------------------


def _gpu_ready() -> bool:
    if not triton_available():
        return False
    try:
        import jax
        import torch

        return torch.cuda.is_available() and jax.default_backend() == "gpu"
    except Exception:  # noqa: BLE001 - any failure means no usable GPU here
        return False


gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs triton, jax-triton and a CUDA GPU "
                         "(run on the GPU machine with JAX_PLATFORMS=cuda)")
ROWS = (1, 2, 3, 7, 64)


def _row_diffs(fn, x, *rest):
    """Bits differing between rows computed in batches of M and the same rows computed alone."""
    alone = np.concatenate([bits(fn(x[r:r + 1], *rest)) for r in range(max(ROWS))])
    return {m: int(np.count_nonzero(bits(fn(x[:m], *rest)) != alone[:m])) for m in ROWS}


@pytest.fixture(scope="module")
def gemm_inputs():
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (64, 2048), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (2048, 1024), jnp.float32) / 45).astype(jnp.bfloat16)
    return x, w


@gpu
def test_gemm_rows_and_launches_bitwise(gemm_inputs):
    import jax.numpy as jnp
    import torch

    x, w = gemm_inputs
    fn = lambda x, w: triton_gemm.gemm_triton(x, w, out_dtype=jnp.bfloat16)
    assert _row_diffs(fn, x, w) == {m: 0 for m in ROWS}
    tx, tw = torch.from_dlpack(x), torch.from_dlpack(w)
    for m in ROWS:
        t = triton_gemm.gemm_triton_torch(tx[:m], tw, out_dtype=torch.bfloat16)
        assert np.array_equal(bits(t), bits(fn(x[:m], w)))


@gpu
def test_negative_control_xla_dot_is_row_variant(gemm_inputs):
    from pallas_kernels.gemm import gemm_xla_native
    import jax.numpy as jnp

    x, w = gemm_inputs
    diffs = _row_diffs(lambda x, w: gemm_xla_native(x, w, out_dtype=jnp.float32), x, w)
    assert sum(diffs.values()) > 0, "the row comparison found nothing where XLA is known to differ"


@gpu
def test_norm_silu_sumexp_rows_and_launches_bitwise():
    import jax
    import jax.numpy as jnp
    import torch

    x = jax.random.normal(jax.random.key(2), (64, 4096), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (4096,), jnp.float32).astype(jnp.bfloat16)
    s = jax.random.normal(jax.random.key(4), (64, 65536), jnp.float32) * 3 - 12
    cases = [
        (lambda x, w: triton_norm.rmsnorm_triton(x, w, eps=1e-5),
         lambda x, w: triton_norm.rmsnorm_triton_torch(x, w, eps=1e-5), x, (w,)),
        (triton_activation.silu_triton, triton_activation.silu_triton_torch, x, ()),
        (lambda s: triton_sampling.block_sumexp_triton(s, block_size=32768),
         lambda s: triton_sampling.block_sumexp_triton_torch(s, block_size=32768), s, ()),
    ]
    for jfn, tfn, a, rest in cases:
        assert _row_diffs(jfn, a, *rest) == {m: 0 for m in ROWS}
        t_rest = [torch.from_dlpack(r) for r in rest]
        assert np.array_equal(bits(tfn(torch.from_dlpack(a), *t_rest)), bits(jfn(a, *rest)))


def _fake_triton_lib(shared_cache):
    """jax_triton.triton_lib as `_lower` uses it: a CUDA backend factory (Triton's own backend,
    for the H200's compute capability), the compile cache, and a lowering that records what it was
    given and what the backend it was handed parses."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    calls = []

    def lowering(backend_init, ctx, *args, custom_call_target_name, **params):
        options = backend_init(0, 90).parse_options({"num_warps": 4, "num_stages": 3})
        calls.append(dict(target=custom_call_target_name, params=params,
                          maxnreg=options.maxnreg, cache=lib._COMPILED_KERNEL_CACHE))
        return ["results"]

    lib = types.SimpleNamespace(
        get_cuda_backend=lambda device, cc: CUDABackend(GPUTarget("cuda", cc, 32)),
        _COMPILED_KERNEL_CACHE=shared_cache, triton_kernel_call_lowering=lowering)
    return lib, calls


def test_a_register_bound_reaches_the_compiler_under_its_own_compile_cache():
    """jax-triton cannot pass Triton's maxnreg: jax_launch carries it as MAXNREG_PARAM, and the
    lowering takes it off jax-triton's parameters, hands jax-triton a backend whose options have
    it, and swaps in the bound's own compile cache for the call (jax-triton's cache key has no
    maxnreg). An unbounded call keeps the shared cache and Triton's default (no bound)."""
    pytest.importorskip("triton")
    from pallas_kernels import _triton_launch as L

    shared = {"an unbounded kernel": 1}
    lib, calls = _fake_triton_lib(shared)
    assert L._lower(lib, "ctx", "x", custom_call_target_name=L.LEGACY_TARGET,
                    **{L.MAXNREG_PARAM: 128}, PAGES=16) == ["results"]
    assert L._lower(lib, "ctx", "x", custom_call_target_name=L.LEGACY_TARGET, PAGES=16)
    bounded, unbounded = calls
    assert bounded["params"] == unbounded["params"] == {"PAGES": 16}  # the bound taken off
    assert (bounded["maxnreg"], unbounded["maxnreg"]) == (128, None)
    assert bounded["cache"] is not shared and "an unbounded kernel" not in bounded["cache"]
    assert unbounded["cache"] is shared and lib._COMPILED_KERNEL_CACHE is shared  # restored
    L._lower(lib, "ctx", custom_call_target_name=L.LEGACY_TARGET, **{L.MAXNREG_PARAM: 128})
    assert calls[-1]["cache"] is bounded["cache"]  # one cache per bound, kept between calls
