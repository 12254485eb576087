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

from sharding.mesh import DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS

MeshAxis = str | None  # a mesh axis name, or None = not split (every rank holds all of it)

# --tp-batch-invariant picks the tensor-parallel layout; each is one column of the table below.
LAYOUTS = ("replicated", "tensor_parallel", "tensor_parallel_attn", "tensor_parallel_all")
TP_BATCH_INVARIANT_LAYOUTS = {"off": "tensor_parallel", "attn": "tensor_parallel_attn",
                              "all": "tensor_parallel_all"}

T, E = TENSOR_AXIS, EXPERT_AXIS
# fmt: off
RULES_TABLE: tuple[tuple[str, MeshAxis, MeshAxis, MeshAxis, MeshAxis], ...] = (
    # logical axis  replicated  tp (off)   tp attn    tp all      why
    ("tokens",      DATA_AXIS,  DATA_AXIS, DATA_AXIS, DATA_AXIS), # attention DP: own rows
    ("vocab",       None,       T,         T,         T),         # vocab-parallel embed, LM head
    ("embed",       None,       None,      None,      None),      # hidden rows stay whole
    ("heads",       None,       T,         T,         T),         # q heads
    ("kv_heads",    None,       T,         T,         T),         # replicated when tp > kv_heads
    ("head_dim",    None,       None,      None,      None),      # a head is never split
    ("latent",      None,       None,      None,      None),      # MLA's low-rank widths (q/kv lora)
    ("mlp",         None,       T,         T,         T),         # gate/up columns
    # The two reduction sites. Row-parallel (input split): the output is a cross-rank sum.
    # Column-parallel on hidden (output split), fed by an all-gather of the input: every output
    # element is one full-K GEMM -- the TP1 value, whatever the width (spec: --tp-batch-invariant).
    ("o_heads",     None,       T,         None,      None),      # o_proj's input (heads)
    ("o_embed",     None,       None,      T,         T),         # o_proj's output (hidden)
    ("down_mlp",    None,       T,         T,         None),      # down_proj's input (mlp)
    ("down_embed",  None,       None,      None,      T),         # down_proj's output (hidden)
    # MoE (issue #18): --ep-size splits the stacked experts over the "expert" mesh axis (of size 1
    # without it); MoE TP is 1 (an expert's MLP width is never split); every rank scores every
    # expert ("router_expert").
    ("expert",        E,        E,         E,         E),         # stacked experts [E, ...]
    ("expert_mlp",    None,     None,      None,      None),      # an expert's MLP width
    ("router_expert", None,     None,      None,      None),      # the router's output columns
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
    latent: MeshAxis
    mlp: MeshAxis
    o_heads: MeshAxis
    o_embed: MeshAxis
    down_mlp: MeshAxis
    down_embed: MeshAxis
    expert: MeshAxis
    expert_mlp: MeshAxis
    router_expert: MeshAxis

    def column_parallel(self, site: str) -> bool:
        """Whether reduction site "o" (o_proj) or "down" (down_proj) is column-parallel on hidden
        under this layout (else, when split at all, row-parallel: a cross-rank sum)."""
        return self.mesh_axis(f"{site}_embed") is not None

    def replicate_kv_heads(self) -> "ShardingRules":
        """These rules with KV heads whole on every rank (tp > kv_heads: each rank then computes
        and caches the one KV head its query heads read; jengine/models/layers/attention.py)."""
        return dataclasses.replace(self, kv_heads=None)

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


def layout_for(tp_size: int, tp_batch_invariant: str = "off") -> str:
    """The layout a launch's --tp-size and --tp-batch-invariant imply."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be a positive int")
    if tp_batch_invariant not in TP_BATCH_INVARIANT_LAYOUTS:
        raise ValueError(f"tp_batch_invariant={tp_batch_invariant!r} is not one of "
                         f"{list(TP_BATCH_INVARIANT_LAYOUTS)}")
    return TP_BATCH_INVARIANT_LAYOUTS[tp_batch_invariant] if tp_size > 1 else "replicated"


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
