"""Expert parallelism on 8 fake CPU devices, measured and printed as one JSON object.

Run by tests/test_expert_parallel.py in a subprocess. A tiny random MoE model -- Qwen3-MoE (8
experts, top-4), or with the argument `deepseek` DeepSeek-V3 (interop.testing's: layer 0 dense,
two MoE layers of 16 experts, top-4, a shared expert) -- in float32 under the rl-bitwise kernel
plans (fixed-order GEMMs; Qwen3-MoE's stable router leaf, DeepSeek-V3's torch one) at EP 1, 2, 4 and 8 (DeepSeek: 1 and 4): teacher-forced logits of two prompts, alone and packed; and
`--moe-combine-order rank` at EP4 against slot at EP1; with the argument `harness`, also the
invariance harness at EP4. Every entry is a measurement; the assertions live in the test.
"""

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from interop.testing import make_tiny_hf_model  # noqa: E402
from jengine.config import LaunchConfig  # noqa: E402
from jengine.engine.model_runner import ModelRunner  # noqa: E402
from jengine.launch import plan_launch  # noqa: E402
from jengine.models import load_model  # noqa: E402
from jengine.models.family import MoEOptions  # noqa: E402
from jengine.numerics import resolve_launch  # noqa: E402
from jengine.profiles import override_profile  # noqa: E402
from tests.tp_probe import differing, logits_of  # noqa: E402

# architecture -> (the tiny checkpoint's overrides, its first MoE layer, the router leaf: the
# grouped router has `torch` (rl-bitwise's pin) and `auto`, which is its stable leaf), the EP sizes
# of the slot combine (DeepSeek's three layers: 1 and 4 only, to keep CI time)
MODELS = {"Qwen3MoeForCausalLM": ({"num_experts_per_tok": 4}, 0, "stable", (1, 2, 4, 8)),
          "DeepseekV3ForCausalLM": ({}, 1, "torch", (1, 4))}
ARCH = "DeepseekV3ForCausalLM" if "deepseek" in sys.argv[1:] else "Qwen3MoeForCausalLM"
OPTIONS = dict(max_total_tokens=512, chunked_prefill_size=32, max_prefill_tokens=64,
               max_running_requests=4, skip_warmup=True)
rng = np.random.default_rng(1)
PROMPT_A = rng.integers(1, 32768, 11).tolist()
PROMPT_B = rng.integers(1, 32768, 17).tolist()


def harness(model_dir: str) -> dict:
    """The invariance harness at EP4 (packed, rerun, prefix hit; greedy and T=1) under rl-bitwise
    (the torch tie-order router leaf, fixed-order GEMMs) and its auto control in float32."""
    from jengine.invariance import DEFAULT_PROMPTS, HarnessConfig, InvarianceHarness

    out = {}
    for name, numerics, extra in (("rl-bitwise ep4", "rl-bitwise", ()),
                                  ("auto ep4 f32", "auto", (("dtype", "float32"),))):
        cfg = HarnessConfig(model=model_dir, numerics=numerics, prompts=DEFAULT_PROMPTS[:3],
                            max_new_tokens=5, chunk_sizes=(), retraction_intervals=(),
                            launch=(("ep_size", 4), ("max_total_tokens", 2048)) + extra)
        lines = []
        results = InvarianceHarness(cfg).run(report=lines.append)
        out[name] = {"modes": sorted({r.mode for r in results}),
                     "compared_values": sum(r.compared_values for r in results),
                     "divergences": [str(d) for r in results for d in r.divergences],
                     "table": lines[0]}
    return out


def main():
    out = {}
    with tempfile.TemporaryDirectory() as tmp, override_profile(ARCH,
                                                                numerics_envelopes={"rl-bitwise"}):
        # top-4: with two slots any fold is one commutative add, so `rank` could not differ
        overrides, moe_layer, router, slot_sizes = MODELS[ARCH]
        loaded = load_model(str(make_tiny_hf_model(Path(tmp) / "moe", ARCH, seed=5, **overrides)),
                            progress=False)
        # float32: a different fp32 association (the `rank` control) would mostly vanish in a bf16
        # rounding of the layer output
        resolved = resolve_launch(LaunchConfig(numerics="rl-bitwise", dtype="float32", **OPTIONS),
                                  hardware="cpu", probe_xla_flags=False)
        plan = plan_launch(resolved, loaded.config)
        base = None
        for combine, sizes in (("slot", slot_sizes), ("rank", (4,))):
            model = dataclasses.replace(plan.runner.model,
                                        moe=MoEOptions(router_topk=router, combine_order=combine))
            for ep in sizes:
                runner = ModelRunner(loaded.config, loaded.checkpoint,
                                     dataclasses.replace(plan.runner, model=model, ep_size=ep))
                alone = logits_of(runner, [PROMPT_A])[0]
                packed = logits_of(runner, [PROMPT_B, PROMPT_A])[1]
                base = alone if base is None else base
                entry = {"differing_vs_ep1": differing(alone, base),
                         "batch_differing": differing(alone, packed),
                         "elements": int(alone.size)}
                if ep == 4:
                    expert = runner._model(runner._params).named_parameters()[
                        f"layers.{moe_layer}.mlp.experts.gate_proj"]
                    entry["expert_weight_spec"] = str(expert.sharding.spec)
                    entry["expert_weight_local_experts"] = int(
                        expert.addressable_shards[0].data.shape[0])
                    entry["parallelism"] = runner.parallelism()
                out[f"{combine}_ep{ep}"] = entry
        if "harness" in sys.argv[1:]:
            out["harness"] = harness(str(Path(tmp) / "moe"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
