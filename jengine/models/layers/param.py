"""`ParamSpec`: one parameter, declared by the layer that owns it, and the weight sources that
fill it.

A layer declares each parameter once: the shape and dtype the model holds, the logical axes of each
dimension (what sharding/rules.py maps to mesh axes), and where the value comes from in a Hugging
Face checkpoint (the tensor name, set by the family's name map, and the transform from the stored
layout). Everything else reads the spec: the loader, random weights for the bench and tests, the
sharding rules' checks and a weight swap. There is no second list of parameter names.

A weight source turns a spec into the model's array, on its placement:

- `CheckpointSource(reader)`: one tensor read from the checkpoint at a time, transformed on the
  host (row slice, transpose), placed on the device, then cast to the model dtype there. Those are
  the exact operations (and so the exact bits) the model has always been built with.
- `RandomSource(seed)`: normal values created on the device (the bench builds 8B-shaped models;
  none of it is ever on the host).
- `OverlaySource(updates, current)`: a weight update that names only some tensors (a trainer's
  bucket): those are read through a `CheckpointSource`, every other parameter keeps its current
  array.
- `OrbaxSource` (jengine/models/orbax_checkpoint.py): every parameter restored from an Orbax
  checkpoint already in the held layout, straight onto its placement, then cast on the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]          # as the model holds it
    dtype: Any                      # the model dtype
    axes: tuple[str, ...]           # logical axis of each dimension (sharding/rules.py)
    checkpoint: str = ""            # HF tensor name (the family's name map fills it in)
    transpose: bool = False         # stored [out, in]; held [in, out] so a leaf computes x @ w
    rows: int | None = None         # keep the first `rows` stored rows (a tied head, split vocab)
    # A stack of this many checkpoint tensors along a new leading axis (a MoE layer's experts,
    # stored one tensor per expert): `checkpoint` is then a pattern with "{}" for the index, and
    # `transpose` / `rows` apply to each tensor.
    stacked: int = 0

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"ParamSpec {self.checkpoint!r}: axes {self.axes} name "
                             f"{len(self.axes)} dims but shape {self.shape} has {len(self.shape)}")
        if self.stacked and self.shape[0] != self.stacked:
            raise ValueError(f"ParamSpec {self.checkpoint!r}: stacked={self.stacked} but the "
                             f"leading dimension of shape {self.shape} is {self.shape[0]}")

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """Every checkpoint tensor this parameter is read from."""
        if not self.stacked:
            return (self.checkpoint,)
        return tuple(self.checkpoint.format(i) for i in range(self.stacked))

    def member(self, index: int) -> "ParamSpec":
        """One tensor of a stacked parameter, as an ordinary spec."""
        return replace(self, shape=self.shape[1:], axes=self.axes[1:],
                       checkpoint=self.checkpoint.format(index), stacked=0)

    def named(self, checkpoint: str) -> "ParamSpec":
        return replace(self, checkpoint=checkpoint)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape this spec expects (before `rows`, which may cut it)."""
        return self.shape[::-1] if self.transpose else self.shape


class WeightSource(Protocol):
    def place(self, spec: ParamSpec) -> Any:
        """The parameter's value as the model holds it (a jax.Array on its placement)."""


class CheckpointReader(Protocol):
    """Names, shapes and dtypes up front; one tensor read at a time (jengine/models/loader.py)."""

    def names(self) -> tuple[str, ...]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> str: ...
    def read(self, name: str) -> np.ndarray: ...


class MappingReader:
    """A `CheckpointReader` over HF-named arrays already in memory (a trainer's handoff)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self._tensors = tensors

    def names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self._tensors[name]))

    def dtype(self, name: str) -> str:
        value = self._tensors[name]
        try:  # numpy and jax arrays name their dtype without a host copy
            return np.dtype(value.dtype).name
        except (AttributeError, TypeError):
            return np.asarray(value).dtype.name

    def read(self, name: str):
        import jax

        if name not in self._tensors:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        value = self._tensors[name]
        return value if isinstance(value, jax.Array) else np.asarray(value)


Placement = Callable[[ParamSpec], Any]  # spec -> its jax Sharding (sharding.rules.param_placement)


def held_layout(arr, spec: ParamSpec):
    """A checkpoint tensor -> the layout the model holds (`rows` kept, transposed), checked
    against the spec's shape; still in the stored dtype. A device array (DLPack handoff) stays on
    the device; anything else becomes a numpy array (Orbax conversion writes these)."""
    import jax

    if not isinstance(arr, jax.Array):
        arr = np.asarray(arr)
    if spec.rows is not None:
        arr = arr[: spec.rows]
    if spec.transpose:
        arr = arr.T
    if arr.shape != spec.shape:
        stored = arr.shape[::-1] if spec.transpose else arr.shape
        raise ValueError(f"checkpoint tensor {spec.checkpoint!r} has shape {tuple(stored)} "
                         + ("(first rows kept) " if spec.rows is not None else "")
                         + f"but the model expects {spec.stored_shape}")
    return arr


def read_held(reader: CheckpointReader, spec: ParamSpec):
    """The parameter's tensor(s) from `reader`, in the held layout (`held_layout`); a stacked
    parameter's members stacked on the leading axis."""
    if not spec.stacked:
        return held_layout(reader.read(spec.checkpoint), spec)
    import jax
    import jax.numpy as jnp

    members = [held_layout(reader.read(m.checkpoint), m)
               for m in (spec.member(i) for i in range(spec.stacked))]
    if any(isinstance(m, jax.Array) for m in members):
        return jnp.stack(members)
    return np.stack(members)


