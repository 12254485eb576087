"""Parts `engine` (the whole Engine on a fixed synthetic workload) and `hf` (the HF transformers
`generate` peer)."""

from __future__ import annotations

import time

from jengine.bench.common import (SHAPES, _checkpoint, _median_time, _pages, _pool_tokens,
                                  random_runner)


# -- part engine: the whole Engine on a fixed synthetic workload ------------------------------------

E2E_MAX_RUNNING = 256  # the running set holds the whole default workload at once
E2E_PREFILL_BUDGET = 4096  # --max-prefill-tokens, and the prefill chunk per request
PROGRESS_S = 15.0  # seconds between the workload's progress lines


class _NullDetokenizer:
    """Random weights have no tokenizer; text is not what this part measures (token ids are)."""

    def __init__(self, prompt_ids=()):
        pass

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def _e2e_launch(args):
    from jengine.config import LaunchConfig

    ps = LaunchConfig().page_size
    per_request = args.e2e_input + args.e2e_output
    running = min(E2E_MAX_RUNNING, args.e2e_requests)
    return LaunchConfig(numerics=args.numerics, max_running_requests=E2E_MAX_RUNNING,
                        max_prefill_tokens=E2E_PREFILL_BUDGET, chunked_prefill_size=E2E_PREFILL_BUDGET,
                        context_length=per_request + ps,
                        max_total_tokens=_pool_tokens([(running, per_request)], ps), skip_warmup=True,
                        output_hold_ms=args.output_hold_ms)


def _warm_step_programs(runner, sampler, args) -> float:
    """Compile what the workload's steps run, as a long-running server has it compiled; seconds.

    runner.warmup() compiles every (tokens, pages) bucket of the launch (~80 for the default
    workload): too slow for one device call. The workload hits: its first, prefill-only step at the
    largest token bucket with the prompt's page bucket; every later step (decodes grew past the
    prompt's pages) at any token bucket with the page bucket of a whole request. Anything missed
    still compiles inside the timed window, and the part reports that time.
    """
    import jax
    import numpy as np

    from jengine.engine.batch import StepBatch
    from pallas_kernels.fixed_order import next_pow2

    t0 = time.time()
    ps = runner.page_size
    top_tokens = next_pow2(min(E2E_PREFILL_BUDGET, args.e2e_requests * args.e2e_input), 16)
    token_buckets = [t for t in (1 << i for i in range(4, 32)) if t <= top_tokens]
    prompt_pages = next_pow2(_pages(args.e2e_input, ps))
    full_pages = next_pow2(_pages(args.e2e_input + args.e2e_output, ps))
    shapes = {(t, full_pages) for t in token_buckets} | {(top_tokens, prompt_pages)}
    for t, p in sorted(shapes):  # every row is padding: no K/V is written
        batch = StepBatch(input_ids=np.zeros(t), positions=np.zeros(t), token_req=np.zeros(t),
                          block_tables=np.zeros((1, p)), hidden_rows=[0])
        jax.block_until_ready(runner.forward_padded(batch))  # the engine's call
    _warm_row_glue(runner, sampler, min(E2E_MAX_RUNNING, args.e2e_requests), top_tokens)
    return time.time() - t0


def _warm_row_glue(runner, sampler, max_rows: int, top_tokens: int) -> None:
    """The glue around the jitted step -- `runner.logits_at` (row gather + LM head) and the
    sampler -- compiles one program per (token bucket, row bucket): run each once, on zeros
    committed to the device like a step's output, as a long-running server has them compiled."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jengine.engine.batch import SamplingRows
    from pallas_kernels.fixed_order import next_pow2

    device = jax.devices()[0]
    width = runner.model_config.hidden_size
    row_buckets = sorted({next_pow2(n) for n in range(1, max_rows + 1)})
    for n in row_buckets:
        for tokens in {next_pow2(n, 16), top_tokens}:
            hidden = jax.device_put(jnp.zeros((tokens, width), runner.dtype), device)
            zeros = np.zeros(n)
            sampler.sample(runner.logits_at(hidden, np.arange(n)),
                           SamplingRows(temperature=zeros, top_k=zeros - 1, top_p=zeros + 1,
                                        min_p=zeros, seed=zeros, position=zeros))


class _CompileClock:
    """Counts XLA backend compiles (and their seconds) while active: what leaked into a timing."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def _listen(self, event, duration, **_):
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration

    def __enter__(self):
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        import jax

        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister:  # without it (older jax) the listener stays, counting into a dead clock
            unregister(self._listen)


