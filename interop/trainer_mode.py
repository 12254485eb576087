"""Trainer mode: HF transformers' own forward (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3), in
torch, computing the engine's bits.

``enable()`` overrides, with ``torch.library`` at the device's dispatch key (the way
``batch_invariant_ops`` does), the aten operations whose torch implementation cannot reproduce the
engine's arithmetic, and routes them to the twins of the engine's leaves (interop/twins.py):

  mm, addmm (1-D bias, beta = alpha = 1), bmm  -> the fixed-order GEMM leaf (MKL/cuBLAS orders vary)
  mean.dim over the last dim                   -> the RMSNorm leaf's fixed-order mean
  rsqrt, cos, sin, pow, exp, log               -> XLA's own functions (CPU polynomials differ)
  silu                                         -> the SiLU leaf (x / (1 + exp(-x)))

Everything else (casts, adds, multiplies, gathers, cat) is correctly rounded IEEE arithmetic in both
frameworks and stays torch's. Attention is replaced at the model level: ``enable(model)`` registers
the dense-causal attention leaf's twin with transformers' ``AttentionInterface`` under
``ATTENTION_NAME``, selects it on the model, and replaces the rotary ``inv_freq`` with the
engine's own (jengine.models.layers.rope: HF's formula as torch evaluates it, with XLA's pow; HF
computed it at load time with torch's pow), as a float32 buffer (``model.to(torch.bfloat16)``
rounds HF's to bf16). MoE routers and experts are replaced at the module level too
(interop/trainer_moe.py): each router's forward runs its gate GEMM as before and then the twin of
the router leaf ``--router-topk torch`` plans in the engine, and each experts module's forward the
engine's expert path and slot-order combine in routed torch ops.
MLA attention modules (``DeepseekV3Attention``) run the engine's absorbed computation instead of
HF's expanded one (interop/trainer_mla.py).
Leaving the context restores the model and the dispatcher.

Unsupported call forms (e.g. ``addmm`` with beta != 1, a mean over another axis) run torch's own
kernel and are counted in ``TrainerMode.fallbacks`` -- the dump writer prints them, because a
fallback on the model's path means its bits are torch's, not the engine's.

Gradients: ``loss.backward()`` works under trainer mode. The overrides sit below autograd, so torch's
own derivative formulas apply to the routed aten ops (the experts' forward is built from them); the
attention and router twins carry their own backward (interop/twin_autograd.py). Only the forward is bitwise; the backward is accurate torch arithmetic.

Scope: unpadded causal sequences (the twin attention refuses masks other than plain causal, and a
KV cache), bf16 or f32 models.
"""

from __future__ import annotations

import collections
import logging
import threading
import warnings
from typing import Any

import torch

from interop import trainer_moe
from interop.trainer_mla import route_mla_attention
from interop.twin_autograd import twin_attention
from interop.twins import TwinError, TwinTable, plan_twin_table

logger = logging.getLogger(__name__)

ATTENTION_NAME = "jengine_twin"

_TORCH_TO_JAX_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
_LOCK = threading.Lock()
_ACTIVE: "TrainerMode | None" = None

_UNSET = trainer_moe.UNSET  # a restore entry whose attribute the model did not have (deleted)


def _jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return jnp.dtype(_TORCH_TO_JAX_DTYPE[dtype])


def _dispatch_key(device: str) -> str:
    return "CPU" if device.split(":")[0] == "cpu" else "CUDA"