class CheckpointSource:
    """Fills each spec from `reader`, one tensor at a time. `placement` (None: the default device)
    gives each parameter's sharding from its spec (its logical axes under the launch's rules)."""

    def __init__(self, reader: CheckpointReader, *, placement: Placement | None = None):
        self.reader, self.placement = reader, placement

    def place(self, spec: ParamSpec):
        import jax

        arr = read_held(self.reader, spec)
        sharding = None if self.placement is None else self.placement(spec)
        return jax.device_put(arr, sharding).astype(spec.dtype)


class RandomSource:
    """N(0, 1/fan_in) matrices and N(0, 1) vectors, drawn on the device, one key per parameter
    in the order the model asks for them (timing and structure only: no bits are promised)."""

    def __init__(self, seed: int = 0):
        self._keys = itertools.count(seed)

    def place(self, spec: ParamSpec):
        import jax
        import jax.numpy as jnp

        key = jax.random.key(next(self._keys))
        fan_in = spec.shape[0] if spec.transpose else spec.shape[-1]
        scale = 1.0 if len(spec.shape) == 1 else fan_in ** -0.5
        return (jax.random.normal(key, spec.shape, jnp.float32) * scale).astype(spec.dtype)


class OverlaySource:
    """The tensors `updates` (a reader) names, read like a checkpoint; every other parameter is
    its array in `current` (spec -> the array the model holds now). Two specs may share a
    checkpoint tensor (a tied head): both are refilled when it is updated."""

    def __init__(self, updates: CheckpointReader, current: Mapping[ParamSpec, Any], *,
                 placement: Placement | None = None):
        self.names = frozenset(updates.names())
        self._read = CheckpointSource(updates, placement=placement)
        self._current = current

    def place(self, spec: ParamSpec):
        named = [n for n in spec.checkpoint_names if n in self.names]
        if not named:
            return self._current[spec]
        if len(named) != len(spec.checkpoint_names):
            raise ValueError(f"the update names {len(named)} of the {len(spec.checkpoint_names)} "
                             f"tensors {spec.checkpoint!r} is stacked from (e.g. {named[0]!r}); a "
                             "stacked parameter is replaced whole: send all of them")
        return self._read.place(spec)


class PlacedSource:
    """Another source's values (RandomSource: drawn as on one device, so the same numbers at every
    mesh size), each moved to its placement."""

    def __init__(self, source: WeightSource, placement: Placement):
        self.source, self.placement = source, placement

    def place(self, spec: ParamSpec):
        import jax

        return jax.device_put(self.source.place(spec), self.placement(spec))


def weight_source(weights, *, placement: Placement | None = None) -> WeightSource:
    """A weight source from what a caller holds: a source, a reader, or a mapping name -> array;
    with `placement`, every parameter it gives is on its sharding."""
    if hasattr(weights, "weight_source"):  # a checkpoint that restores onto the placement itself
        return weights.weight_source(placement)  # (Orbax: jengine/models/orbax_checkpoint.py)
    if hasattr(weights, "place"):
        # Moving an array already on its sharding is free, so any source may be wrapped.
        return weights if placement is None else PlacedSource(weights, placement)
    if hasattr(weights, "read"):
        return CheckpointSource(weights, placement=placement)
    if isinstance(weights, Mapping):
        return CheckpointSource(MappingReader(weights), placement=placement)
    raise TypeError(f"weights must be a weight source, a checkpoint reader or a mapping of tensor "
                    f"name -> array, got {type(weights).__name__}")
