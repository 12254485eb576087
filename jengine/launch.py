"""The launch, resolved once and split into the parts each layer is handed.

    argv / Engine(**options) -> LaunchConfig                      jengine/config.py
      -> resolve_launch: envelope, pins, XLA environment          jengine/numerics.py   (once)
      -> the checkpoint's ModelConfig                             jengine/models/loader.py
      -> plan_launch(resolved, model_config) -> LaunchPlan                              (once)
           .model      ModelOptions     the runner's model: dtype, kernel request, forward switches
           .kv         KVPoolConfig     pool size in pages, page size, context
           .runner     RunnerConfig     model + kv + the step's token budget
           .scheduler  SchedulerConfig  batching and the prefix cache
           .sampler    SamplerOptions   logprob order, kernel request
           .server     ServerOptions    bind address, key, names

Everything that needs both the launch and the model is decided here and nowhere else: the model's
dtype, whether the envelope can serve it (`check_model`), launch switches that would have no effect
on this model (refused, naming the switch and the reason), and the KV pool's size. Each part is
frozen and small; no layer below reads the LaunchConfig or the ResolvedLaunch, so following a value
from argv leads down, never back up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jengine.config import LaunchRefusal
from jengine.logprob_orders import LOGPROB_ORDERS
from jengine.models.family import MoEOptions
from jengine.engine.scheduler import SchedulerConfig
from jengine.numerics import SWITCH_DEFAULTS, ResolvedLaunch, check_model

DEFAULT_MAX_TOTAL_TOKENS = 65536

_DTYPES = ("bfloat16", "float32", "float16")


@dataclass(frozen=True)
class ModelOptions:
    """What the runner needs to build and plan the model."""

    dtype: str                     # "bfloat16", "float32", "float16": the launch's, else the checkpoint's
    hardware: str                  # kernel planning: xla_environment.HARDWARE_KINDS
    required_features: frozenset[str]
    layer_boundary_norm: str       # "fused" / "unfused"
    rope_frequency_device: str     # --yarn-frequency-device: where RoPE frequencies are computed
    rope_ramp_device: str          # --yarn-ramp-mask-device: where the YaRN ramp is built
    moe: MoEOptions | None = None  # --router-topk, --moe-combine-order (MoE models only)
    # --mla-lora-scale: "runtime" / "folded" (models with MLA LoRA norm scales only, else None)
    mla_lora_scale: str | None = None


@dataclass(frozen=True)
class KVPoolConfig:
    page_size: int
    num_pages: int                 # including the null page
    max_context: int               # tokens of one request, prompt + output

    @property
    def capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_context // self.page_size)


@dataclass(frozen=True)
class RunnerConfig:
    model: ModelOptions
    kv: KVPoolConfig
    max_step_tokens: int           # the largest token bucket a step can need
    tp_size: int = 1                           # the "tensor" mesh axis
    batch_invariant_collectives: bool = False  # the row-parallel sums' route (sharding.collectives)
    tp_batch_invariant: str = "off"            # the reduction sites' layout (sharding/rules.py)
    # The logprob order's block width (None: the whole row, "torch"): under TP the LM head is padded
    # so each rank holds whole blocks, and the step scores without gathering logits.
    logprob_block_width: int | None = None
    ep_size: int = 1                           # the "expert" mesh axis (MoE families)
    eplb: "EPLBOptions | None" = None           # --enable-eplb (sharding/eplb.py), else None


@dataclass(frozen=True)
class EPLBOptions:
    """--enable-eplb's part of the runner (sharding/eplb.py)."""
    num_physical: int              # P = E + --ep-num-redundant-experts slots per MoE layer
    init_location: str             # --init-expert-location
    rebalance_interval: int        # --eplb-rebalance-num-iterations (0: on request only)


@dataclass(frozen=True)
class SamplerOptions:
    logprob_order: str
    hardware: str
    required_features: frozenset[str]


@dataclass(frozen=True)
class ServerOptions:
    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    log_level: str


