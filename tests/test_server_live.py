"""Acceptance tests of issue 6 against a REAL server process on loopback (`python -m jengine.serve`
serving the embedded tiny model), with the real `openai` client and httpx.

One server for the whole module (startup compiles the step buckets; a persistent compilation cache
makes later runs start in seconds). The load test is bounded: 256 requests of at most 12 new tokens,
and a wall-clock limit.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jengine.config import CHOICES
from jengine.server.testing import ServerProcess, check_cumulative_stream

CONTEXT = 512
VOCAB = 32768  # tiny: input and output vocabularies are equal
LAUNCH = ["--context-length", str(CONTEXT), "--max-running-requests", "32",
          "--chunked-prefill-size", "64", "--max-prefill-tokens", "128", "--log-level", "warning"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(LAUNCH) as proc:
        yield proc
        assert proc.proc.poll() is None, "the server died during the tests:\n" + proc.log_tail()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


def engine_metrics(http: httpx.Client) -> dict[str, float]:
    """Unlabelled samples of /metrics by name."""
    values = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if not sample.labels:
                values[sample.name] = sample.value
    return values


def wait_idle(http: httpx.Client, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = engine_metrics(http)
        if m["jengine:num_running_reqs"] == 0 and m["jengine:num_queue_reqs"] == 0 \
                and m["jengine:num_http_in_flight"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine not idle after {timeout_s} s: {m}"
        time.sleep(0.1)


def sse_data(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# -- OpenAI ---------------------------------------------------------------------------------------

def test_openai_completion_logprobs_match_the_generate_dialect(oai, http):
    c = oai.completions.create(model="tiny", prompt="The cat", max_tokens=6, logprobs=3, seed=11,
                               extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) <= 3 and max(top.values()) >= chosen
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert c.usage.completion_tokens == 6 and c.choices[0].finish_reason == "length"
    # The same request in SGLang's dialect: the same tokens and bit-identical logprobs.
    g = http.post("/generate", json={"text": "The cat", "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "seed": 11, "ignore_eos": True}}).json()
    assert g["text"] == c.choices[0].text
    assert [t[0] for t in g["meta_info"]["output_token_logprobs"]] == lp.token_logprobs


def test_openai_chat_with_logprobs(oai):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                    max_tokens=5, logprobs=True, top_logprobs=2, seed=3)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert 1 <= len(choice.logprobs.content) <= 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    assert r.usage.completion_tokens == len(choice.logprobs.content)


def test_openai_seed_twice_identical_and_another_seed_differs(oai):
    def run(seed):
        c = oai.completions.create(model="tiny", prompt="Once upon", max_tokens=12, seed=seed,
                                   temperature=1.0, logprobs=0, extra_body={"ignore_eos": True})
        return c.choices[0].text, c.choices[0].logprobs.token_logprobs

    first, again, other = run(1234), run(1234), run(1235)
    assert first == again
    assert first[0] != other[0]  # negative control: the seed is actually used


def test_openai_n2_gives_two_distinct_reproducible_samples(oai):
    def run():
        return oai.completions.create(model="tiny", prompt="A", max_tokens=10, n=2, seed=7,
                                      temperature=1.0, extra_body={"ignore_eos": True})

    a, b = run(), run()
    assert [c.index for c in a.choices] == [0, 1]
    assert a.choices[0].text != a.choices[1].text
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20


def test_openai_streaming_equals_non_streaming(oai):
    kwargs = dict(model="tiny", max_tokens=8, seed=5, extra_body={"ignore_eos": True})
    full = oai.completions.create(prompt="Stream me", **kwargs).choices[0].text
    chunks = list(oai.completions.create(prompt="Stream me", stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "hi"}]
    chat_full = oai.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    chat_chunks = list(oai.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_full
    assert [c.choices[0].finish_reason for c in chat_chunks][-1] == "length"


# -- SGLang /generate -----------------------------------------------------------------------------

def test_generate_batch_input_ids_in_order(http):
    prompts = [[5, 6, 7], [100, 200], [9] * 40]
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    batch = http.post("/generate", json={"input_ids": prompts, "sampling_params": sp}).json()
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, out in zip(prompts, batch):
        single = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp}).json()
        assert out["output_ids"] == single["output_ids"] and len(out["output_ids"]) == 4
        assert out["meta_info"]["prompt_tokens"] == len(prompt)


def test_generate_teacher_forcing_scores_every_prompt_position(http):
    ids = [11, 22, 33, 44, 55, 66]
    out = http.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                       "logprob_start_len": 0,
                                       "sampling_params": {"max_new_tokens": 0}}).json()
    triples = out["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in triples] == ids
    assert triples[0][0] is None
    assert all(isinstance(t[0], float) and t[0] <= 0 for t in triples[1:])
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0


def test_generate_streaming_chunks_then_done(http):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                        "ignore_eos": True}}
    final = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        data = sse_data(r.iter_lines())
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    check_cumulative_stream(chunks, 5)
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["text"] == final["text"]


def test_client_disconnect_mid_stream_aborts_and_frees_kv(http, server):
    body = {"input_ids": list(range(1, 30)), "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}  # ~tens of seconds
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/generate", json=body) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                assert json.loads(next(events)[6:])["finished"] is False
            # leaving the block closes the connection mid-stream
    wait_idle(http, timeout_s=10)  # far less than the 400 tokens would take
    # The same for a client that gives up on a non-streaming request.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json={**body, "stream": False}, timeout=2.0)
    wait_idle(http, timeout_s=10)
    assert http.post("/flush_cache").status_code == 200
    assert engine_metrics(http)["jengine:kv_used_tokens"] == 0


def test_abort_request_by_rid_aborts_all_n_samples(http, server):
    result = {}

    def long_request():
        result["r"] = httpx.post(server.url + "/generate", timeout=60, json={
            "input_ids": [9, 9, 9], "rid": "abort-me",
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "n": 2}})

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while engine_metrics(http)["jengine:num_running_reqs"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert http.post("/abort_request", json={"rid": "abort-me"}).json()["success"] is True
    thread.join(30)
    outs = result["r"].json()
    assert [o["meta_info"]["id"] for o in outs] == ["abort-me-0", "abort-me-1"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    wait_idle(http, timeout_s=10)


# -- bad input ------------------------------------------------------------------------------------

GOOD = ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
OVER = CONTEXT - 2 + 1  # prompt of 2 tokens: at most CONTEXT - 2 new tokens

# (route, body as JSON text or object, field named, value named)
BAD_INPUTS = [
    ("/generate", "{'input_ids': [1]", "body", "{'input_ids': [1]"),
    ("/generate", "[1, 2, 3]", "body", [1, 2, 3]),
    ("/generate", {"input_ids": "1 2 3"}, "input_ids", "1 2 3"),
    ("/generate", {"input_ids": [1], "stream": "yes"}, "stream", "yes"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
     "sampling_params.temperature", "hot"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 5}},
     "sampling_params.max_tokens", 5),
    ("/generate", {"input_ids": [1, VOCAB]}, "input_ids[1]", VOCAB),
    ("/generate", {"input_ids": [[1], [2, -1]]}, "input_ids[1][1]", -1),
    # Prompt-logprob target outside the output vocabulary (tiny's vocabularies are equal, so the
    # split case, target < input vocab but >= output vocab, is covered in test_server_unit.py).
    ("/generate", {"input_ids": [1, VOCAB + 5], "return_logprob": True, "logprob_start_len": 0},
     "input_ids[1]", VOCAB + 5),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}},
     "sampling_params.max_new_tokens", -3),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": OVER}},
     "sampling_params.max_new_tokens", OVER),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -0.1}},
     "sampling_params.temperature", -0.1),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0.0}}, "sampling_params.top_p", 0.0),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", 1.5),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k", 0),
    ("/generate", {"input_ids": [7] * CONTEXT}, "input_ids", CONTEXT),
    ("/generate", {"text": "hello " * CONTEXT}, "text", None),  # value: the token count
    ("/generate", {"input_ids": [1], "logprob_start_len": 5}, "logprob_start_len", 5),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT}, "max_tokens", CONTEXT),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", -1),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p", 2),
    ("/v1/completions", {"prompt": [1, VOCAB]}, "prompt[1]", VOCAB),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs", 99),
    ("/v1/chat/completions", {"messages": "hello"}, "messages", "hello"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content", 5),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 0},
     "top_k", 0),
    ("/v1/chat/completions", "{]", "body", "{]"),
]


def test_bad_input_is_400_naming_field_and_value_and_harms_nobody(http, server):
    # A streaming request in flight the whole time: bad neighbours must not disturb it.
    bystander: dict = {}

    def stream_bystander():
        body = {"input_ids": [3, 1, 4, 1, 5], "stream": True,
                "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
        with httpx.Client(base_url=server.url, timeout=120) as own:
            with own.stream("POST", "/generate", json=body) as r:
                bystander["data"] = sse_data(r.iter_lines())

    thread = threading.Thread(target=stream_bystander)
    thread.start()
    for route, body, field, value in BAD_INPUTS:
        content = body if isinstance(body, str) else json.dumps(body)
        r = http.post(route, content=content)
        assert r.status_code == 400, (route, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["field"] == field and err["message"], (body, err)
        if value is not None:
            assert err["value"] == value, (body, err)
        ok = http.post(GOOD[0], json=GOOD[1])
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2, (body, ok.text)
    thread.join(120)
    data = bystander["data"]
    assert data[-1] == "[DONE]" and len(json.loads(data[-2])["output_ids"]) == 60
    assert http.get("/health").status_code == 200


# -- info routes ----------------------------------------------------------------------------------

def test_info_routes_advertise_the_contract(http):
    info = http.get("/get_server_info").json()
    for switch in CHOICES:  # every numerics switch, resolved to a concrete value
        assert info.get(switch) is not None, switch
    assert info["max_context"] == CONTEXT and info["max_running_requests"] == 32
    model = http.get("/get_model_info").json()
    assert model["context_length"] == CONTEXT and model["vocab_size"] == VOCAB
    assert model["has_chat_template"] is True
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert http.get("/health_generate").status_code == 200
    assert http.post("/abort_request", json={"rid": "not-a-request"}).json()["success"] is False
    names = set(engine_metrics(http))
    for metric in ("num_requests_total", "prompt_tokens_total", "generation_tokens_total",
                   "num_queue_reqs", "num_running_reqs", "kv_used_tokens", "token_usage",
                   "cache_hit_tokens_total", "num_retractions_total", "step_latency_seconds_count"):
        assert "jengine:" + metric in names, metric


# -- load -----------------------------------------------------------------------------------------

LOAD_REQUESTS = 256
LOAD_LIMIT_S = 240  # wall-clock bound of the whole load


async def _one_load_request(client: httpx.AsyncClient, i: int, rng: random.Random) -> dict:
    """Request i of the load; its kind is i % 8. Returns what the client saw."""
    kind = i % 8
    ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 120))]
    n = rng.randint(1, 12)
    sp = {"max_new_tokens": n, "ignore_eos": True, "temperature": rng.choice([0.0, 1.0])}
    seen = {"kind": kind, "n": n}
    if kind in (0, 1, 2):  # /generate, whole response
        r = await client.post("/generate", json={"input_ids": ids, "sampling_params": sp,
                                                 "return_logprob": kind == 2})
        seen.update(status=r.status_code, finals=[r.json()])
    elif kind == 3:  # OpenAI completion
        r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": n,
                                                       "ignore_eos": True, "logprobs": 1})
        seen.update(status=r.status_code, finals=[r.json()])
    elif kind in (4, 5, 6):  # streams read to the end (6: OpenAI chat)
        route, body = ("/generate", {"input_ids": ids, "sampling_params": sp, "stream": True})
        if kind == 6:
            route, body = ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "load " * rng.randint(1, 30)}],
                "max_tokens": n, "ignore_eos": True, "stream": True})
        async with client.stream("POST", route, json=body) as r:
            data = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        seen.update(status=r.status_code, data=data)
    else:  # a stream abandoned after its first chunk
        sp["max_new_tokens"] = seen["n"] = 200
        async with client.stream("POST", "/generate", json={"input_ids": ids, "stream": True,
                                                            "sampling_params": sp}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        seen.update(status=r.status_code, aborted=True)
    return seen


def _check_complete(seen: dict) -> None:
    assert seen["status"] == 200, seen
    if seen.get("aborted"):
        return
    kind, n = seen["kind"], seen["n"]
    if kind in (0, 1, 2):
        (out,) = seen["finals"]
        assert out["finished"] and len(out["output_ids"]) == n, seen
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        if kind == 2:
            assert len(out["meta_info"]["output_token_logprobs"]) == n
    elif kind == 3:
        (out,) = seen["finals"]
        assert out["usage"]["completion_tokens"] == n and out["choices"][0]["finish_reason"] == "length"
    else:
        data = seen["data"]
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1, seen
        chunks = [json.loads(d) for d in data[:-1]]
        if kind == 6:
            finishes = [c["choices"][0]["finish_reason"] for c in chunks]
            assert finishes.count("length") == 1 and finishes[-1] == "length", finishes
        else:
            assert [c["finished"] for c in chunks].count(True) == 1 and chunks[-1]["finished"]
            assert len(chunks[-1]["output_ids"]) == n


def test_load_256_concurrent_mixed_requests(http, server):
    before = engine_metrics(http)["jengine:num_requests_total"]

    async def run_all():
        rng = random.Random(2026)
        limits = httpx.Limits(max_connections=LOAD_REQUESTS + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=LOAD_LIMIT_S, limits=limits) as c:
            return await asyncio.wait_for(asyncio.gather(
                *(_one_load_request(c, i, random.Random(rng.random())) for i in range(LOAD_REQUESTS))),
                LOAD_LIMIT_S)

    started = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - started
    assert len(results) == LOAD_REQUESTS
    for seen in results:
        _check_complete(seen)

    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    metrics = wait_idle(http, timeout_s=30)
    aborted = sum(1 for s in results if s.get("aborted"))
    # Every request reached the engine and finished there (the abandoned ones as aborts).
    assert metrics["jengine:num_requests_total"] - before >= LOAD_REQUESTS + 1
    assert http.post("/flush_cache").status_code == 200
    assert engine_metrics(http)["jengine:kv_used_tokens"] == 0
    print(f"load: {LOAD_REQUESTS} requests ({aborted} abandoned) in {elapsed:.1f} s")
