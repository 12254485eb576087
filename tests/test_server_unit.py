"""Server unit tests against a fake engine (no model, no compile): schema translation, error
mapping, auth, metrics. The real-server acceptance tests are in test_server_live.py."""

from __future__ import annotations

import json
import threading
import time
import types
import zlib

import openai
import pytest
from starlette.testclient import TestClient

from jengine.config import LaunchConfig
from jengine.launch import ServerOptions
from jengine.engine.io_struct import RequestLimits
from jengine.engine.request import InvalidRequest, SamplingParams, derive_sample_seeds
from jengine.server.app import create_app
from jengine.server.async_engine import LoopWakeups, RequestStream
from jengine.server.gil import favour_engine_thread
from jengine.server.http_utils import CumulativeEvents, dumps_bytes, jsonable, sse_event
from jengine.server.metrics import _after_overlap
from jengine.server.testing import check_cumulative_stream

class CharTokenizer:
    chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i % 95)) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("model has no chat template")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ">"


class FakeEngine:
    def __init__(self, vocab_size: int = 100, input_vocab_size: int = 128, max_context: int = 64,
                 token_delay_s: float = 0.0):
        self.tokenizer = CharTokenizer()
        self.model_config = types.SimpleNamespace(vocab_size=vocab_size,
                                                  input_vocab_size=input_vocab_size,
                                                  max_position_embeddings=max_context)
        self.max_context = max_context
        # No KV pool: the pool bound never binds here.
        self.request_limits = RequestLimits(max_context, input_vocab_size, vocab_size,
                                            pool_tokens=1 << 30, page_size=1)
        self.config = LaunchConfig()
        self.resolved = types.SimpleNamespace(config=self.config, as_dict=lambda: {"numerics": "auto"})
        self.plan = types.SimpleNamespace(
            scheduler=types.SimpleNamespace(max_running_requests=self.config.max_running_requests),
            server=ServerOptions(host="127.0.0.1", port=0, api_key=None, served_model_name=None,
                                 log_level="info"))
        self.token_delay_s = token_delay_s
        self.submitted: list[dict] = []
        self.aborted: set[str] = set()
        self.abort_messages: dict[str, str] = {}
        self.abort_calls = 0
        self._lock = threading.Lock()
        self._running: set[str] = set()

    # -- the Engine API used by the server ---------------------------------------------------------
    def submit(self, *, input_ids, sampling_params=None, return_logprob=False, logprob_start_len=-1,
               top_logprobs_num=0, rid=None, stream=False, on_output=None):
        sp = SamplingParams.from_dict(sampling_params)
        with self._lock:
            if rid in self._running:
                raise ValueError(f"rid={rid!r} is already in flight")
            self._running.add(rid)
        self.submitted.append(dict(input_ids=list(input_ids), sampling_params=dict(sampling_params),
                                   return_logprob=return_logprob, rid=rid, stream=stream,
                                   logprob_start_len=logprob_start_len,
                                   top_logprobs_num=top_logprobs_num))
        args = (list(input_ids), sp, rid, return_logprob, logprob_start_len, top_logprobs_num,
                stream, on_output)
        threading.Thread(target=self._run, args=args, daemon=True).start()
        return rid

    def abort_many(self, rids, message: str = "aborted by the client") -> int:
        with self._lock:
            found = [r for r in rids if r in self._running]
            self.aborted.update(found)
            self.abort_messages.update({r: message for r in found})
            self.abort_calls += 1
            return len(found)

    def flush_cache(self) -> bool:
        return True

    def stats(self) -> dict:
        return {"num_running": len(self._running), "num_waiting": 0, "kv_used_tokens": 0,
                "kv_total_tokens": 1024, "cache_hit_tokens_total": 0, "retractions_total": 0,
                "prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_total": 0,
                "step_latency_seconds": [0.01, 0.02]}

    def server_info(self) -> dict:
        return {"numerics": "auto", "max_context": self.max_context}

    # -- the fake model -------------------------------------------------------------------------------
    @staticmethod
    def token_at(seed: int, position: int, vocab_size: int) -> int:
        return (seed + 7 * position) % vocab_size

    def _run(self, ids, sp, rid, return_logprob, start, k, stream, on_output):
        seed = sp.seed if sp.seed is not None else zlib.crc32(rid.encode())
        vocab = self.model_config.vocab_size
        out_ids: list[int] = []
        reason = {"type": "length"}
        for j in range(sp.max_new_tokens):
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            if rid in self.aborted:
                reason = {"type": "abort", "message": self.abort_messages.get(rid, "aborted")}
                break
            out_ids.append(self.token_at(seed, len(ids) + j, vocab))
            if stream and j < sp.max_new_tokens - 1:
                on_output(self._output(ids, out_ids, rid, None, return_logprob, start, k))
        with self._lock:
            self._running.discard(rid)
        on_output(self._output(ids, out_ids, rid, reason, return_logprob, start, k))

    def _output(self, ids, out_ids, rid, reason, return_logprob, start, k) -> dict:
        def triple(t):
            return (-(t % 5) / 4, t, None)

        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": len(ids),
                "completion_tokens": len(out_ids), "cached_tokens": 0}
        if return_logprob:
            s = len(ids) - 1 if start == -1 else start
            meta["input_token_logprobs"] = [(None, ids[s], None)] + [triple(t) for t in ids[s + 1:]]
            meta["output_token_logprobs"] = [triple(t) for t in out_ids]
            if k:
                meta["input_top_logprobs"] = [None] + [[triple(t)] * k for t in ids[s + 1:]]
                meta["output_top_logprobs"] = [[triple(t)] * k for t in out_ids]
        return {"text": self.tokenizer.decode(out_ids), "output_ids": list(out_ids),
                "finished": reason is not None, "meta_info": meta}