@dataclass(frozen=True)
class LaunchPlan:
    resolved: ResolvedLaunch       # reported by /get_server_info; not read below the engine
    runner: RunnerConfig
    scheduler: SchedulerConfig
    sampler: SamplerOptions
    server: ServerOptions
    input_logprob_chunk_tokens: int
    overlap_schedule: bool = True  # schedule step N+1 while step N runs (docs/engine.md)
    output_hold_s: float = 0.02  # jengine/engine/host_gate.py

    @property
    def model(self) -> ModelOptions:
        return self.runner.model

    @property
    def kv(self) -> KVPoolConfig:
        return self.runner.kv


def model_dtype_name(launch_dtype: str, checkpoint_dtype: str | None) -> str:
    name = (checkpoint_dtype or "bfloat16") if launch_dtype == "auto" else launch_dtype
    if name not in _DTYPES:
        raise LaunchRefusal(f"dtype={name!r} is not supported (supported: {sorted(_DTYPES)})")
    return name


def _is_moe(m, launch) -> bool:
    return m.num_experts > 0


def _multi_device(m, launch) -> bool:
    # Not dp_size: a data-parallel replica computes alone; no collective crosses replicas.
    return any(getattr(launch, n) > 1 for n in ("tp_size", "ep_size", "moe_tp_size"))


# Switches that act only on some models or launches. Set explicitly to a value other than its
# default where it cannot act, a switch would be accepted and do nothing, so it is refused with the
# reason. An envelope's pins are not "given" (ResolvedLaunch.given), so they never trip this.
_APPLIES_TO: dict[str, tuple[str, Any]] = {
    "router_topk": ("MoE models", _is_moe),
    "moe_combine_order": ("MoE models", _is_moe),
    "moe_backend": ("MoE models", _is_moe),
    "enable_eplb": ("expert-parallel MoE launches (--ep-size > 1)",
                    lambda m, launch: _is_moe(m, launch) and launch.ep_size > 1),
    "mla_lora_scale": ("MLA models with LoRA norm scales (LongCat-Flash)",
                       lambda m, launch: getattr(m, "mla_lora_scale", False)),
    "dsa_slot_order": ("DeepSeek sparse-attention models (none is implemented)",
                       lambda m, launch: False),
    "yarn_ramp_mask_device": ("YaRN rope scaling",
                              lambda m, launch: (m.rope_scaling or {}).get("rope_type") == "yarn"),
    "batch_invariant_collectives": ("multi-device launches", _multi_device),
    "force_deterministic_rsag": ("multi-device launches", _multi_device),
    "tp_batch_invariant": ("multi-device launches", _multi_device),
    # The per-request stream costs what one batch key costs in JAX, so it is the only one built.
    "sampling_stream": ("engines with a batch-keyed sampler (jengine draws per-request streams "
                        "only, keyed by seed and position)", lambda m, launch: False),
}


def refuse_inert_switches(resolved: ResolvedLaunch, model_config: Any) -> None:
    for name in sorted(resolved.given & set(_APPLIES_TO)):
        value = getattr(resolved.config, name)
        what, applies = _APPLIES_TO[name]
        if value != SWITCH_DEFAULTS[name] and not applies(model_config, resolved.config):
            raise LaunchRefusal(f"--{name.replace('_', '-')} {value} has no effect on "
                                f"{model_config.architecture} with this launch: it acts on {what} "
                                "only; drop it")


_EPLB_ONLY = {"ep_num_redundant_experts": 0, "init_expert_location": "trivial",
              "eplb_rebalance_num_iterations": 0}


def _eplb_options(launch, model_config) -> EPLBOptions | None:
    if not launch.enable_eplb:
        for name, default in _EPLB_ONLY.items():
            value = getattr(launch, name)
            if value != default:
                raise LaunchRefusal(f"--{name.replace('_', '-')} {value} has no effect on "
                                    f"{model_config.architecture} with this launch: it acts with "
                                    "--enable-eplb only; drop it")
        return None
    physical = model_config.num_experts + launch.ep_num_redundant_experts
    if physical % launch.ep_size:
        raise LaunchRefusal(f"--ep-num-redundant-experts {launch.ep_num_redundant_experts}: "
                            f"num_experts {model_config.num_experts} + "
                            f"{launch.ep_num_redundant_experts} = {physical} physical slots do not "
                            f"split evenly over --ep-size {launch.ep_size}")
    return EPLBOptions(num_physical=physical, init_location=launch.init_expert_location,
                       rebalance_interval=launch.eplb_rebalance_num_iterations)


