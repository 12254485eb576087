"""Launch configuration: one frozen dataclass, one argparse builder, one resolution step.

Every entrypoint (CLI, `Engine(...)`, the server) builds a `LaunchConfig` from the same fields, then
calls `resolve_launch` (jengine.numerics) exactly once, before JAX initialises its backend. Layers
that read a resolved switch trust it; closed-set switches are validated here, once.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from jengine.logprob_orders import LOGPROB_ORDERS

# Closed sets of every switch. The spec names the CUDA-engine values; where the choice is "host vs
# accelerator" jengine says "device" instead of "cuda" (docs/numerics.md has the mapping).
CHOICES: dict[str, tuple[str, ...]] = {
    "numerics": ("auto", "rl-bitwise"),  # plugins may add more (jengine.numerics.register_numerics_envelope)
    "sampling_stream": ("batch", "per-request"),
    "logprob_order": tuple(LOGPROB_ORDERS),
    "layer_boundary_norm": ("fused", "unfused"),
    "router_topk": ("auto", "torch"),
    "moe_combine_order": ("rank", "slot"),
    "dsa_slot_order": ("sorted", "selection"),
    "yarn_ramp_mask_device": ("cpu", "device"),
    "yarn_frequency_device": ("cpu", "device"),
    "mla_lora_scale": ("folded", "runtime"),
    "moe_backend": ("auto", "batch_invariant", "portable"),
    "sampling_backend": ("canonical", "portable"),
    "attention_backend": ("auto", "batch_invariant", "portable"),
    "dtype": ("auto", "bfloat16", "float32"),
    "tp_batch_invariant": ("off", "attn", "all"),
    "log_level": ("debug", "info", "warning", "error", "critical"),
}


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class LaunchConfig:
    # -- model ----------------------------------------------------------------------------------
    model_path: str = _opt("tiny", "HF-format model directory, or 'tiny' for the embedded model")
    dtype: str = _opt("auto", "activation/weight dtype; auto = the checkpoint's torch_dtype")
    context_length: int | None = _opt(None, "max tokens per request (default: the model's)")

    # -- numerics envelope and its switches (None = not given explicitly) ------------------------
    numerics: str = _opt("auto", "numerical contract: auto, or rl-bitwise (bitwise run/batch "
                         "invariance + trainer alignment)")
    sampling_stream: str | None = _opt(None, "batch: one key per step; per-request: draws keyed "
                                       "by (request seed, absolute position)")
    logprob_order: str | None = _opt(None, "selected-token logprob arithmetic")
    layer_boundary_norm: str | None = _opt(None, "fused add+norm (fp32 sum) or unfused "
                                           "(bf16 residual materialised, then RMSNorm)")
    router_topk: str | None = _opt(None, "MoE router top-k form (MoE families)")
    moe_combine_order: str | None = _opt(None, "MoE combine fold order (MoE families)")
    dsa_slot_order: str | None = _opt(None, "sparse-attention reduction order (DSA families)")
    yarn_ramp_mask_device: str | None = _opt(None, "where the YaRN linear ramp is built")
    yarn_frequency_device: str | None = _opt(None, "where YaRN powers/interpolation are computed")
    mla_lora_scale: str | None = _opt(None, "MLA LoRA norm scale: folded into weights or runtime")
    moe_backend: str | None = _opt(None, "MoE expert backend")
    sampling_backend: str | None = _opt(None, "sampler backend (canonical = lowest-index greedy ties)")
    attention_backend: str | None = _opt(None, "attention leaf selection")
    batch_invariant_collectives: bool | None = _opt(None, "every reduction = all-gather + "
                                                    "rank-ordered fp32 fold", flag=True)
    force_deterministic_rsag: bool | None = _opt(None, "collectives on the plain path only", flag=True)
    tp_batch_invariant: str | None = _opt(None, "decode layer without cross-rank sums outside MoE")
    enable_eplb: bool | None = _opt(None, "online expert rebalancing (MoE families)", flag=True)
    disable_autotune: bool | None = _opt(None, "no shape-dependent tactic choice", flag=True)
    disable_pdl: bool | None = _opt(None, "no programmatic dependent launch: each of XLA's "
                                    "kernels starts after the one before it has finished",
                                    flag=True)
    deterministic_ops: bool | None = _opt(None, "XLA deterministic ops flags", flag=True)
    quantization: str | None = _opt(None, "checkpoint quantization (none supported under bitwise)")

    # -- parallelism (docs/parallelism.md; sizes other than tp_size must be 1 for now) ----------
    tp_size: int = _opt(1, "tensor parallel size")
    dp_size: int = _opt(1, "data-parallel replicas behind one server, each on its own "
                        "--tp-size devices (docs/serving.md)")
    ep_size: int = _opt(1, "expert parallel size (MoE families)")
    ep_num_redundant_experts: int = _opt(0, "--enable-eplb: physical expert slots beyond the "
                                         "logical experts (E + R slots per MoE layer, a multiple "
                                         "of --ep-size)")
    init_expert_location: str = _opt("trivial", "--enable-eplb: the initial placement, 'trivial' "
                                     "(slot j holds expert j mod E) or a JSON file "
                                     "{\"physical_to_logical\": [[...] per layer]}")
    eplb_rebalance_num_iterations: int = _opt(0, "--enable-eplb: rebalance the experts every N "
                                              "steps from the load measured since the last "
                                              "(0: only when Engine.rebalance_experts() is called)")
    moe_tp_size: int = _opt(1, "MoE tensor parallel size")

    # -- scheduler and memory ------------------------------------------------------------------
    page_size: int = _opt(16, "tokens per KV page")
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens (default: from memory)")
    chunked_prefill_size: int = _opt(256, "max prefill tokens per request per step")
    max_prefill_tokens: int = _opt(512, "token budget of one step (prefill + decode)")
    max_running_requests: int = _opt(32, "max requests in the running set")
    input_logprob_chunk_tokens: int = _opt(64, "rows per prompt-logprob chunk (bounds [rows, vocab])")
    disable_radix_cache: bool = _opt(False, "turn the token-level prefix cache off", flag=True)
    debug_force_retraction_interval: int = _opt(0, "retract every running request every N steps "
                                                "(negative: also mid-prefill); 0 = off")
    skip_warmup: bool = _opt(False, "do not compile the shape buckets at startup", flag=True)
    disable_overlap_schedule: bool = _opt(False, "resolve each step before scheduling the next "
                                          "(the overlap schedule builds step N+1 while step N "
                                          "runs; docs/engine.md)", flag=True)
    output_hold_ms: float = _opt(20.0, "how long a step's outputs may wait (the output "
                                 "processor, a server's stream wake-ups) while the engine thread "
                                 "schedules and dispatches -- host work the device waits on -- to "
                                 "be delivered in its device wait instead; 0: at once "
                                 "(jengine/engine/host_gate.py)")

    # -- server ----------------------------------------------------------------------------------
    host: str = _opt("127.0.0.1", "bind address (loopback by default)")
    port: int = _opt(30000, "port")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' on every route but /health")
    served_model_name: str | None = _opt(None, "model name reported by /v1/models")
    log_level: str = _opt("info", "log level of jengine's loggers (and the server's)")

    def replace(self, **changes) -> "LaunchConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate_choices(cfg: LaunchConfig, extra_numerics: tuple[str, ...] = ()) -> None:
    """Validate every closed-set switch once. Errors name the field and the value."""
    for name, allowed in CHOICES.items():
        value = getattr(cfg, name)
        if value is None:
            continue
        if name == "numerics":
            allowed = allowed + tuple(extra_numerics)
        if value not in allowed:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} is not one of {list(allowed)}")
    for name in ("page_size", "chunked_prefill_size", "max_prefill_tokens",
                 "max_running_requests", "input_logprob_chunk_tokens", "tp_size", "dp_size",
                 "ep_size", "moe_tp_size"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
    for name in ("ep_num_redundant_experts", "eplb_rebalance_num_iterations"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} must be an integer >= 0")
    hold = cfg.output_hold_ms
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= 1000:
        raise ValueError(f"--output-hold-ms={hold!r} must be a number of milliseconds in [0, 1000]")
    if cfg.max_total_tokens is not None and cfg.max_total_tokens < cfg.page_size:
        raise ValueError(f"--max-total-tokens={cfg.max_total_tokens} is smaller than one page "
                         f"(--page-size={cfg.page_size})")


class LaunchRefusal(ValueError):
    """A launch option jengine accepts by name but cannot honour: refused with the reason, never
    silently run without it (numerics.NumericsRefusal is the envelopes' kind)."""


# Parallel sizes not implemented yet: a larger one would be accepted and silently served without it.
# (--tp-size, --ep-size and --dp-size are served: jengine/engine/model_runner.py,
# jengine/server/replicas.py; docs/parallelism.md.)
PARALLEL_SIZES = ("moe_tp_size",)


def refuse_inert_options(cfg: LaunchConfig) -> None:
    """Refuse every option value that would change nothing (resolve_launch calls this once)."""
    for name in PARALLEL_SIZES:
        value = getattr(cfg, name)
        if value != 1:
            raise LaunchRefusal(f"--{name.replace('_', '-')} {value}: not implemented yet (only "
                                "--tp-size, --ep-size and --dp-size may be larger than 1; "
                                "docs/parallelism.md)")
    if cfg.quantization not in (None, "", "none"):
        raise LaunchRefusal(f"--quantization {cfg.quantization}: jengine has no quantized "
                            "execution; the weights run in --dtype")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Every LaunchConfig field becomes --kebab-case, with its help text and choices."""
    for f in fields(LaunchConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if f.metadata.get("flag"):
            parser.add_argument(flag, dest=f.name, action="store_true", default=f.default, help=help_)
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_}
        if f.name in CHOICES and f.name != "numerics":
            kw["choices"] = CHOICES[f.name]
        typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
        if "int" in typ:
            kw["type"] = int
        elif "float" in typ:
            kw["type"] = float
        parser.add_argument(flag, **kw)
    parser.add_argument("--model", dest="model_path", default=argparse.SUPPRESS,
                        help="alias of --model-path")


def launch_config_from_args(args: argparse.Namespace) -> LaunchConfig:
    names = {f.name for f in fields(LaunchConfig)}
    return LaunchConfig(**{k: v for k, v in vars(args).items() if k in names})


def launch_config_from_kwargs(model_path: str = "tiny", **kwargs) -> LaunchConfig:
    """`Engine(model_path=..., numerics=..., **launch_options)` -> LaunchConfig, naming bad keys."""
    names = {f.name for f in fields(LaunchConfig)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"unknown launch option(s) {unknown}; see `jengine serve --help`")
    return LaunchConfig(model_path=model_path, **kwargs)
