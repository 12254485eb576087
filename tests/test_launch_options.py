"""Every accepted launch option is real (issue #15, item 9): each LaunchConfig field, set to a
value other than its default, either changes something observable or is refused with the reason.

The walk iterates dataclasses.fields(LaunchConfig), so an option added without an entry in
`PROBES` fails here. Each probe is cheap: the resolved launch, the XLA flags, the scheduler of an
engine over a fake runner, a ModelRunner of the tiny model (no compile), or the server.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types

import pytest
from starlette.testclient import TestClient

from jengine.config import LaunchConfig, LaunchRefusal
from jengine.launch import plan_launch
from jengine.numerics import SWITCHES, resolve_launch
from jengine.server.app import create_app
from tests.test_engine_scheduler import fake_model_config, make_engine
from tests.test_server_unit import FakeEngine


_FAKE_MODEL = fake_model_config(160)


def _resolved(hardware="gpu", **kw):
    return resolve_launch(LaunchConfig(**kw), hardware=hardware, probe_xla_flags=False)


def _switch(value, name, tiny):
    return getattr(_resolved(**{name: value}).config, name)


def _xla_flags(value, name, tiny):
    return _resolved(**{name: value}).xla_flags


def _scheduler(value, name, tiny):
    with make_engine(**{name: value}) as eng:
        return dataclasses.asdict(eng.scheduler.cfg)


def _placeholder_steps(value, name, tiny):
    """How many steps of a 6-token greedy request read the step in flight's tokens (overlap)."""
    with make_engine(**{name: value}) as eng:
        fed = []
        forward = eng.runner.forward_padded
        eng.runner.forward_padded = lambda batch, prev=None: fed.append(prev is not None) or \
            forward(batch, prev)
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 6, "temperature": 0})
        return sum(fed)


def _logit_calls(value, name, tiny):
    """How many logits computations a 20-token prompt scored with logprobs takes."""
    with make_engine(**{name: value}) as eng:
        calls = []
        compute = eng.runner.compute_logits
        eng.runner.compute_logits = lambda hidden: calls.append(len(hidden)) or compute(hidden)
        eng.generate(input_ids=list(range(1, 21)), sampling_params={"max_new_tokens": 0},
                     return_logprob=True, logprob_start_len=0)
        return len(calls)


@pytest.fixture(scope="module")
def tiny():
    from jengine.models import load_model

    return load_model("tiny")


def _runner(attr):
    def probe(value, name, tiny):
        from jengine.engine.model_runner import ModelRunner

        plan = plan_launch(_resolved("cpu", **{name: value}), tiny.config)
        return getattr(ModelRunner(tiny.config, tiny.checkpoint, plan.runner), attr)
    return probe


def _server_app(value, name, tiny):
    """/v1/models and auth of an app built from the launch, as `jengine serve` builds it."""
    cfg = LaunchConfig(**{name: value})
    eng = FakeEngine()
    eng.config = eng.resolved.config = cfg
    eng.plan.server = plan_launch(_resolved("cpu", **{name: value}), _FAKE_MODEL).server
    with TestClient(create_app(eng)) as c:
        r = c.get("/v1/models")
        return r.status_code, r.json()


def _server_running_sets(value, name, tiny):
    """How many requests the server admits to run at once: one running set per data-parallel
    replica (the replicas themselves: tests/test_server_replicas.py)."""
    from jengine.server.async_engine import AsyncEngine

    eng = FakeEngine()
    eng.config = LaunchConfig(**{name: value})
    return AsyncEngine(eng).work.max_running


def _serve_argv(value, name, tiny):
    """What `jengine serve --<flag> <value>` hands uvicorn (host, port)."""
    from jengine.config import launch_config_from_args
    from jengine.server.cli import build_parser

    cfg = launch_config_from_args(build_parser().parse_args([f"--{name.replace('_', '-')}",
                                                             str(value)]))
    return cfg.host, cfg.port


def _outputs_held(value, name, tiny):
    """Whether a step's outputs are still held 0.3 s after they arrive while the engine thread is
    busy (its host gate closed): the launch plan's hold as the engine's output processor gets it."""
    from jengine.engine.host_gate import HostGate
    from jengine.engine.output_processor import OutputProcessor, RequestState, StepOutput
    from jengine.engine.request import SamplingParams

    plan = plan_launch(_resolved("cpu", **{name: value}), tiny.config)
    gate, delivered = HostGate(), []
    gate.close()
    proc = OutputProcessor(lambda rid: None, lambda state: None, gate=gate, hold_s=plan.output_hold_s)
    proc.add_request(RequestState(
        rid="r", prompt_ids=[1], sampling=SamplingParams(), return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, return_routed_experts=False, stream=True,
        detokenizer=types.SimpleNamespace(add=str, flush=str), on_output=delivered.append))
    proc.put([StepOutput("r", new_token_ids=[7])])
    time.sleep(0.3)
    held = not delivered
    gate.open()
    proc.shutdown()
    return held


def _engine_logger(value, name, tiny):
    from jengine.engine.engine import Engine

    logger = logging.getLogger("jengine")
    before = logger.level
    try:
        with Engine(model_path="tiny", skip_warmup=True, **{name: value}):
            return logger.getEffectiveLevel()
    finally:
        logger.setLevel(before)


