"""Bisect a teacher-forced mismatch to the first layer and op whose outputs differ.

The dump writer records named states of the trainer's forward (interop/states.py) for the first
``n`` positions. Here the engine's own forward runs over the same tokens
(``ModelRunner.forward_sequence`` with an instrument) with every kernel plan wrapped in a recorder:
each leaf call's inputs and outputs are kept and named by the parameter it was called with, as the
model names it (``model.named_parameters()``: ``layers.i.self_attn.q_proj.weight`` ->
``layers.i.q_proj``), so nothing of the model's op order or parameter list is restated here. The
first state in forward order whose bits differ is the op to look at: every state before it
matched, so it saw the same inputs on both sides.

As a guard, the recorded forward's final hidden states are compared with the runner's real step
program (``forward_sequence`` without an instrument) bit for bit; a difference is reported, not
hidden.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from interop.states import LAYER_OPS, state_names


class _Recorder:
    """A kernel plan that also appends (kind, args, output) of every call to a shared log."""

    def __init__(self, plan, kind: str, log: list):
        self.plan, self.kind, self.log = plan, kind, log

    def __call__(self, *args, **kwargs):
        out = self.plan(*args, **kwargs)
        if self.kind == "gemm_group":  # one grouped launch: log each member as its own gemm
            x, ws = args[0], args[1]
            biases = args[2] if len(args) > 2 else kwargs.get("biases")
            for i, (w, o) in enumerate(zip(ws, out)):
                self.log.append(("gemm", (x, w, None if biases is None else biases[i]), o))
        elif self.kind == "silu" and kwargs.get("times") is not None:
            # SwiGLU's one-leaf silu(gate) * up: the trainer's act_fn is the SiLU alone (its
            # product with up is recorded as down_proj's input), so log that, computed aside.
            self.log.append(("silu", args, self.plan(*args)))
        else:
            self.log.append((self.kind, args, out))
        return out


def _param_names(model) -> dict[int, tuple[int | None, str]]:
    """id(weight value) -> (layer index or None, state name) for the weights a state is named
    after: "layers.3.self_attn.q_proj.weight" -> (3, "q_proj"), "norm.weight" -> (None, "norm")."""
    names = {}
    for path, value in model.named_parameters().items():
        parts = path.split(".")
        if parts[-1] != "weight":
            continue
        if path == "norm.weight":
            names[id(value)] = (None, "norm")
        elif parts[0] == "layers" and parts[-2] in LAYER_OPS:
            names[id(value)] = (int(parts[1]), parts[-2])
    return names


def _states_from_log(log, names, num_layers: int, tokens: int) -> dict:
    """Turn the recorded leaf calls into the named states of interop/states.py ([tokens, width])."""
    states, layer = {}, 0

    def flat(a):  # q_norm/k_norm run on [tokens * heads, head_dim]; attention is [tokens, heads, D]
        return a.reshape(tokens, -1)

    def boundary(i, value):  # the residual stream entering layer i (i == num_layers: final norm)
        states["embed" if i == 0 else f"layers.{i - 1}.output"] = value

    for kind, args, out in log:
        if kind in ("rmsnorm", "add_rmsnorm"):
            where = names.get(id(args[-1]))
            if where is None:
                continue
            i, name = where
            normed = out[0] if kind == "add_rmsnorm" else out
            stream = out[1] if kind == "add_rmsnorm" else args[0]  # the norm's (summed) input
            if name == "norm":
                boundary(num_layers, stream)
                states["norm"] = normed
                continue
            layer = i
            states[f"layers.{i}.{name}"] = flat(normed)
            if name == "input_layernorm":
                boundary(i, stream)
            elif name == "post_attention_layernorm":
                states[f"layers.{i}.attn_residual"] = stream
        elif kind == "gemm":
            where = names.get(id(args[1]))
            if where is None:
                continue
            layer, name = where
            states[f"layers.{layer}.{name}"] = out
            if name == "down_proj":
                states[f"layers.{layer}.mlp_product"] = args[0]
        elif kind == "silu":
            states[f"layers.{layer}.act_fn"] = out
        elif kind == "attention":
            states[f"layers.{layer}.attention"] = flat(out)
    return states


def engine_states(runner, ids) -> tuple[dict[str, np.ndarray], bool]:
    """(named states of the engine's forward over ``ids``, recorded-forward-equals-real-step?)."""
    t = len(ids)
    num_layers = runner.model_config.num_hidden_layers

    def instrument(model):
        log: list = []
        kern = model.kernels
        # The fused leaves (JENGINE_GEMM_EPILOGUES; rope_paged, planned by default) would hide
        # o_proj's, down_proj's, gate/up's and the attention's outputs; they give the separate
        # leaves' bits, so the record runs those.
        unfused = {name: None for name in ("gemm_add_rmsnorm", "gemm_swiglu", "rope_paged")
                   if getattr(kern, name, None) is not None}
        model.kernels = dataclasses.replace(kern, **unfused, **{
            f.name: _Recorder(getattr(kern, f.name), f.name, log)
            for f in dataclasses.fields(kern)
            if f.name not in unfused and getattr(kern, f.name) is not None})
        return lambda: _states_from_log(log, _param_names(model), num_layers, t)

    hidden, states = runner.forward_sequence(ids, instrument=instrument)
    states = {k: np.asarray(v) for k, v in states.items()}
    real, _ = runner.forward_sequence(ids)
    agrees = bool((_bits(np.asarray(real)) == _bits(np.asarray(hidden))).all())
    return states, agrees


@dataclass(frozen=True)
class StateDiff:
    name: str
    differing: int
    total: int
    first_position: int
    max_ulp: int
    dtype: str = ""


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        a = a.astype(np.float32)  # bf16 -> f32 is exact
    return np.ascontiguousarray(a).view(np.int32)


def ulp_distance(a, b) -> np.ndarray:
    """|ordered(a) - ordered(b)| in ulps of the arrays' own dtype (bf16 or f32)."""
    shift = 16 if np.asarray(a).dtype.itemsize == 2 else 0  # bf16 is the top half of an f32

    def ordered(x):
        i = _bits(x).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i) >> shift

    return np.abs(ordered(a) - ordered(b))


