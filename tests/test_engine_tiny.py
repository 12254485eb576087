"""The engine on the real tiny model (fp32): continuous batching, chunked prefill, prefix cache and
retraction against a naive reference loop that runs one request at a time with no cache.

Equality of greedy tokens is asserted; logprobs within float tolerance here (auto numerics: XLA's
row-count-dependent dots may move the last bits). The bitwise versions are the numerics tests' job.
"""

from __future__ import annotations

import numpy as np
import pytest

from jengine.engine.batch import StepBatch
from jengine.engine.engine import Engine

LAUNCH = dict(dtype="float32", max_total_tokens=4096, chunked_prefill_size=32, max_prefill_tokens=96,
              max_running_requests=8, input_logprob_chunk_tokens=16, skip_warmup=True)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 30000, size=n).tolist() for n in lengths]


PROMPTS = prompts_of([5, 17, 40, 70, 1, 33])
NEW_TOKENS = [12, 7, 20, 9, 15, 1]


def greedy(n, **kw):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **kw}


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.fixture(scope="module")
def eng():
    with Engine(model_path="tiny", **LAUNCH) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(eng):
    """Naive loop on a second runner over the same weights: one request, whole prompt, then one
    token per forward; no batching, no chunking, no prefix cache."""
    from jengine.engine.model_runner import ModelRunner
    from jengine.models import load_model

    loaded = load_model("tiny", progress=False)
    runner = ModelRunner(loaded.config, loaded.checkpoint, eng.plan.runner)
    ps = runner.page_size

    def run(prompt, n):
        pages = list(range(1, 1 + -(-(len(prompt) + n) // ps)))
        tokens, start, out, lps = list(prompt), 0, [], []
        for _ in range(n):
            feed = tokens[start:]
            batch = StepBatch(input_ids=feed, positions=list(range(start, len(tokens))),
                              token_req=[0] * len(feed), block_tables=[pages], hidden_rows=[len(feed) - 1])
            logits = np.asarray(runner.compute_logits(runner.forward(batch)))[0]
            token = int(np.argmax(logits))  # lowest index on ties, like the canonical argmax
            out.append(token)
            lps.append(log_softmax(logits)[token])
            start = len(tokens)
            tokens.append(token)
        return out, lps

    memo = {}

    def cached(prompt, n):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = run(prompt, n)
        return memo[key]

    for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS)):
        memo[i] = cached(p, n)
    memo["run"] = cached
    return memo


def test_batched_engine_matches_naive_reference(eng, reference):
    eng.flush_cache()
    outs = eng.generate(input_ids=PROMPTS, sampling_params=[greedy(n) for n in NEW_TOKENS],
                        return_logprob=True)
    for i, out in enumerate(outs):
        ref_tokens, ref_lps = reference[i]
        assert out["output_ids"] == ref_tokens, f"prompt {i}"
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(lps, ref_lps, rtol=1e-4, atol=1e-4)
        assert out["meta_info"]["finish_reason"] == {"type": "length"}


def test_prefix_hit_same_tokens_as_cold(eng, reference):
    eng.flush_cache()
    cold = eng.generate(input_ids=PROMPTS[3], sampling_params=greedy(NEW_TOKENS[3]))
    assert cold["meta_info"]["cached_tokens"] == 0
    warm = eng.generate(input_ids=PROMPTS[3], sampling_params=greedy(NEW_TOKENS[3]))
    # The whole prompt but its last token is cached (the last one yields the first logits).
    assert warm["meta_info"]["cached_tokens"] == len(PROMPTS[3]) - 1
    assert warm["output_ids"] == cold["output_ids"] == reference[3][0]
    # A hit that ends inside a page (not a multiple of page_size 16): 37 shared tokens.
    branch = PROMPTS[3][:37] + [7, 8, 9]
    hit = eng.generate(input_ids=branch, sampling_params=greedy(6))
    assert hit["meta_info"]["cached_tokens"] == 37
    eng.flush_cache()
    assert eng.generate(input_ids=branch, sampling_params=greedy(6))["output_ids"] == hit["output_ids"]


def test_teacher_forcing_returns_one_logprob_per_position(eng):
    prompt = PROMPTS[2]
    gen = eng.generate(input_ids=prompt, sampling_params=greedy(8), return_logprob=True)
    seq = prompt + gen["output_ids"]
    tf = eng.generate(input_ids=seq, sampling_params=greedy(0), return_logprob=True, logprob_start_len=0)
    entries = tf["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(seq) and entries[0][0] is None
    assert [t for _, t, _ in entries] == seq
    assert tf["output_ids"] == [] and tf["meta_info"]["cached_tokens"] == 0
    response_tf = [lp for lp, _, _ in entries[len(prompt):]]
    response_gen = [lp for lp, _, _ in gen["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(response_tf, response_gen, rtol=1e-4, atol=1e-4)


def test_many_concurrent_requests_complete(eng):
    prompts = prompts_of([3 + (7 * i) % 50 for i in range(20)], seed=1)
    params = [greedy(1 + i % 9) for i in range(20)]
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    for i, out in enumerate(outs):
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) == 1 + i % 9
        assert out["meta_info"]["prompt_tokens"] == len(prompts[i])
    # stop_token_ids end a request on the first occurrence of the token.
    first = outs[5]["output_ids"]
    stopped = eng.generate(input_ids=prompts[5], sampling_params=greedy(9, stop_token_ids=[first[1]]))
    assert stopped["output_ids"] == first[: first.index(first[1]) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[1]}
    stats = eng.stats()
    assert stats["num_running"] == 0 and stats["requests_total"] >= 20


def test_bad_inputs_raise_and_engine_keeps_serving(eng, reference):
    vocab = eng.model_config.vocab_size
    with pytest.raises(ValueError, match=r"input_ids\[1\]="):
        eng.generate(input_ids=[1, vocab + 5], sampling_params=greedy(2))
    with pytest.raises(ValueError, match="temprature"):
        eng.generate(input_ids=[1, 2], sampling_params={"temprature": 0})
    with pytest.raises(ValueError, match="input_ids is empty"):
        eng.submit(input_ids=[], sampling_params=greedy(1))
    assert eng.generate(input_ids=PROMPTS[0], sampling_params=greedy(NEW_TOKENS[0]))["output_ids"] == reference[0][0]


def test_forced_retraction_same_tokens(reference):
    with Engine(model_path="tiny", **{**LAUNCH, "debug_force_retraction_interval": 3}) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=[greedy(n) for n in NEW_TOKENS])
        assert [o["output_ids"] for o in outs] == [reference[i][0] for i in range(len(PROMPTS))]
        assert engine.stats()["retractions_total"] >= 5


def test_pool_exhaustion_retracts_and_completes(reference):
    # 8 pages of 16 tokens: six one-page prompts are admitted together, then each grows to 4 pages.
    prompts = prompts_of([14] * 6, seed=2)
    with Engine(model_path="tiny", **{**LAUNCH, "max_total_tokens": 128}) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=greedy(40))
        assert [o["output_ids"] for o in outs] == [reference["run"](p, 40)[0] for p in prompts]
        assert engine.stats()["retractions_total"] > 0


# -- rl-bitwise: retraction and prefix hits are byte-exact (spec oracles) -----------------------------
BITWISE_LAUNCH = dict(numerics="rl-bitwise", max_total_tokens=4096, chunked_prefill_size=32,
                      max_prefill_tokens=96, skip_warmup=True)
MIXED = [greedy(12) if i % 2 == 0 else {"max_new_tokens": 12, "temperature": 1.0, "seed": 3,
                                        "ignore_eos": True} for i in range(len(PROMPTS))]


def run_bits(engine, prompts=PROMPTS, params=MIXED):
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                           logprob_start_len=0)
    ids = [o["output_ids"] for o in outs]
    out_bits = [np.array([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]], np.float32)
                .view(np.uint32).tolist() for o in outs]
    in_bits = [np.array([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]], np.float32)
               .view(np.uint32).tolist() for o in outs]
    return ids, out_bits, in_bits