def plan_launch(resolved: ResolvedLaunch, model_config: Any) -> LaunchPlan:
    """Check the model against the launch (once) and split the launch into its parts."""
    check_model(resolved, model_config)
    refuse_inert_switches(resolved, model_config)
    launch = resolved.config
    if launch.ep_size > 1 and not _is_moe(model_config, launch):
        raise LaunchRefusal(f"--ep-size {launch.ep_size} has no effect on "
                            f"{model_config.architecture}: it splits a MoE model's experts")
    if launch.ep_size > 1 and getattr(model_config, "zero_expert_num", 0):
        raise LaunchRefusal(f"--ep-size {launch.ep_size}: {model_config.architecture} has "
                            f"zero_expert_num={model_config.zero_expert_num} identity experts, whose "
                            "residual has no expert-parallel form yet; launch with --ep-size 1")
    eplb = _eplb_options(launch, model_config)
    model = ModelOptions(
        dtype=model_dtype_name(launch.dtype, model_config.torch_dtype),
        hardware=resolved.hardware, required_features=frozenset(resolved.required_features),
        layer_boundary_norm=launch.layer_boundary_norm,
        rope_frequency_device=launch.yarn_frequency_device,
        rope_ramp_device=launch.yarn_ramp_mask_device,
        moe=MoEOptions(router_topk=launch.router_topk or SWITCH_DEFAULTS["router_topk"],
                       combine_order=launch.moe_combine_order
                       or SWITCH_DEFAULTS["moe_combine_order"],
                       backend=launch.moe_backend or SWITCH_DEFAULTS["moe_backend"])
        if _is_moe(model_config, launch) else None,
        mla_lora_scale=(launch.mla_lora_scale or SWITCH_DEFAULTS["mla_lora_scale"])
        if getattr(model_config, "mla_lora_scale", False) else None)
    max_context = min(launch.context_length or model_config.max_position_embeddings,
                      model_config.max_position_embeddings)
    total_tokens = launch.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS
    kv = KVPoolConfig(page_size=launch.page_size,
                      num_pages=total_tokens // launch.page_size + 1,  # + the null page
                      max_context=max_context)
    scheduler = SchedulerConfig(
        page_size=kv.page_size, max_context=kv.max_context,
        chunked_prefill_size=launch.chunked_prefill_size,
        max_prefill_tokens=launch.max_prefill_tokens,
        max_running_requests=launch.max_running_requests,
        enable_prefix_cache=not launch.disable_radix_cache,
        debug_force_retraction_interval=launch.debug_force_retraction_interval)
    return LaunchPlan(
        resolved=resolved,
        runner=RunnerConfig(model=model, kv=kv,
                            max_step_tokens=launch.max_prefill_tokens + launch.max_running_requests,
                            tp_size=launch.tp_size,
                            batch_invariant_collectives=bool(launch.batch_invariant_collectives),
                            tp_batch_invariant=launch.tp_batch_invariant,
                            logprob_block_width=LOGPROB_ORDERS[launch.logprob_order][0],
                            ep_size=launch.ep_size, eplb=eplb),
        scheduler=scheduler,
        sampler=SamplerOptions(logprob_order=launch.logprob_order, hardware=resolved.hardware,
                               required_features=frozenset(resolved.required_features)),
        server=ServerOptions(host=launch.host, port=launch.port, api_key=launch.api_key,
                             served_model_name=launch.served_model_name,
                             log_level=launch.log_level),
        input_logprob_chunk_tokens=launch.input_logprob_chunk_tokens,
        overlap_schedule=not launch.disable_overlap_schedule,
        output_hold_s=float(launch.output_hold_ms) / 1e3)
