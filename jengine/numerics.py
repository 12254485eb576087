"""Numerics envelopes: `--numerics {auto, rl-bitwise}` and the switches it keeps coherent.

Read with docs/numerics.md (the spec's hierarchy with jengine's option names). The shape:

* Every switch is its own launch option (jengine.config.LaunchConfig); ``None`` means "not given".
* An envelope is a policy object: a name, a bitwise flag, a launch resolver and a checkpoint
  validator. ``resolve_launch`` runs once, before JAX initialises its backend: the envelope's
  resolver tightens the switches it governs; then, for every envelope in ``BITWISE_ENVELOPES``, the
  run/batch-invariance pins are applied (the kernels, sampling and collectives layers); then every
  switch still unset takes its own default. The envelope only ever tightens: an explicit choice it
  cannot tighten is refused with the reason (``NumericsRefusal``), never silently kept.
* Selection points test ``numerics in BITWISE_ENVELOPES``, never the name, so a plugin envelope
  registered above rl-bitwise inherits every pin.
* What needs the model (its dtype on a GPU, quantization, the model profile) is checked once,
  when the model is constructed: ``check_model``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from jengine import xla_environment
from jengine.config import CHOICES, LaunchConfig, LaunchRefusal, refuse_inert_options, validate_choices
from jengine.profiles import PROFILES, ModelProfile

logger = logging.getLogger("jengine.numerics")


# Each switch's own default: what `auto` leaves it at.
SWITCH_DEFAULTS: dict[str, Any] = {
    # Per-request streams are our default even under auto: in JAX a key derived from (seed,
    # position) costs the same as one batch key (fold_in is a few integer ops per row), so there
    # is no speed to buy with the batch stream and its draws would move with the co-batch.
    "sampling_stream": "per-request",
    "logprob_order": "torch",
    "layer_boundary_norm": "fused",
    "router_topk": "auto",
    "moe_combine_order": "rank",
    "dsa_slot_order": "sorted",
    "yarn_ramp_mask_device": "device",
    "yarn_frequency_device": "device",
    "mla_lora_scale": "folded",
    "moe_backend": "auto",
    "sampling_backend": "canonical",
    "attention_backend": "auto",
    "batch_invariant_collectives": False,
    "force_deterministic_rsag": False,
    "tp_batch_invariant": "off",
    "enable_eplb": False,
    "disable_autotune": False,
    "disable_pdl": False,
    "deterministic_ops": False,
}
SWITCHES = tuple(SWITCH_DEFAULTS)


class NumericsRefusal(LaunchRefusal):
    """A launch or a model the envelope cannot honour. The message names the rule and the values."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class NumericsEnvelope:
    """One numerical contract. Plugins build one and call ``register_numerics_envelope``.

    resolve_launch(cfg) -> cfg: sets the switches this envelope governs (``None`` = not given
        explicitly) and raises NumericsRefusal for an explicit choice it cannot tighten.
    validate_checkpoint(resolved, model_config, profile) -> list of violated rules (strings).
    """

    name: str
    bitwise: bool
    resolve_launch: Callable[[LaunchConfig], LaunchConfig]
    validate_checkpoint: Callable[["ResolvedLaunch", Any, ModelProfile | None], list[str]]
    # Launching the envelope refuses a model whose profile does not list it. Every envelope but
    # auto (spec: "Every policy still passes the model profile gate").
    require_verified_numerics: bool = True
    description: str = ""


# -- the built-in envelopes ----------------------------------------------------------------------


class _Tightener:
    """Applies an envelope's tight values to a LaunchConfig, logging each explicit choice it moves."""

    def __init__(self, cfg: LaunchConfig, envelope: str) -> None:
        self.cfg, self.envelope, self.changes = cfg, envelope, {}

    def set(self, name: str, tight: Any) -> None:
        given = getattr(self.cfg, name)
        if given is not None and given != tight:
            logger.info("--numerics %s tightens %s %s -> %s", self.envelope, _flag(name), given, tight)
        self.changes[name] = tight

    def refuse_if(self, name: str, bad: Any, reason: str) -> None:
        if getattr(self.cfg, name) == bad:
            raise NumericsRefusal(f"--numerics {self.envelope} refuses {_flag(name)} {bad}: {reason}")

    def result(self) -> LaunchConfig:
        return dataclasses.replace(self.cfg, **self.changes)


