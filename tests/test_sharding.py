"""sharding/: the mesh, the rules table, the ordered-fold collectives and their route.

The collectives need several devices. XLA reads --xla_force_host_platform_device_count once per
process and this process started jax with one CPU device (tests/conftest.py), so they are measured
by tests/sharding_probe.py in ONE subprocess with 8 fake devices, and asserted on here.
"""

import types
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sharding.collectives import OP_KINDS, ordered_all_reduce, ordered_reduce_scatter, route
from sharding.mesh import MESH_AXES, MeshShape, make_mesh, mesh_shape, use_mesh
from sharding.rules import (DENSE_ACTIVATION_AXES, LAYOUTS, LOGICAL_AXES, RULES, RULES_TABLE,
                            ShardingRules, check_divisible, layout_for, logical_to_spec, rules_for)
from tests.fake_devices import run_probe

# -- the 8-device measurements (one subprocess) -------------------------------------------------


@pytest.fixture(scope="module")
def probe():
    return run_probe("sharding_probe.py")


def test_probe_ran_on_an_8_device_mesh(probe):
    assert probe["devices"] == 8
    assert probe["mesh8"]["axes"] == list(MESH_AXES)
    assert probe["mesh8"]["shape"] == {"data": 1, "expert": 1, "tensor": 8}
    assert probe["mesh8"]["device_ids"] == list(range(8))  # rank r is device r, in list order
    assert probe["mesh1"] == {"data": 1, "expert": 1, "tensor": 1}


def test_fold_equals_numpy_left_fold_bitwise(probe):
    assert probe["all_reduce_f32_differing"] == 0
    assert probe["all_reduce_bf16_differing"] == 0  # fp32 fold, one rounding to bf16
    assert probe["all_reduce_dtype"] == "bfloat16"
    assert probe["reduce_scatter_differing"]["64"] == 0
    assert probe["reduce_scatter_bf16_differing"] == 0
    assert probe["grouped_mesh_differing"] == 0  # a 2x4 mesh folds within each data rank


def test_fold_is_batch_invariant(probe):
    """Row i's bits are the numpy fold's whether the call reduces 1, 3 or 64 rows."""
    for rows in ("1", "3", "64"):
        assert probe["batch_invariance_differing"][rows] == 0, rows
        assert probe["reduce_scatter_differing"][rows] == 0, rows


def test_negative_control_tree_order_is_caught(probe):
    """The bit checker can fail: a pairwise tree over the same parts gives other bits."""
    assert probe["tree_differing"] > 0
    ill = probe["ill_conditioned"]
    assert ill["left_fold"] == ill["numpy_left_fold"] != ill["tree"]
    assert np.float32(ill["left_fold"]) == np.float32(8.001)
    assert np.float32(ill["tree"]) == np.float32(7.001)


def test_negative_zero_sums_come_out_positive(probe):
    assert probe["signed_zero_bits"] == {"fold": 0, "numpy": 0, "fold_mixed": 0}


def test_xla_cpu_flushes_subnormals(probe):
    """Measured platform fact, documented in docs/parallelism.md: XLA:CPU arithmetic (the fold and a
    plain jitted add alike) treats subnormals as zero, where numpy keeps them."""
    sub = probe["subnormal"]
    assert sub["numpy"] > 0
    assert sub["fold"] == 0.0 and sub["plain_jit_add"] == 0.0


def test_xla_cpu_psum_is_a_rank_order_fold(probe):
    """Measurement, not a contract (docs/parallelism.md): on XLA:CPU's in-process communicator psum
    and psum_scatter give the fold's bits here, bf16 included. Nothing says so for NCCL."""
    assert probe["psum_vs_fold_differing"] == 0
    assert probe["psum_bf16_vs_fold_differing"] == 0
    assert probe["psum_scatter_vs_fold_differing"] == 0
    assert probe["psum_ill_conditioned"] == probe["ill_conditioned"]["left_fold"]
    assert probe["psum_signed_zero_bits"] == 0