@pytest.fixture(scope="module")
def bitwise_plain():
    from jengine.profiles import override_profile

    # The tiny model's profile does not declare rl-bitwise (the numerics issue earns that); the
    # engine's byte-copy paths are what is tested here.
    with override_profile("Qwen3ForCausalLM", numerics_envelopes={"rl-bitwise"}):
        with Engine(model_path="tiny", **BITWISE_LAUNCH) as engine:
            yield engine, run_bits(engine)


@pytest.mark.parametrize("interval", [3, -2])
def test_rl_bitwise_forced_retraction_is_a_byte_copy(bitwise_plain, interval):
    from jengine.profiles import override_profile

    _, plain = bitwise_plain
    with override_profile("Qwen3ForCausalLM", numerics_envelopes={"rl-bitwise"}):
        with Engine(model_path="tiny", **BITWISE_LAUNCH, debug_force_retraction_interval=interval) as engine:
            assert run_bits(engine) == plain
            assert engine.stats()["retractions_total"] >= len(PROMPTS)
            # Negative control: a restore that is not byte-exact is caught by the same comparison.
            write = engine.runner.write_pages
            engine.runner.write_pages = lambda pages, data: write(pages, (data * 1.5).astype(data.dtype))
            assert run_bits(engine)[1] != plain[1]


