"""The tensor-parallel runner on 8 fake CPU devices, measured and printed as one JSON object.

Run by tests/test_tensor_parallel.py in a subprocess (XLA reads the fake device count once per
process). The tiny model (4 q heads, 2 KV heads) is run at TP1 and TP2 with teacher-forced prompts:
every row's logits, from a RunnerConfig built directly with tp_size (with the default
--tp-batch-invariant off: row-parallel o_proj/down_proj). Whole engines, the other layouts and TP8
are measured by tests/tp_engine_probe.py. Every entry is a measurement; the assertions live in the
test.
"""

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jengine.config import LaunchConfig  # noqa: E402
from jengine.engine.batch import StepBatch  # noqa: E402
from jengine.engine.model_runner import ModelRunner  # noqa: E402
from jengine.launch import plan_launch  # noqa: E402
from jengine.models import load_model  # noqa: E402
from jengine.numerics import resolve_launch  # noqa: E402

OPTIONS = dict(max_total_tokens=1024, chunked_prefill_size=32, max_prefill_tokens=256,
               max_running_requests=8, skip_warmup=True)
rng = np.random.default_rng(0)
PROMPT_A = rng.integers(1, 32768, 12).tolist()
PROMPT_B = rng.integers(1, 32768, 19).tolist()
# Five more prompts: packed before PROMPT_A they make a 134-row step. XLA's CPU dot keeps its
# summation order across 16- and 32-row steps on some processors (AVX2: 0 logits differ in f32 at
# TP2) but not across 16 and 134 rows, so the negative control packs this many.
BIG_PACK = [np.random.default_rng(1).integers(1, 32768, n).tolist() for n in (21, 30, 17, 25, 29)]


def logits_of(runner, prompts):
    """Teacher-forced logits [len(p), V] of each prompt, all prompts in one step."""
    ps = runner.page_size
    ids, pos, req, tables, page = [], [], [], [], 1
    for r, p in enumerate(prompts):
        n = -(-len(p) // ps)
        tables.append(list(range(page, page + n)))
        page += n
        ids += p
        pos += range(len(p))
        req += [r] * len(p)
    width = max(map(len, tables))
    tables = [t + [0] * (width - len(t)) for t in tables]
    batch = StepBatch(input_ids=ids, positions=pos, token_req=req, block_tables=tables,
                      hidden_rows=list(range(len(ids))))
    out = np.asarray(runner.compute_logits(runner.forward(batch)))
    return np.split(out, np.cumsum([len(p) for p in prompts])[:-1])


def logprobs(logits, prompt):
    x = logits[:-1].astype(np.float64)
    x = x - x.max(1, keepdims=True)
    lse = np.log(np.exp(x).sum(1))
    return x[np.arange(len(x)), prompt[1:]] - lse


def differing(a, b) -> int:
    return int(np.count_nonzero(np.asarray(a, np.float32).view(np.uint32)
                                 != np.asarray(b, np.float32).view(np.uint32)))


def main():
    tiny = load_model("tiny", progress=False)
    out = {"devices": len(jax.devices())}
    # auto in float32 too: a layout bug would show there as well, where rounding cannot hide it
    for name, launch in (("auto", {}), ("auto-f32", {"dtype": "float32"}),
                         ("rl-bitwise", {"numerics": "rl-bitwise"})):
        resolved = resolve_launch(LaunchConfig(**launch, **OPTIONS), hardware="cpu",
                                  probe_xla_flags=False)
        plan = plan_launch(resolved, tiny.config)
        runners = {tp: ModelRunner(tiny.config, tiny.checkpoint,
                                   dataclasses.replace(plan.runner, tp_size=tp))
                   for tp in (1, 2)}
        r2 = runners[2]
        entry = {
            "bic": plan.runner.batch_invariant_collectives,
            "row_sum_path": r2.placement.tp.row_sum_route.path,
            "mesh": dict(r2.placement.mesh.shape),
            "param_specs": {path: str(a.sharding.spec) for path, a in
                            r2._model(r2._params).named_parameters().items()
                            if path.startswith(("embed", "lm_head", "layers.0."))},
            "kv_pool_spec": str(r2.kv_pool.arrays[0][0].sharding.spec),
            "kv_pool_local_shape": list(r2.kv_pool.arrays[0][0].addressable_shards[0].data.shape),
        }
        alone1 = logits_of(runners[1], [PROMPT_A])[0]
        alone2 = logits_of(r2, [PROMPT_A])[0]
        again2 = logits_of(r2, [PROMPT_A])[0]
        packed2 = logits_of(r2, [PROMPT_B, PROMPT_A])[1]
        lp1, lp2 = logprobs(alone1, PROMPT_A), logprobs(alone2, PROMPT_A)
        entry.update(
            max_abs_logprob_diff_tp2_vs_tp1=float(np.abs(lp1 - lp2).max()),
            greedy_ids_equal_tp2_vs_tp1=bool((alone1.argmax(1) == alone2.argmax(1)).all()),
            logits_differing_tp2_vs_tp1=differing(alone1, alone2),
            run_differing_tp2=differing(alone2, again2),
            batch_differing_tp2=differing(alone2, packed2),
            big_batch_differing_tp2=differing(alone2, logits_of(r2, BIG_PACK + [PROMPT_A])[-1]),
            logits_elements=int(alone2.size),
        )
        out[name] = entry
    # 2 KV heads over 4 ranks: KV-head replication (each rank caches the one head it reads)
    r4 = ModelRunner(tiny.config, tiny.checkpoint, dataclasses.replace(plan.runner, tp_size=4))
    out["tp4"] = {
        "kv_head_replicas": r4.parallelism()["kv_head_replicas"],
        "k_proj_spec": str(r4._model(r4._params).named_parameters()[
            "layers.0.self_attn.k_proj.weight"].sharding.spec),
        "kv_pool_global_shape": list(r4.kv_pool.arrays[0][0].shape),
        "kv_pool_local_shape": list(r4.kv_pool.arrays[0][0].addressable_shards[0].data.shape),
        "max_abs_logprob_diff_vs_tp1": float(np.abs(
            logprobs(logits_of(r4, [PROMPT_A])[0], PROMPT_A) - lp1).max()),
    }
    try:  # 3 ranks cannot hold whole query heads of a 4-head model
        ModelRunner(tiny.config, tiny.checkpoint, dataclasses.replace(plan.runner, tp_size=3))
        out["tp3_refusal"] = None
    except ValueError as e:
        out["tp3_refusal"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
