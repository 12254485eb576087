"""Weight updates of an EPLB launch, measured on fake CPU devices and printed as one JSON object.

Run by tests/test_eplb.py in a subprocess: `eplb_update_probe.py MODE EP REDUNDANT` (MODE: `main`).
A tiny Qwen3-MoE (float32, 8 experts, top-4) under rl-bitwise with --enable-eplb, on a placement in
which slot e does not hold expert e, takes a partial update --
layer 1's experts of W1, in transformers 5's fused layout, as a 5.x trainer's named_parameters()
give them -- and then a full update from W1's directory. Fresh engines started with that placement
(--init-expert-location) from the mixed checkpoint (W0, layer 1's experts from W1) and from W1
serve what the updated engine should. The assertions live in the test.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from interop.testing import make_tiny_hf_model  # noqa: E402
from jengine.engine.engine import Engine  # noqa: E402
from tests.bits import count_bit_differences  # noqa: E402
from tests.eplb_probe import OPTIONS, PROMPTS, SAMPLING, generate  # noqa: E402

LAYER = "model.layers.1.mlp.experts"


def run_all(eng) -> dict:
    """Greedy and seeded T=1 on one prompt, with prompt and output logprobs."""
    return {kind: generate(eng, PROMPTS[0], kind) for kind in SAMPLING}


def layer_experts_fused(model_dir: Path) -> dict:
    """Layer 1's experts as transformers 5 holds them (gate_up_proj, down_proj): torch tensors."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    return {name: p.detach() for name, p in model.named_parameters() if name.startswith(LAYER)}


def mixed_checkpoint(w0: Path, w1: Path, out: Path) -> Path:
    """W0 with layer 1's experts from W1, as a model directory."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(w0, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(w0 / "model.safetensors"))
    new = load_file(str(w1 / "model.safetensors"))
    tensors.update({n: a for n, a in new.items() if n.startswith(LAYER + ".")})
    save_file(tensors, str(out / "model.safetensors"))
    return out


def params(eng) -> list:
    """The runner's parameter tuple (physical expert slots, maps and all), copied to the host."""
    return [np.asarray(p) for p in eng.runner._params]


def differing(a: list, b: list) -> dict:
    """Index -> elements whose bits differ, per parameter."""
    return {i: n for i, (x, y) in enumerate(zip(a, b, strict=True))
            if (n := count_bit_differences(x, y))}


def main():
    """outputs: rebalanced after a request, ids and logprob bits compared (engine outputs);
    params: launched with a scrambled placement, the parameter bits compared (no step compiled)."""
    mode, ep, redundant = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    launch = dict(numerics="rl-bitwise", ep_size=ep, enable_eplb=True,
                  ep_num_redundant_experts=redundant, **OPTIONS)
    observe = run_all if mode == "outputs" else params
    seen, out = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        w0, w1 = (make_tiny_hf_model(tmp / f"w{i}", "Qwen3MoeForCausalLM", seed=5 + i,
                                     num_experts_per_tok=4) for i in range(2))
        location = tmp / "placement.json"
        start = dict(launch)
        if mode == "params":  # slot j holds expert (P-1-j) % E: slot e never holds expert e
            p = 8 + redundant
            start["init_expert_location"] = str(location)
            location.write_text(json.dumps({"physical_to_logical": [(p - 1 - j) % 8
                                                                    for j in range(p)]}))
        with Engine(model_path=str(w0), **start) as eng:
            seen["w0"] = observe(eng)
            if mode == "outputs":  # the greedy placement of the measured load
                eng.rebalance_experts()
            placement = eng.runner.eplb.placement.tolist()
            eng.update_weights_from_tensor(layer_experts_fused(w1))
            seen["partial"] = observe(eng)
            eng.update_weights_from_disk(str(w1))
            seen["full"] = observe(eng)
            out["placements"] = [placement, eng.runner.eplb.placement.tolist()]
        location.write_text(json.dumps({"physical_to_logical": placement}))
        fresh = dict(launch, init_expert_location=str(location))
        with Engine(model_path=str(mixed_checkpoint(w0, w1, tmp / "mixed")), **fresh) as eng:
            seen["fresh_partial"] = observe(eng)
        with Engine(model_path=str(w1), **fresh) as eng:
            seen["fresh_full"] = observe(eng)
    if mode == "outputs":
        out.update(seen)
    else:
        out["differing"] = {f"{a}-{b}": differing(seen[a], seen[b]) for a, b in (
            ("partial", "fresh_partial"), ("full", "fresh_full"), ("w0", "partial"),
            ("partial", "full"))}
        out["params"] = len(seen["w0"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
