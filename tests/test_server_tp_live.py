"""Serving at TP2 (issue #17): a real server with `--tp-size 2 --dp-size 2 --tp-batch-invariant all`
on four fake CPU devices -- two replicas of two tensor ranks each -- answers /generate, OpenAI
completions and chat, streaming included, with the ids and logprob bits of a one-device (TP1)
Engine in this process on the same requests, on both replicas. /get_server_info reports the mesh,
the layout and the invariances the launch holds, and each replica's device group.

The negative controls show the comparison can fail: a one-ulp change of one logprob, and the TP1
reference under another seed.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable

import numpy as np
import pytest

from jengine import Engine
from jengine.server.testing import ServerProcess, check_cumulative_stream
from scripts.goldens import bits, differences, output_record
from tests.test_server_live import http, oai, sse_data  # noqa: F401  (fixtures over `server`)
from tests.test_server_replicas import server_info

# Options that reach the bits are the same on both sides; only the device layout differs.
LAUNCH = dict(context_length=256, page_size=16, chunked_prefill_size=64, max_prefill_tokens=128)
SERVER_ARGS = ["--numerics", "rl-bitwise", "--tp-size", "2", "--dp-size", "2",
               "--tp-batch-invariant", "all", "--skip-warmup", "--log-level", "warning",
               *[a for k, v in LAUNCH.items() for a in (f"--{k.replace('_', '-')}", str(v))]]
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}


@pytest.fixture(scope="module")
def server():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    with ServerProcess(SERVER_ARGS, env={"XLA_FLAGS": flags}) as proc:
        yield proc
        assert proc.proc.poll() is None, "the server died during the tests:\n" + proc.log_tail()


@pytest.fixture(scope="module")
def tp1():
    """The reference: the same model and launch on this process's one device."""
    with Engine("tiny", numerics="rl-bitwise", skip_warmup=True, **LAUNCH) as eng:
        yield eng


def on_both_replicas(http, sends: list[Callable[[], Any]]) -> list[Any]:
    """Run each send (a blocking request) in its own thread while generation is paused, one
    after the other is in flight, so least-loaded routing puts send i on replica i % 2 (checked
    on the replicas' loads) before any step runs."""
    assert http.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
    results: list[Any] = [None] * len(sends)

    def run(i: int) -> None:
        try:
            results[i] = sends[i]()
        except BaseException as exc:  # re-raised in the test's thread below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sends))]
    try:
        for i, thread in enumerate(threads):
            thread.start()
            while sum(r["requests_in_flight"] for r in server_info(http)["replicas"]) < i + 1:
                thread.join(0.05)
                assert thread.is_alive(), results[i]
        loads = [r["requests_in_flight"] for r in server_info(http)["replicas"]]
        assert loads == [len(sends) - len(sends) // 2, len(sends) // 2], loads
    finally:
        assert http.post("/continue_generation", json={}).json()["success"]
        for thread in threads:
            thread.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def generate(http, sampling_params: dict, **extra) -> dict:
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": sampling_params,
                                     **LOGPROBS, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def token_text(eng, token_id: int) -> str:
    return eng.tokenizer.decode([token_id], skip_special_tokens=False)


# -- /get_server_info -----------------------------------------------------------------------------

def test_server_info_reports_the_mesh_layout_invariances_and_replica_devices(http, tp1):
    info = server_info(http)
    par = info["parallelism"]
    assert par["mesh"] == {"data": 1, "expert": 1, "tensor": 2}
    assert par["layout"] == "tensor_parallel_all"
    assert par["projections"]["o_proj"].startswith("column-parallel on hidden")
    assert par["invariances"] == {"run": True, "batch": True, "topology": True}
    assert info["dp_size"] == 2 and info["tp_size"] == 2
    groups = [r["devices"] for r in info["replicas"]]
    assert groups == [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]]
    # The reference runs the same launch but for the device layout (so equal bits mean something).
    # (Besides the layout, only the server's own options differ: its port, log level, HTTP limits.)
    layout_only = {"tp_size", "dp_size", "tp_batch_invariant", "parallelism", "replicas",
                   "warnings", "server", "port", "log_level"}
    ref = tp1.server_info()
    differing = {k for k in set(info) | set(ref) if info.get(k) != ref.get(k)} - layout_only
    assert not differing, {k: (info.get(k), ref.get(k)) for k in differing}


# -- bits: both replicas, and the TP1 reference ---------------------------------------------------

