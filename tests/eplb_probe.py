"""EPLB on 8 fake CPU devices, measured and printed as one JSON object.

Run by tests/test_eplb.py in a subprocess. A tiny Qwen3-MoE (float32, 8 experts, top-4) under
rl-bitwise: the EP1 engine without EPLB, then an EP4 engine with --enable-eplb and 4 redundant
experts (P = 12) that rebalances every 3 steps (so while requests are in flight) and once more on
request between two requests. The control: the rank-order combine (refused by rl-bitwise with
EPLB, so under --numerics auto) with one forced rebalance. The assertions live in the test.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402

from interop.testing import make_tiny_hf_model  # noqa: E402
from jengine.engine.engine import Engine  # noqa: E402
from scripts.goldens import output_record  # noqa: E402

OPTIONS = dict(dtype="float32", max_total_tokens=512, chunked_prefill_size=32,
               max_prefill_tokens=64, max_running_requests=4, skip_warmup=True)
EPLB = dict(ep_size=4, enable_eplb=True, ep_num_redundant_experts=4)
PROMPTS = ([11, 3072, 77, 5, 19000, 8, 260, 4100, 31, 2], [900, 45, 17, 22222, 6, 6, 301])
SAMPLING = {"greedy": dict(temperature=0), "t1": dict(temperature=1.0, seed=7)}


def bits_of(out: dict) -> dict:
    rec = output_record(out)
    rec.pop("cached_tokens")  # a prefix hit is allowed to differ; ids and logprobs are not
    return rec


def generate(eng, prompt, kind):
    return bits_of(eng.generate(input_ids=prompt, return_logprob=True, logprob_start_len=0,
                                sampling_params=dict(max_new_tokens=10, ignore_eos=True,
                                                     **SAMPLING[kind])))


def run_all(eng, between=None) -> dict:
    """Every (prompt, sampling) case; `between()` runs after the first one."""
    out = {}
    for i, prompt in enumerate(PROMPTS):
        for kind in SAMPLING:
            out[f"{kind}_{i}"] = generate(eng, prompt, kind)
            if between is not None and len(out) == 1:
                between()
    return out


def main():
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_hf_model(Path(tmp) / "moe", "Qwen3MoeForCausalLM", seed=5,
                                       num_experts_per_tok=4))
        with Engine(model_path=model, numerics="rl-bitwise", **OPTIONS) as eng:
            out["ep1"] = run_all(eng)

        with Engine(model_path=model, numerics="rl-bitwise", eplb_rebalance_num_iterations=3,
                    **EPLB, **OPTIONS) as eng:
            runner = eng.runner
            maps = [runner.eplb.placement.tolist()]
            compiled = []

            def rebalance():  # between two requests, on request
                compiled.append(runner._forward._cache_size())
                maps.append(eng.rebalance_experts()["physical_to_logical"])

            out["eplb"] = run_all(eng, between=rebalance)
            compiled.append(runner._forward._cache_size())
            out["eplb_maps"] = maps + [runner.eplb.placement.tolist()]
            out["eplb_rebalances"] = runner.eplb.rebalances
            out["eplb_step_programs"] = compiled
            out["physical_slots"] = int(runner._params[runner.eplb.slots[0][1][0]].shape[0])

        with Engine(model_path=model, numerics="auto", moe_combine_order="rank",
                    disable_radix_cache=True, **EPLB, **OPTIONS) as eng:
            before = generate(eng, PROMPTS[0], "greedy")
            eng.rebalance_experts()
            out["rank_control"] = {"before": before, "after": generate(eng, PROMPTS[0], "greedy")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