# alignment.trainer: the trainer's operation order, one switch at a time (spec table).
RL_BITWISE_ALIGNMENT = {
    "layer_boundary_norm": "unfused",
    "router_topk": "torch",
    "moe_combine_order": "slot",
    "dsa_slot_order": "selection",  # overrides an explicit sorted (spec)
    "yarn_ramp_mask_device": "cpu",
    "yarn_frequency_device": "device",  # overrides an explicit cpu (spec)
    "mla_lora_scale": "runtime",
}


def resolve_rl_bitwise(cfg: LaunchConfig) -> LaunchConfig:
    """rl-bitwise's launch resolver: trainer alignment plus its launch-level limits.

    Public so a plugin envelope "above" rl-bitwise can start from it.
    """
    t = _Tightener(cfg, cfg.numerics)
    for name, tight in RL_BITWISE_ALIGNMENT.items():
        t.set(name, tight)
    # torch folds to blockwise (the trainer's negative cross-entropy, -0.0 for a certain token);
    # an explicit blockwise variant is already a trainer form and is preserved.
    if cfg.logprob_order in (None, "torch"):
        t.set("logprob_order", "blockwise")
    if cfg.quantization not in (None, "", "none"):
        raise NumericsRefusal(
            f"--numerics {cfg.numerics} refuses --quantization {cfg.quantization}: no "
            "batch-invariant quantized GEMM leaf exists, so its linears would select "
            "shape-dependent ones")
    if cfg.moe_tp_size != 1:
        raise NumericsRefusal(
            f"--numerics {cfg.numerics} refuses --moe-tp-size {cfg.moe_tp_size}: MoE TP must be 1 "
            "(the slot-order MoE combine folds over the EP group inside the leaf)")
    return t.result()


def _validate_rl_bitwise_checkpoint(resolved: "ResolvedLaunch", model_config: Any,
                                    profile: ModelProfile | None) -> list[str]:
    violations = []
    arch = model_config.architecture
    qcfg = model_config.quantization_config
    if qcfg:
        violations.append(
            f"unquantized checkpoints only: {arch} has quantization_config={qcfg!r}, and no "
            "batch-invariant quantized GEMM leaf exists")
    moe_tp = resolved.config.moe_tp_size
    if _is_moe(model_config) and moe_tp != 1:
        violations.append(f"MoE TP 1: {arch} is a MoE model and --moe-tp-size is {moe_tp}")
    dtype = resolved.config.dtype
    if dtype == "auto":
        dtype = model_config.torch_dtype or "bfloat16"
    if resolved.hardware.startswith("gpu") and dtype == "float32":
        # Not verified, so refused rather than served with a silent gap: the f32 Triton RMSNorm's
        # tree is not the trainer twin's (docs/gpu-validation.md), and XLA contracts the f32 RoPE
        # multiply-add into an FMA where torch rounds the product.
        violations.append(
            f"bf16 models only on the GPU: {arch} would run in float32 (--dtype {resolved.config.dtype}"
            f", checkpoint {model_config.torch_dtype}), whose trainer alignment is "
            "not verified on the GPU; serve it with --dtype bfloat16, or under --numerics auto")
    return violations


def _no_checkpoint_rules(resolved, model_config, profile) -> list[str]:
    return []


AUTO = NumericsEnvelope(
    name="auto", bitwise=False, resolve_launch=lambda cfg: cfg,
    validate_checkpoint=_no_checkpoint_rules, require_verified_numerics=False,
    description="every switch at its own default; no bitwise promise")
RL_BITWISE = NumericsEnvelope(
    name="rl-bitwise", bitwise=True, resolve_launch=resolve_rl_bitwise,
    validate_checkpoint=_validate_rl_bitwise_checkpoint,
    description="run invariance + batch invariance + trainer alignment, bitwise")

