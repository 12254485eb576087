"""Named intermediate states of a dense decoder forward: what bisect compares, op by op.

Both sides produce the same names for the first ``n`` positions of a sequence, each a ``[n, width]``
array in the model dtype:

  embed                                    the embedding rows
  layers.{i}.input_layernorm               RMSNorm opening layer i
  layers.{i}.q_proj / k_proj / v_proj      projections (+ bias for Qwen2)
  layers.{i}.q_norm / k_norm               Qwen3's per-head norms (absent elsewhere)
  layers.{i}.attention                     attention output, heads concatenated (o_proj's input)
  layers.{i}.o_proj                        attention block output
  layers.{i}.attn_residual                 residual + attention (post_attention_layernorm's input)
  layers.{i}.post_attention_layernorm
  layers.{i}.gate_proj / up_proj
  layers.{i}.act_fn                        silu(gate)
  layers.{i}.mlp_product                   silu(gate) * up (down_proj's input)
  layers.{i}.down_proj                     MLP output
  layers.{i}.output                        residual + MLP: the layer's output
  norm                                     the final norm

The torch side (``capture_hf_states``) hooks HF modules; the engine side is interop/bisect.py.
RoPE is not a module in HF, so a RoPE difference shows up first at ``attention``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

LAYER_OPS = ("input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "attention",
             "o_proj", "attn_residual", "post_attention_layernorm", "gate_proj", "up_proj",
             "act_fn", "mlp_product", "down_proj", "output")

# op -> (HF submodule path inside the layer, capture its "input" or "output").
_HF_LAYER_HOOKS = {
    "input_layernorm": ("input_layernorm", "output"),
    "q_proj": ("self_attn.q_proj", "output"),
    "k_proj": ("self_attn.k_proj", "output"),
    "v_proj": ("self_attn.v_proj", "output"),
    "q_norm": ("self_attn.q_norm", "output"),
    "k_norm": ("self_attn.k_norm", "output"),
    "attention": ("self_attn.o_proj", "input"),
    "o_proj": ("self_attn.o_proj", "output"),
    "attn_residual": ("post_attention_layernorm", "input"),
    "post_attention_layernorm": ("post_attention_layernorm", "output"),
    "gate_proj": ("mlp.gate_proj", "output"),
    "up_proj": ("mlp.up_proj", "output"),
    "act_fn": ("mlp.act_fn", "output"),
    "mlp_product": ("mlp.down_proj", "input"),
    "down_proj": ("mlp.down_proj", "output"),
    "output": ("", "output"),
}


def state_names(num_layers: int, qk_norm: bool) -> list[str]:
    """Every state name, in forward order."""
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.{op}" for op in LAYER_OPS
                  if qk_norm or op not in ("q_norm", "k_norm")]
    return names + ["norm"]


@contextmanager
def capture_hf_states(model, num_positions: int) -> Iterator[dict]:
    """Record the named states of the first ``num_positions`` positions while the block runs.

    ``model`` is an HF ``*ForCausalLM``; the forward inside the block must be batch 1. The yielded
    dict fills in as the forward runs (numpy arrays, bf16 as ml_dtypes).
    """
    from interop.convert import tensor_to_numpy

    states: dict = {}
    handles = []
    base = model.model

    def record(name: str, tensor) -> None:
        if isinstance(tensor, tuple):
            tensor = tensor[0]
        if tensor.shape[0] != 1:
            raise ValueError("state capture needs a batch of one sequence")
        # q_norm/k_norm outputs are [1, S, heads, D]; everything else [1, S, width].
        flat = tensor.reshape(tensor.shape[0], tensor.shape[1], -1)[0, :num_positions]
        states[name] = tensor_to_numpy(flat)

    def hook(name: str, which: str):
        def fn(module, args, output):
            record(name, args[0] if which == "input" else output)
        return fn

    try:
        handles.append(base.embed_tokens.register_forward_hook(hook("embed", "output")))
        for i, layer in enumerate(base.layers):
            for op, (path, which) in _HF_LAYER_HOOKS.items():
                if op in ("q_norm", "k_norm") and not hasattr(layer.self_attn, op):
                    continue
                module = layer.get_submodule(path) if path else layer
                handles.append(module.register_forward_hook(hook(f"layers.{i}.{op}", which)))
        handles.append(base.norm.register_forward_hook(hook("norm", "output")))
        yield states
    finally:
        for h in handles:
            h.remove()
