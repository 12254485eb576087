"""Sharding as data: one table maps logical axes to mesh axes, per layout.

A weight (its ParamSpec) or activation names its dimensions logically ("embed", "heads", ...); a layout's
ShardingRules says which mesh axis, if any, splits each of them; `logical_to_spec` turns the
names into a PartitionSpec. Changing a layout is changing one column of RULES_TABLE.

The model runner's tensor-parallel path places parameters and the KV pool with it (param_placement).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import DATA_AXIS, TENSOR_AXIS

MeshAxis = str | None  # a mesh axis name, or None = not split (every rank holds all of it)

LAYOUTS = ("replicated", "tensor_parallel")

# fmt: off
RULES_TABLE: tuple[tuple[str, MeshAxis, MeshAxis], ...] = (
    # logical axis   replicated   tensor_parallel   why
    ("tokens",       DATA_AXIS,   DATA_AXIS),     # attention DP: a data rank serves its own rows
    ("vocab",        None,        TENSOR_AXIS),   # vocab-parallel embedding and LM head
    ("embed",        None,        None),          # hidden rows stay whole on every rank
    ("heads",        None,        TENSOR_AXIS),   # query heads (and o_proj's input)
    ("kv_heads",     None,        TENSOR_AXIS),   # needs kv_heads % tp == 0 (no KV replication)
    ("head_dim",     None,        None),          # a head is never split
    ("mlp",          None,        TENSOR_AXIS),   # gate/up columns, down_proj rows
)
# fmt: on


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis for one layout (jax-llm-examples' ShardingRules, frozen)."""

    layout: str
    tokens: MeshAxis
    vocab: MeshAxis
    embed: MeshAxis
    heads: MeshAxis
    kv_heads: MeshAxis
    head_dim: MeshAxis
    mlp: MeshAxis

    def mesh_axis(self, logical: str) -> MeshAxis:
        if logical not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {logical!r}; known: {', '.join(LOGICAL_AXES)}")
        return getattr(self, logical)


LOGICAL_AXES = tuple(row[0] for row in RULES_TABLE)
RULES = {layout: ShardingRules(layout=layout, **{row[0]: row[1 + i] for row in RULES_TABLE})
         for i, layout in enumerate(LAYOUTS)}

# A parameter's logical axes are declared with the parameter (jengine.models.layers.param.ParamSpec,
# listed by ModelFamily.param_specs); projections fuse heads and head_dim into one head-major
# dimension, so splitting it on "heads" gives every rank whole heads.

# The dense model's activations over the flat ragged token rows of a step.
DENSE_ACTIVATION_AXES: dict[str, tuple[str | None, ...]] = {
    "hidden": ("tokens", "embed"),
    "q": ("tokens", "heads", "head_dim"),
    "kv": ("tokens", "kv_heads", "head_dim"),
    "mlp_hidden": ("tokens", "mlp"),
    "logits": ("tokens", "vocab"),
}


def rules_for(layout: str) -> ShardingRules:
    if layout not in RULES:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    return RULES[layout]


def layout_for(tp_size: int) -> str:
    """The layout a launch's --tp-size implies."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be a positive int")
    return "tensor_parallel" if tp_size > 1 else "replicated"


def logical_to_spec(logical_axes: Sequence[str | None], rules: ShardingRules) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions are named `logical_axes` (None = unnamed)."""
    spec = [None if name is None else rules.mesh_axis(name) for name in logical_axes]
    used = [axis for axis in spec if axis is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {tuple(logical_axes)} map to {tuple(spec)} under the "
                         f"{rules.layout} layout: a mesh axis may split only one dimension")
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, logical_axes: Sequence[str | None],
                   rules: ShardingRules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules))


def check_divisible(name: str, shape: Sequence[int], logical_axes: Sequence[str | None],
                    rules: ShardingRules, mesh: Mesh) -> None:
    """Refuse, naming the array and axis, a dimension its mesh axis does not divide evenly."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"{name}: shape {tuple(shape)} has {len(shape)} dims but logical axes "
                         f"{tuple(logical_axes)} name {len(logical_axes)}")
    sizes = dict(mesh.shape)
    for dim, (extent, axis) in enumerate(zip(shape, logical_to_spec(logical_axes, rules))):
        if axis is not None and extent % sizes[axis]:
            raise ValueError(
                f"{name}: dim {dim} ({logical_axes[dim]}) has size {extent}, not a multiple of "
                f"mesh axis {axis!r} of size {sizes[axis]} ({rules.layout} layout)")


def param_placement(mesh: Mesh, rules: ShardingRules):
    """spec -> its NamedSharding on `mesh`: a ParamSpec (jengine/models/layers/param.py) is placed
    by its declared logical axes through `rules`, after its shape is checked to divide."""

    def place(spec) -> NamedSharding:
        check_divisible(spec.checkpoint or "parameter", spec.shape, spec.axes, rules, mesh)
        return named_sharding(mesh, spec.axes, rules)

    return place
