"""The device mesh: three named axes, ("data", "expert", "tensor"), and how to enter one.

The engine runs on one device today; `make_mesh()` with no arguments gives that device as a
1 x 1 x 1 mesh, so code written against the named axes runs unchanged when TP/EP/DP arrive.

jax API notes (checked on jax 0.10.2 and on 0.11.2, the GPU machine's, with its CPU backend):

* `jax.make_mesh(axis_shapes, axis_names, axis_types=None, *, devices=None)` builds the mesh. Its
  default axis type is `AxisType.Explicit` on both versions, but defaults move between releases,
  so we always pass `axis_types` ourselves.
* `jax.sharding.AxisType` has `Auto`, `Explicit` and `Manual`. We use `Explicit`: a `shard_map`
  whose `in_specs` disagree with an argument's sharding is then an error (since jax 0.9.1), never
  a silent reshard. Arguments must therefore be placed with a `NamedSharding` first.
* `jax.set_mesh(mesh)` is the context manager (and global setter). `with mesh:` raises a
  DeprecationWarning on 0.10.2 and later; do not use it. `use_mesh` below is the one spelling.
* `jax.shard_map(f, mesh=..., in_specs=..., out_specs=..., check_vma=True)` is the top-level API
  on both versions; `jax.experimental.shard_map` is the legacy path and is not used here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

# Outermost to innermost. "tensor" is innermost so a TP group is consecutive devices (on a GPU
# host: the ones sharing the fastest links); "data" is outermost because DP ranks exchange least.
DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS = "data", "expert", "tensor"
MESH_AXES = (DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the three mesh axes. Every size is a positive int."""

    dp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self):
        for field in ("dp", "ep", "tp"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh size {field}={value!r} must be a positive int")

    @property
    def axis_sizes(self) -> tuple[int, int, int]:
        """Sizes in MESH_AXES order."""
        return (self.dp, self.ep, self.tp)

    @property
    def num_devices(self) -> int:
        return self.dp * self.ep * self.tp


def make_mesh(tp: int = 1, dp: int = 1, ep: int = 1, devices: Sequence | None = None) -> Mesh:
    """A ("data", "expert", "tensor") mesh of dp x ep x tp devices.

    `devices` defaults to `jax.devices()`; the first dp*ep*tp of them are used, in list order, so
    rank r of the "tensor" axis is a fixed device and the ordered fold's rank order
    (sharding.collectives) is fixed with it.
    """
    shape = MeshShape(dp=dp, ep=ep, tp=tp)
    available = list(jax.devices() if devices is None else devices)
    if len(available) < shape.num_devices:
        raise ValueError(
            f"make_mesh(tp={tp}, dp={dp}, ep={ep}) needs {shape.num_devices} devices but "
            f"{len(available)} are available (on CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count=N before jax starts)")
    return jax.make_mesh(shape.axis_sizes, MESH_AXES,
                         axis_types=(AxisType.Explicit,) * len(MESH_AXES),
                         devices=available[: shape.num_devices])


def replica_devices(dp: int, tp: int, replica: int, devices: Sequence | None = None, *,
                    ep: int = 1) -> tuple:
    """Data-parallel replica `replica`'s device group: its tp x ep devices, [replica*tp*ep,
    (replica+1)*tp*ep) of `devices` (default `jax.devices()`). Groups are disjoint, so each replica
    owns its weights and KV pool, and a replica's tensor ranks stay consecutive (the fastest links
    on a GPU host)."""
    available = list(jax.devices() if devices is None else devices)
    group = tp * ep
    if dp * group > len(available):
        sizes = f"--dp-size {dp} x --tp-size {tp}" + (f" x --ep-size {ep}" if ep > 1 else "")
        raise ValueError(
            f"{sizes} needs {dp * group} devices but {len(available)} are "
            "visible (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax "
            "starts)")
    if not 0 <= replica < dp:
        raise ValueError(f"replica={replica} is not in [0, {dp}) (--dp-size {dp})")
    return tuple(available[replica * group:(replica + 1) * group])


def use_mesh(mesh: Mesh):
    """Context manager making `mesh` current (raw PartitionSpecs then resolve against it).

    Use this, never `with mesh:` (deprecated). Only outside `jax.jit`, as jax requires.
    """
    return jax.set_mesh(mesh)


def mesh_shape(mesh: Mesh) -> MeshShape:
    """The MeshShape of a mesh made by make_mesh (an error for any other axis naming)."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} are not {MESH_AXES}")
    sizes = dict(mesh.shape)
    return MeshShape(dp=sizes[DATA_AXIS], ep=sizes[EXPERT_AXIS], tp=sizes[TENSOR_AXIS])