# -- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


def expected_ids(seed: int, prompt_len: int, n: int, vocab: int = 100) -> list[int]:
    return [FakeEngine.token_at(seed, prompt_len + j, vocab) for j in range(n)]


def sse_events(response) -> tuple[list[dict], str]:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line[6:]) for line in lines[:-1]], lines[-1]


# -- /generate ------------------------------------------------------------------------------------

def test_generate_single_and_batch_keep_order_and_rids(client):
    r = client.post("/generate", json={"input_ids": [1, 2, 3],
                                       "sampling_params": {"max_new_tokens": 3, "seed": 5}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == expected_ids(5, 3, 3)
    r = client.post("/generate", json={"input_ids": [[1, 2], [3, 4, 5]], "rid": ["a", "b"],
                                       "sampling_params": [{"max_new_tokens": 2, "seed": 1},
                                                           {"max_new_tokens": 1, "seed": 2}]})
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    assert [o["output_ids"] for o in outs] == [expected_ids(1, 2, 2), expected_ids(2, 3, 1)]


def test_generate_text_is_tokenized_and_default_max_fits_context(client, engine):
    r = client.post("/generate", content=json.dumps({"text": "x" * 60}))  # no JSON content-type
    assert r.status_code == 200, r.text
    assert engine.submitted[-1]["input_ids"] == [ord("x")] * 60
    assert engine.submitted[-1]["sampling_params"]["max_new_tokens"] == 4  # context 64 - 60


def test_generate_n_samples_use_the_engines_seed_derivation(client):
    r = client.post("/generate", json={"input_ids": [1, 2], "rid": "x",
                                       "sampling_params": {"max_new_tokens": 2, "seed": 9, "n": 2}})
    outs = r.json()
    seeds = derive_sample_seeds(9, 2)
    assert [o["meta_info"]["id"] for o in outs] == ["x-0", "x-1"]
    assert [o["output_ids"] for o in outs] == [expected_ids(s, 2, 2) for s in seeds]
    assert seeds[0] != seeds[1]


def test_generate_stream_is_cumulative_and_ends_with_done(client):
    body = {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 4, "seed": 3}}
    with client.stream("POST", "/generate", json=body) as r:
        events, last = sse_events(r)
    assert last == "data: [DONE]"
    check_cumulative_stream(events, 4)
    assert events[-1]["output_ids"] == expected_ids(3, 2, 4)


def test_generate_batch_stream_tags_index(client):
    body = {"input_ids": [[1], [2, 3]], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    with client.stream("POST", "/generate", json=body) as r:
        events, last = sse_events(r)
    assert last == "data: [DONE]"
    finals = {e["index"]: e for e in events if e["finished"]}
    assert sorted(finals) == [0, 1]


def test_teacher_forcing_triples_and_token_text(client):
    r = client.post("/generate", json={"input_ids": [10, 11, 12], "return_logprob": True,
                                       "logprob_start_len": 0, "return_text_in_logprobs": True,
                                       "sampling_params": {"max_new_tokens": 0}})
    meta = r.json()["meta_info"]
    assert [t[0] for t in meta["input_token_logprobs"]] == [None, -(11 % 5) / 4, -(12 % 5) / 4]
    assert [t[2] for t in meta["input_token_logprobs"]] == [chr(32 + 10), chr(32 + 11), chr(32 + 12)]
    assert meta["output_token_logprobs"] == [] and r.json()["output_ids"] == []


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field, value", [
    ("{not json", "body", "{not json"),
    ("[1, 2]", "body", [1, 2]),
    ({"input_ids": [1, "a"]}, "input_ids", [1, "a"]),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob", "yes"),
    ({"input_ids": [1], "return_logprobs": True}, "return_logprobs", True),
    ({"input_ids": [1], "return_routed_experts": True}, "return_routed_experts", True),  # no MoE
    ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "sampling_params.temprature", 1),
    ({"input_ids": [1, 128]}, "input_ids[1]", 128),  # input vocab is 128
    ({"input_ids": [1, 120], "return_logprob": True, "logprob_start_len": 0}, "input_ids[1]", 120),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", -1),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 64}}, "sampling_params.max_new_tokens", 64),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature", -0.5),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p", 0),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k", 0),
    ({"input_ids": [1] * 64}, "input_ids", 64),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params", [{}]),
])
def test_bad_generate_input_is_400_naming_field_and_value(client, body, field, value):
    data = body if isinstance(body, str) else json.dumps(body)
    r = client.post("/generate", content=data)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["field"], err["value"]) == (field, value), err
    assert client.post("/generate", json={"input_ids": [1], "sampling_params": {
        "max_new_tokens": 1}}).status_code == 200


