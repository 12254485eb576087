"""The RL loop's routes against a real server on loopback (rl_api.py): weight updates from disk
and from safetensors bytes, weight versions on outputs, pause / continue, memory release and
resume, and 400s with success=false that name the field."""

from __future__ import annotations

import base64

import httpx
import pytest

from jengine.server.testing import ServerProcess

GEN = {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "return_logprob": True,
       "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def http(ckpts):
    args = ["--model-path", str(ckpts["w0"]), "--numerics", "rl-bitwise", "--skip-warmup",
            "--context-length", "256", "--log-level", "warning"]
    with ServerProcess(args) as proc, httpx.Client(base_url=proc.url, timeout=120) as client:
        yield client


def generate(http) -> dict:
    r = http.post("/generate", json=GEN)
    assert r.status_code == 200, r.text
    return r.json()


def buckets(tensors: dict, max_bytes: int) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        if out[-1] and size + tensors[name].nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += tensors[name].nbytes
    return out


def test_weight_updates_over_http(http, ckpts):
    import ml_dtypes  # noqa: F401  registers bf16 with numpy, which safetensors.numpy needs
    from safetensors.numpy import load_file, save

    assert http.get("/get_weight_version").json() == {"weight_version": "default"}
    w0 = generate(http)
    assert w0["meta_info"]["weight_version"] == "default"

    r = http.post("/update_weights_from_disk", json={"model_path": str(ckpts["w1"]),
                                                     "weight_version": "1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    w1 = generate(http)
    assert w1["meta_info"]["weight_version"] == "1" and w1 != w0

    tensors = load_file(str(ckpts["w0"] / "model.safetensors"))
    for bucket in buckets(tensors, max_bytes=4 << 20):  # base64 must fit --max-request-bytes
        blob = base64.b64encode(save({n: tensors[n] for n in bucket})).decode()
        r = http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [blob], "flush_cache": False, "weight_version": "2"})
        assert r.status_code == 200 and r.json()["success"], r.text
    again = generate(http)
    assert again["output_ids"] == w0["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == w0["meta_info"]["output_token_logprobs"]
    assert again["meta_info"]["weight_version"] == "2"


def test_refusals_name_the_field(http, tmp_path):
    cases = [("/update_weights_from_disk", {"model_path": str(tmp_path / "none")}, "model_path"),
             ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%"]},
              "serialized_named_tensors[0]"),
             ("/pause_generation", {"mode": "nap"}, "mode"),
             ("/release_memory_occupation", {"tags": ["gpu"]}, "tags[0]")]
    for path, body, field in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["success"] is False and r.json()["error"]["field"] == field, r.text
    before = generate(http)  # the old weights still serve
    assert before["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_release_resume_continue(http):
    before = generate(http)
    for path, body in [("/pause_generation", {"mode": "retract"}),
                       ("/release_memory_occupation", {}),
                       ("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}),
                       ("/continue_generation", {})]:
        r = http.post(path, json=body)
        assert r.status_code == 200 and r.json()["success"], (path, r.text)
    after = generate(http)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
