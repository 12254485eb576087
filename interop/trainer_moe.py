"""Trainer mode's MoE part: HF transformers' router and experts modules run the engine's leaves.

Routers (by class name), each an instance ``forward`` removed on leaving trainer mode:

* ``TORCH_TOPK_ROUTERS`` (``Qwen3MoeTopKRouter``: gate GEMM -> fp32 softmax -> ``torch.topk``
  sorted -> optional ``/ sum``): the gate GEMM as before (``F.linear``, routed to the GEMM twin),
  then the ("moe", "router_topk") leaf's twin with PyTorch CUDA's tie order;
* ``GROUPED_ROUTERS`` (``DeepseekV3TopkRouter``: f32 gate GEMM -> sigmoid -> + correction bias ->
  group-limited ``topk(sorted=False)`` -> unbiased weights, norm, scale): the f32 gate GEMM as HF
  writes it, then the ("moe", "router_grouped_topk") leaf's twin (its torch leaf: CUDA's
  ``sorted=False`` write order and row-sum order).
* ``SOFTMAX_BIAS_ROUTERS`` (``LongcatFlashTopkRouter``: f32 classifier GEMM -> softmax over the
  real and zero experts -> + correction bias -> ``topk(sorted=False)`` -> unbiased weights times
  routed_scaling_factor, no normalisation): the same leaf's twin with score="softmax", one group.

Experts: the forward of every ``SLOT_ORDER_EXPERTS`` module (fused SwiGLU experts, gate_up_proj
[E, 2I, H], down_proj [E, H, I], called as experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])) is replaced by the engine's expert path and slot-order combine
(``experts_forward``), whichever ``experts_implementation`` the model was loaded with.

A DeepSeek-V3 MoE block then computes ``experts(...) + shared_experts(x)`` with its own torch ops:
the shared SwiGLU's GEMMs and SiLU are routed aten ops, and the add is one bf16 rounding, as the
engine's `DeepseekMoE` does (jengine/models/layers/deepseek_moe.py).

Zero experts (LongCat-Flash: ids >= the number of real experts are identities): such a slot's term
is x * weight (the weight rounded to the model dtype first, as the real experts' is), rounded to the
model dtype, in its slot of the same f32 slot-order fold -- the engine's
``SparseMoE.combine(identity=...)``. HF handles them in one of two places by version: up to 5.24
``LongcatFlashExperts`` adds x * f32 weight in ascending expert id in bf16; from 5.25
``LongcatFlashMoE`` sums the identity weights, sends those slots to a real expert with weight 0
and adds x * sum afterwards. Neither is the engine's fold, so the whole ``ZERO_EXPERT_BLOCKS``
forward is replaced too (router call, then ``experts_forward`` with the identity slots), which
serves both versions.
"""

from __future__ import annotations

import functools

import torch

from interop.twin_autograd import twin_router_grouped_topk, twin_router_topk
from interop.twins import TwinError

TORCH_TOPK_ROUTERS = ("Qwen3MoeTopKRouter",)
GROUPED_ROUTERS = ("DeepseekV3TopkRouter",)
SOFTMAX_BIAS_ROUTERS = ("LongcatFlashTopkRouter",)
SLOT_ORDER_EXPERTS = ("Qwen3MoeExperts", "DeepseekV3Experts", "LongcatFlashExperts")
ZERO_EXPERT_BLOCKS = ("LongcatFlashMoE",)
UNSET = object()  # a restore entry whose attribute the module did not have (deleted on restore)


def route_routers(mode, model) -> int:
    """Give every router module of ``model`` the forward that runs its leaf's twin; returns how
    many. ``mode``: the active TrainerMode (its twin table, counters and restore list)."""
    forwards = {**{name: _topk_router_forward for name in TORCH_TOPK_ROUTERS},
                **{name: _grouped_router_forward for name in GROUPED_ROUTERS},
                **{name: _softmax_bias_router_forward for name in SOFTMAX_BIAS_ROUTERS}}
    return _replace_forwards(mode, model, forwards)


def route_experts(mode, model) -> int:
    """Replace the forward of every ``SLOT_ORDER_EXPERTS`` module of ``model`` with
    ``experts_forward``; returns how many.

    The instance forward shadows the class's, so it runs whatever ``experts_implementation``
    the model was loaded with (transformers 5.24 picks ``grouped_mm`` by default, on the CPU
    too with torch >= 2.9, whose ``aten::_grouped_mm`` trainer mode does not route)."""
    for module in model.modules():
        if type(module).__name__ in SLOT_ORDER_EXPERTS and getattr(module, "_is_expert_parallel",
                                                                   False):
            raise TwinError(f"trainer mode: {type(module).__name__} is expert-parallel "
                            "(transformers' EP); run the trainer's experts unsharded")
    return _replace_forwards(mode, model, {
        **{name: experts_forward for name in SLOT_ORDER_EXPERTS},
        **{name: _zero_expert_block_forward for name in ZERO_EXPERT_BLOCKS}})


def _replace_forwards(mode, model, forwards) -> int:
    routed = 0
    for module in model.modules():
        forward = forwards.get(type(module).__name__)
        if forward is not None and "forward" not in vars(module):
            module.forward = functools.partial(forward, mode, module)
            mode._model_restore.append((module, "forward", UNSET))
            routed += 1
    return routed