def test_engine_refusal_becomes_400_read_from_its_fields():
    class Refusing(FakeEngine):
        def submit(self, **kw):
            raise InvalidRequest("input_ids[0]", 5, "is refused by the engine")

    with TestClient(create_app(Refusing())) as c:
        err = c.post("/generate", json={"input_ids": [5]}).json()["error"]
    assert (err["field"], err["value"]) == ("input_ids[0]", 5)
    assert err["message"] == "input_ids[0]=5 is refused by the engine"


def test_unexpected_failure_is_500_for_that_request_only():
    class Broken(FakeEngine):
        def server_info(self):
            raise RuntimeError("boom")

    with TestClient(create_app(Broken()), raise_server_exceptions=False) as c:
        r = c.get("/get_server_info")
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200


# -- OpenAI ---------------------------------------------------------------------------------------

def test_completion_logprobs_n_and_seed(oai, engine):
    a = oai.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, n=2, seed=4, logprobs=2)
    seeds = derive_sample_seeds(4, 2)
    assert [c.index for c in a.choices] == [0, 1]
    for choice, seed in zip(a.choices, seeds):
        ids = expected_ids(seed, 3, 3)
        assert choice.text == "".join(chr(32 + i) for i in ids)
        assert choice.logprobs.token_logprobs == [-(i % 5) / 4 for i in ids]
        assert choice.logprobs.tokens == [chr(32 + i) for i in ids]
        assert choice.logprobs.text_offset == [0, 1, 2]
        assert choice.finish_reason == "length"
    assert a.usage.prompt_tokens == 3 and a.usage.completion_tokens == 6
    one = oai.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, seed=4)
    assert engine.submitted[-1]["sampling_params"]["seed"] == 4  # n=1 keeps the seed as sent
    assert one.choices[0].text == "".join(chr(32 + i) for i in expected_ids(4, 3, 3))