def test_every_route_runs_and_gives_its_result(probe):
    runs = probe["routes"]
    assert runs["all_reduce/sum/True"] == {"path": "ordered_fold", "differing": 0}
    assert runs["reduce_scatter/sum/True"] == {"path": "ordered_fold", "differing": 0}
    assert runs["all_reduce/sum/False"]["path"] == "native"
    assert runs["all_gather/data/True"] == {"path": "native", "differing": 0}
    for kind in ("max", "min"):
        for bic in (False, True):
            assert runs[f"all_reduce/{kind}/{bic}"]["path"] == "native"
            assert runs[f"all_reduce/{kind}/{bic}"]["unequal_values"] == 0  # exact in value


def test_pmax_zero_sign_follows_rank_order(probe):
    """Why "exact in any order" is a value claim: over mixed signed zeros, XLA:CPU's pmax returns
    the sign of the first zero in rank order (-0.0 first -> -0.0, +0.0 first -> +0.0)."""
    assert probe["pmax_mixed_zero_bits"] == [0x80000000, 0]


# -- in-process: route, mesh, rules ----------------------------------------------------------


def test_route_is_a_static_decision():
    for op, kinds in OP_KINDS.items():
        for kind in kinds:
            for bic in (False, True):
                r = route(op, batch_invariant_collectives=bic, op_kind=kind)
                assert r == route(op, batch_invariant_collectives=bic, op_kind=kind)
                folds = bic and kind == "sum"
                assert r.path == ("ordered_fold" if folds else "native"), (op, kind, bic)
    assert route("all_reduce", batch_invariant_collectives=True,
                 op_kind="sum").fn is ordered_all_reduce
    assert route("reduce_scatter", batch_invariant_collectives=True,
                 op_kind="sum").fn is ordered_reduce_scatter


@pytest.mark.parametrize("kwargs, error", [
    (dict(op="broadcast", batch_invariant_collectives=True, op_kind="sum"), r"op='broadcast'"),
    (dict(op="all_gather", batch_invariant_collectives=True, op_kind="sum"), r"op_kind='sum'"),
    (dict(op="reduce_scatter", batch_invariant_collectives=True, op_kind="max"),
     r"op_kind='max'"),
    (dict(op="all_reduce", batch_invariant_collectives=None, op_kind="sum"),
     r"batch_invariant_collectives=None"),
])
def test_route_refuses_bad_input(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        route(kwargs.pop("op"), **kwargs)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.int32])
def test_fold_refuses_dtypes_it_cannot_fold_exactly(dtype):
    x = np.zeros(4, dtype=np.float64 if dtype == jnp.float64 else np.int32)
    with pytest.raises(TypeError, match="x.dtype="):
        ordered_all_reduce(x, "tensor")
    with pytest.raises(TypeError, match="x.dtype="):
        ordered_reduce_scatter(x, "tensor")


def test_single_device_mesh_and_set_mesh_without_deprecation():
    mesh = make_mesh()
    assert tuple(mesh.axis_names) == MESH_AXES
    assert mesh_shape(mesh) == MeshShape(1, 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with use_mesh(mesh):
            pass


@pytest.mark.parametrize("kwargs, error", [
    (dict(tp=0), r"tp=0"), (dict(dp=-1), r"dp=-1"), (dict(ep=1.5), r"ep=1.5"),
    (dict(tp=True), r"tp=True"), (dict(tp=2), r"needs 2 devices but 1 are available"),
])
def test_make_mesh_refuses_bad_sizes(kwargs, error):
    with pytest.raises(ValueError, match=error):
        make_mesh(**kwargs)


def test_rules_table_is_the_one_source():
    assert LOGICAL_AXES == tuple(f for f in ShardingRules.__dataclass_fields__ if f != "layout")
    for i, layout in enumerate(LAYOUTS):
        for logical, *columns in RULES_TABLE:
            assert rules_for(layout).mesh_axis(logical) == columns[i]
    mapped = {rules_for("replicated").mesh_axis(a) for a in LOGICAL_AXES}
    # replicated (TP1): only token rows (by DP) and, under --ep-size, a MoE model's experts split
    assert mapped == {None, "data", "expert"}
    assert layout_for(1) == "replicated" and layout_for(4) == "tensor_parallel"


# A small config of every family with every optional parameter (q/k/v/o biases, an untied head;
# Qwen3 adds the q/k norms): the parameters' own specs are the weight table.
FAMILY_CONFIG = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, max_position_embeddings=16, vocab_size=32,
                     attention_bias=True, tie_word_embeddings=False, torch_dtype="float32")


