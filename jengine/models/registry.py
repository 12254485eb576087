"""The model families by Hugging Face architecture name: the only way the engine finds a model.

Each family module (FAMILY_MODULES) declares `EntryClass`, a `ModelFamily`
(jengine/models/family.py). Adding a family is adding its module to FAMILY_MODULES.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from jengine.models.family import ModelFamily

FAMILY_MODULES = ("jengine.models.llama", "jengine.models.qwen2", "jengine.models.qwen3",
                  "jengine.models.qwen3_moe", "jengine.models.deepseek_v3",
                  "jengine.models.longcat_flash")

_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> None:
    """Add a family; a second family under one architecture name is refused, never replaced."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family needs a ModelFamily, got {type(family).__name__}")
    if family.architecture in _FAMILIES:
        raise ValueError(f"architecture {family.architecture!r} is already registered")
    _FAMILIES[family.architecture] = family


def unregister_family(architecture: str) -> None:
    _FAMILIES.pop(architecture, None)


def architectures() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def get_family(architecture: Any) -> ModelFamily:
    try:
        return _FAMILIES[architecture]
    except (KeyError, TypeError):
        raise ValueError(unsupported_architecture_message(architecture)) from None


def unsupported_architecture_message(architecture: Any) -> str:
    return (f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(architectures())}")


def architecture_of(d: Mapping[str, Any]) -> str:
    """The registered architecture a config.json names: the first of `architectures` that is
    registered, else the family of `model_type` when `architectures` is missing or null (what
    `PretrainedConfig.to_dict()` gives for a config built in code)."""
    names = d.get("architectures")
    if names:
        if not isinstance(names, (list, tuple)):
            raise ValueError(f"config.json 'architectures' must be a list, got {names!r}")
        for name in names:
            if name in _FAMILIES:
                return name
        raise ValueError(unsupported_architecture_message(names[0])
                         + f" (config.json architectures={list(names)!r})")
    model_type = d.get("model_type")
    for family in _FAMILIES.values():
        if family.model_type == model_type:
            return family.architecture
    raise ValueError(f"config.json names no supported architecture (architectures={names!r}, "
                     f"model_type={model_type!r}); supported: {', '.join(architectures())}")


for _module in FAMILY_MODULES:
    register_family(importlib.import_module(_module).EntryClass)