def test_completion_echo_scores_the_prompt(oai):
    c = oai.completions.create(model="tiny", prompt=[10, 11], max_tokens=0, echo=True, logprobs=0)
    lp = c.choices[0].logprobs
    assert lp.token_logprobs == [None, -(11 % 5) / 4]
    assert c.choices[0].text == chr(32 + 10) + chr(32 + 11)


def test_completion_stream_deltas_concatenate_to_the_text(oai):
    chunks = list(oai.completions.create(model="tiny", prompt="ab", max_tokens=4, seed=1,
                                         stream=True, logprobs=1))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == "".join(chr(32 + i) for i in expected_ids(1, 2, 4))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 4


def test_chat_uses_the_template_and_streams(oai, engine):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=2, logprobs=True, top_logprobs=1, seed=0)
    assert engine.submitted[-1]["input_ids"] == [ord(c) for c in "<user>hi>"]
    assert r.choices[0].message.role == "assistant"
    assert [t.logprob for t in r.choices[0].logprobs.content] == [
        -(i % 5) / 4 for i in expected_ids(0, 9, 2)]
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 1
    chunks = list(oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, seed=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "".join(chr(32 + i) for i in expected_ids(0, 9, 3))
    assert chunks[-1].usage.completion_tokens == 3


def test_openai_errors_use_openai_field_names(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="a", max_tokens=100)
    assert e.value.body["field"] == "max_tokens" and e.value.body["value"] == 100
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                    temperature=-1)
    assert e.value.body["field"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="a")