# Live registries. Plugins change them only through register/unregister (atomic, rolled back).
ENVELOPES: dict[str, NumericsEnvelope] = {AUTO.name: AUTO, RL_BITWISE.name: RL_BITWISE}
BITWISE_ENVELOPES: set[str] = {RL_BITWISE.name}
_BUILTIN = frozenset(ENVELOPES)
_LOCK = threading.RLock()


# -- the bitwise pins: every envelope in BITWISE_ENVELOPES ----------------------------------------


def _apply_bitwise_pins(cfg: LaunchConfig) -> LaunchConfig:
    """Run and batch invariance (kernels, sampling, collectives layers) for any bitwise envelope."""
    t = _Tightener(cfg, cfg.numerics)
    t.refuse_if("sampling_stream", "batch",
                "one key per step moves a request's draws with its co-batch; use per-request")
    t.refuse_if("sampling_backend", "portable",
                "it has no canonical lowest-index greedy tie-break, and exact logit ties happen")
    t.refuse_if("moe_backend", "portable", "it does not declare the batch_invariant feature")
    t.refuse_if("attention_backend", "portable",
                "it does not declare the batch_invariant feature")
    t.set("sampling_stream", "per-request")
    t.set("batch_invariant_collectives", True)
    t.set("disable_autotune", True)
    t.set("disable_pdl", True)
    t.set("deterministic_ops", True)
    cfg = t.result()
    # Online rebalancing makes the expert placement traffic-dependent; only the slot-order combine
    # is placement-independent (spec, "Expert placement and online rebalancing").
    if cfg.enable_eplb and cfg.moe_combine_order in (None, "rank"):
        raise NumericsRefusal(
            f"--numerics {cfg.numerics} refuses --enable-eplb with --moe-combine-order rank: the "
            "rank-order combine makes the output a function of the placement; use slot")
    return cfg


# -- resolution ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedLaunch:
    config: LaunchConfig  # every switch concrete
    envelope: NumericsEnvelope
    bitwise: bool
    required_features: frozenset[str]
    hardware: str
    xla_flags: tuple[str, ...]
    environment: Mapping[str, str] = field(default_factory=dict)  # other env vars set pre-init
    matmul_precision: str | None = None  # jax_default_matmul_precision, or None = leave JAX's
    warnings: tuple[str, ...] = ()
    # The switches the launch set explicitly (not None before resolution): an envelope's pins are
    # not "given", so jengine.launch refuses only a user's switch that has no effect on the model.
    given: frozenset[str] = frozenset()

    def as_dict(self) -> dict[str, Any]:
        """Every launch field with its resolved value, plus the envelope's derived settings."""
        out = self.config.to_dict()
        if out.get("api_key"):
            out["api_key"] = "<set>"  # /get_server_info must not leak it
        out.update(
            envelope=self.envelope.name,
            bitwise=self.bitwise,
            required_features=sorted(self.required_features),
            hardware=self.hardware,
            xla_flags=list(self.xla_flags),
            environment=dict(self.environment),
            matmul_precision=self.matmul_precision or "default",
        )
        return out

    def describe(self) -> str:
        """The startup banner: the envelope and every switch, one per line."""
        lines = [f"numerics envelope: {self.envelope.name} (bitwise={self.bitwise}, "
                 f"hardware={self.hardware})"]
        lines += [f"  {_flag(name):32s} {getattr(self.config, name)}" for name in SWITCHES]
        lines.append(f"  required kernel features         {sorted(self.required_features)}")
        lines.append(f"  XLA_FLAGS                        {' '.join(self.xla_flags) or '(none)'}")
        lines.append(f"  matmul precision                 {self.matmul_precision or 'default'}")
        return "\n".join(lines)

    def apply_environment(self) -> None:
        """Put the XLA flags (and TF32 override) in the environment before JAX's backend starts.

        Idempotent. After the backend is up, XLA no longer reads XLA_FLAGS: then this only succeeds
        if the flags are already there (e.g. a second Engine in the same process).
        """
        current = os.environ.get("XLA_FLAGS", "")
        merged = xla_environment.merge_xla_flags(current, self.xla_flags)
        changes = {k: v for k, v in self.environment.items() if os.environ.get(k) != v}
        if merged.split() != current.split():
            changes["XLA_FLAGS"] = merged
        if changes and xla_environment.backend_initialized():
            raise RuntimeError(
                f"--numerics {self.envelope.name} needs {changes} in the environment before JAX "
                "initialises its backend, but the backend is already up (something created a jax "
                "array first). Resolve the launch and call apply_environment() before any jax "
                "computation, or export these variables before starting Python.")
        os.environ.update(changes)
        if self.matmul_precision is not None:
            import jax

            jax.config.update("jax_default_matmul_precision", self.matmul_precision)