def _family_config(architecture):
    from jengine.models.config import ModelConfig

    return ModelConfig.from_hf_dict({**FAMILY_CONFIG, "architectures": [architecture]})


@pytest.fixture(scope="module")
def weight_axes():
    """Every dense parameter's logical axes, by path, read from the Qwen3 family's specs."""
    from jengine.models.registry import get_family

    cfg = _family_config("Qwen3ForCausalLM")
    return {path: spec.axes
            for path, spec in get_family(cfg.architecture).param_specs(cfg, dtype=jnp.float32).items()}


def test_logical_to_spec_tensor_parallel(weight_axes):
    tp = RULES["tensor_parallel"]
    spec = {name: logical_to_spec(axes, tp) for name, axes in weight_axes.items()}
    assert spec["layers.0.self_attn.q_proj.weight"] == P(None, "tensor")  # column parallel
    # row parallel: its output is a cross-rank sum
    assert spec["layers.0.self_attn.o_proj.weight"] == P("tensor", None)
    assert spec["layers.0.mlp.down_proj.weight"] == P("tensor", None)
    assert spec["embed_tokens.weight"] == P("tensor", None)
    assert spec["lm_head.weight"] == P(None, "tensor")
    assert spec["layers.0.input_layernorm.weight"] == P(None)
    assert logical_to_spec(DENSE_ACTIVATION_AXES["q"], tp) == P("data", "tensor", None)
    for axes in weight_axes.values():
        assert all(a is None for a in logical_to_spec(axes, RULES["replicated"]))


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM"])
def test_every_parameter_has_a_spec_the_rules_resolve(architecture):
    """The model built from its specs (random weights: the bench's path) holds exactly the
    specified parameters, each of its spec's shape and dtype, and every spec's logical axes
    resolve under every layout."""
    from jengine.models.layers.param import RandomSource
    from jengine.models.registry import get_family

    cfg = _family_config(architecture)
    family = get_family(architecture)
    specs = family.param_specs(cfg, dtype=jnp.float32)
    kernels = family.plan_kernels(dtype=jnp.float32, hardware="cpu")
    model = family.build(cfg, RandomSource(seed=0), dtype=jnp.float32, kernels=kernels)
    params = model.named_parameters()
    assert list(params) == list(specs)
    for path, spec in specs.items():
        assert (params[path].shape, params[path].dtype) == (spec.shape, spec.dtype), path
        assert spec.checkpoint.startswith(("model.", "lm_head.")), path
        for layout in LAYOUTS:
            assert len(logical_to_spec(spec.axes, rules_for(layout))) == len(spec.shape), path
    qk_norm = any(p.endswith("q_norm.weight") for p in specs)
    assert qk_norm == (architecture == "Qwen3ForCausalLM")
    o_bias = "layers.0.self_attn.o_proj.bias" in specs
    assert o_bias == (architecture != "Qwen2ForCausalLM")  # Qwen2 never biases o_proj


@pytest.mark.parametrize("call, error", [
    (lambda: logical_to_spec(("embed", "hiddden"), RULES["replicated"]), r"'hiddden'"),
    (lambda: logical_to_spec(("heads", "mlp"), RULES["tensor_parallel"]), r"only one dim"),
    (lambda: rules_for("tp"), r"layout='tp'"),
    (lambda: layout_for(0), r"tp_size=0"),
])
def test_rules_refuse_bad_input(call, error):
    with pytest.raises(ValueError, match=error):
        call()


def test_check_divisible_names_the_array_and_axis(weight_axes):
    # check_divisible reads only mesh.shape; a 4-way "tensor" axis needs no 4 devices here.
    mesh = types.SimpleNamespace(shape={"data": 1, "expert": 1, "tensor": 4})
    tp = RULES["tensor_parallel"]
    check_divisible("q_proj", (64, 64), weight_axes["layers.0.self_attn.q_proj.weight"], tp, mesh)
    with pytest.raises(ValueError, match=r"k_proj: dim 1 \(kv_heads\) has size 6, not a "
                                         r"multiple of mesh axis 'tensor' of size 4"):
        check_divisible("k_proj", (64, 6), weight_axes["layers.0.self_attn.k_proj.weight"], tp,
                        mesh)
    with pytest.raises(ValueError, match=r"norm: shape \(64, 2\) has 2 dims"):
        check_divisible("norm", (64, 2), weight_axes["norm.weight"], tp, mesh)
