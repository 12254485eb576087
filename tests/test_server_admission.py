"""Bounded admission, cancellation and input hygiene (jengine/server/admission.py), against the fake
engine of test_server_unit.py: every bound answers before the work it bounds is done.

The real-process versions (a fuzz over every route, the overload run) are in
tests/test_server_abuse.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from starlette.testclient import TestClient

from jengine.server.admission import AdmissionLimits
from jengine.server.app import create_app
from jengine.server.async_engine import AsyncEngine
from tests.test_server_unit import CharTokenizer, FakeEngine


class _Vocab:
    def get_vocab(self, with_added_tokens=True):
        return {"abcd": 0, "x": 1}  # the longest token covers 4 characters


class BoundedTokenizer(CharTokenizer):
    """A tokenizer that counts its calls and declares its vocabulary (for the text bound)."""

    backend = _Vocab()

    def __init__(self):
        self.calls = 0

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        return super().encode(text, add_special_tokens)


LIMITS = AdmissionLimits(max_n=8, max_batch_requests=20, max_request_bytes=4096,
                         max_waiting_requests=4, max_queued_tokens=400)


@pytest.fixture
def engine():
    eng = FakeEngine(max_context=64)
    eng.tokenizer = BoundedTokenizer()
    return eng


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine, admission=LIMITS)) as c:
        yield c


def _error(r, status, field):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    return err


# -- bounds that need only the request --------------------------------------------------------------

def test_n_above_max_n_is_refused_before_anything_is_expanded(client, engine):
    t0 = time.monotonic()
    r = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2,
                                                                          "n": 1000000}})
    assert time.monotonic() - t0 < 2.0
    assert "--max-n 8" in _error(r, 400, "sampling_params.n")["message"]
    assert engine.submitted == [] and engine.tokenizer.calls == 0
    _error(client.post("/v1/completions", json={"prompt": "Hi", "n": 9}), 400, "n")
    _error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "n": 9}), 400, "n")
    r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 1, "n": 8}})
    assert r.status_code == 200 and len(r.json()) == 8


def test_batch_fanout_is_refused_before_tokenizing(client, engine):
    r = client.post("/generate", json={"text": ["a"] * 21, "sampling_params": {"max_new_tokens": 1}})
    assert "--max-batch-requests is 20" in _error(r, 400, "text")["message"]
    r = client.post("/generate", json={"text": ["a"] * 3, "sampling_params": {"max_new_tokens": 1,
                                                                              "n": 7}})
    assert "3 prompt(s) x n=7" in _error(r, 400, "text")["message"]
    _error(client.post("/v1/completions", json={"prompt": ["a"] * 5, "n": 5}), 400, "prompt")
    assert engine.tokenizer.calls == 0 and engine.submitted == []


def test_oversized_body_is_413_before_it_is_read(client, engine):
    big = json.dumps({"text": "a" * 5000})
    err = _error(client.post("/generate", content=big), 413, "body")
    assert "--max-request-bytes" in err["message"] and err["type"] == "request_too_large"

    def chunks():  # no Content-Length: refused while streaming in
        for _ in range(10):
            yield b" " * 1000

    _error(client.post("/generate", content=chunks()), 413, "body")
    assert engine.tokenizer.calls == 0


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(client, engine):
    # context 64 x longest token 4 x margin 4 = 1024 characters at most
    r = client.post("/generate", json={"text": "a" * 1025, "sampling_params": {"max_new_tokens": 1}})
    assert "1025 characters" in _error(r, 400, "text")["message"]
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "b" * 2000}]})
    _error(r, 400, "messages[1].content")
    assert engine.tokenizer.calls == 0
    r = client.post("/generate", json={"text": "a" * 60, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200  # below the bound: tokenized, and fits


# -- bounds on the work in flight ------------------------------------------------------------------

def test_a_request_that_can_never_fit_the_queue_is_400(client):
    r = client.post("/generate", json={"input_ids": [[1] * 30] * 10,
                                       "sampling_params": {"max_new_tokens": 30}})
    assert "--max-queued-tokens is 400" in _error(r, 400, "max_new_tokens")["message"]


def test_full_queue_is_503_with_retry_after_then_serves_again(engine):
    engine.token_delay_s = 0.05
    aengine_holder = {}

    async def scenario():
        app = create_app(engine, admission=LIMITS)
        aengine: AsyncEngine = app.state.server.aengine
        aengine_holder["a"] = aengine
        from httpx import ASGITransport, AsyncClient

        async with AsyncClient(transport=ASGITransport(app=app), base_url="http://t") as c:
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 20}}
            # 32 running + 4 waiting fit; tokens: 22 each, 400 at most -> the 19th is refused
            tasks = [asyncio.ensure_future(c.post("/generate", json=body)) for _ in range(25)]
            results = await asyncio.gather(*tasks)
            codes = sorted(r.status_code for r in results)
            busy = [r for r in results if r.status_code == 503]
            assert codes.count(200) == 18 and len(busy) == 7, codes
            assert busy[0].headers["retry-after"] == "1"
            assert "--max-queued-tokens 400" in busy[0].json()["error"]["message"]
            assert aengine.work.queued_tokens == 0  # every finished request released its tokens
            r = await c.post("/generate", json=body)
            assert r.status_code == 200

    asyncio.run(scenario())


def test_waiting_bound_counts_requests_beyond_the_running_set(engine):
    engine.token_delay_s = 0.05
    limits = AdmissionLimits(max_waiting_requests=2, max_queued_tokens=10**6)

    async def scenario():
        app = create_app(engine, admission=limits)
        from httpx import ASGITransport, AsyncClient

        async with AsyncClient(transport=ASGITransport(app=app), base_url="http://t") as c:
            body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 3}}
            results = await asyncio.gather(*(c.post("/generate", json=body) for _ in range(40)))
            codes = [r.status_code for r in results]
            assert codes.count(200) == 34 and codes.count(503) == 6, codes  # 32 running + 2

    asyncio.run(scenario())


# -- cancellation ---------------------------------------------------------------------------------------

def test_aborts_are_coalesced_into_few_engine_calls(engine):
    engine.token_delay_s = 0.02

    async def scenario():
        aengine = AsyncEngine(engine, admission=AdmissionLimits(max_waiting_requests=100))
        items = [dict(input_ids=[1], sampling_params={"max_new_tokens": 200}) for _ in range(64)]
        handles = await aengine.submit_all(items)
        for h in handles:
            h.abort()  # 64 aborts, as a disconnect of a 64-sample request does
        finals = await asyncio.gather(*(h.final() for h in handles))
        assert all(f["meta_info"]["finish_reason"]["type"] == "abort" for f in finals)
        assert engine.abort_calls <= 2, engine.abort_calls  # not 64
        more = await aengine.submit_all(items[:10])
        assert await aengine.abort_all("server shutting down") == 10
        finals = await asyncio.gather(*(h.final() for h in more))
        assert {f["meta_info"]["finish_reason"]["message"] for f in finals} == {"server shutting down"}
        aengine.close()

    asyncio.run(scenario())


def test_abort_request_reaches_samples_and_batch_items(client, engine):
    engine.token_delay_s = 0.05
    import threading

    results = {}

    def send(name, body):
        results[name] = client.post("/generate", json=body)

    bodies = {"n": {"input_ids": [1], "rid": "fan", "sampling_params": {"max_new_tokens": 50,
                                                                         "n": 4}},
              "batch": {"input_ids": [[1], [2]], "rid": "bat",
                        "sampling_params": {"max_new_tokens": 50}}}
    threads = [threading.Thread(target=send, args=kv) for kv in bodies.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(engine.submitted) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.post("/abort_request", json={"rid": "fan"}).json()["success"]
    assert client.post("/abort_request", json={"rid": "bat"}).json()["success"]
    for t in threads:
        t.join(10)
    assert [o["meta_info"]["id"] for o in results["batch"].json()] == ["bat_0", "bat_1"]
    for r in results.values():
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in r.json())


# -- SGLang's per-item forms, roles, inputs that used to be 500s ---------------------------------------

def test_per_item_logprob_options_and_rid_prefix(client):
    r = client.post("/generate", json={
        "input_ids": [[1, 2, 3], [4, 5, 6]], "rid": "job",
        "return_logprob": [True, False], "logprob_start_len": [0, -1], "top_logprobs_num": [2, 0],
        "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert [a["meta_info"]["id"], b["meta_info"]["id"]] == ["job_0", "job_1"]
    assert len(a["meta_info"]["input_token_logprobs"]) == 3 and len(a["meta_info"]["output_top_logprobs"][0]) == 2
    assert "input_token_logprobs" not in b["meta_info"]
    _error(client.post("/generate", json={"input_ids": [[1], [2]], "return_logprob": [True]}), 400,
           "return_logprob")
    _error(client.post("/generate", json={"input_ids": [1, 2], "return_logprob": [True]}), 400,
           "return_logprob")
    _error(client.post("/generate", json={"input_ids": [[1], [2]], "top_logprobs_num": [1, "2"]}),
           400, "top_logprobs_num[1]")


def test_chat_roles_are_openais(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert "wizard" in _error(r, 400, "messages[0].role")["message"]
    r = client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, field", [
    ('{"text": "\\ud800"}', "text"),
    ('{"text": ["ok", "a\\udfffb"]}', "text[1]"),
    ('{"input_ids": [1], "sampling_params": {"stop": ["\\ud83d"]}}', "sampling_params.stop[0]"),
    ('{"text": "x", "\\ud800": 1}', "body key"),
])
def test_lone_surrogates_are_400_naming_the_field(client, body, field):
    _error(client.post("/generate", content=body), 400, field)


def test_surrogates_in_openai_bodies_and_deep_nesting_are_400(client):
    r = client.post("/v1/chat/completions",
                    content='{"messages": [{"role": "user", "content": "\\udc00"}]}')
    _error(r, 400, "messages[0].content")
    _error(client.post("/v1/completions", content='{"prompt": "\\ud800x"}'), 400, "prompt")
    deep = "[" * 1500 + "]" * 1500  # past Python's recursion limit, under the byte bound
    r = client.post("/generate", content='{"text": ' + deep + "}")
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    r = client.post("/generate", content='{"text": "x", "sampling_params": ' + "[" * 40 + "]" * 40 + "}")
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200


def test_limits_are_reported_and_validated(client):
    info = client.get("/get_server_info").json()
    assert info["server"]["admission"]["max_n"] == 8
    with pytest.raises(ValueError, match="--max-n=0"):
        AdmissionLimits(max_n=0)
