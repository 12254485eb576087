"""Issue #16's acceptance on the CPU: an rl-bitwise engine updated to checkpoint W serves the bits a
fresh engine started from W serves -- from disk, from tensors (torch, in buckets; safetensors
bytes), after a memory release and resume -- with the prefix cache warm before the update, and
no step program compiled again. Negative controls: a 1-ulp change of one weight changes the bits;
with the flush on a weight change turned off, a stale prefix-cache entry is reused and caught.

W0 and W1: tiny random Qwen3 checkpoints (two seeds). One engine serves the whole module.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from interop.testing import make_tiny_hf_model
from jengine import Engine
from jengine.engine.rl_control import EngineStateError
from jengine.engine.request import InvalidRequest

LAUNCH = dict(numerics="rl-bitwise", skip_warmup=True, page_size=4, chunked_prefill_size=8,
              max_total_tokens=512)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
GREEDY = dict(max_new_tokens=5, temperature=0, ignore_eos=True)


def record(eng) -> list:
    """ids and logprob bits of: a scored prompt, a sampled continuation, and a request whose
    prefix (PROMPT) the cache holds -- the case a stale cache entry would change."""
    outs = [eng.generate(input_ids=PROMPT, return_logprob=True, logprob_start_len=0,
                         sampling_params=GREEDY),
            eng.generate(input_ids=PROMPT[:7], return_logprob=True, top_logprobs_num=2,
                         sampling_params=dict(max_new_tokens=6, temperature=0.8, seed=3)),
            eng.generate(input_ids=PROMPT + [20, 21, 22], return_logprob=True,
                         logprob_start_len=13, sampling_params=GREEDY)]
    assert outs[2]["meta_info"]["cached_tokens"] > 0, "the prefix-cache case missed the cache"
    return [(o["output_ids"], _bits(o["meta_info"])) for o in outs]


def _bits(meta: dict) -> list[int]:
    lps = [t[0] for t in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    lps += [t[0] for row in meta.get("output_top_logprobs", []) for t in row]
    return np.asarray(lps, np.float32).view(np.uint32).tolist()


def compiled(eng) -> tuple[int, int]:
    return eng.runner._forward._cache_size(), eng.runner._logits_rows._cache_size()


@pytest.fixture(scope="module")
def fresh(ckpts):
    """What a fresh engine started from each checkpoint serves."""
    out = {}
    for name, path in ckpts.items():
        with Engine(model_path=str(path), **LAUNCH) as eng:
            out[name] = record(eng)
    assert out["w0"] != out["w1"]
    return out


@pytest.fixture(scope="module")
def eng(ckpts, fresh):
    with Engine(model_path=str(ckpts["w0"]), **LAUNCH) as engine:
        assert record(engine) == fresh["w0"]  # also warms the prefix cache and the step programs
        yield engine


def tensors(path) -> list:
    from safetensors.torch import load_file

    return list(load_file(str(path / "model.safetensors")).items())


def test_update_from_disk_serves_a_fresh_engines_bits(eng, ckpts, fresh):
    before = compiled(eng)
    out = eng.update_weights_from_disk(str(ckpts["w1"]), weight_version="step-1")
    assert out == {"success": True, "message": "weights updated", "weight_version": "step-1"}
    got = record(eng)
    assert got == fresh["w1"]
    assert compiled(eng) == before, "a weight update compiled a step program again"
    assert eng.generate(input_ids=PROMPT, sampling_params=GREEDY)["meta_info"][
        "weight_version"] == "step-1"


def test_update_from_torch_tensors_in_buckets(eng, ckpts, fresh):
    before = compiled(eng)
    named = tensors(ckpts["w0"])  # CPU torch bf16: shared with the engine, no host copy
    for i in range(0, len(named), 10):  # each bucket applies on its own
        eng.update_weights_from_tensor(named[i:i + 10], weight_version="w0")
    assert record(eng) == fresh["w0"]
    assert compiled(eng) == before


def test_update_from_safetensors_bytes(eng, ckpts, fresh):
    from safetensors.numpy import load_file, save

    named = load_file(str(ckpts["w1"] / "model.safetensors"))
    names = sorted(named)
    blobs = [save({n: named[n] for n in names[:12]}), save({n: named[n] for n in names[12:]})]
    eng.update_weights_from_safetensors(blobs, weight_version="w1")
    assert record(eng) == fresh["w1"]


def test_release_and_resume_serve_the_same_bits(eng, fresh):
    assert eng.get_weight_version() == "w1"
    before = compiled(eng)
    eng.pause_generation("retract")
    eng.release_memory_occupation()
    assert eng.runner.weights_released and eng.runner.kv_pool.released
    assert eng.stats()["memory_released"] == ["kv_cache", "weights"]
    eng.resume_memory_occupation(["weights"])
    eng.resume_memory_occupation(["kv_cache"])
    eng.continue_generation()
    assert record(eng) == fresh["w1"]
    assert compiled(eng) == before


def test_one_ulp_in_one_weight_changes_the_bits(eng, ckpts, fresh):
    import torch

    name = "model.norm.weight"
    value = dict(tensors(ckpts["w1"]))[name]
    nudged = value.clone()
    nudged.view(torch.int16)[0] += 1  # the next bf16 value: one ulp
    eng.update_weights_from_tensor({name: nudged})
    assert record(eng) != fresh["w1"]
    eng.update_weights_from_tensor({name: value})
    assert record(eng) == fresh["w1"]


def test_a_stale_prefix_cache_entry_would_be_caught(eng, ckpts, fresh):
    """The control for the flush: with it off, the cached prefix computed under W1 is reused
    after the update to W0, and the comparison with a fresh W0 engine fails."""
    record(eng)  # the cache holds PROMPT's KV under W1
    eng._flush_on_weight_change = False
    try:
        eng.update_weights_from_disk(str(ckpts["w0"]), weight_version="w0")
        stale = record(eng)
    finally:
        eng._flush_on_weight_change = True
    assert stale[0] == fresh["w0"][0]  # every row recomputed (logprob_start_len=0): W0's bits
    assert stale[1:] != fresh["w0"][1:]  # the hits on W1's KV are visible in the bits
    eng.flush_cache()
    assert record(eng) == fresh["w0"]


def test_a_refused_update_leaves_the_old_weights_serving(eng, ckpts, fresh, tmp_path):
    from safetensors.numpy import load_file

    w1 = load_file(str(ckpts["w1"] / "model.safetensors"))
    other = make_tiny_hf_model(tmp_path / "llama", "LlamaForCausalLM", seed=5)
    refusals = {
        "another architecture": lambda: eng.update_weights_from_disk(str(other)),
        "a missing directory": lambda: eng.update_weights_from_disk(str(tmp_path / "none")),
        "a shape": lambda: eng.update_weights_from_tensor(
            {"model.norm.weight": w1["model.norm.weight"][:3]}),
        "a dtype": lambda: eng.update_weights_from_tensor(
            {"model.norm.weight": w1["model.norm.weight"].astype(np.float32)}),
        "a name": lambda: eng.update_weights_from_tensor({"model.extra.weight": np.zeros(2)}),
        # The last tensor is bad: nothing of the first ones may have been applied.
        "a late tensor": lambda: eng.update_weights_from_tensor(
            {**w1, "model.norm.weight": w1["model.norm.weight"][:3]}),
        "a flag": lambda: eng.update_weights_from_disk(str(ckpts["w1"]), abort_all_requests=1),
    }
    for what, call in refusals.items():
        with pytest.raises(InvalidRequest) as err:
            call()
        assert err.value.field in ("model_path", "named_tensors", "abort_all_requests"), what
    assert "LlamaForCausalLM" in str(_refusal(refusals["another architecture"]))
    assert record(eng) == fresh["w0"]
    assert eng.get_weight_version() == "w0"


def _refusal(call) -> Exception:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("not refused")


def test_in_flight_requests_finish_on_the_old_weights_unless_aborted(eng, ckpts, fresh):
    long = dict(max_new_tokens=60, temperature=0, ignore_eos=True)
    first = eng.submit(input_ids=PROMPT, sampling_params=long)
    done = threading.Event()
    threading.Thread(target=lambda: (eng.update_weights_from_disk(
        str(ckpts["w1"]), weight_version="late"), done.set()), daemon=True).start()
    out = first.result(timeout=120)
    assert done.wait(120)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["weight_version"] == "w0"  # every token of it came from W0
    assert record(eng) == fresh["w1"]

    running = eng.submit(input_ids=PROMPT, sampling_params=long)
    eng.update_weights_from_disk(str(ckpts["w0"]), abort_all_requests=True, weight_version="w0")
    assert running.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
    assert record(eng) == fresh["w0"]


def test_pause_and_release_refusals(eng):
    with pytest.raises(InvalidRequest):
        eng.pause_generation("sleep")
    with pytest.raises(InvalidRequest):
        eng.release_memory_occupation(["cuda_graph"])
    eng.pause_generation("in_place")
    try:
        held = eng.submit(input_ids=PROMPT, sampling_params=GREEDY)  # queues while paused
        assert not held.done()
    finally:
        eng.continue_generation()
    assert held.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "length"
    started = threading.Event()
    running = eng.submit(input_ids=PROMPT, sampling_params=dict(GREEDY, max_new_tokens=200),
                         stream=True, on_output=lambda out: started.set())
    assert started.wait(60)  # it holds KV pages now
    eng.pause_generation("in_place")
    try:
        with pytest.raises(EngineStateError, match="retract"):
            eng.release_memory_occupation(["kv_cache"])
    finally:
        eng.continue_generation()
    assert running.result(timeout=120)["meta_info"]["finish_reason"]["type"] == "length"