def _topk_router_forward(mode, router, hidden_states):
    """Qwen3MoeTopKRouter.forward (transformers 5.24) with the softmax and topk replaced:
    -> (router_logits, routing weights in the logits' dtype, expert ids int64)."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, router.weight)
    ids, weights = twin_router_topk(mode.table.router_topk, router_logits, k=router.top_k,
                                    norm_topk_prob=bool(router.norm_topk_prob))
    mode.routed["router_topk"] += 1
    return router_logits, weights.to(router_logits.dtype), ids


def _grouped_router_forward(mode, router, hidden_states):
    """DeepseekV3TopkRouter.forward (transformers 5.24) with everything after the f32 gate GEMM
    replaced by the router_grouped_topk twin: -> (router_logits f32, routing weights f32, expert
    ids int64)."""
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.type(torch.float32),
                                               router.weight.type(torch.float32))
    ids, weights = twin_router_grouped_topk(
        mode.table.router_grouped_topk, router_logits, router.e_score_correction_bias,
        k=router.top_k, n_group=router.num_group, topk_group=router.topk_group,
        norm_topk_prob=bool(router.norm_topk_prob),
        routed_scaling_factor=float(router.routed_scaling_factor), score="sigmoid")
    mode.routed["router_grouped_topk"] += 1
    return router_logits, weights, ids


@functools.lru_cache(maxsize=None)
def _returns_logits(router_cls) -> bool:
    """Whether the installed router's own forward returns (logits, weights, ids) -- transformers
    5.24's LongcatFlashTopkRouter -- or (weights, ids), as 5.17's (what the H200 machine has):
    the MoE block unpacks whichever its version returns, so the replacement must match it. Read
    from the forward's last `return`, not from a version number."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(router_cls.forward)))
    returns = [n for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    value = max(returns, key=lambda n: n.lineno).value
    arity = len(value.elts) if isinstance(value, ast.Tuple) else 1
    if arity not in (2, 3):
        raise TwinError(f"trainer mode: {router_cls.__name__}.forward returns {arity} values; "
                        "the replacement knows the 2- and 3-value forms")
    return arity == 3


def _softmax_bias_router_forward(mode, router, hidden_states):
    """LongcatFlashTopkRouter.forward with everything after the f32 classifier GEMM replaced by
    the router_grouped_topk twin (softmax, one group, no normalisation): -> (router_logits f32,
    routing weights f32, expert ids int64; ids >= n_routed_experts of the real ones are zero
    experts), without the logits where the installed version's forward returns none."""
    if router.classifier.bias is not None:
        raise TwinError("trainer mode: LongcatFlashTopkRouter with router_bias has no engine "
                        "form (the engine's router GEMM has no bias)")
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.type(torch.float32),
                                               router.classifier.weight.type(torch.float32))
    ids, weights = twin_router_grouped_topk(
        mode.table.router_grouped_topk, router_logits, router.e_score_correction_bias,
        k=router.top_k, n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=float(router.routed_scaling_factor), score="softmax")
    mode.routed["router_grouped_topk"] += 1
    return (router_logits, weights, ids) if _returns_logits(type(router)) else (weights, ids)


def _zero_expert_block_forward(mode, block, hidden_states):
    """LongcatFlashMoE.forward: the router (a module call, so its hooks run; whichever 2- or
    3-value form it returns, weights and ids are the last two), then the engine's expert path
    with every id past the real experts an identity slot. The real experts are those with
    weights (``down_proj``'s first axis), in 5.24's layout and 5.25's alike."""
    shape = hidden_states.shape
    hidden_states = hidden_states.reshape(-1, shape[-1])
    weights, ids = block.router(hidden_states)[-2:]
    out = experts_forward(mode, block.experts, hidden_states, ids, weights,
                          identities_from=block.experts.down_proj.shape[0])
    return out.reshape(shape)


def experts_forward(mode, experts, hidden_states, top_k_index, top_k_weights,
                    identities_from=None):
    """The engine's expert path (jengine/models/layers/moe.py) in torch ops trainer mode routes.

    For each expert e and the rows routed to it: gate = x W_gate^T and up = x W_up^T as two
    GEMMs (F.linear -> aten mm -> the GEMM twin; the engine's gemm_group keeps each member's
    own gemm bits, and the fixed-order GEMM's rows do not depend on how many rows share the
    call), silu(gate) * up (F.silu -> the SiLU twin), times the slot's routing weight in the
    model dtype (inside the activation, as the engine applies it), y = h W_down^T. A token's
    k outputs are added in f32 in slot order 0..k-1 and rounded once (``slot_order_sum``,
    --moe-combine-order slot). Plain torch ops throughout, so autograd differentiates it with its
    own formulas. ``identities_from``: the first zero expert's id (LongCat), None without any."""
    import torch.nn.functional as F

    tokens, k = top_k_index.shape
    inter = getattr(experts, "intermediate_dim", None) or experts.intermediate_size
    slots = hidden_states.new_zeros(tokens, k, hidden_states.shape[-1])
    for e in torch.unique(top_k_index).tolist():
        token_idx, slot = torch.where(top_k_index == e)
        x = hidden_states[token_idx]
        if identities_from is not None and e >= identities_from:  # zero expert: x * w, one rounding
            slots = slots.index_put((token_idx, slot),
                                    x * top_k_weights[token_idx, slot, None].to(x.dtype))
            continue
        gate_up, down = experts.gate_up_proj[e], experts.down_proj[e]
        h = F.silu(F.linear(x, gate_up[:inter])) * F.linear(x, gate_up[inter:])
        y = F.linear(h * top_k_weights[token_idx, slot, None].to(h.dtype), down)
        slots = slots.index_put((token_idx, slot), y)
    mode.routed["moe_experts"] += 1
    total = slots[:, 0].float()
    for s in range(1, k):
        total = total + slots[:, s].float()
    return total.to(hidden_states.dtype)
