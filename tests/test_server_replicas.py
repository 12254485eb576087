"""Data-parallel replicas (`--dp-size 2`, jengine/server/replicas.py) on a real server over
loopback, each replica on its own fake CPU device: the same request gives the same ids and
logprob bits on both replicas (rl-bitwise), concurrent requests spread over both (least-loaded),
the RL routes reach both, and /get_server_info and /metrics give one view. The negative control
shows the bit comparison does see a replica serving other weights. Routing and aborts are also
checked without a server, over two of the server tests' fake engines.
"""

from __future__ import annotations

import os
import threading
import types

import httpx
import pytest

from jengine.config import LaunchConfig, LaunchRefusal
from jengine.server.testing import ServerProcess
from jengine.server.metrics import ServerMetrics
from jengine.server.replicas import ReplicaSet
from sharding.mesh import replica_devices
from tests.bits import count_bit_differences
from tests.test_server_unit import FakeEngine

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(ckpts):
    args = ["--model-path", str(ckpts["w0"]), "--numerics", "rl-bitwise", "--dp-size", "2",
            "--skip-warmup", "--context-length", "256", "--log-level", "warning"]
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    with ServerProcess(args, env={"XLA_FLAGS": flags}) as proc, \
            httpx.Client(base_url=proc.url, timeout=120) as client:
        yield client


def generate_while_paused(http, sampling_params: list[dict]) -> list[dict]:
    """One batch (a prompt per sampling_params), all of it in flight before any step runs, so
    least-loaded routing alone decides where each item goes (item i -> replica i % 2)."""
    assert http.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
    result: dict = {}
    body = {"input_ids": [PROMPT] * len(sampling_params), "sampling_params": sampling_params,
            "return_logprob": True}
    sender = threading.Thread(target=lambda: result.update(r=http.post("/generate", json=body)))
    sender.start()
    try:
        while sum(r["requests_in_flight"] for r in server_info(http)["replicas"]) < len(body["input_ids"]):
            sender.join(0.05)
            assert sender.is_alive(), result["r"].text
    finally:
        assert http.post("/continue_generation", json={}).json()["success"]
        sender.join()
    assert result["r"].status_code == 200, result["r"].text
    return result["r"].json()


def server_info(http) -> dict:
    r = http.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()


def same_bits(a: dict, b: dict) -> bool:
    """Same output ids and the same logprob float bits (never a tolerance)."""
    la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
    lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
    return a["output_ids"] == b["output_ids"] and count_bit_differences(la, lb) == 0


def test_same_request_same_bits_on_every_replica(http):
    outs = generate_while_paused(http, [GREEDY, GREEDY, SEEDED, SEEDED])
    assert [o["meta_info"]["replica"] for o in outs] == [0, 1, 0, 1]  # spread, ties to replica 0
    greedy0, greedy1, seeded0, seeded1 = outs
    assert len(greedy0["output_ids"]) == 6 and greedy0["output_ids"] != seeded0["output_ids"]
    assert same_bits(greedy0, greedy1), (greedy0, greedy1)
    assert same_bits(seeded0, seeded1), (seeded0, seeded1)


def test_one_view_of_both_replicas(http):
    info = server_info(http)
    assert info["dp_size"] == 2
    assert [r["devices"] for r in info["replicas"]] == [["cpu:0"], ["cpu:1"]]
    metrics = http.get("/metrics").text
    assert 'jengine:replica_num_running_reqs{replica="1"}' in metrics
    per_replica = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("jengine:replica_kv_total_tokens{")]
    total = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("jengine:kv_total_tokens "))
    assert len(per_replica) == 2 and total == sum(per_replica)


def test_weight_update_reaches_every_replica_and_the_check_sees_other_weights(http, ckpts):
    before = generate_while_paused(http, [GREEDY, GREEDY])
    r = http.post("/update_weights_from_disk", json={"model_path": str(ckpts["w1"]),
                                                     "weight_version": "w1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert [x["weight_version"] for x in server_info(http)["replicas"]] == ["w1", "w1"]
    assert http.get("/get_weight_version").json() == {"weight_version": "w1"}
    after = generate_while_paused(http, [GREEDY, GREEDY])
    assert [o["meta_info"]["weight_version"] for o in after] == ["w1", "w1"]
    assert same_bits(after[0], after[1])
    # Negative control: replica 1 on W1 against replica 0 on W0 -- the check must fail.
    assert before[0]["meta_info"]["replica"] == 0 and after[1]["meta_info"]["replica"] == 1
    assert not same_bits(before[0], after[1])


def test_too_few_devices_and_the_offline_engine_are_refused():
    with pytest.raises(ValueError, match=r"--dp-size 2 x --tp-size 2 needs 4 devices but 3"):
        replica_devices(2, 2, 0, devices=["d0", "d1", "d2"])
    assert replica_devices(2, 2, 1, devices=["d0", "d1", "d2", "d3"]) == ("d2", "d3")
    from jengine.engine.engine import _replica_devices

    with pytest.raises(LaunchRefusal, match=r"--dp-size 2: an Engine is one replica.*jengine serve"):
        _replica_devices(LaunchConfig(dp_size=2), None)


class FakeReplica(FakeEngine):
    """The server's fake engine, returning a handle as Engine.submit does."""

    def submit(self, **request):
        return types.SimpleNamespace(rids=[super().submit(**request)])


def test_least_loaded_routing_aborts_and_metrics_without_a_server():
    replicas = [FakeReplica(token_delay_s=0.005), FakeReplica(token_delay_s=0.005)]
    rs = ReplicaSet(replicas)
    finals: dict[str, dict] = {}
    done = threading.Condition()

    def on_output(out):
        with done:
            finals[out["meta_info"]["id"]] = out
            done.notify_all()

    def wait_for(*rids):
        with done:
            assert done.wait_for(lambda: all(r in finals for r in rids), timeout=30), rids

    long = {"max_new_tokens": 10_000}
    for rid in ("r0", "r1", "r2"):  # -> replicas 0, 1, 0 (ties to the lowest index)
        rs.submit(input_ids=[1], sampling_params=long, rid=rid, on_output=on_output)
    assert [s["num_running"] for s in rs.stats()["replicas"]] == [2, 1]
    assert rs.stats()["num_running"] == 3
    assert rs.abort_many(["r1"]) == 1 and replicas[0].abort_calls == 0  # only its replica
    wait_for("r1")
    assert finals["r1"]["meta_info"]["replica"] == 1
    assert finals["r1"]["meta_info"]["finish_reason"]["type"] == "abort"
    rs.submit(input_ids=[1], sampling_params=long, rid="r3", on_output=on_output)
    assert [s["num_running"] for s in rs.stats()["replicas"]] == [2, 1]  # r3 took replica 1
    assert rs.abort_many(["r0", "r2", "r3"]) == 3
    wait_for("r0", "r2", "r3")
    assert [finals[r]["meta_info"]["replica"] for r in ("r0", "r2", "r3")] == [0, 0, 1]

    text = ServerMetrics(rs).render().decode()
    assert 'jengine:replica_kv_total_tokens{replica="1"} 1024.0' in text
    assert "jengine:kv_total_tokens 2048.0" in text
    assert "jengine:step_latency_seconds_count 4.0" in text  # each replica's two steps
