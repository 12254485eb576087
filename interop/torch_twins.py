"""Alias of interop.trainer_mode under the name issue 7 uses: ``interop.torch_twins.enable()``."""

from interop.trainer_mode import ATTENTION_NAME, TrainerMode, active, disable, enable

__all__ = ["ATTENTION_NAME", "TrainerMode", "active", "disable", "enable"]