class TrainerMode:
    """The installed overrides. Use ``enable()``; this object is also its context manager."""

    def __init__(self, table: TwinTable, model: Any = None):
        self.table = table
        self.model = model
        self.routed: collections.Counter[str] = collections.Counter()
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self._lib: torch.library.Library | None = None
        self._originals: dict[str, Any] = {}
        self._model_restore: list[tuple[Any, str, Any]] = []

    # -- context manager --------------------------------------------------------------------------
    def __enter__(self) -> "TrainerMode":
        return self

    def __exit__(self, *exc) -> None:
        disable()

    # -- the aten overrides -----------------------------------------------------------------------
    def _fallback(self, op: str, keyset, *args, **kwargs):
        self.fallbacks[op] += 1
        return self._originals[op].call_boxed(keyset, *args, **kwargs)

    def _mm(self, keyset, a, b):
        if a.dtype == b.dtype and a.dtype in _TORCH_TO_JAX_DTYPE:
            self.routed["mm"] += 1
            return self.table.gemm(a, b, None, out_dtype=_jax_dtype(a.dtype))
        return self._fallback("mm", keyset, a, b)

    def _addmm(self, keyset, bias, a, b, *, beta=1, alpha=1):
        n = b.shape[-1]
        simple = (beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == n
                  and a.dtype == b.dtype == bias.dtype and a.dtype in _TORCH_TO_JAX_DTYPE)
        if simple:
            # One rounding: the f32 accumulator plus the f32-widened bias, then the output dtype
            # (what the engine's linear leaf does, and what a bf16 GEMM with beta*C computes).
            self.routed["addmm"] += 1
            return self.table.gemm(a, b, bias, out_dtype=_jax_dtype(a.dtype))
        return self._fallback("addmm", keyset, bias, a, b, beta=beta, alpha=alpha)

    def _bmm(self, keyset, a, b):
        if a.dtype == b.dtype and a.dtype in _TORCH_TO_JAX_DTYPE:
            self.routed["bmm"] += 1
            out_dtype = _jax_dtype(a.dtype)
            return torch.stack([self.table.gemm(a[i], b[i], None, out_dtype=out_dtype)
                                for i in range(a.shape[0])])
        return self._fallback("bmm", keyset, a, b)

    def _mean_dim(self, keyset, x, dim, keepdim=False, *, dtype=None):
        dims = [d % x.dim() for d in (dim or [])]
        if dims == [x.dim() - 1] and dtype is None and x.dtype in _TORCH_TO_JAX_DTYPE:
            self.routed["mean.dim"] += 1
            out = self.table.mean_last(x)
            return out if keepdim else out.squeeze(-1)
        return self._fallback("mean.dim", keyset, x, dim, keepdim, dtype=dtype)

    def _unary(self, op: str, twin):
        def impl(keyset, x):
            if x.dtype in _TORCH_TO_JAX_DTYPE:
                self.routed[op] += 1
                return twin(x)
            return self._fallback(op, keyset, x)

        return impl

    def _pow_tensor_scalar(self, keyset, x, exponent):
        if x.dtype in _TORCH_TO_JAX_DTYPE and isinstance(exponent, (int, float)):
            self.routed["pow.Tensor_Scalar"] += 1
            return self.table.elementwise["pow_tensor_scalar"](x, exponent=exponent)
        return self._fallback("pow.Tensor_Scalar", keyset, x, exponent)

    def _pow_scalar(self, keyset, base, exponent):
        if exponent.dtype in _TORCH_TO_JAX_DTYPE and isinstance(base, (int, float)):
            self.routed["pow.Scalar"] += 1
            return self.table.elementwise["pow_scalar_tensor"](exponent, base=float(base))
        return self._fallback("pow.Scalar", keyset, base, exponent)

    def _pow_tensor_tensor(self, keyset, x, exponent):
        if x.dtype == exponent.dtype and x.dtype in _TORCH_TO_JAX_DTYPE:
            self.routed["pow.Tensor_Tensor"] += 1
            return self.table.elementwise["pow_tensor_tensor"](x, exponent)
        return self._fallback("pow.Tensor_Tensor", keyset, x, exponent)

    def _impls(self) -> dict[str, Any]:
        t = self.table
        return {
            "mm": self._mm,
            "addmm": self._addmm,
            "bmm": self._bmm,
            "mean.dim": self._mean_dim,
            "rsqrt": self._unary("rsqrt", t.rsqrt),
            "silu": self._unary("silu", t.silu),
            "cos": self._unary("cos", t.elementwise["cos"]),
            "sin": self._unary("sin", t.elementwise["sin"]),
            "exp": self._unary("exp", t.elementwise["exp"]),
            "log": self._unary("log", t.elementwise["log"]),
            "pow.Tensor_Scalar": self._pow_tensor_scalar,
            "pow.Scalar": self._pow_scalar,
            "pow.Tensor_Tensor": self._pow_tensor_tensor,
        }

    def install(self) -> None:
        key = _dispatch_key(self.table.device)
        impls = self._impls()
        self._originals = {op: torch.library.get_kernel(f"aten::{op}", key) for op in impls}
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel": that is the point.
                warnings.simplefilter("ignore", UserWarning)
                for op, fn in impls.items():
                    lib.impl(op, fn, key, with_keyset=True)
        except Exception:
            lib._destroy()
            raise
        self._lib = lib
        if self.model is not None:
            self._prepare_model(self.model)

    def uninstall(self) -> None:
        for obj, attr, value in reversed(self._model_restore):
            if value is _UNSET:
                delattr(obj, attr)
            elif attr == "attn_implementation":
                _set_attn_implementation(obj, value)
            else:
                setattr(obj, attr, value)
        self._model_restore.clear()
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None

    # -- the model-level parts ---------------------------------------------------------------------
    def _prepare_model(self, model) -> None:
        self.route_moe_routers(model)
        self.route_moe_experts(model)
        route_mla_attention(self, model, self._model_restore, _UNSET)
        register_twin_attention(self.table)
        previous = model.config._attn_implementation
        _set_attn_implementation(model, ATTENTION_NAME)
        self._model_restore.append((model, "attn_implementation", previous))
        rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
        if rotary is not None:
            inv_freq, scaling = recompute_inv_freq(model.config, rotary, type(model).__name__)
            self._model_restore.append((rotary, "attention_scaling", rotary.attention_scaling))
            self._model_restore.append((rotary, "inv_freq", rotary.inv_freq))
            # A new f32 buffer, not a copy into the old one: after model.to(bfloat16) the old
            # buffer is bf16 and would round the frequencies the engine keeps in f32.
            rotary.inv_freq = inv_freq.to(device=rotary.inv_freq.device, dtype=torch.float32)
            rotary.attention_scaling = scaling

    def route_moe_routers(self, model) -> int:
        """Route every MoE router module of ``model`` to its leaf's twin (interop/trainer_moe.py);
        returns how many. ``enable(model)`` calls it."""
        return trainer_moe.route_routers(self, model)

    def route_moe_experts(self, model) -> int:
        """Replace the forward of every MoE experts module of ``model`` with the engine's expert
        path and slot-order combine (interop/trainer_moe.py); returns how many."""
        return trainer_moe.route_experts(self, model)

    def summary(self) -> str:
        routed = ", ".join(f"{k}={v}" for k, v in sorted(self.routed.items())) or "none"
        fallback = ", ".join(f"{k}={v}" for k, v in sorted(self.fallbacks.items())) or "none"
        return f"trainer mode routed: {routed}; torch fallbacks: {fallback}"


