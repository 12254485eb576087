"""Checkpoint conversion between a torch trainer and the engine, both ways, bit for bit.

The engine reads HF-named numpy arrays (a checkpoint reader, ``LoadedModel.checkpoint``, or a
mapping of them: bf16 via ``ml_dtypes``, ``[out, in]`` projections as stored by HF); each
parameter's spec says how the model transposes it when it builds its parameters. So conversion
is only about containers and dtypes, never values:

* ``state_dict_to_weights(sd)``: torch ``state_dict`` -> engine weights. CPU tensors are shared
  (zero copy, a bf16 tensor is viewed as ``ml_dtypes.bfloat16``); CUDA tensors are copied to host.
* ``weights_to_state_dict(weights)``: the reverse, zero copy.
* ``load_state_dict_file(path)``: ``.pt``/``.bin`` (``torch.load(weights_only=True)`` only -- no
  pickled code runs) or ``.safetensors``; ``load_hf_dir(dir)``: the engine's own loader.
* ``update_runner_weights(runner, sd)``: the in-process handoff after a training step: rebuild the
  engine model's parameters from a live ``state_dict`` without touching disk; the compiled step
  programs are reused (same shapes and dtypes).

Tied embeddings: HF's ``state_dict()`` holds ``lm_head.weight`` even when it is tied to the
embedding (the same tensor twice); the engine ignores it when the config says tied, so passing a
live state_dict is fine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def tensor_to_numpy(t) -> np.ndarray:
    """One torch tensor -> numpy with the same bits (bf16 kept as ml_dtypes.bfloat16)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bf16())
    return t.numpy()


def numpy_to_tensor(a: np.ndarray):
    """One numpy array -> torch tensor with the same bits (zero copy when contiguous)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == _bf16():
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def state_dict_to_weights(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A torch state_dict (HF names) -> the engine's weights dict."""
    out = {}
    for name, value in state_dict.items():
        if not hasattr(value, "detach"):
            raise TypeError(f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor")
        out[name] = tensor_to_numpy(value)
    return out


def weights_to_state_dict(weights: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The engine's weights dict -> a torch state_dict (``model.load_state_dict`` accepts it)."""
    return {name: numpy_to_tensor(np.asarray(value)) for name, value in weights.items()}


def load_state_dict_file(path) -> dict[str, Any]:
    """A ``.safetensors`` or ``.pt``/``.bin`` file of tensors -> state_dict (torch tensors)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix in (".pt", ".pth", ".bin"):
        import torch

        obj = torch.load(str(path), map_location="cpu", weights_only=True)
        if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
        return obj
    raise ValueError(f"{path}: unknown checkpoint suffix {path.suffix!r} "
                     "(supported: .safetensors, .pt, .pth, .bin)")


def save_state_dict_file(state_dict: Mapping[str, Any], path) -> None:
    """Write tensors as ``.safetensors`` (or ``.pt``, plain tensors only)."""
    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        # HF state_dicts can hold one tensor under two names (tied head); safetensors refuses
        # shared storage, so the copy below keeps the file self-contained.
        save_file({k: v.clone() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    else:
        import torch

        torch.save(tensors, str(path))


@dataclass
class LoadedWeights:
    """What ``ModelRunner`` reads from a loaded model: ``.config`` and ``.checkpoint`` (here a
    mapping of HF tensor name -> array, read one tensor at a time like a checkpoint)."""

    config: Any  # jengine.models.config.ModelConfig
    checkpoint: dict[str, np.ndarray]
    path: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def load_hf_dir(directory):
    """An HF model directory -> the engine's ``LoadedModel`` (jengine.models.loader, no torch)."""
    from jengine.models.loader import load_model

    return load_model(str(directory), progress=False)


def loaded_from_torch_model(model) -> LoadedWeights:
    """A live HF torch model -> config and weights, in process (no disk)."""
    from jengine.models.config import ModelConfig

    config = ModelConfig.from_hf_dict(model.config.to_dict())
    return LoadedWeights(config=config, checkpoint=state_dict_to_weights(model.state_dict()))


def update_runner_weights(runner, state_dict: Mapping[str, Any]) -> None:
    """Hand a trainer's new weights to a live ModelRunner without disk (same shapes and dtypes).

    The model is rebuilt from the new arrays with the runner's frozen kernel plans, and only its
    parameter state is swapped in, so the compiled step programs are reused. The KV pool is not
    touched: the caller flushes any cached prefixes (they were computed with the old weights).
    """
    runner.load_weights(state_dict_to_weights(state_dict))