def test_generate_with_prompt_logprobs_on_both_replicas_gives_the_tp1_bits(http, tp1):
    sends = [lambda p=p: generate(http, p) for p in (GREEDY, GREEDY, SEEDED, SEEDED)]
    outs = on_both_replicas(http, sends)
    assert [o["meta_info"]["replica"] for o in outs] == [0, 1, 0, 1]
    ids = tp1.tokenizer.encode(PROMPT)
    for out, params in zip(outs, (GREEDY, GREEDY, SEEDED, SEEDED)):
        want = output_record(tp1.generate(input_ids=ids, sampling_params=params, **LOGPROBS))
        got = output_record(out)
        assert len(got["input_token_logprobs"]) == len(ids) and len(got["output_ids"]) == 6
        assert got["input_top_logprobs"][1] and got["output_top_logprobs"][0]
        assert differences(want, got) == [], (out["meta_info"]["replica"], params)
    assert outs[0]["output_ids"] != outs[2]["output_ids"]  # the seeded request really sampled


def completion_record(logprobs) -> dict:
    return {"tokens": list(logprobs.tokens),
            "token_logprobs": [bits(x) for x in logprobs.token_logprobs],
            "top_logprobs": [None if t is None else [[k, bits(v)] for k, v in t.items()]
                             for t in logprobs.top_logprobs]}


def test_openai_completion_with_echo_on_both_replicas_gives_the_tp1_bits(oai, http, tp1):
    def send(temperature):
        return lambda: oai.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=temperature, seed=7, echo=True,
            logprobs=2, extra_body={"ignore_eos": True})

    outs = on_both_replicas(http, [send(0), send(0), send(1.0), send(1.0)])
    ids = tp1.tokenizer.encode(PROMPT)
    for out, params in zip(outs, (GREEDY, GREEDY, SEEDED, SEEDED)):
        ref = tp1.generate(input_ids=ids, sampling_params=params, **LOGPROBS)["meta_info"]
        triples = ref["input_token_logprobs"] + ref["output_token_logprobs"]
        tops = ref["input_top_logprobs"] + ref["output_top_logprobs"]
        want = {"tokens": [token_text(tp1, t[1]) for t in triples],
                "token_logprobs": [bits(t[0]) for t in triples],
                "top_logprobs": [None if row is None else
                                 [[token_text(tp1, t[1]), bits(t[0])] for t in row] for row in tops]}
        got = completion_record(out.choices[0].logprobs)
        assert len(got["tokens"]) == len(ids) + 6
        assert differences(want, got) == [], params


def test_openai_chat_with_logprobs_on_both_replicas_gives_the_tp1_bits(oai, http, tp1):
    def send():
        return oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                           temperature=1.0, seed=3, logprobs=True,
                                           top_logprobs=2, extra_body={"ignore_eos": True})

    outs = on_both_replicas(http, [send, send])
    text = tp1.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = tp1.tokenizer.encode(text, add_special_tokens=False)
    ref = tp1.generate(input_ids=ids, return_logprob=True, top_logprobs_num=2, sampling_params={
        "max_new_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True})["meta_info"]
    want = [[token_text(tp1, t[1]), bits(t[0]), [[token_text(tp1, a[1]), bits(a[0])] for a in row]]
            for t, row in zip(ref["output_token_logprobs"], ref["output_top_logprobs"])]
    for out in outs:
        got = [[c.token, bits(c.logprob), [[a.token, bits(a.logprob)] for a in c.top_logprobs]]
               for c in out.choices[0].logprobs.content]
        assert len(got) == 6 and differences(want, got) == []


def test_streaming_generate_ends_with_the_tp1_bits(http, tp1):
    body = {"text": PROMPT, "sampling_params": SEEDED, **LOGPROBS, "stream": True}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        data = sse_data(r.iter_lines())
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    check_cumulative_stream(chunks, 6)
    want = tp1.generate(input_ids=tp1.tokenizer.encode(PROMPT), sampling_params=SEEDED, **LOGPROBS)
    assert differences(output_record(want), output_record(chunks[-1])) == []


# -- negative controls ----------------------------------------------------------------------------

def test_the_bit_comparison_sees_one_ulp_and_another_seed(http, tp1):
    out = generate(http, SEEDED)
    one_ulp = json.loads(json.dumps(out))
    lp = one_ulp["meta_info"]["output_token_logprobs"][3]
    was, lp[0] = lp[0], float(np.nextafter(np.float32(lp[0]), np.float32(0)))
    assert differences(output_record(out), output_record(one_ulp)) == [
        f"/output_token_logprobs[3][0]: {bits(was)!r} -> {bits(lp[0])!r}"]
    other_seed = tp1.generate(input_ids=tp1.tokenizer.encode(PROMPT), **LOGPROBS,
                              sampling_params={**SEEDED, "seed": SEEDED["seed"] + 1})
    assert differences(output_record(out), output_record(other_seed)) != []