def _set_attn_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name


def recompute_inv_freq(config, rotary, architecture: str | None = None) -> tuple[torch.Tensor, float]:
    """The engine's own inverse frequencies (jengine/models/layers/rope.py) for this model's rotary.

    They are HF's ``ROPE_INIT_FUNCTIONS`` as torch evaluates them on the rotary's device, with
    XLA's pow -- computed by the engine's function, so the two sides agree by construction
    whatever the installed transformers does (5.17 builds the default frequencies on the given
    device, 5.24 on the CPU, where trainer mode does not route pow).
    """
    from jengine.models.config import ModelConfig
    from jengine.models.layers.rope import inv_freq_and_scaling

    d = config.to_dict()
    if not d.get("architectures") and architecture:
        d["architectures"] = [architecture]
    cfg = ModelConfig.from_hf_dict(d)
    where = "cpu" if rotary.inv_freq.device.type == "cpu" else "device"
    inv_freq, scaling = inv_freq_and_scaling(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                             cfg.max_position_embeddings, frequency_device=where,
                                             ramp_device="cpu")
    return torch.from_numpy(inv_freq).to(rotary.inv_freq.device), scaling


def register_twin_attention(table: TwinTable) -> None:
    """Register the dense-causal attention twin (and a causal mask builder) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sliding_window=None, **kwargs):
        """query [B, Hq, S, D], key/value [B, Hkv, S, D] -> ([B, S, Hq, D], None)."""
        if dropout:
            raise ValueError(f"trainer mode attention: dropout={dropout} is not supported")
        if sliding_window:
            raise ValueError(f"trainer mode attention: sliding_window={sliding_window} is not supported")
        if key.shape[2] != query.shape[2]:
            raise ValueError(f"trainer mode attention needs the whole sequence at once (no KV "
                             f"cache): query length {query.shape[2]}, key length {key.shape[2]}")
        _check_causal_mask(attention_mask, query.shape[2])
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return twin_attention(table.attention, q, k, v, scale=float(scaling)), None

    AttentionInterface.register(ATTENTION_NAME, attention)
    # A mask builder under the same name, so a padded or packed batch reaches the twin as a mask
    # it can refuse (a name without one gets no mask at all).
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def _check_causal_mask(mask, length: int) -> None:
    if mask is None:
        return
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    m = mask if mask.dtype == torch.bool else mask == 0
    if m.dim() != 4 or not bool((m == causal).all()):
        raise ValueError("trainer mode attention supports unpadded causal sequences only (got a "
                         "padding or packing mask); run one sequence per forward")


def enable(model: Any = None, *, device: str | None = None) -> TrainerMode:
    """Route torch's ops to the engine's leaf twins. Returns the installed mode (a context manager).

    ``model``: an HF ``*ForCausalLM`` to prepare too (twin attention, recomputed rotary inv_freq).
    ``device``: "cpu" or "cuda"; defaults to the model's device, else "cpu".
    """
    global _ACTIVE
    fmt = "bf16"
    if model is not None:
        param = next(model.parameters())
        device = device or param.device.type
        fmt = "f32" if param.dtype == torch.float32 else "bf16"
    device = device or "cpu"
    ensure_xla_environment()
    table = plan_twin_table(device, fmt)
    with _LOCK:
        if _ACTIVE is not None:
            raise RuntimeError("trainer mode is already enabled; call disable() first")
        mode = TrainerMode(table, model)
        mode.install()
        _ACTIVE = mode
    return mode


def disable() -> None:
    """Undo ``enable()``: torch's own kernels and the model's own attention and rotary come back."""
    global _ACTIVE
    with _LOCK:
        mode, _ACTIVE = _ACTIVE, None
    if mode is not None:
        mode.uninstall()


def active() -> TrainerMode | None:
    return _ACTIVE


def ensure_xla_environment() -> None:
    """The twins must run under the XLA flags the engine's rl-bitwise launch uses.

    Before JAX's backend starts, set them (resolving an rl-bitwise launch, as the engine does);
    afterwards, check they are already in effect and refuse otherwise.
    """
    from jengine.config import LaunchConfig
    from jengine.numerics import resolve_launch

    resolved = resolve_launch(LaunchConfig(numerics="rl-bitwise"))
    try:
        resolved.apply_environment()
    except RuntimeError as e:
        raise TwinError(f"trainer mode: {e}") from e
