"""Orbax checkpoints of the engine's parameters: written by `jengine convert`, restored by the loader
straight onto each parameter's placement.

`write_orbax` (what `jengine convert SRC DST` runs, jengine/convert.py) stores every parameter of
the model under its ParamSpec path ("layers.0.self_attn.q_proj.weight") in the layout the model
holds it (`held_layout`: the first `rows` kept, transposed; a stacked parameter -- a MoE layer's
experts -- its per-expert tensors stacked, `read_held`) but still in the checkpoint's stored dtype.
The cast to the model dtype stays at load, on the device, the same operation as from safetensors:
the parameters' bits are the same under any --dtype. Orbax's custom metadata records, per path, the
HF tensor it came from and how (transpose, rows; for a stack of `stacked` tensors, the name pattern
with "{}" for the expert), that tensor's shape and dtype (each member's), and the parameter's
logical axes (sharding/rules.py): the checkpoint says how it may be sharded.

`load_model(dir)` opens a model directory holding DIR/orbax/ as an `OrbaxCheckpoint`: the HF-name
view the loader's and the weight update's checks read (names, shapes, stored dtypes), and
`weight_source(placement)`, whose `OrbaxSource` restores every parameter in one Orbax call, each
array onto its target sharding (the runner's `placement(spec)` under tensor parallelism, else the
default device): a rank reads only its shards, no process assembles a full host copy of a sharded
tensor. Paths, transforms and shapes are checked against the model's current declaration
(`family.param_specs`) when the checkpoint is opened, so a mismatch is refused naming the
parameter before anything is restored.

Costs: a tied head is its own path (the embedding's first vocab_size rows, transposed), stored a
second time; conversion holds the whole model on the host once (Orbax writes one tree per call);
the restore holds every parameter on the device in its stored dtype until the model casts it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from jengine.models.layers.param import ParamSpec, Placement, read_held
from jengine.models.registry import get_family

logger = logging.getLogger(__name__)

ORBAX_DIR = "orbax"              # the checkpoint's folder inside a model directory
FORMAT = "jengine-params/1"      # custom_metadata["format"]: what the metadata below means


def has_orbax_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / ORBAX_DIR).is_dir()


def write_orbax(reader, config, model_dir: str | Path, *, progress: bool = True) -> int:
    """Every parameter of `config`'s model, read from `reader` (HF names), as an Orbax checkpoint
    in model_dir/orbax. Returns the number of parameters written."""
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    specs = get_family(config.architecture).param_specs(config, dtype=config.torch_dtype)
    tree: dict = {}
    params: dict[str, dict] = {}
    for path, spec in tqdm(specs.items(), desc="Converting", unit="param", disable=not progress):
        first = spec.checkpoint_names[0]
        dtypes = sorted({reader.dtype(name) for name in spec.checkpoint_names})
        if len(dtypes) > 1:  # stacking would widen some members: not the bits a launch holds
            raise ValueError(f"parameter {path!r} is stacked from tensors {spec.checkpoint!r} "
                             f"stored in several dtypes {dtypes}")
        _set(tree, path, read_held(reader, spec))  # each member's shape checked against the spec
        params[path] = {"checkpoint": spec.checkpoint, "stacked": spec.stacked,
                        "transpose": spec.transpose, "rows": spec.rows, "axes": list(spec.axes),
                        "stored_shape": list(reader.shape(first)), "stored_dtype": dtypes[0]}
    target = Path(model_dir).absolute() / ORBAX_DIR
    logger.info("writing %d parameters to %s", len(specs), target)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(target, tree, custom_metadata={
        "format": FORMAT, "architecture": config.architecture, "params": params})
    checkpointer.wait_until_finished()
    return len(specs)


class OrbaxCheckpoint:
    """The Orbax checkpoint of a model directory, checked against the model `config` declares.

    As a `CheckpointReader` it names the HF tensors the parameters came from, with their stored
    shapes and dtypes; `read` gives one back in the HF layout (a host copy, for tools). The engine
    places parameters through `weight_source` instead.
    """

    def __init__(self, model_dir: str | Path, config):
        import orbax.checkpoint as ocp

        self.directory = Path(model_dir).absolute() / ORBAX_DIR
        try:
            metadata = ocp.StandardCheckpointer().metadata(self.directory)
        except Exception as exc:  # Orbax and tensorstore raise their own error types
            raise ValueError(f"cannot read the Orbax checkpoint {str(self.directory)!r}: "
                             f"{exc}") from exc
        custom = metadata.custom_metadata or {}
        if custom.get("format") != FORMAT:
            raise ValueError(f"{str(self.directory)!r} is not an Orbax checkpoint written by "
                             f"`jengine convert` (custom metadata format={custom.get('format')!r},"
                             f" expected {FORMAT!r})")
        self._meta: dict[str, dict] = custom["params"]
        self._stored = dict(_flatten(getattr(metadata.item_metadata, "tree",
                                             metadata.item_metadata)))
        self._specs = get_family(config.architecture).param_specs(config,
                                                                   dtype=config.torch_dtype)
        self._check()
        self._path_of = {_transform(s): p for p, s in self._specs.items()}
        self._hf: dict[str, tuple] = {}  # HF name -> (stored shape, stored dtype)
        self._whole: dict[str, tuple[str, int | None]] = {}  # HF name -> (path, index in a stack)
        for path, m in self._meta.items():
            stacked = m.get("stacked", 0)
            for index in range(stacked) if stacked else (None,):
                name = m["checkpoint"] if index is None else m["checkpoint"].format(index)
                self._hf[name] = (tuple(m["stored_shape"]), m["stored_dtype"])
                if m["rows"] is None:
                    self._whole.setdefault(name, (path, index))

    def _check(self) -> None:
        where = f"the Orbax checkpoint {str(self.directory)!r}"
        unknown = sorted(set(self._stored) - set(self._specs))
        for path, spec in self._specs.items():
            if path not in self._stored or path not in self._meta:
                hint = f"; it holds {unknown[0]!r}, which the model does not" if unknown else ""
                raise ValueError(f"the model's parameter {path!r} (HF tensor {spec.checkpoint!r})"
                                 f" is not in {where}{hint}")
            stored_shape = tuple(self._stored[path].shape)
            if stored_shape != spec.shape:
                raise ValueError(f"parameter {path!r} in {where} has shape {stored_shape}, but the "
                                 f"model expects {spec.shape}")
            m = self._meta[path]
            stacked = m.get("stacked", 0)
            if (m["checkpoint"], m["transpose"], m["rows"], stacked) != _transform(spec)[:4]:
                raise ValueError(
                    f"parameter {path!r} in {where} was converted from {m['checkpoint']!r} "
                    f"(transpose={m['transpose']}, rows={m['rows']}, stacked={stacked}), but the "
                    f"model reads it from {spec.checkpoint!r} (transpose={spec.transpose}, "
                    f"rows={spec.rows}, stacked={spec.stacked})")
        if unknown:
            raise ValueError(f"{where} holds {unknown[0]!r}, which is not a parameter of the model "
                             f"({len(unknown)} such)")

    # -- the HF-name view (CheckpointReader) ---------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        return tuple(self._hf)

    def __contains__(self, name: str) -> bool:
        return name in self._hf

    def shape(self, name: str) -> tuple[int, ...]:
        return self._hf[name][0]

    def dtype(self, name: str) -> str:
        return self._hf[name][1]

    def read(self, name: str) -> np.ndarray:
        """HF tensor `name` as the HF checkpoint stored it (from the path that holds all of it)."""
        import orbax.checkpoint as ocp

        if name not in self._whole:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        path, index = self._whole[name]
        item, args = {}, {}
        _set(item, path, 0)
        _set(args, path, ocp.RestoreArgs(restore_type=np.ndarray))
        restored = ocp.PyTreeCheckpointer().restore(self.directory, args=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
        arr = dict(_flatten(restored))[path]
        if index is not None:  # one member of a stack (a MoE layer's expert)
            arr = arr[index]
        return np.ascontiguousarray(arr.T) if self._meta[path]["transpose"] else arr

    # -- the engine's path ------------------------------------------------------------------------
    def weight_source(self, placement: Placement | None) -> "OrbaxSource":
        return OrbaxSource(self, placement)

    def path_of(self, spec: ParamSpec) -> str:
        path = self._path_of.get(_transform(spec))
        if path is None:
            raise KeyError(f"{str(self.directory)!r} holds no parameter read from "
                           f"{spec.checkpoint!r} with shape {spec.shape}")
        return path

    def restore(self, placement: Placement | None) -> dict[str, Any]:
        """Every parameter (path -> jax.Array in its stored dtype), each restored onto
        `placement(spec)` (None: the default device)."""
        import jax
        import orbax.checkpoint as ocp

        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target: dict = {}
        for path, spec in self._specs.items():
            sharding = default if placement is None else placement(spec)
            _set(target, path, jax.ShapeDtypeStruct(spec.shape, self._stored[path].dtype,
                                                    sharding=sharding))
        start = time.perf_counter()
        restored = dict(_flatten(ocp.StandardCheckpointer().restore(self.directory, target)))
        logger.info("restored %d parameters from %s in %.2f s", len(restored), self.directory,
                    time.perf_counter() - start)
        return restored


class OrbaxSource:
    """Parameters restored from an `OrbaxCheckpoint` on their placement (all in one Orbax call, at
    the first request), each cast to the model dtype on the device like a `CheckpointSource`'s."""

    def __init__(self, checkpoint: OrbaxCheckpoint, placement: Placement | None):
        self.checkpoint, self.placement = checkpoint, placement
        self._arrays: dict[str, Any] | None = None

    def place(self, spec: ParamSpec):
        path = self.checkpoint.path_of(spec)
        if self._arrays is None:
            self._arrays = self.checkpoint.restore(self.placement)
        return self._arrays.pop(path).astype(spec.dtype)  # popped: the model holds the only copy


def _transform(spec: ParamSpec) -> tuple:
    """What makes a parameter's values: its HF tensor(s), the transform, the held shape (not the
    model dtype, which the load casts to)."""
    return (spec.checkpoint, spec.transpose, spec.rows, spec.stacked, spec.shape)


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _flatten(tree, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
