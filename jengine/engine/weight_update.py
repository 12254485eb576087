"""Weight updates of a running engine: what a new checkpoint or a trainer's tensors must satisfy
before they may replace the weights being served.

The rule is "a fresh engine started from the new weights would serve the same model": same
architecture and config, every tensor the name, shape and stored dtype the launch checkpoint had
(the stored dtype decides the model dtype under `--dtype auto` and the cast's bits). Everything is
checked while the new parameter tuple is built -- in the caller's thread, next to the old weights
-- so a refused update leaves the old weights serving, untouched.

Tensors arrive three ways, all as a `CheckpointReader` (jengine/models/layers/param.py):

- a model directory (`read_update_checkpoint`): safetensors, read one tensor at a time, or the
  Orbax checkpoint `jengine convert` writes, restored onto the placement (its `weight_source`);
- torch / numpy / jax arrays in process (`arrays_from_tensors`): a CPU torch tensor becomes a numpy
  view of its memory (zero copy; bf16 viewed as ml_dtypes.bfloat16), a device tensor a jax array
  through DLPack (no host copy);
- safetensors-encoded bytes over HTTP (`arrays_from_safetensors`).

A family reading another layout of its tensors (Qwen3-MoE: transformers 5's fused experts,
jengine/models/fused_experts.py) names them as its specs do first (`ModelFamily.read_checkpoint`:
the loader for a directory, RLControl for tensors), so every check here sees the specs' names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jengine.engine.request import InvalidRequest
from jengine.models.layers.param import CheckpointReader, MappingReader

# Config fields a checkpoint may change without being another model: the special ids (the
# tokenizer's business) and the config's dtype label (the stored dtypes are compared instead).
_FREE_CONFIG_FIELDS = frozenset({"bos_token_id", "eos_token_ids", "torch_dtype"})


def read_update_checkpoint(model_path: Any, current_config: Any):
    """The checkpoint in `model_path` (safetensors, or the Orbax checkpoint `jengine convert`
    writes), after its config.json was compared with the served model's; its tensors are read
    later (safetensors: one at a time; Orbax: all at once, onto their placement)."""
    from jengine.models.config import ModelConfig
    from jengine.models.loader import _read_config, _resolve_directory, open_weights

    if not isinstance(model_path, str) or not model_path:
        raise InvalidRequest("model_path", model_path, "must be a model directory path")
    try:
        directory = _resolve_directory(model_path)
        config = ModelConfig.from_hf_dict(_read_config(directory))
        checkpoint = open_weights(directory, config)
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidRequest("model_path", model_path, f"cannot be read: {exc}") from None
    for f in dataclasses.fields(current_config):
        new, old = getattr(config, f.name), getattr(current_config, f.name)
        if f.name not in _FREE_CONFIG_FIELDS and new != old:
            raise InvalidRequest("model_path", model_path, f"is another model: its config has "
                                 f"{f.name}={new!r}, the served model {f.name}={old!r}")
    return checkpoint


def arrays_from_tensors(named_tensors: Any) -> dict[str, Any]:
    """A mapping or a list of (name, tensor) pairs -> name -> numpy array or jax array, sharing
    the tensors' memory (the trainer must not modify them until the update returns)."""
    import jax

    pairs = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else named_tensors
    if not isinstance(pairs, (list, tuple)):
        raise InvalidRequest("named_tensors", named_tensors, "must be a dict or a list of "
                             "(name, tensor) pairs", shown=f" of type {type(named_tensors).__name__}")
    out: dict[str, Any] = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise InvalidRequest(f"named_tensors[{i}]", pair, "is not a (name, tensor) pair")
        name, tensor = pair
        if name in out:
            raise InvalidRequest(f"named_tensors[{i}]", name, "names a tensor a second time")
        if isinstance(tensor, (np.ndarray, jax.Array)):
            out[name] = tensor
        elif hasattr(tensor, "__dlpack__") and hasattr(tensor, "detach"):
            out[name] = _from_torch(tensor)
        else:
            raise InvalidRequest(f"named_tensors[{name!r}]", type(tensor).__name__,
                                 "must be a torch tensor, a numpy array or a jax array")
    return out


