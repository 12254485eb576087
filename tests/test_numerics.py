"""The numerics envelope policy layer: resolution table, refusals, plugins, model checks, XLA flags.

The expected values below are written from the spec (numerics-envelopes.md) and the task brief,
independently of jengine.numerics' own tables, so a wrong table in the code fails here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from jengine import numerics, xla_environment
from jengine.config import CHOICES, LaunchConfig, LaunchRefusal
from jengine.numerics import (BITWISE_ENVELOPES, ENVELOPES, NumericsEnvelope, NumericsRefusal,
                              check_model, register_numerics_envelope, resolve_launch,
                              unregister_numerics_envelope)
from jengine.profiles import PROFILES, get_profile, override_profile

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each switch's own default (what auto leaves it at) and rl-bitwise's value, from the spec/brief.
AUTO_DEFAULTS = {
    "sampling_stream": "per-request", "logprob_order": "torch", "layer_boundary_norm": "fused",
    "router_topk": "auto", "moe_combine_order": "rank", "dsa_slot_order": "sorted",
    "yarn_ramp_mask_device": "device", "yarn_frequency_device": "device",
    "mla_lora_scale": "folded", "moe_backend": "auto", "sampling_backend": "canonical",
    "attention_backend": "auto", "batch_invariant_collectives": False,
    "force_deterministic_rsag": False, "tp_batch_invariant": "off", "enable_eplb": False,
    "disable_autotune": False, "disable_pdl": False, "deterministic_ops": False,
}
RL_BITWISE_VALUES = {
    **AUTO_DEFAULTS,
    "logprob_order": "blockwise", "layer_boundary_norm": "unfused", "router_topk": "torch",
    "moe_combine_order": "slot", "dsa_slot_order": "selection", "yarn_ramp_mask_device": "cpu",
    "yarn_frequency_device": "device", "mla_lora_scale": "runtime",
    "batch_invariant_collectives": True, "disable_autotune": True, "disable_pdl": True,
    "deterministic_ops": True,
}

# rl-bitwise and an explicit choice: (switch, explicit value, resolved value or a refusal regex).
REFUSED = object()
RL_EXPLICIT = [
    ("sampling_stream", "per-request", "per-request"),
    ("sampling_stream", "batch", (REFUSED, r"refuses --sampling-stream batch: .*co-batch")),
    ("logprob_order", "torch", "blockwise"),
    ("logprob_order", "blockwise", "blockwise"),
    ("logprob_order", "blockwise-direct", "blockwise-direct"),
    ("logprob_order", "blockwise-16384", "blockwise-16384"),
    ("logprob_order", "blockwise-direct-16384", "blockwise-direct-16384"),
    ("layer_boundary_norm", "fused", "unfused"),
    ("layer_boundary_norm", "unfused", "unfused"),
    ("router_topk", "auto", "torch"),
    ("moe_combine_order", "rank", "slot"),
    ("dsa_slot_order", "sorted", "selection"),
    ("yarn_ramp_mask_device", "device", "cpu"),
    ("yarn_frequency_device", "cpu", "device"),
    ("mla_lora_scale", "folded", "runtime"),
    ("moe_backend", "auto", "auto"),
    ("moe_backend", "batch_invariant", "batch_invariant"),
    ("moe_backend", "portable", (REFUSED, r"refuses --moe-backend portable: .*batch_invariant feature")),
    ("sampling_backend", "canonical", "canonical"),
    ("sampling_backend", "portable", (REFUSED, r"refuses --sampling-backend portable: .*greedy tie")),
    ("attention_backend", "batch_invariant", "batch_invariant"),
    ("attention_backend", "portable",
     (REFUSED, r"refuses --attention-backend portable: .*batch_invariant feature")),
    ("batch_invariant_collectives", False, True),
    ("force_deterministic_rsag", True, True),  # the user's knob; not folded by the envelope
    ("force_deterministic_rsag", False, False),
    ("tp_batch_invariant", "attn", "attn"),  # a layout, not a switch the envelope tightens
    ("tp_batch_invariant", "all", "all"),
    ("enable_eplb", True, True),  # accepted: rl-bitwise folds in the slot-order combine
    ("disable_autotune", False, True),
    ("disable_pdl", False, True),
    ("deterministic_ops", False, True),
]


def resolve(**kw):
    return resolve_launch(LaunchConfig(**kw), hardware="cpu", probe_xla_flags=False)


def switches(resolved):
    return {name: getattr(resolved.config, name) for name in AUTO_DEFAULTS}


# -- resolution table ---------------------------------------------------------------------------


def test_the_table_covers_every_switch():
    assert set(AUTO_DEFAULTS) == set(numerics.SWITCHES)
    assert {s for s, _, _ in RL_EXPLICIT} == set(AUTO_DEFAULTS)


def test_auto_leaves_every_switch_at_its_default():
    r = resolve()
    assert switches(r) == AUTO_DEFAULTS
    assert (r.bitwise, r.required_features, r.xla_flags, r.matmul_precision) == (
        False, frozenset(), (), None)


def test_rl_bitwise_sets_every_governed_switch():
    r = resolve(numerics="rl-bitwise")
    assert switches(r) == RL_BITWISE_VALUES
    assert r.bitwise and r.required_features == {"batch_invariant"}
    assert r.matmul_precision == "highest"


@pytest.mark.parametrize("name", sorted(AUTO_DEFAULTS))
def test_auto_keeps_every_explicit_choice(name):
    values = CHOICES.get(name, (True, False))
    for value in values:
        assert getattr(resolve(**{name: value}).config, name) == value, (name, value)


@pytest.mark.parametrize("name,explicit,expected", RL_EXPLICIT,
                         ids=[f"{n}={v}" for n, v, _ in RL_EXPLICIT])
def test_rl_bitwise_explicit_choice(name, explicit, expected):
    if isinstance(expected, tuple):
        with pytest.raises(NumericsRefusal, match=expected[1]):
            resolve(numerics="rl-bitwise", **{name: explicit})
    else:
        assert getattr(resolve(numerics="rl-bitwise", **{name: explicit}).config, name) == expected


@pytest.mark.parametrize("kw,pattern", [
    ({"quantization": "fp8"}, r"refuses --quantization fp8: no batch-invariant quantized GEMM"),
    ({"moe_tp_size": 2}, r"refuses --moe-tp-size 2: MoE TP must be 1"),
])
def test_rl_bitwise_launch_refusals(kw, pattern):
    with pytest.raises(NumericsRefusal, match=pattern):
        resolve(numerics="rl-bitwise", **kw)
    with pytest.raises(LaunchRefusal) as auto:  # under auto: refused as an option that does nothing
        resolve(**kw)
    assert not isinstance(auto.value, NumericsRefusal)


def test_closed_sets_are_validated_with_field_and_value():
    with pytest.raises(ValueError, match=r"--logprob-order='megatron' is not one of"):
        resolve(logprob_order="megatron")  # the old name is rejected, never silently mapped
    with pytest.raises(ValueError, match=r"--numerics='rl-bitwize' is not one of"):
        resolve(numerics="rl-bitwize")


def test_eplb_with_the_rank_combine_stays_an_auto_launch():
    assert resolve(enable_eplb=True).config.moe_combine_order == "rank"


@pytest.mark.parametrize("name", ["moe_tp_size"])
@pytest.mark.parametrize("numerics", ["auto", "rl-bitwise"])
def test_parallel_sizes_not_implemented_are_refused(name, numerics):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(LaunchRefusal, match=rf"{flag} 2\b.*(not implemented|MoE TP must be 1)"):
        resolve(numerics=numerics, **{name: 2})


def test_tp_without_tp_batch_invariant_warns_under_rl_bitwise():
    """Spec, "Parallel layouts and the envelope": a bitwise launch whose o_proj/down_proj are
    row-parallel is told its bits hold at its own TP size only; `all` (or auto) does not warn."""
    (warning,) = resolve(numerics="rl-bitwise", tp_size=2).warnings
    assert "--tp-size 2 without --tp-batch-invariant" in warning
    assert resolve(numerics="rl-bitwise", tp_size=2, tp_batch_invariant="all").warnings == ()
    assert resolve(numerics="auto", tp_size=2).warnings == ()
    assert resolve(numerics="rl-bitwise").warnings == ()


def test_as_dict_lists_every_switch_and_the_envelope():
    d = resolve(numerics="rl-bitwise", api_key="secret").as_dict()
    for name, value in RL_BITWISE_VALUES.items():
        assert d[name] == value
    assert d["envelope"] == "rl-bitwise" and d["bitwise"] is True
    assert d["required_features"] == ["batch_invariant"] and d["xla_flags"]
    assert d["api_key"] != "secret"  # /get_server_info returns this dict
    json.dumps(d)  # the server returns it as JSON
    assert "--layer-boundary-norm" in resolve().describe()


# -- the kernels layer: hardware, XLA flags ---------------------------------------------------------


def test_gpu_flags_and_tf32_override():
    r = resolve_launch(LaunchConfig(numerics="rl-bitwise"), hardware="gpu-sm90", probe_xla_flags=False)
    assert set(r.xla_flags) == {"--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0",
                                "--xla_gpu_enable_pdl=false",
                                "--xla_allow_excess_precision=false"}
    assert r.environment == {"NVIDIA_TF32_OVERRIDE": "0"}


def test_each_kernels_switch_exists_alone_under_auto():
    r = resolve_launch(LaunchConfig(disable_autotune=True), hardware="gpu", probe_xla_flags=False)
    assert r.xla_flags == ("--xla_gpu_autotune_level=0",) and not r.bitwise
    r = resolve_launch(LaunchConfig(disable_pdl=True), hardware="gpu", probe_xla_flags=False)
    assert r.xla_flags == ("--xla_gpu_enable_pdl=false",) and not r.bitwise
    # auto leaves XLA's own default (PDL on): no flag at all
    r = resolve_launch(LaunchConfig(), hardware="gpu", probe_xla_flags=False)
    assert r.xla_flags == ()


def test_cpu_flags_are_verified_against_the_installed_jaxlib():
    r = resolve_launch(LaunchConfig(numerics="rl-bitwise"), hardware="cpu")
    assert "--xla_allow_excess_precision=false" in r.xla_flags
    assert "--xla_cpu_enable_fast_min_max=false" in r.xla_flags


def test_probing_an_unknown_flag_does_not_abort_us():
    good = "--xla_allow_excess_precision=false"
    unknown = xla_environment.unknown_xla_flags((good, "--xla_jengine_no_such_flag=1"), "cpu")
    assert unknown == {"--xla_jengine_no_such_flag=1"}  # and we are still running


def test_the_installed_jaxlib_has_pdl_on_by_default_and_knows_the_pin():
    """Why rl-bitwise pins --xla_gpu_enable_pdl=false: XLA's own default is on. The flag is parsed
    by every backend's XLA (a GPU flag is accepted on the CPU), so this runs in CI."""
    assert xla_environment.unknown_xla_flags(("--xla_gpu_enable_pdl=false",), "cpu") == frozenset()
    # True: =true leaves the default options as they are and =false (the pin) changes them
    assert xla_environment.xla_flag_default("xla_gpu_enable_pdl") is True
    # negative controls: a flag off by default reads off; an unknown one reads None
    assert xla_environment.xla_flag_default("xla_gpu_deterministic_ops") is False
    assert xla_environment.xla_flag_default("xla_jengine_no_such_flag") is None


