"""What a model family declares (sglang-jax's EntryClass): one `ModelFamily` per HF architecture.

A family owns what is particular to it: how its config.json reads (`parse_config`: the fields that
differ between families), its checkpoint name map (`checkpoint_name`: model parameter path -> HF
tensor name), its profile (the numerics envelopes it has been verified under), and, through its
`body` module, its parameters, KV cache spec, kernel-plan set and forward. The runner and the
loader know only the registry (jengine/models/registry.py).

This module and the family modules import nothing heavy: config parsing and the numerics checks
run before JAX starts. The body module (flax, the kernel leaves) is imported on first use.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class ModelProfile:
    architecture: str  # the Hugging Face class name in config.json "architectures"
    numerics_envelopes: frozenset[str] = frozenset()
    notes: str = ""


@dataclass(frozen=True)
class MoEOptions:
    """The launch's MoE switches a MoE body plans with (jengine.launch sets them for MoE models
    only; a dense body never sees them)."""

    router_topk: str = "auto"       # --router-topk: "auto" (the registry's first) or a leaf name
    combine_order: str = "rank"     # --moe-combine-order: "rank" or "slot"
    backend: str = "auto"           # --moe-backend: "batch_invariant", "portable" or "auto"


@dataclass(frozen=True)
class ModelFamily:
    architecture: str                   # HF class name in config.json "architectures"
    model_type: str                     # config.json "model_type", used when architectures is null
    profile: ModelProfile
    parse_config: Callable[[Mapping[str, Any]], dict]  # config.json -> family-specific fields
    checkpoint_name: Callable[[Any, str], str]         # (config, parameter path) -> HF tensor name
    body: str                           # module: param_specs, kv_cache_spec, ModelKernels, Model
    # (config, checkpoint reader) -> a reader naming the tensors as checkpoint_name does, for a
    # family whose checkpoints come in another layout too (Qwen3-MoE: transformers 5's fused
    # experts); None: the names are read as they are.
    checkpoint_view: Callable[[Any, Any], Any] | None = None

    def _body(self):
        return importlib.import_module(self.body)

    def param_specs(self, cfg, *, dtype) -> dict:
        """Every parameter's `ParamSpec` (path -> spec), from the config alone: nothing loads."""
        return self._body().param_specs(
            cfg, dtype=dtype, checkpoint_name=lambda path: self.checkpoint_name(cfg, path))

    def read_checkpoint(self, cfg, reader):
        """`reader` (a checkpoint, or a weight update's tensors) named as `param_specs` reads it."""
        return reader if self.checkpoint_view is None else self.checkpoint_view(cfg, reader)

    def kv_cache_spec(self, cfg):
        return self._body().kv_cache_spec(cfg)

    def plan_kernels(self, *, moe: MoEOptions | None = None, kv_lora_rank: int | None = None,
                     **kwargs):
        """The family's kernel-plan set, planned once (e.g. `ModelKernels.plan_for`); `moe`
        (MoE models only) and `kv_lora_rank` (MLA models only) reach the body's planner when
        given."""
        if moe is not None:
            kwargs["moe"] = moe
        if kv_lora_rank:
            kwargs["kv_lora_rank"] = kv_lora_rank
        return self._body().ModelKernels.plan_for(**kwargs)

    def build(self, cfg, source, *, dtype, kernels, **options):
        """The model, its parameters filled by `source` (jengine/models/layers/param.py)."""
        return self._body().Model(cfg, self.param_specs(cfg, dtype=dtype), source, dtype=dtype,
                                  kernels=kernels, **options)


def int_field(d: Mapping[str, Any], name: str, default: Any, *, minimum: int,
              architecture: str) -> int:
    """config.json's integer `name` (or `default`), refused below `minimum` or when not an int."""
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum} for {architecture}")
    return value


def hf_decoder_name(cfg, path: str) -> str:
    """The HF *ForCausalLM naming shared by the Llama-style families: the decoder under "model.",
    the head at the top level, or the embedding when the config ties them (the head's spec then
    keeps the first vocab_size rows)."""
    if path == "lm_head.weight":
        return "model.embed_tokens.weight" if cfg.tie_word_embeddings else path
    return f"model.{path}"


_EXPERT_PARAM = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


def hf_moe_decoder_name(cfg, path: str) -> str:
    """`hf_decoder_name`, with a layer's stacked expert weights named by their per-expert tensors
    ("{}" = the expert): `model.layers.{l}.mlp.experts.{e}.gate_proj.weight`, what
    `save_pretrained` writes and released checkpoints hold (Qwen3-MoE, DeepSeek-V3)."""
    m = _EXPERT_PARAM.match(path)
    if m:
        return f"model.{m.group(1)}.{{}}.{m.group(2)}.weight"
    return hf_decoder_name(cfg, path)


def hf_fused_experts_view(cfg, reader):
    """`reader` with transformers 5's fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) named per expert, as `hf_moe_decoder_name` reads them
    (jengine/models/fused_experts.py)."""
    from jengine.models.fused_experts import per_expert_view

    return per_expert_view(reader, num_experts=cfg.num_experts,
                           intermediate_size=cfg.moe_intermediate_size,
                           hidden_size=cfg.hidden_size)


_MOE_MLA_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "kv_lora_rank",
                 "q_lora_rank")


def require_silu(d: Mapping[str, Any]) -> None:
    """Every body's MLPs are SwiGLU: refuse another activation rather than compute the wrong one."""
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act={hidden_act!r} is not supported (supported: 'silu')")


def dense_config_rules(d: Mapping[str, Any], architecture: str) -> None:
    """Options a dense family's config may carry but the dense body does not implement: refuse,
    don't ignore. MoE/MLA keys belong to other families; read as dense, such a checkpoint would be
    served as a different model."""
    require_silu(d)
    if d.get("mlp_bias"):
        raise ValueError(f"mlp_bias={d.get('mlp_bias')!r} is not supported for {architecture}")
    if d.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported (sliding-window attention is "
                         f"not implemented; sliding_window={d.get('sliding_window')!r})")
    for key in _MOE_MLA_KEYS:
        if d.get(key):
            raise ValueError(f"{key}={d[key]!r} in config.json, but {architecture} is a dense "
                             "family (no experts, no latent attention)")