def latency_stats(submitted: list[float], arrivals: list[list[tuple[float, int]]]) -> dict:
    """TTFT and inter-token latency percentiles (ms) from each request's submit time and its
    (arrival time, tokens so far) stream events; an event of k new tokens counts k gaps of 1/k."""
    import numpy as np

    ttft, itl = [], []
    for t0, events in zip(submitted, arrivals):
        events = [(t, n) for t, n in events if n > 0]
        if not events:
            continue
        ttft.append(events[0][0] - t0)
        for (ta, na), (tb, nb) in zip(events, events[1:]):
            if nb > na:
                itl += [(tb - ta) / (nb - na)] * (nb - na)
    out = {}
    for name, xs in (("ttft", ttft), ("itl", itl)):
        if xs:
            p50, p90, p99 = np.percentile(np.asarray(xs) * 1e3, [50, 90, 99])
            out.update({f"{name}_p50_ms": p50, f"{name}_p90_ms": p90, f"{name}_p99_ms": p99})
    return out


def _run_workload(engine, prompts, sampling: dict) -> tuple[float, list[dict], dict]:
    """Wall seconds from submitting every request to the last one finished, the outputs, and the
    TTFT / inter-token latency percentiles (streamed: each token timed as the caller gets it)."""
    arrivals = [[] for _ in prompts]
    submitted = []
    t0 = time.perf_counter()
    handles = []
    for i, ids in enumerate(prompts):
        submitted.append(time.perf_counter())
        handles.append(engine.submit(
            input_ids=ids, sampling_params=sampling, stream=True,
            on_output=lambda out, a=arrivals[i]: a.append((time.perf_counter(),
                                                           len(out["output_ids"])))))
    outs = []
    for h in handles:
        # A progress line every PROGRESS_S: a part stopped by its timeout then says how far the
        # workload got (a device call once spent 105 s here and reported nothing).
        while True:
            try:
                outs.append(h.result(timeout=PROGRESS_S))
                break
            except TimeoutError:  # RequestHandle.result's, raised when PROGRESS_S passes
                produced = sum(a[-1][1] for a in arrivals if a)
                print(f"  ... {time.perf_counter() - t0:.0f} s: {len(outs)} of {len(prompts)} "
                      f"requests done, {produced} tokens out", flush=True)
    return time.perf_counter() - t0, outs, latency_stats(submitted, arrivals)


def part_engine(args) -> dict:
    """The workload on the overlapped loop (the default; the top-level fields) and on the
    synchronous one (`overlap_off`), then the loop overhead at --loop-batch decode rows."""
    import dataclasses

    launch = _e2e_launch(args)
    t0 = time.time()
    runner, plan, loaded = random_runner(args.shape, args.numerics, launch)
    from jengine.engine.sampler import Sampler

    sampler = Sampler(plan.sampler, loaded.config.vocab_size)
    out = {"numerics": args.numerics, "shape": args.shape, "kernels": runner.kernels.describe(),
           "requests": args.e2e_requests, "input_tokens": args.e2e_input,
           "output_tokens": args.e2e_output, "max_running_requests": launch.max_running_requests,
           "max_prefill_tokens": launch.max_prefill_tokens, "max_total_tokens": launch.max_total_tokens,
           "build_s": time.time() - t0}
    print(f"[{args.numerics}] built in {out['build_s']:.1f} s; compiling the step programs",
          flush=True)
    out["warmup_s"] = _warm_step_programs(runner, sampler, args)
    print(f"[{args.numerics}] step programs compiled in {out['warmup_s']:.1f} s", flush=True)
    _checkpoint(args, out)
    # The bucket warm-up above misses programs the workload's own step shapes need (on the CPU, 12
    # to 14 programs compiled inside the timed run: forwards of prefill steps at the prompt's page
    # bucket, the overlap schedule's placeholder fill and sampling per row bucket; on the H200 each
    # forward compiles for seconds). So the workload runs once untimed first, as a long-running
    # server would have seen such steps; what it still compiled is reported.
    print(f"[{args.numerics}] e2e workload once untimed (compiles what its steps need) ...",
          flush=True)
    warm = _engine_run(runner, sampler, plan, loaded, args)
    out["warm_run"] = {k: warm[k] for k in ("wall_s", "compiles_in_timing", "compile_s_in_timing")}
    _checkpoint(args, out)
    for overlap in (True, False):
        print(f"[{args.numerics}] e2e workload, overlap {overlap} ...", flush=True)
        run = _engine_run(runner, sampler, dataclasses.replace(plan, overlap_schedule=overlap),
                          loaded, args)
        if overlap:
            out.update(run)
        else:
            out["overlap_off"] = run
        _checkpoint(args, out)
    if args.loop_batch:
        out["loop_overhead"] = {
            name: _loop_overhead(runner, sampler, dataclasses.replace(plan, overlap_schedule=on),
                                 loaded, args)
            for name, on in (("overlap", True), ("overlap_off", False))}
    return out