def compare_states(trainer: dict[str, np.ndarray], engine: dict[str, np.ndarray],
                   names: list[str]) -> list[StateDiff]:
    """Every named state present on both sides whose bits differ, in forward order."""
    diffs = []
    for name in names:
        if name not in trainer or name not in engine:
            continue
        a, b = trainer[name], engine[name][: trainer[name].shape[0]]
        if a.shape != b.shape:
            diffs.append(StateDiff(name, a.size, a.size, 0, -1))
            continue
        neq = _bits(a) != _bits(b)
        if neq.any():
            rows = np.nonzero(neq.any(axis=-1))[0]
            diffs.append(StateDiff(name, int(neq.sum()), int(neq.size), int(rows[0]),
                                   int(ulp_distance(a, b)[neq].max()), str(a.dtype)))
    return diffs


def bisect_sequence(runner, record: dict) -> str:
    """A report line for one dump record that carries ``states``."""
    trainer = record["states"]
    n = next(iter(trainer.values())).shape[0]
    cfg = runner.model_config
    engine, agrees = engine_states(runner, record["ids"][:n])
    names = state_names(cfg.num_hidden_layers, cfg.qk_norm)
    lines = []
    if not agrees:
        lines.append("  bisect: WARNING the recorded forward's output differs from the engine's real "
                     "step program (a compilation difference); the states below may not be the "
                     "engine's")
    if "logits" in record:
        rows = min(len(record["logits"]), n)
        logits = np.asarray(runner.compute_logits(jnp.asarray(engine["norm"][:rows])))
        engine["logits"], trainer = logits, {**trainer, "logits": record["logits"][:rows]}
        names = names + ["logits"]
    diffs = compare_states(trainer, engine, names)
    if not diffs:
        lines.append(f"  bisect: all {len([x for x in names if x in trainer])} recorded states "
                     f"match over the first {n} positions (the divergence is later than position "
                     f"{n - 1}, or in the logprob arithmetic)")
    else:
        d = diffs[0]
        lines.append(f"  bisect: first differing state {d.name}: {d.differing} of {d.total} "
                     f"elements, first at position {d.first_position}, max {d.max_ulp} ulp of {d.dtype} "
                     f"(then {len(diffs) - 1} more states differ)")
    return "\n".join(lines)
