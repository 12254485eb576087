"""The overlap schedule on the real tiny model, rl-bitwise: ids and logprob bits equal the
synchronous loop's (--disable-overlap-schedule), with requests ended by a sampled stop token one
step late in the overlapped engine; the invariance harness runs both loops too (its overlap-off
mode). The exact KV and scheduling checks are tests/test_engine_scheduler.py's, on its fake model.
"""

from __future__ import annotations

import numpy as np
import pytest

from jengine.engine.engine import Engine

LAUNCH = dict(numerics="rl-bitwise", max_total_tokens=512, page_size=4, chunked_prefill_size=16,
              max_prefill_tokens=48, max_running_requests=6, skip_warmup=True)
PROMPTS = [np.random.default_rng(i).integers(100, 30000, size=n).tolist()
           for i, n in enumerate([5, 17, 30, 1, 9, 12])]


def run_bits(engine, params):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True,
                           logprob_start_len=0)

    def bits(pairs):
        return np.array([lp for lp, _, _ in pairs], np.float32).view(np.uint32).tolist()

    return [(o["output_ids"], bits(o["meta_info"]["output_token_logprobs"]),
             bits(o["meta_info"]["input_token_logprobs"][1:]),
             o["meta_info"]["finish_reason"]["type"]) for o in outs]


@pytest.fixture(scope="module")
def engines():
    from jengine.profiles import override_profile

    with override_profile("Qwen3ForCausalLM", numerics_envelopes={"rl-bitwise"}):
        with Engine(model_path="tiny", **LAUNCH) as on, \
                Engine(model_path="tiny", disable_overlap_schedule=True, **LAUNCH) as off:
            assert on.plan.overlap_schedule and not off.plan.overlap_schedule
            yield on, off


@pytest.fixture(scope="module")
def params(engines):
    """Greedy and T=1 requests; half stop at a token their unstopped run samples mid-way."""
    _, off = engines
    base = [{"max_new_tokens": 10, "temperature": 0.0 if i % 2 else 1.0, "seed": 7 + i,
             "ignore_eos": True} for i in range(len(PROMPTS))]
    free = run_bits(off, base)
    return [{**p, "stop_token_ids": [free[i][0][4]]} if i % 2 == 0 else p
            for i, p in enumerate(base)]


def test_overlap_bits_equal_the_synchronous_loop(engines, params):
    on, off = engines
    fed = []  # steps whose rows read the step in flight's tokens on the device
    forward = on.runner.forward_routed
    on.runner.forward_routed = lambda batch, prev=None: fed.append(prev is not None) or forward(batch, prev)
    try:
        want = run_bits(off, params)
        assert run_bits(on, params) == want
    finally:
        on.runner.forward_routed = forward
    assert sum(fed) > 5  # the overlapped path ran
    assert [kind for *_, kind in want].count("stop") >= 2  # ended by a sampled token
    for eng in (on, off):  # every page back: the extra rows of ended requests leaked none
        eng.kv.check_consistent()
        assert eng.kv.num_used == eng.scheduler.cache.num_pages


def test_negative_control_a_wrong_fed_token_is_caught(engines, params):
    on, off = engines
    forward = on.runner.forward_routed

    def off_by_one(batch, prev=None):
        return forward(batch, None if prev is None else prev + 1)

    on.runner.forward_routed = off_by_one
    try:
        assert run_bits(on, params) != run_bits(off, params)
    finally:
        on.runner.forward_routed = forward