def test_unknown_required_flag_refuses_optional_flag_is_dropped(monkeypatch, caplog):
    bogus = lambda required: xla_environment.XlaFlag(  # noqa: E731
        "--xla_jengine_no_such_flag=1", frozenset({"cpu"}), "deterministic_ops", required, "test")
    monkeypatch.setattr(xla_environment, "DETERMINISTIC_XLA_FLAGS", (bogus(False),))
    with caplog.at_level(logging.WARNING, logger="jengine.numerics"):
        assert resolve_launch(LaunchConfig(numerics="rl-bitwise"), hardware="cpu").xla_flags == ()
    assert "dropping XLA flag --xla_jengine_no_such_flag=1" in caplog.text
    monkeypatch.setattr(xla_environment, "DETERMINISTIC_XLA_FLAGS", (bogus(True),))
    with pytest.raises(NumericsRefusal, match="does not know the deterministic XLA flag"):
        resolve_launch(LaunchConfig(numerics="rl-bitwise"), hardware="cpu")


def test_a_conflicting_user_flag_is_refused():
    with pytest.raises(xla_environment.XlaFlagError, match="sets --xla_allow_excess_precision=true"):
        xla_environment.merge_xla_flags("--xla_allow_excess_precision=true",
                                        ("--xla_allow_excess_precision=false",))
    assert xla_environment.merge_xla_flags("--a=1  --b=2", ("--b=2", "--c=3")) == "--a=1 --b=2 --c=3"