def _make_engine(runner, sampler, plan, loaded):
    from jengine.engine.engine import Engine

    return Engine.from_components(
        plan=plan, model_config=loaded.config, tokenizer=None,
        eos_token_ids=loaded.eos_token_ids, runner=runner, sampler=sampler,
        detokenizer_factory=_NullDetokenizer, model_info={"model_dir": "random weights"})


def _engine_run(runner, sampler, plan, loaded, args) -> dict:
    import collections

    import numpy as np

    engine = _make_engine(runner, sampler, plan, loaded)
    rng = np.random.default_rng(0)
    # Greedy, and ignore_eos so every request yields exactly --e2e-output tokens.
    sampling = {"max_new_tokens": args.e2e_output, "temperature": 0.0, "ignore_eos": True}
    prompts = rng.integers(0, 32000, (args.e2e_requests, args.e2e_input)).tolist()
    try:
        warm = rng.integers(0, 32000, args.e2e_input).tolist()
        engine.submit(input_ids=warm, sampling_params={**sampling, "max_new_tokens": 4}).result()
        engine.flush_cache()  # the timed run starts from an empty prefix cache
        engine.time_host_phases()  # the loop's phases summed over the run (the server's too)
        with _CompileClock() as clock:
            wall, outs, latency = _run_workload(engine, prompts, sampling)
        host = engine.host_phases()
    finally:
        engine.shutdown()
    produced = sum(o["meta_info"]["completion_tokens"] for o in outs)
    out = dict(
        overlap_schedule=plan.overlap_schedule, output_hold_s=plan.output_hold_s, wall_s=wall,
        output_tokens_total=produced,
        finish_reasons=dict(collections.Counter(o["meta_info"]["finish_reason"]["type"]
                                                for o in outs)),
        output_tok_s=produced / wall, total_tok_s=(produced + args.e2e_input * len(outs)) / wall,
        req_s=len(outs) / wall, compiles_in_timing=clock.count, compile_s_in_timing=clock.seconds,
        host_phases=host, **latency)
    print(f"[{args.numerics}] e2e {len(outs)} requests, overlap {plan.overlap_schedule}: "
          f"{wall:.2f} s, {out['output_tok_s']:.0f} output tok/s, ITL p50 "
          f"{out.get('itl_p50_ms', 0):.2f} ms", flush=True)
    return out


def _loop_overhead(runner, sampler, plan, loaded, args) -> dict:
    """The Engine's decode step at --loop-batch rows (its median inter-token latency, every
    request decoding in lockstep) against the model's own step at that batch and the run's middle
    context: forward, LM head and sampling dispatched back to back, so host time hides behind the
    device's. overhead_pct = how much longer the Engine's step is (the issue's <= 5 % goal).
    host_phases: the engine thread's median ms per loop phase (`Engine.host_phases`)."""
    import jax
    import numpy as np

    from jengine.engine.batch import SamplingRows, StepBatch

    bs = min(args.loop_batch, args.e2e_requests, E2E_MAX_RUNNING)  # what the pool is sized for
    engine = _make_engine(runner, sampler, plan, loaded)
    engine.time_host_phases()  # where the engine thread's step goes (jengine/engine/loop_clock.py)
    rng = np.random.default_rng(1)
    sampling = {"max_new_tokens": args.e2e_output, "temperature": 0.0, "ignore_eos": True}
    try:
        _, _, latency = _run_workload(engine, rng.integers(0, 32000, (bs, args.e2e_input)).tolist(),
                                      sampling)
        host = engine.host_phases()
    finally:
        engine.shutdown()
    context = args.e2e_input + args.e2e_output // 2
    pages = _pages(context + 1, runner.page_size)
    batch = StepBatch(input_ids=np.arange(bs) % 1000, positions=np.full(bs, context),
                      token_req=np.arange(bs),
                      block_tables=1 + np.arange(bs * pages, dtype=np.int32).reshape(bs, pages),
                      hidden_rows=np.arange(bs))
    zeros = np.zeros(bs)
    rows = SamplingRows(temperature=zeros, top_k=zeros - 1, top_p=zeros + 1, min_p=zeros,
                        seed=zeros, position=zeros + context)

    def model_step():
        return sampler.sample_on_device(runner.logits_at(runner.forward_padded(batch),
                                                         batch.hidden_rows), rows)

    model_ms = _median_time(model_step, args.iters, warmup=2, back_to_back=8,
                            sync=jax.block_until_ready) * 1e3
    engine_ms = latency.get("itl_p50_ms")
    out = {"batch": bs, "context": context, "model_step_ms": model_ms,
           "engine_step_ms": engine_ms, "overlap_schedule": plan.overlap_schedule,
           "overhead_pct": 100 * (engine_ms / model_ms - 1) if engine_ms else None,
           "host_phases": host}
    print(f"[{args.numerics}] loop overhead bs={bs}, overlap {plan.overlap_schedule}: engine "
          f"{engine_ms or 0:.2f} ms/step, model {model_ms:.2f} ms/step; host "
          + ", ".join(f"{k} {v:.3f}" for k, v in host.items() if k.endswith("_ms")), flush=True)
    return out