def _from_torch(tensor):
    import torch

    t = tensor.detach()
    if t.device.type == "cpu":
        t = t.contiguous()
        if t.dtype == torch.bfloat16:  # numpy has no bf16: view the bits, then name them
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()  # a view of the tensor's memory
    import jax

    return jax.dlpack.from_dlpack(t.contiguous())  # stays on its device


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "BOOL": "bool"}


def arrays_from_safetensors(blobs: list[bytes], field: str) -> dict[str, np.ndarray]:
    """Each blob a safetensors file's bytes; together, one bucket of tensors. Decoded with
    `safetensors.deserialize` (safetensors.numpy.load has no bf16): each array a view of its blob."""
    import ml_dtypes
    from safetensors import deserialize

    out: dict[str, np.ndarray] = {}
    for i, blob in enumerate(blobs):
        try:
            entries = deserialize(blob)
        except Exception as exc:  # safetensors raises its own error types
            raise InvalidRequest(f"{field}[{i}]", f"{len(blob)} bytes",
                                 f"is not a safetensors payload: {exc}", shown=" of") from None
        for name, entry in entries:
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise InvalidRequest(f"{field}[{i}]", entry["dtype"], f"(tensor {name!r}) is not "
                                     "a dtype jengine reads")
            if name in out:
                raise InvalidRequest(f"{field}[{i}]", name, "names a tensor an earlier entry has")
            np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
            out[name] = np.frombuffer(entry["data"], np_dtype).reshape(entry["shape"])
    return out


class CheckedReader:
    """A reader of an update, refusing what a fresh launch would not load the same way: a name the
    model has no parameter for, a stored dtype other than the launch checkpoint's. Shapes are
    checked against the specs as each tensor is placed (CheckpointSource)."""

    def __init__(self, reader: CheckpointReader, *, field: str, expected_dtypes: Mapping[str, str],
                 known_names: frozenset[str], require_all: bool):
        names = tuple(reader.names())
        for name in names:
            if name not in known_names:
                raise InvalidRequest(field, name, "is not a tensor of the served model (another "
                                     "architecture or naming?)", shown=f" tensor {name!r}")
            want = expected_dtypes.get(name)
            if want is not None and reader.dtype(name) != want:
                raise InvalidRequest(field, name, f"is stored as {reader.dtype(name)}, but the "
                                     f"served checkpoint stores it as {want}",
                                     shown=f" tensor {name!r}")
        if require_all:
            missing = sorted(set(expected_dtypes) - set(names))
            if missing:
                raise InvalidRequest(field, missing[0], f"is missing ({len(missing)} tensor(s) "
                                     "of the served model are)", shown=f" tensor {missing[0]!r}")
        self._reader, self._names = reader, names
        if hasattr(reader, "weight_source"):  # an Orbax checkpoint restores onto the placement
            self.weight_source = reader.weight_source

    def names(self) -> tuple[str, ...]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(name)

    def dtype(self, name: str) -> str:
        return self._reader.dtype(name)

    def read(self, name: str):
        return self._reader.read(name)


def launch_dtypes(weights: Any, checkpoint_names) -> dict[str, str]:
    """The stored dtype of every checkpoint tensor the model reads, when the model was launched
    from a reader or a mapping ({} for a source such as RandomSource: dtypes are not checked)."""
    if isinstance(weights, Mapping):
        weights = MappingReader(weights)
    reader = getattr(weights, "reader", weights)
    if not hasattr(reader, "dtype"):
        return {}
    stored = set(reader.names())
    return {name: reader.dtype(name) for name in checkpoint_names if name in stored}
