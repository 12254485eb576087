"""The trainer's selected-token logprob, written as a trainer writes it, with the engine's leaf inside.

A trainer's log-prob is Megatron's cross-entropy order (reference-notes §5.3): widen the logits to
fp32, subtract the row max, gather the target, ``exp``, sum per vocabulary shard, fold the shard
sums in rank order, ``log``, and subtract. With the shard width set to the engine's
``--logprob-order`` block (32768, or 16384 for the ``-16384`` orders) this is the engine's blockwise
form; the in-shard sum is the one reduction whose order torch leaves unspecified, so it is the
registered ``sampling.block_sumexp`` leaf's twin (the spec's "vendor leaf with the trainer's
in-block order", here shared by construction). ``log`` is XLA's, through the twin table.

Forms (spec, "Logprobs"):
  neg-ce  -> -(log(S) - target): the trainer's negative cross-entropy, -0.0 for a certain token;
             the engine's ``--logprob-order blockwise``.
  direct  -> target - log(S): +0.0 for a certain token; ``--logprob-order blockwise-direct``.
"""

from __future__ import annotations

import torch

from interop.twin_autograd import blockwise_log_sum_exp
from interop.twins import TwinTable, plan_twin_table
from jengine.logprob_orders import BLOCKWISE_VOCAB_BLOCK, LOGPROB_BLOCK_WIDTHS, LOGPROB_ORDERS

LOGPROB_FORMS = {"neg-ce": True, "direct": False}  # form -> the engine order's negated form?
DEFAULT_BLOCK = BLOCKWISE_VOCAB_BLOCK


def logprob_order_for(form: str, block_size: int = DEFAULT_BLOCK) -> str:
    """The engine ``--logprob-order`` that reproduces a trainer ``form`` at ``block_size``."""
    if form not in LOGPROB_FORMS:
        raise ValueError(f"--logprob-form={form!r} is not one of {list(LOGPROB_FORMS)}")
    if block_size not in LOGPROB_BLOCK_WIDTHS:
        raise ValueError(f"block_size={block_size} must be one of {list(LOGPROB_BLOCK_WIDTHS)} "
                         "(the engine's orders)")
    return next(order for order, (width, negated) in LOGPROB_ORDERS.items()
                if width == block_size and negated == LOGPROB_FORMS[form])


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, form: str = "neg-ce",
                   block_size: int = DEFAULT_BLOCK, table: TwinTable | None = None) -> torch.Tensor:
    """f32[T] log p(targets[t]) under logits[t] ([T, V], bf16 or f32), in the trainer's form."""
    logprob_order_for(form, block_size)  # validates both
    if logits.dim() != 2:
        raise ValueError(f"logits must be [positions, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if targets.shape != (rows,):
        raise ValueError(f"targets must have shape ({rows},), got {tuple(targets.shape)}")
    table = table or plan_twin_table(logits.device.type)
    x = logits.float()  # bf16 -> f32 is exact
    # The shift cancels in the logprob (log-softmax is shift-invariant): it carries no gradient.
    row_max = x.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == 0, torch.zeros_like(row_max), row_max)  # -0.0 -> +0.0
    shifted = x - row_max
    target = shifted.gather(-1, targets.long()[:, None])
    # Per-block sums over ceil(V / block) blocks (a last block short of the width is completed with
    # -inf logits), folded in rank order: shard 0, 1, 2, ... left to right; differentiable.
    log_s = blockwise_log_sum_exp(shifted, block_sumexp=table.block_sumexp,
                                  log=table.elementwise["log"], block_size=block_size)[:, None]
    out = -(log_s - target) if form == "neg-ce" else target - log_s
    return out[:, 0]