def test_chat_without_template_is_a_clear_400():
    eng = FakeEngine()
    eng.tokenizer.chat_template = None
    with TestClient(create_app(eng)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


# -- auth, admin, metrics -------------------------------------------------------------------------

def test_api_key_guards_every_route_but_health():
    with TestClient(create_app(FakeEngine(), api_key="sekret")) as c:
        assert c.get("/health").status_code == 200
        for method, path in [("get", "/v1/models"), ("post", "/generate"), ("get", "/metrics"),
                             ("get", "/get_server_info"), ("post", "/flush_cache")]:
            assert getattr(c, method)(path).status_code == 401, path
            bad = {"Authorization": "Bearer wrong"}
            assert getattr(c, method)(path, headers=bad).status_code == 401, path
        ok = {"Authorization": "Bearer sekret"}
        assert c.get("/v1/models", headers=ok).status_code == 200


def test_admin_routes(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/get_model_info").json()["context_length"] == 64
    assert client.get("/get_server_info").json()["numerics"] == "auto"
    assert client.post("/flush_cache").json()["success"] is True
    assert client.post("/abort_request", json={"rid": "nope"}).json()["success"] is False
    assert client.post("/abort_request", json={}).status_code == 400
    assert client.get("/health_generate").status_code == 200


def test_step_histogram_counts_each_step_once():
    assert _after_overlap([], [1.0, 2.0]) == 0
    assert _after_overlap([1.0, 2.0], [1.0, 2.0]) == 2
    assert _after_overlap([1.0, 2.0], [0.5, 1.0, 2.0, 3.0]) == 3
    assert _after_overlap([9.0], [1.0, 2.0]) == 0  # wrapped past the list: take it all
    eng = FakeEngine()
    with TestClient(create_app(eng)) as c:
        c.get("/metrics")
        text = c.get("/metrics").text  # the same two latencies: not observed again
    assert "jengine:step_latency_seconds_count 2.0" in text
    assert "jengine:num_running_reqs 0.0" in text and "jengine:kv_total_tokens 1024.0" in text


def test_failure_inside_a_stream_ends_it_with_an_error_event():
    class BadDecode(CharTokenizer):
        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            if not skip_special_tokens:  # only the per-token decode of return_text_in_logprobs
                raise RuntimeError("decoder broke")
            return super().decode(ids)

    eng = FakeEngine()
    eng.tokenizer = BadDecode()
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        body = {"input_ids": [1, 2], "stream": True, "return_logprob": True,
                "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3}}
        with c.stream("POST", "/generate", json=body) as r:
            events, last = sse_events(r)
        assert last == "data: [DONE]" and "decoder broke" in events[-1]["error"]["message"]
        deadline = time.monotonic() + 5
        while eng._running and time.monotonic() < deadline:  # the request was aborted, not leaked
            time.sleep(0.01)
        assert not eng._running and c.get("/health").status_code == 200


class _StreamOwner:
    def _observe(self, handle, update):
        pass

    def _forget(self, rid):
        pass


def _cumulative(ids, finished=False):
    return {"text": "".join(map(str, ids)), "output_ids": ids, "finished": finished,
            "meta_info": {"output_token_logprobs": [(-0.5, i, None) for i in ids]}}


def test_a_stream_behind_the_engine_gets_the_newest_output_with_every_token_it_missed():
    """Outputs are cumulative: offered faster than they are read, only the newest is handed over,
    and its delta holds every token since the last one read (SGLang's out_list[-1])."""
    import asyncio

    out = _cumulative

    async def run():
        stream = RequestStream(_StreamOwner(), "r", LoopWakeups(asyncio.get_running_loop()))
        updates = stream.updates()
        stream.offer(out([7]))
        first = await updates.__anext__()
        for n in range(2, 5):  # three outputs before the reader comes back
            stream.offer(out(list(range(7, 7 + n)), finished=n == 4))
        await asyncio.sleep(0)  # the scheduled wake-ups run
        second = await updates.__anext__()
        with pytest.raises(StopAsyncIteration):
            await updates.__anext__()
        return first, second

    first, second = asyncio.run(run())
    assert first.new_ids == [7] and first.new_text == "7" and not first.finished
    assert second.new_ids == [8, 9, 10] and second.new_text == "8910" and second.finished
    assert [t[1] for t in second.new_logprobs] == [8, 9, 10]


def test_a_steps_offers_to_many_streams_wake_the_loop_once():
    """The engine thread offers every running request an output per step: one self-pipe write and
    one loop callback for the batch, not one per request; every stream still gets its output."""
    import asyncio

    async def run():
        loop = asyncio.get_running_loop()
        scheduled = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda cb, *a: (scheduled.append(cb), real(cb, *a))[1]
        wakeups = LoopWakeups(loop)
        streams = [RequestStream(_StreamOwner(), f"r{i}", wakeups) for i in range(64)]
        readers = [s.updates() for s in streams]
        engine = threading.Thread(target=lambda: [
            s.offer(_cumulative([i], finished=True)) for i, s in enumerate(streams)])
        engine.start()
        engine.join()  # all 64 offered before the loop runs any wake-up
        got = [await r.__anext__() for r in readers]
        return len(scheduled), got

    n, got = asyncio.run(run())
    assert n == 1
    assert [u.new_ids for u in got] == [[i] for i in range(64)] and all(u.finished for u in got)


def test_dumps_writes_the_bytes_the_jsonable_walk_wrote():
    import numpy as np

    value = {"text": "é\u2028", "output_ids": [1, np.int64(2)], "finished": np.bool_(True),
             "meta_info": {"lp": [(np.float32(-0.1), 3, None), (-0.0, 4, None),
                                  (float("-inf"), 5, None)], "t": (1.5, np.float64(1e-300)),
                           "tags": {"b", "a"}, 7: np.arange(3)}}
    old = json.dumps(jsonable(value), ensure_ascii=False, allow_nan=True,
                     separators=(",", ":")).encode()
    assert dumps_bytes(value) == old
    assert json.loads(dumps_bytes(value))["meta_info"]["lp"][0][0] == float(np.float32(-0.1))
    assert dumps_bytes({np.int64(1): 2}) == b'{"1":2}'  # a key json refuses takes the walk
    assert dumps_bytes({"s": "\ud800"}) == b'{"s":"\\ud800"}'  # a lone surrogate: escaped
    assert dumps_bytes([np.float32(0.1)]) != dumps_bytes([0.1])  # the float32 value, not 0.1


def test_cumulative_events_are_sse_event_byte_for_byte():
    """/generate's stream encodes each token id once (CumulativeEvents); every event must still be
    the bytes `sse_event` writes for that output, whatever the outputs do between events."""
    import numpy as np

    def out(ids, text=None, **extra):
        return {"text": "".join(f" t{i}" for i in ids) if text is None else text,
                "output_ids": list(ids), "finished": False,
                "meta_info": {"id": "r", "completion_tokens": len(ids),
                              "output_token_logprobs": [(np.float32(-0.25), i, None) for i in ids]},
                **extra}

    ids = [5, 7, 9, 11, 13, 17, 19, 23]
    outs = [out(ids[:n]) for n in (1, 2, 3, 6)]  # growing by one, and by several (a late reader)
    outs += [out(ids[:6], text='he said "output_ids":[] \u2028 é')]  # text only changes
    outs += [out([5, 8, 9, 11, 13, 17])]  # ids rewritten, not extended: must start over
    outs += [out([5, 8, 9, 11, 13, 17, np.int64(29)], index=3)]  # a batch's index; a numpy id
    outs += [out([5, 8], text="lone \ud800 surrogate")]  # shorter; UTF-8 cannot encode it
    outs += [{"output_ids": [1], "text": "keys in another order"}, out([1, 2]), out([1, 2, 3])]
    outs += [{**out([1, 2, 3, 4]), "finished": True}]
    events = CumulativeEvents()
    for o in outs:
        assert events.event(o) == sse_event(o), o
    assert json.loads(events.event(out([1, 2, 3, 4, 5]))[len(b"data: "):])["output_ids"] == [1, 2, 3, 4, 5]
    # Negative control: the state it keeps matters; an encoder that missed the rewrite above
    # would have sent the old ids.
    stale = CumulativeEvents()
    stale.event(out([5, 7, 9]))
    stale._ids = [5, 8, 9]  # pretend the previous output had been [5, 8, 9]
    assert stale.event(out([5, 8, 9, 11])) != sse_event(out([5, 8, 9, 11]))


def test_a_caller_extending_its_ids_list_in_place_still_gets_the_right_events():
    ids = [1, 2]
    events = CumulativeEvents()
    first = {"text": "ab", "output_ids": ids}
    assert events.event(first) == sse_event(first)
    ids.append(3)
    second = {"text": "abc", "output_ids": ids}
    assert events.event(second) == sse_event(second) == b'data: {"text":"abc","output_ids":[1,2,3]}\n\n'


def test_favour_engine_thread_sets_the_interval_and_refuses_nonsense():
    import sys

    before = sys.getswitchinterval()
    try:
        favour_engine_thread(0.001)
        assert sys.getswitchinterval() == pytest.approx(0.001)
        with pytest.raises(ValueError, match="switch interval 0"):
            favour_engine_thread(0)
    finally:
        sys.setswitchinterval(before)
