"""HF transformers 5.x's fused expert layout, read as the one-tensor-per-expert names the MoE specs
declare.

transformers 5 holds a MoE layer's experts as two 3-D parameters, and `named_parameters()` /
`state_dict()` yield them under these names (what an RL trainer on 5.x pushes into the engine):

    {layer}.mlp.experts.gate_up_proj   [E, 2I, H]   expert e: gate_proj.weight = [e, :I],
                                                              up_proj.weight   = [e, I:]
    {layer}.mlp.experts.down_proj      [E, H, I]    expert e: down_proj.weight = [e]

(`Qwen3MoeExperts.forward`: `linear(x, gate_up_proj[e]).chunk(2)`, gate first.) `save_pretrained`
and released checkpoints write the per-expert tensors `{layer}.mlp.experts.{e}.gate_proj.weight`,
... [out, in] that ParamSpec.stacked reads. `FusedExpertsView` is a `CheckpointReader` over either:
every fused tensor is named as its per-expert parts, each part a slice of the fused tensor (bytes,
no arithmetic; from safetensors only the slice is read). Everything downstream -- the name, dtype
and shape checks of a launch or an update, a partial update's stacks, Orbax conversion -- sees
the per-expert names only.

Refused, naming the tensor: a fused tensor whose shape is not the layout's above; a layer named in
both layouts by one checkpoint or update (which tensor would win is no rule anyone should rely on).
"""

from __future__ import annotations

import re
from typing import Any

_FUSED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.experts)\.\d+\.(?:gate_proj|up_proj|down_proj)\.weight$")


class CheckpointLayoutError(ValueError):
    """A tensor the fused-layout view refuses: `tensor` (its name) and `reason` for the caller's
    message (a weight update's InvalidRequest names the field it came in)."""

    def __init__(self, tensor: str, reason: str):
        self.tensor, self.reason = tensor, reason
        super().__init__(f"tensor {tensor!r} {reason}")


def per_expert_view(reader: Any, *, num_experts: int, intermediate_size: int, hidden_size: int):
    """`reader` itself when it names no fused expert tensor, else a `FusedExpertsView` of it."""
    if not any(_FUSED.match(name) for name in reader.names()):
        return reader
    return FusedExpertsView(reader, num_experts=num_experts, intermediate_size=intermediate_size,
                            hidden_size=hidden_size)


class FusedExpertsView:
    """`reader` with every fused expert tensor renamed into its per-expert parts (module
    docstring); every other tensor passes through. num_experts (E), intermediate_size (I) and
    hidden_size (H) give the fused shapes it checks."""

    def __init__(self, reader: Any, *, num_experts: int, intermediate_size: int, hidden_size: int):
        e, i, h = num_experts, intermediate_size, hidden_size
        expected = {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}
        layout = {"gate_up_proj": "[num_experts, 2 * moe_intermediate_size, hidden_size]",
                  "down_proj": "[num_experts, hidden_size, moe_intermediate_size]"}
        self._reader = reader
        self._parts: dict[str, tuple[str, tuple]] = {}  # part name -> (fused name, its index)
        names: list[str] = []
        fused_layers: dict[str, str] = {}  # "...experts" -> a fused tensor of it
        per_expert_layers: dict[str, str] = {}
        for name in reader.names():
            m = _FUSED.match(name)
            if m is None:
                names.append(name)
                if (p := _PER_EXPERT.match(name)) is not None:
                    per_expert_layers.setdefault(p.group("experts"), name)
                continue
            experts, kind = m.group("experts"), m.group("kind")
            shape = tuple(reader.shape(name))
            if shape != expected[kind]:
                raise CheckpointLayoutError(name, f"has shape {shape}, but transformers' fused "
                                            f"layout is {layout[kind]} = {expected[kind]}")
            fused_layers.setdefault(experts, name)
            for x in range(e):
                if kind == "gate_up_proj":
                    parts = {"gate_proj": (x, slice(0, i)), "up_proj": (x, slice(i, 2 * i))}
                else:
                    parts = {"down_proj": (x,)}
                for part, index in parts.items():
                    part_name = f"{experts}.{x}.{part}.weight"
                    self._parts[part_name] = (name, index)
                    names.append(part_name)
        for experts, fused in fused_layers.items():
            if experts in per_expert_layers:
                raise CheckpointLayoutError(
                    fused, f"and the per-expert tensor {per_expert_layers[experts]!r} both name "
                    f"the experts of {experts!r}: send one layout per layer (fused gate_up_proj / "
                    "down_proj, or experts.{e}.gate_proj/up_proj/down_proj.weight)")
        self._names = tuple(names)
        self._known = frozenset(names)

    def names(self) -> tuple[str, ...]:
        return self._names

    def __contains__(self, name: str) -> bool:
        return name in self._known

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._parts:
            fused, index = self._parts[name]
            shape = tuple(self._reader.shape(fused))
            rows = index[1] if len(index) > 1 else slice(0, shape[1])
            return (rows.stop - rows.start, *shape[2:])
        return tuple(self._reader.shape(name))

    def dtype(self, name: str) -> str:
        return self._reader.dtype(self._parts[name][0] if name in self._parts else name)

    def read(self, name: str):
        if name not in self._parts:
            return self._reader.read(name)
        fused, index = self._parts[name]
        read_part = getattr(self._reader, "read_part", None)
        if read_part is not None:  # safetensors: only the slice's bytes
            return read_part(fused, index)
        return self._reader.read(fused)[index]  # an array in memory: a view (numpy) or a slice