def _warmup_runs(value, name, tiny):
    from jengine.engine.engine import Engine
    from jengine.engine.model_runner import ModelRunner

    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "warmup", lambda self: calls.append(1) or 0.0)
        with Engine(model_path="tiny", **{name: value}):
            return len(calls)


def _model_loaded(value, name, tiny):
    from jengine.engine.engine import Engine

    try:
        with Engine(skip_warmup=True, **{name: value}) as eng:
            return eng.server_info()["model_dir"]
    except Exception as exc:  # the path is read: the error names what is missing
        assert value in str(exc), exc
        return str(exc)


REFUSED = "refused"  # by the launch alone
REFUSED_HERE = "refused for the tiny model on one device"  # by the launch plan
# field -> (a non-default value, how it shows: probe(value, name, tiny) -> what is compared).
PROBES = {
    "model_path": ("/nonexistent/model", _model_loaded),
    "dtype": ("float32", _runner("dtype")),
    "context_length": (64, _runner("max_context")),
    "numerics": ("rl-bitwise", lambda v, name, tiny: _resolved(numerics=v).bitwise),
    **{name: (value, _switch) for name, value in {
        "logprob_order": "blockwise", "layer_boundary_norm": "unfused",
        "yarn_frequency_device": "cpu", "sampling_backend": "portable",
        "attention_backend": "portable"}.items()},
    # Switches that act only on other models (MoE, MLA, DSA, YaRN) or on several devices: on the
    # dense tiny model, on one device, the launch plan refuses them.
    **{name: (value, REFUSED_HERE) for name, value in {
        "sampling_stream": "batch", "router_topk": "torch", "moe_combine_order": "slot",
        "dsa_slot_order": "selection", "yarn_ramp_mask_device": "cpu", "mla_lora_scale": "runtime",
        "moe_backend": "portable", "batch_invariant_collectives": True,
        "force_deterministic_rsag": True, "tp_batch_invariant": "attn",
        "enable_eplb": True, "ep_num_redundant_experts": 4,
        "init_expert_location": "/placement.json", "eplb_rebalance_num_iterations": 3}.items()},
    "disable_autotune": (True, _xla_flags),
    "disable_pdl": (True, _xla_flags),
    "deterministic_ops": (True, _xla_flags),
    "quantization": ("fp8", REFUSED),
    "tp_size": (2, lambda v, name, tiny: plan_launch(_resolved("cpu", tp_size=v),
                                                     tiny.config).runner.tp_size),
    "dp_size": (2, _server_running_sets),
    "ep_size": (2, REFUSED_HERE),  # served for MoE models (tests/test_expert_parallel.py)
    "moe_tp_size": (2, REFUSED),
    "page_size": (8, _runner("page_size")),
    "max_total_tokens": (256, _runner("num_pages")),
    "chunked_prefill_size": (4, _scheduler),
    "max_prefill_tokens": (16, _scheduler),
    "max_running_requests": (2, _scheduler),
    "input_logprob_chunk_tokens": (2, _logit_calls),
    "disable_radix_cache": (True, _scheduler),
    "debug_force_retraction_interval": (3, _scheduler),
    "skip_warmup": (True, _warmup_runs),
    "disable_overlap_schedule": (True, _placeholder_steps),
    "output_hold_ms": (1000.0, _outputs_held),
    "host": ("0.0.0.0", _serve_argv),
    "port": (8080, _serve_argv),
    "api_key": ("sekret", _server_app),
    "served_model_name": ("my-model", _server_app),
    "log_level": ("warning", _engine_logger),
}


def test_every_option_has_a_probe():
    assert sorted(PROBES) == sorted(f.name for f in dataclasses.fields(LaunchConfig))
    assert set(SWITCHES) <= set(PROBES)


@pytest.mark.parametrize("field", [f for f in dataclasses.fields(LaunchConfig)], ids=lambda f: f.name)
def test_each_option_changes_behaviour_or_is_refused(field, tiny):
    value, probe = PROBES[field.name]
    assert value != field.default, field.name
    flag = "--" + field.name.replace("_", "-")
    if probe is REFUSED:
        with pytest.raises(LaunchRefusal, match=rf"^{flag} {value}: "):  # names flag and value
            _resolved(**{field.name: value})
        return
    if probe is REFUSED_HERE:
        plan_launch(_resolved("cpu", **{field.name: field.default}), tiny.config)  # the default: fine
        with pytest.raises(LaunchRefusal, match=rf"^{flag} {value} has no effect on Qwen3ForCausalLM"):
            plan_launch(_resolved("cpu", **{field.name: value}), tiny.config)
        return
    changed, default = probe(value, field.name, tiny), probe(field.default, field.name, tiny)
    assert changed != default, (field.name, changed)


def test_an_envelopes_pins_are_not_refused_as_inert(tiny):
    """rl-bitwise pins MoE, collective and YaRN switches for every model; only a user's explicit
    choice that cannot act is refused, and an explicit default is accepted."""
    from jengine.profiles import override_profile

    resolved = _resolved("cpu", numerics="rl-bitwise")
    assert resolved.config.router_topk == "torch" and resolved.config.batch_invariant_collectives
    assert not resolved.given & {"router_topk", "batch_invariant_collectives"}
    with override_profile("Qwen3ForCausalLM", numerics_envelopes={"rl-bitwise"}):
        plan_launch(resolved, tiny.config)
    plan_launch(_resolved("cpu", router_topk="auto", tp_batch_invariant="off"), tiny.config)
