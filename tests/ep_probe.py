"""Expert parallelism on 8 fake CPU devices, measured and printed as one JSON object.

Run by tests/test_expert_parallel.py in a subprocess: one process measures both tiny random MoE
models (starting 8 fake devices and compiling the shared small programs once), each under its key
-- `qwen3_moe` (8 experts, top-4) and `deepseek_v3` (interop.testing's: layer 0 dense, two MoE
layers of 16 experts, top-4, a shared expert) -- in float32 under the rl-bitwise kernel plans
(fixed-order GEMMs; Qwen3-MoE's stable router leaf, DeepSeek-V3's torch one) at EP 1, 2, 4 and 8
(DeepSeek: 1 and 4): teacher-forced logits of two prompts, alone and packed; the collectives of the
EP4 step program; `--moe-combine-order rank` at EP4 against slot at EP1; for Qwen3-MoE the
all-to-all dispatch alone on stand-in experts (`dispatch_cases`). With the argument `harness`, the
invariance harness at EP4 of each model instead (a slow test). Every entry is a measurement; the
assertions live in the test.
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

# output key -> (architecture, the tiny checkpoint's overrides, its first MoE layer, the router
# leaf: the grouped router has `torch` (rl-bitwise's pin) and `auto`, which is its stable leaf), the
# EP sizes of the slot combine (DeepSeek's three layers: 1 and 4 only, to keep CI time)
MODELS = {"qwen3_moe": ("Qwen3MoeForCausalLM", {"num_experts_per_tok": 4}, 0, "stable",
                        (1, 2, 4, 8)),
          "deepseek_v3": ("DeepseekV3ForCausalLM", {}, 1, "torch", (1, 4))}
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


def dispatch_cases() -> dict:
    """The all-to-all dispatch alone (sharding/expert_parallel.py), on stand-in experts whose row
    output is the row times its expert's vector times its weight (no sum: a misplaced or reordered
    pair changes bits). T = 13 rows (no multiple of 2, 4 or 8), k = 4 of 32 experts. `mixed`:
    random routing, row 0 all on rank 0 and row 1 all on the last rank; `one_owner`: every pair on
    rank 0, so rank 0 receives full buffers. The fold returns the k outputs side by side with the
    row's slots, so the gathered result is every slot's output where one device computes it; an
    empty buffer row's expert vector is NaN, so a received row that is not a pair would show."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from sharding.expert_parallel import ExpertParallel
    from sharding.mesh import make_mesh

    t, k, h, n = 13, 4, 8, 32
    rng = np.random.default_rng(7)
    x = rng.standard_normal((t, h), np.float32)
    w = rng.standard_normal((t, k), np.float32)
    table = rng.standard_normal((n, h), np.float32)
    mixed = np.stack([rng.permutation(n)[:k] for _ in range(t)]).astype(np.int32)
    mixed[0], mixed[1] = [2, 0, 3, 1], [n - 1, n - 4, n - 2, n - 3]
    one_owner = np.stack([rng.permutation(4) for _ in range(t)]).astype(np.int32)
    expected = {name: x[:, None, :] * table[ids] * w[:, :, None]
                for name, ids in (("mixed", mixed), ("one_owner", one_owner))}
    out = {}
    for e in (2, 4, 8):
        mesh = make_mesh(ep=e)
        ep, n_local = ExpertParallel(e), n // e

        def step(table_local, x, ids, w):
            def experts(rows, local, row_w):
                vec = table_local.at[local].get(mode="fill", fill_value=np.nan)
                return rows * vec * row_w[:, None]

            def fold(outputs, slots):
                return jnp.concatenate([outputs.reshape(outputs.shape[0], -1),
                                        slots.astype(jnp.float32)], axis=1)

            return ep.combine(x, ids, w, n_local, experts, fold)

        rep = PartitionSpec()
        run = jax.jit(jax.shard_map(step, mesh=mesh, out_specs=rep, check_vma=False,
                                    in_specs=(PartitionSpec("expert"),) + (rep,) * 3))
        placed = jax.device_put(table, NamedSharding(mesh, PartitionSpec("expert")))
        for name, ids in (("mixed", mixed), ("one_owner", one_owner)):
            got = np.asarray(run(placed, x, ids, w))
            outputs = got[:, :k * h].reshape(t, k, h)
            out[f"{name}_ep{e}"] = {
                "differing": differing(outputs, expected[name]),
                "slots_differing": int(np.count_nonzero(got[:, k * h:] != ids)),
                # the control: the same comparison catches two slots exchanged
                "differing_if_slots_swapped": differing(outputs[:, [1, 0, 2, 3]], expected[name])}
    return out


def step_collectives(runner, tokens: int = 16) -> dict:
    """The result shapes of every all-to-all and all-gather in the step program of a `tokens` bucket
    (its lowered StableHLO text), keyed by op."""
    import re

    from jengine.models.kv_cache import NULL_PAGE

    text = runner._forward.lower(runner._params, runner.kv_pool.arrays,
                                 *(np.zeros(tokens, np.int32),) * 3,
                                 np.full((tokens, 1), NULL_PAGE, np.int32)).as_text()
    return {op: re.findall(rf'"?stablehlo\.{op}"?\(.*->\s*tensor<([^>]*)>', text)
            for op in ("all_to_all", "all_gather")}


def ep_sizes(loaded, moe_layer: int, router: str, slot_sizes) -> dict:
    """Teacher-forced logits at each EP size of the slot combine and at EP4 of the rank combine,
    against EP1's; at EP4 also the expert weights' placement and the step's collectives."""
    # float32: a different fp32 association (the `rank` control) would mostly vanish in a bf16
    # rounding of the layer output
    resolved = resolve_launch(LaunchConfig(numerics="rl-bitwise", dtype="float32", **OPTIONS),
                              hardware="cpu", probe_xla_flags=False)
    plan = plan_launch(resolved, loaded.config)
    out, base = {}, None
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
                if combine == "slot":
                    entry["collectives"] = step_collectives(runner)
            out[f"{combine}_ep{ep}"] = entry
    return out


def main():
    section = sys.argv[1] if len(sys.argv) > 1 else "ep_sizes"
    if section not in ("ep_sizes", "harness"):
        raise SystemExit(f"ep_probe.py: unknown section {section!r} (ep_sizes or harness)")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, (arch, overrides, moe_layer, router, slot_sizes) in MODELS.items():
            with override_profile(arch, numerics_envelopes={"rl-bitwise"}):
                # top-4: with two slots any fold is one commutative add, so `rank` could not differ
                model_dir = str(make_tiny_hf_model(Path(tmp) / key, arch, seed=5, **overrides))
                if section == "harness":
                    out[key] = harness(model_dir)
                    continue
                out[key] = ep_sizes(load_model(model_dir, progress=False), moe_layer, router,
                                    slot_sizes)
                if key == "qwen3_moe":
                    out[key]["dispatch"] = dispatch_cases()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