def _run_fresh(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    environ.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=300)


def test_resolution_does_not_start_the_backend_and_apply_sets_flags():
    proc = _run_fresh("""
        import os
        from jengine.config import LaunchConfig
        from jengine.numerics import resolve_launch
        from jengine.xla_environment import backend_initialized
        r = resolve_launch(LaunchConfig(numerics="rl-bitwise"))
        assert r.hardware == "cpu" and not backend_initialized()
        r.apply_environment()
        import jax, jax.numpy as jnp
        jnp.ones(2).block_until_ready()
        assert all(f in os.environ["XLA_FLAGS"].split() for f in r.xla_flags), os.environ["XLA_FLAGS"]
        assert jax.config.jax_default_matmul_precision == "highest"
        r.apply_environment()  # idempotent, even with the backend up
        print("OK")
    """)
    assert proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_apply_after_backend_start_is_refused_unless_flags_match():
    code = """
        import jax.numpy as jnp
        jnp.ones(2).block_until_ready()
        from jengine.config import LaunchConfig
        from jengine.numerics import resolve_launch
        try:
            resolve_launch(LaunchConfig(numerics="rl-bitwise")).apply_environment()
            print("APPLIED")
        except RuntimeError as e:
            print("REFUSED", e)
    """
    late = _run_fresh(code)
    assert late.stdout.startswith("REFUSED") and "backend is already up" in late.stdout, late.stderr
    flags = "--xla_allow_excess_precision=false --xla_cpu_enable_fast_min_max=false " \
            "--xla_cpu_enable_fast_math=false"
    exported = _run_fresh(code, XLA_FLAGS=flags)  # negative control: flags were there from start
    assert exported.stdout.startswith("APPLIED"), exported.stdout + exported.stderr[-2000:]