# -- part hf: the HF transformers `generate` peer -------------------------------------------------


def _hf_model(args):
    """The bench shape's own HF class (its `architectures` entry: LlamaForCausalLM,
    Qwen3MoeForCausalLM, ...) with random weights, created on the device in its dtype (never 16 GB
    of float32 on the host)."""
    import torch
    import transformers

    base, _ = SHAPES[args.shape]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CPU bf16 matmuls crawl
    fields = {k: v for k, v in base.items() if k not in ("architectures", "torch_dtype")}
    if fields["eos_token_id"] >= fields["vocab_size"]:  # the small shape's vocab is cut to 32000
        fields.update(bos_token_id=None, eos_token_id=fields["vocab_size"] - 1)
    config = getattr(transformers, base["architectures"][0]).config_class(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), device, dtype


def _hf_generate(model, prompt, new_tokens: int, cache: str | None):
    import torch

    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, num_beams=1,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,  # every row runs full length
                  pad_token_id=model.config.eos_token_id)
    if cache:
        kwargs["cache_implementation"] = cache
    with torch.inference_mode():
        out = model.generate(prompt, **kwargs)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return out.shape[1] - prompt.shape[1]


def part_hf(args) -> dict:
    try:
        import torch
        import transformers
    except Exception as exc:  # noqa: BLE001 - the peer is optional; the rest of the bench is not
        return {"error": f"torch/transformers not importable: {exc!r}"[:300]}
    import numpy as np

    model, device, dtype = _hf_model(args)
    b, n = args.hf_batch, args.hf_new_tokens
    ids = np.random.default_rng(0).integers(0, 32000, (b, args.context))
    prompt = torch.tensor(ids, device=device)
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "device": device,
           "dtype": str(dtype).replace("torch.", ""), "shape": args.shape,
           "model_class": type(model).__name__, "batch": b,
           "context": args.context, "new_tokens": n}
    # A static cache lets transformers compile the decode step on CUDA; the dynamic cache is the
    # fallback. The warm-up runs the timed shape (a static cache is sized by prompt + new tokens,
    # and the compiled step is kept for it), so the n-token runs are timed before the 1-token ones.
    try:
        out["generated"] = _hf_generate(model, prompt, n, "static")
        out["cache"] = "static"
    except Exception as exc:  # noqa: BLE001
        out["static_cache_error"] = repr(exc)[:300]
        out["generated"] = _hf_generate(model, prompt, n, None)
        out["cache"] = "dynamic (default)"
    cache = "static" if out["cache"] == "static" else None
    iters = max(1, min(args.iters, 3))  # one generate is seconds; three samples are enough
    out["generate_s"] = _median_time(lambda: _hf_generate(model, prompt, n, cache), iters, warmup=0)
    out["generate_1_s"] = _median_time(lambda: _hf_generate(model, prompt, 1, cache), iters, warmup=1)
    out["tok_s_with_prefill"] = b * n / out["generate_s"]
    # The 1-token generate is the prefill (and its first token); the rest is n - 1 decode steps.
    decode_s = out["generate_s"] - out["generate_1_s"]
    out["decode_tok_s"] = b * (n - 1) / decode_s if decode_s > 0 and n > 1 else None
    print(f"[hf] bs={b} ctx={args.context} +{n}: {out['generate_s']:.2f} s "
          f"({out['tok_s_with_prefill']:.0f} tok/s with prefill)", flush=True)
    return out