def test_rl_bitwise_prefix_hit_is_bitwise_cold(bitwise_plain):
    engine, (ids, out_bits, _) = bitwise_plain
    engine.flush_cache()
    params = [{**p, "max_new_tokens": 12} for p in MIXED]
    cold = run_bits(engine, params=params)
    # Output-only logprobs so the hits are not capped at logprob_start_len = 0.
    warm = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    assert sum(o["meta_info"]["cached_tokens"] for o in warm) > 0
    assert [o["output_ids"] for o in warm] == cold[0] == ids
    assert [np.array([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]], np.float32)
            .view(np.uint32).tolist() for o in warm] == cold[1] == out_bits


def test_stats_and_server_info_keys(eng):
    stats = eng.stats()
    assert set(stats) == {"num_running", "num_waiting", "kv_used_tokens", "kv_total_tokens",
                          "cache_hit_tokens_total", "retractions_total", "prompt_tokens_total",
                          "generation_tokens_total", "requests_total", "step_latency_seconds",
                          "weight_version", "paused", "memory_released"}
    assert stats["kv_total_tokens"] == 4096 and stats["generation_tokens_total"] > 0
    info = eng.server_info()
    assert info["numerics"] == "auto" and info["vocab_size"] == eng.model_config.vocab_size
    # n > 1 in a batch: n outputs per prompt, rids <rid>-i, in order.
    outs = eng.generate(input_ids=[PROMPTS[0], PROMPTS[1]], rid=["a", "b"],
                        sampling_params={"max_new_tokens": 3, "temperature": 1.0, "n": 2, "ignore_eos": True})
    assert [o["meta_info"]["id"] for o in outs] == ["a-0", "a-1", "b-0", "b-1"]


def test_generate_cli(capsys):
    import json

    from jengine.cli import main

    common = ["--model", "tiny", "--skip-warmup", "--max-total-tokens", "512", "--log-level", "warning"]
    assert main(["generate", "--input-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos", "--json",
                 *common]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["output_ids"]) == 4 and out["meta_info"]["finish_reason"] == {"type": "length"}
    assert main(["generate", "--input-ids", "5,99999999", *common]) == 2
    assert "input_ids[1]=99999999" in capsys.readouterr().err


def test_a_new_count_of_sampled_rows_compiles_nothing(eng):
    """The engine's glue (ModelRunner.logits_at + the sampler) compiles per row *bucket*, not per
    row count: after 5 rows (bucket 8), 6 and 7 rows reuse every program. The exact-shape path
    (forward + compute_logits, for tools) compiles per count: the negative control that shows the
    counter counts."""
    from jengine.bench.e2e import _CompileClock  # counts XLA backend compiles while active

    runner, sampler = eng.runner, eng.sampler
    t = 16
    batch = StepBatch(input_ids=np.arange(t) + 100, positions=np.arange(t), token_req=np.zeros(t),
                      block_tables=[[1]], hidden_rows=[t - 1])
    hidden = runner.forward_padded(batch)

    def engine_glue(n):
        zeros = np.zeros(n)
        from jengine.engine.batch import SamplingRows

        logits = runner.logits_at(hidden, np.arange(n))
        sampler.sample(logits, SamplingRows(temperature=zeros, top_k=zeros - 1, top_p=zeros + 1,
                                            min_p=zeros, seed=zeros, position=zeros))
        sampler.token_logprobs(logits, np.zeros(n, np.int32))

    engine_glue(5)
    with _CompileClock() as c:
        engine_glue(6)
        engine_glue(7)
    assert c.count == 0
    with _CompileClock() as c:
        np.asarray(runner.compute_logits(jnp_take(hidden, 6)))
        np.asarray(runner.compute_logits(jnp_take(hidden, 7)))
    assert c.count > 0


def jnp_take(hidden, n):
    import jax.numpy as jnp

    return jnp.take(hidden, jnp.arange(n), axis=0)