def _resolve_switches(cfg: LaunchConfig) -> tuple[LaunchConfig, NumericsEnvelope]:
    """Steps that need nothing but the launch: validation, envelope, pins, defaults."""
    validate_choices(cfg, extra_numerics=tuple(n for n in ENVELOPES if n not in CHOICES["numerics"]))
    envelope = ENVELOPES[cfg.numerics]
    resolved = envelope.resolve_launch(cfg)
    if not isinstance(resolved, LaunchConfig) or resolved.numerics != cfg.numerics:
        raise TypeError(f"numerics envelope {envelope.name!r}: its resolver must return the "
                        f"LaunchConfig it was given with switches set, got {resolved!r}")
    if resolved.numerics in BITWISE_ENVELOPES:
        resolved = _apply_bitwise_pins(resolved)
    # After the envelope: where it refuses an option for its own lasting reason, that one is shown.
    refuse_inert_options(resolved)
    resolved = dataclasses.replace(resolved, **{n: SWITCH_DEFAULTS[n] for n in SWITCHES
                                                if getattr(resolved, n) is None})
    # The resolver is a plugin's code: check what it wrote too, so downstream can trust it.
    validate_choices(resolved, extra_numerics=(resolved.numerics,))
    return resolved, envelope


def resolve_launch(cfg: LaunchConfig, *, hardware: str | None = None,
                   probe_xla_flags: bool = True) -> ResolvedLaunch:
    """Resolve a launch once. Does not initialise the JAX backend; call apply_environment() next."""
    with _LOCK:
        config, envelope = _resolve_switches(cfg)
    bitwise = config.numerics in BITWISE_ENVELOPES
    hardware = hardware or xla_environment.detect_hardware()
    if hardware not in xla_environment.HARDWARE_KINDS:
        raise ValueError(f"hardware={hardware!r} is not one of {list(xla_environment.HARDWARE_KINDS)}")
    try:
        flags = xla_environment.flags_for(hardware, deterministic_ops=config.deterministic_ops,
                                          disable_autotune=config.disable_autotune,
                                          disable_pdl=config.disable_pdl,
                                          probe=probe_xla_flags)
    except xla_environment.XlaFlagError as e:
        raise NumericsRefusal(f"--numerics {config.numerics}: {e}") from e
    precise = config.deterministic_ops  # "no TF32": f32 matmuls in f32 on every platform
    environment = {"NVIDIA_TF32_OVERRIDE": "0"} if precise and hardware.startswith("gpu") else {}
    return ResolvedLaunch(
        config=config, envelope=envelope, bitwise=bitwise,
        required_features=frozenset({"batch_invariant"}) if bitwise else frozenset(),
        hardware=hardware, xla_flags=flags, environment=environment,
        matmul_precision="highest" if precise else None,
        warnings=_launch_warnings(config, bitwise),
        given=frozenset(n for n in SWITCHES if getattr(cfg, n) is not None))


def _launch_warnings(config: LaunchConfig, bitwise: bool) -> tuple[str, ...]:
    # Spec, "Parallel layouts and the envelope": the layout is the deployment's choice, never
    # folded into the envelope; a bitwise launch is told what it does and does not promise.
    if bitwise and config.tp_size > 1 and config.tp_batch_invariant == "off":
        return (f"--tp-size {config.tp_size} without --tp-batch-invariant: o_proj and down_proj "
                "are row-parallel (a rank-ordered fold), so outputs are run- and batch-invariant "
                "at this TP size only; --tp-batch-invariant all gives the TP1 bits at any TP size",)
    return ()


# -- model construction -----------------------------------------------------------------------------