# -- model construction ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeModelConfig:
    """The ModelConfig fields check_model reads."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 65536
    quantization_config: dict | None = None
    torch_dtype: str = "bfloat16"
    num_experts: int = 0


def refusal(resolved, model_config, **kw) -> str:
    with pytest.raises(NumericsRefusal) as info:
        check_model(resolved, model_config, **kw)
    return str(info.value)


@pytest.fixture
def llama_verified():
    with override_profile("LlamaForCausalLM", numerics_envelopes={"rl-bitwise"}):
        yield


def test_a_verified_eligible_model_passes(llama_verified):
    check_model(resolve(numerics="rl-bitwise"), FakeModelConfig())


def test_any_vocabulary_size_is_served(llama_verified):
    # The last block is completed with -inf logits (pallas_kernels/logprobs.py), so rl-bitwise and
    # the blockwise orders take any vocabulary: Llama-3's, Qwen's, DeepSeek-V3's, and odd ones.
    for vocab in (32000, 128256, 151936, 129280, 49152, 1):
        check_model(resolve(numerics="rl-bitwise"), FakeModelConfig(vocab_size=vocab))
        check_model(resolve(numerics="rl-bitwise", logprob_order="blockwise-16384"),
                    FakeModelConfig(vocab_size=vocab))
        check_model(resolve(logprob_order="blockwise"), FakeModelConfig(vocab_size=vocab))


def test_f32_models_are_refused_on_the_gpu_only(llama_verified):
    @dataclass(frozen=True)
    class F32Config(FakeModelConfig):
        torch_dtype: str = "float32"

    gpu = dataclasses.replace(resolve(numerics="rl-bitwise"), hardware="gpu-sm90")
    msg = refusal(gpu, F32Config())
    assert "bf16 models only on the GPU" in msg and "--dtype bfloat16" in msg
    check_model(dataclasses.replace(gpu, config=gpu.config.replace(dtype="bfloat16")), F32Config())
    check_model(resolve(numerics="rl-bitwise"), F32Config())  # the CPU: verified in f32 too
    msg = refusal(dataclasses.replace(gpu, config=gpu.config.replace(dtype="float32")),
                  FakeModelConfig())
    assert "bf16 models only on the GPU" in msg
    check_model(dataclasses.replace(resolve(), hardware="gpu-sm90"), F32Config())  # auto serves it


def test_quantized_checkpoint_is_refused(llama_verified):
    msg = refusal(resolve(numerics="rl-bitwise"),
                  FakeModelConfig(quantization_config={"quant_method": "fp8"}))
    assert "unquantized checkpoints only" in msg and "fp8" in msg


def test_profile_without_the_envelope_is_refused():
    with override_profile("LlamaForCausalLM", numerics_envelopes=set()):
        msg = refusal(resolve(numerics="rl-bitwise"), FakeModelConfig())
    assert "require_verified_numerics" in msg and "LlamaForCausalLM" in msg
    assert "numerics_envelopes, which are []" in msg
    msg = refusal(resolve(numerics="rl-bitwise"), FakeModelConfig(architecture="GPT2LMHeadModel"))
    assert "no model profile" in msg


def test_moe_tp_above_one_is_refused():
    r = resolve(numerics="rl-bitwise")
    r = dataclasses.replace(r, config=r.config.replace(moe_tp_size=2))  # past the launch check
    with override_profile("ToyMoeForCausalLM", numerics_envelopes={"rl-bitwise"}):
        msg = refusal(r, FakeModelConfig(architecture="ToyMoeForCausalLM", num_experts=8))
        assert "MoE TP 1" in msg and "--moe-tp-size is 2" in msg
        check_model(r, FakeModelConfig(architecture="ToyMoeForCausalLM"))  # dense: no MoE rule


def test_every_violation_is_reported_at_once():
    with override_profile("LlamaForCausalLM", numerics_envelopes=set()):
        msg = refusal(resolve(numerics="rl-bitwise"),
                      FakeModelConfig(vocab_size=32000, quantization_config={"bits": 4}))
    assert msg.count("\n  - ") == 2


def test_auto_serves_any_model():
    check_model(resolve(), FakeModelConfig(vocab_size=32000, quantization_config={"bits": 4}))


def test_check_model_reads_the_real_model_config(llama_verified):
    from jengine.models.config import ModelConfig

    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 32000, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
          "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}}
    msg = refusal(resolve(numerics="rl-bitwise"), ModelConfig.from_hf_dict(hf))
    assert "quant_method" in msg
    hf.pop("quantization_config")
    check_model(resolve(numerics="rl-bitwise"), ModelConfig.from_hf_dict(hf))


def test_in_tree_profiles_declare_rl_bitwise_only_where_harnessed():
    # A profile lists rl-bitwise in the change that adds its passing harnesses (invariance + align).
    assert set(PROFILES) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                             "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
                             "LongcatFlashForCausalLM"}
    declared = {a for a, p in PROFILES.items() if "rl-bitwise" in p.numerics_envelopes}
    assert declared == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",  # tests/test_mla_align.py
                        "LongcatFlashForCausalLM"}  # tests/test_longcat_flash.py
    with override_profile("LlamaForCausalLM", numerics_envelopes=set()) as p:
        assert get_profile("LlamaForCausalLM") is p and "rl-bitwise" not in p.numerics_envelopes
    assert "rl-bitwise" in get_profile("LlamaForCausalLM").numerics_envelopes
    with pytest.raises(ValueError, match="architecture='GPT2LMHeadModel' is not supported"):
        get_profile("GPT2LMHeadModel")


# -- plugins -------------------------------------------------------------------------------------------


@pytest.fixture
def registry_snapshot():
    before = (dict(ENVELOPES), set(BITWISE_ENVELOPES))
    yield before
    for name in set(ENVELOPES) - set(before[0]):
        unregister_numerics_envelope(name)
    assert (dict(ENVELOPES), set(BITWISE_ENVELOPES)) == before


def envelope(name, bitwise=True, resolver=lambda cfg: cfg, validator=lambda r, m, p: []):
    return NumericsEnvelope(name=name, bitwise=bitwise, resolve_launch=resolver,
                            validate_checkpoint=validator)


def test_a_plugin_bitwise_envelope_inherits_every_pin(registry_snapshot):
    register_numerics_envelope(envelope("strict"))
    r = resolve(numerics="strict")
    assert r.bitwise and r.required_features == {"batch_invariant"}
    assert r.matmul_precision == "highest" and r.xla_flags
    for name in ("sampling_stream", "batch_invariant_collectives", "disable_autotune",
                 "disable_pdl", "deterministic_ops"):
        assert getattr(r.config, name) == RL_BITWISE_VALUES[name], name
    # trainer alignment is rl-bitwise's own policy, not a pin (spec: only rl-bitwise inherits it)
    assert r.config.logprob_order == "torch"
    with pytest.raises(NumericsRefusal, match="refuses --sampling-backend portable"):
        resolve(numerics="strict", sampling_backend="portable")
    with pytest.raises(NumericsRefusal, match="--enable-eplb with --moe-combine-order rank"):
        resolve(numerics="strict", enable_eplb=True)
    msg = refusal(r, FakeModelConfig())  # every policy passes the model profile gate
    assert "must list 'strict'" in msg


def test_a_plugin_above_rl_bitwise_gets_its_switches(registry_snapshot):
    register_numerics_envelope(envelope("rl-bitwise-plus", resolver=numerics.resolve_rl_bitwise))
    assert switches(resolve(numerics="rl-bitwise-plus")) == RL_BITWISE_VALUES


def test_a_non_bitwise_plugin_gets_no_pins(registry_snapshot):
    register_numerics_envelope(envelope("fast", bitwise=False))
    r = resolve(numerics="fast")
    assert switches(r) == AUTO_DEFAULTS and not r.bitwise and "fast" not in BITWISE_ENVELOPES


@pytest.mark.parametrize("resolver", [
    lambda cfg: 1 / 0,
    lambda cfg: cfg.replace(logprob_order="megatron"),  # writes a value outside the closed set
    lambda cfg: None,
], ids=["raises", "bad-value", "returns-none"])
def test_a_failing_plugin_rolls_back(registry_snapshot, resolver):
    with pytest.raises(Exception):
        register_numerics_envelope(envelope("broken", resolver=resolver))
    assert "broken" not in ENVELOPES and "broken" not in BITWISE_ENVELOPES
    with pytest.raises(ValueError, match="--numerics='broken' is not one of"):
        resolve(numerics="broken")


def test_a_plugin_failing_after_registering_rolls_back_everything(registry_snapshot):
    with pytest.raises(RuntimeError, match="late failure"):
        with numerics.numerics_plugin("two-envelopes"):
            register_numerics_envelope(envelope("first"))
            register_numerics_envelope(envelope("second", bitwise=False))
            raise RuntimeError("late failure")
    assert not {"first", "second"} & (set(ENVELOPES) | BITWISE_ENVELOPES)


def test_entry_point_plugins_load_or_roll_back(registry_snapshot, monkeypatch):
    import importlib.metadata

    class EP:
        def __init__(self, name, hook):
            self.name, self.value, self._hook = name, f"fake:{name}", hook

        def load(self):
            return self._hook

    def bad_hook():
        register_numerics_envelope(envelope("half-done"))
        raise ImportError("missing dependency")

    good = EP("good", lambda: register_numerics_envelope(envelope("from-entry-point")))
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [good])
    assert numerics.load_numerics_plugins() == ["good"] and "from-entry-point" in BITWISE_ENVELOPES
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [EP("bad", bad_hook)])
    with pytest.raises(RuntimeError, match="plugin 'bad' .* rolled back: missing dependency"):
        numerics.load_numerics_plugins()
    assert "half-done" not in ENVELOPES


def test_builtins_cannot_be_replaced_or_removed(registry_snapshot):
    with pytest.raises(ValueError, match="built in"):
        register_numerics_envelope(envelope("rl-bitwise", resolver=lambda cfg: cfg))
    with pytest.raises(ValueError, match="built in"):
        unregister_numerics_envelope("auto")


def test_no_selection_point_tests_the_literal_name():
    """Spec: selection points test membership in BITWISE_ENVELOPES, never the name."""
    # A comparison of a numerics value with the literal name (labels elsewhere are fine).
    literal = re.compile(r"""numerics\w*\s*(==|!=|\bin)\s*[(\[{]?\s*["']rl-bitwise["']"""
                         r"""|["']rl-bitwise["']\s*(==|!=)\s*[\w.]*numerics""")
    offenders = []
    for package in ("jengine", "pallas_kernels", "sharding", "interop"):
        for path in (ROOT / package).rglob("*.py"):
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                if literal.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, offenders
    assert literal.search('if cfg.numerics == "rl-bitwise":')  # the pattern can fail
    assert literal.search("bitwise = resolved.config.numerics in ('rl-bitwise',)")
    assert not literal.search('if label == "rl-bitwise":')
