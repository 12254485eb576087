"""A second real server, started with --api-key: authentication, then graceful shutdown on SIGTERM
(stop admitting, finish or abort what is in flight, exit 0). The module's last test stops it.

(API key off is the default of the server in test_server_live.py, whose requests carry no key.)
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from jengine.server.testing import ServerProcess

KEY = "test-key-123"
LAUNCH = ["--context-length", "512", "--max-running-requests", "32", "--chunked-prefill-size", "64",
          "--max-prefill-tokens", "128", "--log-level", "warning", "--api-key", KEY,
          "--graceful-shutdown-timeout", "3"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(LAUNCH) as proc:
        yield proc


def test_api_key_required_everywhere_but_health(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        for method, path, kw in [("post", "/generate", {"json": body}), ("get", "/v1/models", {}),
                                 ("get", "/metrics", {}), ("get", "/get_server_info", {}),
                                 ("get", "/health_generate", {}), ("post", "/flush_cache", {})]:
            assert getattr(http, method)(path, **kw).status_code == 401, path
            wrong = {"Authorization": "Bearer not-the-key"}
            r = getattr(http, method)(path, headers=wrong, **kw)
            assert r.status_code == 401 and r.json()["error"]["field"] == "Authorization", path
        good = {"Authorization": f"Bearer {KEY}"}
        assert http.post("/generate", json=body, headers=good).status_code == 200
        info = http.get("/get_server_info", headers=good)
        assert info.status_code == 200 and KEY not in info.text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_client_leaving_a_non_streaming_request_logs_no_error(server):
    """The disconnect aborts the request (the server stays idle after) and logs no asyncio
    "exception was never retrieved" traceback (it did, once per disconnect)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True,
                                                        "n": 4}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, headers=headers, timeout=1.0)
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            running = [line for line in http.get("/metrics").text.splitlines()
                       if line.startswith("jengine:num_running_reqs ")]
            if running and float(running[0].split()[1]) == 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the disconnected request's samples are still running")
    log = server.log_tail(20000)
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]


def test_sigterm_drains_aborts_after_grace_and_exits_zero(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    results: dict[str, list] = {}
    first_chunk = {name: threading.Event() for name in ("short", "long")}

    def stream(name: str, max_new_tokens: int) -> None:
        body = {"input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as own:
            with own.stream("POST", "/generate", json=body) as r:
                data = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data.append(line[6:])
                        first_chunk[name].set()
                results[name] = data

    # "short" finishes inside the 3 s grace period; "long" (~400 tokens) cannot and is aborted.
    threads = [threading.Thread(target=stream, args=("short", 8)),
               threading.Thread(target=stream, args=("long", 400))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in first_chunk.values())

    server.signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer admitting: the listener is closed
        httpx.get(server.url + "/health", timeout=5)
    assert server.wait(60) == 0, server.log_tail()
    for t in threads:
        t.join(10)

    short = [json.loads(d) for d in results["short"][:-1]]
    assert results["short"][-1] == "[DONE]" and short[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(short[-1]["output_ids"]) == 8
    long = [json.loads(d) for d in results["long"][:-1]]
    assert results["long"][-1] == "[DONE]" and long[-1]["finished"]
    assert long[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert long[-1]["meta_info"]["finish_reason"]["message"] == "server shutting down"
    assert len(long[-1]["output_ids"]) < 400