def check_model(resolved: ResolvedLaunch, model_config: Any, profile: ModelProfile | None = None,
                *, role: str = "target") -> None:
    """Refuse, at model construction, a model the launch's envelope cannot serve.

    Reads model_config.architecture, .vocab_size (the OUTPUT vocabulary), .quantization_config,
    .torch_dtype and .num_experts (jengine.models.config.ModelConfig's fields). ``profile``
    defaults to the architecture's entry in jengine.profiles.PROFILES.
    """
    arch = model_config.architecture
    if profile is None:
        profile = PROFILES.get(arch)
    envelope, violations = resolved.envelope, []
    if envelope.require_verified_numerics:
        listed = sorted(profile.numerics_envelopes) if profile else None
        if profile is None or envelope.name not in profile.numerics_envelopes:
            violations.append(
                f"require_verified_numerics: the {role} model {arch} must list {envelope.name!r} "
                f"in its profile's numerics_envelopes, which are "
                + (f"{listed}" if profile else "absent (no model profile for this architecture)")
                + " -- a model earns an envelope when its invariance and alignment harnesses pass")
    violations += list(envelope.validate_checkpoint(resolved, model_config, profile) or ())
    if violations:
        raise NumericsRefusal(f"--numerics {envelope.name} cannot serve the {role} model {arch}:\n  - "
                              + "\n  - ".join(dict.fromkeys(violations)))


def _is_moe(model_config: Any) -> bool:
    return model_config.num_experts > 0


# -- plugins -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def numerics_plugin(name: str = "plugin"):
    """Everything registered inside rolls back together if the block raises (spec: plugins)."""
    with _LOCK:
        envelopes, bitwise = dict(ENVELOPES), set(BITWISE_ENVELOPES)
        try:
            yield
        except BaseException:
            ENVELOPES.clear(), ENVELOPES.update(envelopes)  # in place: others hold references
            BITWISE_ENVELOPES.clear(), BITWISE_ENVELOPES.update(bitwise)
            logger.error("numerics plugin %s failed; its registrations were rolled back", name)
            raise


def register_numerics_envelope(policy: NumericsEnvelope) -> None:
    """Add an envelope. Atomic: if the policy is malformed or cannot resolve a default launch,
    every shared container is left as it was."""
    if not isinstance(policy, NumericsEnvelope):
        raise TypeError(f"register_numerics_envelope needs a NumericsEnvelope, got {type(policy)}")
    if not isinstance(policy.name, str) or not policy.name or policy.name != policy.name.strip():
        raise ValueError(f"numerics envelope name {policy.name!r} must be a non-empty string")
    if policy.name in _BUILTIN:
        raise ValueError(f"numerics envelope {policy.name!r} is built in and cannot be replaced")
    if not callable(policy.resolve_launch) or not callable(policy.validate_checkpoint):
        raise TypeError(f"numerics envelope {policy.name!r}: resolve_launch and "
                        "validate_checkpoint must be callables")
    with numerics_plugin(policy.name):
        ENVELOPES[policy.name] = policy
        (BITWISE_ENVELOPES.add if policy.bitwise else BITWISE_ENVELOPES.discard)(policy.name)
        _resolve_switches(LaunchConfig(numerics=policy.name))  # must resolve its default launch


def unregister_numerics_envelope(name: str) -> None:
    if name in _BUILTIN:
        raise ValueError(f"numerics envelope {name!r} is built in and cannot be removed")
    with _LOCK:
        ENVELOPES.pop(name, None)
        BITWISE_ENVELOPES.discard(name)


def load_numerics_plugins(group: str = "jengine.plugins") -> list[str]:
    """Run every installed plugin entry point, each rolled back on failure. Call before parsing
    the CLI (plugin discovery precedes CLI choices and launch validation)."""
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=group):
        try:
            with numerics_plugin(ep.name):
                hook = ep.load()
                if callable(hook):
                    hook()
        except Exception as e:
            raise RuntimeError(f"plugin {ep.name!r} ({ep.value}) failed to load and was rolled "
                               f"back: {e}") from e
        loaded.append(ep.name)
    return loaded


def numerics_choices() -> tuple[str, ...]:
    """Every registered envelope name, for --numerics help and validation."""
    return tuple(ENVELOPES)
