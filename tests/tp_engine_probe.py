"""Whole engines at TP 1, 2, 4 and 8 on 8 fake CPU devices, measured and printed as one JSON object.

Run by tests/test_tp_engine.py in a subprocess (XLA reads the fake device count once per process):
`tp_engine_probe.py topology` or `tp_engine_probe.py harness`. Every entry is a measurement (ids and
logprob bits as hex, divergence lists, counts); the assertions live in the test.

topology  the tiny model's recorded goldens (tests/goldens/cpu.json, one device) replayed at TP2
          with --tp-batch-invariant all; and a Qwen3 with 8 query / 2 KV heads (so TP8 divides
          its heads; TP4 and TP8 replicate KV heads) at TP1, TP2, TP4, TP8 with `all`, and at TP8
          with `off`, on the same greedy and seeded T=1 requests with prompt logprobs and top-k
          (at TP2 scored by the vocab-parallel head, at TP4/TP8 from gathered logits).
harness   the invariance harness (jengine/invariance.py) at TP2 under rl-bitwise (harness_tp4: at
          TP4, harness_tp2_variants: TP2 chunked and retracted, both slow tests), and its
          auto control at TP2 in float32 (one engine: packed, rerun, prefix hit).
"""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jengine import Engine  # noqa: E402
from jengine.invariance import DEFAULT_PROMPTS, HarnessConfig, InvarianceHarness  # noqa: E402
from jengine.profiles import override_profile  # noqa: E402
from scripts.goldens import _tiny_requests, differences, output_record  # noqa: E402

ARCH = "Qwen3ForCausalLM"
# blockwise-16384 over a 30000-token vocabulary: at TP2 the LM head is padded to 32768 columns (one
# whole 16384-wide block per rank, +9 %), so the step scores greedy rows and prompt logprobs with the
# vocab-parallel head (no logits gather); at TP4 and TP8 whole blocks would need 65536 columns (more
# than sharding.tensor_parallel.MAX_HEAD_PADDING), so the step gathers the logits. Both paths must
# give the TP1 bits.
VOCAB = 30000
SMALL = dict(skip_warmup=True, page_size=4, chunked_prefill_size=8, max_total_tokens=2048,
             logprob_order="blockwise-16384")


def eight_head_model(directory: Path) -> Path:
    from interop.testing import make_tiny_hf_model

    return make_tiny_hf_model(directory, ARCH, seed=8, num_attention_heads=8,
                              num_key_value_heads=2, vocab_size=VOCAB)


def topology_requests(eng) -> dict:
    prompts = [[int(t) for t in eng.tokenizer.encode(p)] for p in DEFAULT_PROMPTS[:2]]
    out = {}
    for i, ids in enumerate(prompts):
        common = dict(input_ids=ids, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        out[f"greedy_{i}"] = eng.generate(**common, sampling_params=dict(
            max_new_tokens=8, temperature=0, ignore_eos=True))
        out[f"t1_seed_{i}"] = eng.generate(**common, sampling_params=dict(
            max_new_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True))
    return {name: output_record(o) for name, o in out.items()}


def weight_updates(eng, model: str) -> dict:
    """Weight swaps through the padded TP2 head: a partial update of lm_head.weight with its own
    values, then with doubled values (the control), then a full reload from disk."""
    from safetensors.numpy import load_file

    head = load_file(str(Path(model) / "model.safetensors"))["lm_head.weight"]
    before = topology_requests(eng)
    eng.update_weights_from_tensor({"lm_head.weight": head})
    same = topology_requests(eng)
    eng.update_weights_from_tensor({"lm_head.weight": head * 2})
    doubled = topology_requests(eng)
    eng.update_weights_from_disk(model)
    reloaded = topology_requests(eng)
    return {"partial_same_equal": same == before, "partial_doubled_equal": doubled == before,
            "disk_reload_equal": reloaded == before}


def topology() -> dict:
    result = {}
    golden = json.loads((ROOT / "tests" / "goldens" / "cpu.json").read_text())["tiny"]
    # The same launch the goldens were recorded with (scripts/goldens.py: section_tiny).
    with Engine("tiny", numerics="rl-bitwise", skip_warmup=True, page_size=4, chunked_prefill_size=8,
                tp_size=2, tp_batch_invariant="all") as eng:
        result["tiny_tp2_all_vs_goldens"] = differences(golden, _tiny_requests(eng))
        result["server_info_parallelism"] = eng.server_info()["parallelism"]
    with tempfile.TemporaryDirectory() as tmp, override_profile(ARCH,
                                                                numerics_envelopes={"rl-bitwise"}):
        model = str(eight_head_model(Path(tmp) / "q3-8h"))
        records = {}
        for tp, layout in ((1, "off"), (2, "all"), (4, "all"), (8, "all"), (8, "off")):
            launch = dict(tp_size=tp) if tp == 1 else dict(tp_size=tp, tp_batch_invariant=layout)
            with Engine(model, numerics="rl-bitwise", **SMALL, **launch) as eng:
                records[f"tp{tp}_{layout}"] = topology_requests(eng)
                result.setdefault("scores_without_gather", {})[f"tp{tp}_{layout}"] = (
                    eng.runner.scores_without_gather(eng.sampler))
                if tp == 2:
                    result["eight_head_tp2_lm_head"] = eng.runner.parallelism()["projections"][
                        "lm_head"]
                    result["tp2_weight_updates"] = weight_updates(eng, model)
        result["eight_head_records"] = records
    return result


def _harness_run(numerics, variants=True, **launch):
    cfg = HarnessConfig(numerics=numerics, prompts=DEFAULT_PROMPTS[:3], max_new_tokens=5,
                        chunk_sizes=(7,) if variants else (),
                        retraction_intervals=(-3,) if variants else (),
                        launch=tuple(launch.items()))
    lines = []
    results = InvarianceHarness(cfg).run(report=lines.append)
    return {"modes": sorted({r.mode for r in results}),
            "temperatures": sorted({r.temperature for r in results}),
            "compared_values": sum(r.compared_values for r in results),
            "divergences": [str(d) for r in results for d in r.divergences],
            "table": lines[0]}


def harness() -> dict:
    return {
        # one engine (packed, rerun, prefix hit, overlap off); chunked prefill and retraction at
        # TP2 are `harness_tp2_variants` (a slow test)
        "rl-bitwise tp2 off": _harness_run("rl-bitwise", variants=False, tp_size=2),
        # The control: XLA's own dot in f32 changes its blocking with the row count (measured at
        # the runner level in tests/tp_probe.py), and psum has no promised order.
        "auto tp2 f32": _harness_run("auto", variants=False, tp_size=2, dtype="float32"),
    }


def harness_tp2_variants() -> dict:
    return {"rl-bitwise tp2 off, chunked and retracted": _harness_run("rl-bitwise", tp_size=2)}


def harness_tp4() -> dict:
    # one engine (packed, rerun, prefix hit): chunking and retraction ran at TP2 (`harness`)
    return {"rl-bitwise tp4 all": _harness_run("rl-bitwise", variants=False, tp_size=4,
                                               tp_batch_invariant="all")}


if __name__ == "__main__":
    section = sys.argv[1]
    print(json.dumps({"topology": topology, "harness": harness, "harness_tp4": harness_tp4,
                      "harness_tp2_variants": harness_tp2_variants}[section]()))
