"""Part `model`: the real ModelRunner's decode steps (every batch size, the long-context row) and
one prefill chunk, on the random-weight model."""

from __future__ import annotations

import statistics
import time

from jengine.bench.common import (_checkpoint, _median_time, _pages, _pool_tokens, random_runner,
                                  shape_config, step_model)
from jengine.bench.measures import ROOFLINE_SHAPE


def _time_decode(runner, bs: int, context: int, iters: int,
                 label: str = "") -> tuple[float, float, float, float]:
    """(compile s, median ms, pipelined median ms, dispatch median ms) of one decode step: bs
    requests, each at position `context` with its own pages (page 0 is the null page).

    The first time blocks on every step, as the loop without overlap does: host time (Python,
    dispatch, argument transfers) adds to the device's. The pipelined time dispatches 8 steps back
    to back and blocks on the last, as the overlapped Engine loop runs them: the device's step time
    when the host keeps ahead of it (jengine/engine/engine_loop.py). The dispatch time is how long
    the calls take to return with the device idle: the host's share of a step (argument handling
    and XLA's launch of every kernel), which the overlapped loop must keep under the device's."""
    import jax

    batch = _decode_batch(runner, bs, context)

    def dispatch():  # the engine's path: padded hidden states, then the sampled rows' logits
        return runner.logits_at(runner.forward_padded(batch), batch.hidden_rows)

    step = lambda: jax.block_until_ready(dispatch())  # noqa: E731
    t0 = time.time()
    step()
    compile_s = time.time() - t0
    # Said as it happens: a part stopped by its timeout keeps only what it printed.
    print(f"{f'[{label}] ' if label else ''}decode bs={bs} ctx={context}: compiled and ran once in "
          f"{compile_s:.1f} s", flush=True)
    blocked = _median_time(step, iters, warmup=1) * 1e3
    pipelined = _median_time(dispatch, iters, warmup=1, back_to_back=8,
                             sync=jax.block_until_ready) * 1e3
    launch = []
    for _ in range(iters):
        t1 = time.perf_counter()
        out = dispatch()
        launch.append(time.perf_counter() - t1)
        jax.block_until_ready(out)
    return compile_s, blocked, pipelined, statistics.median(launch) * 1e3


def _decode_batch(runner, bs: int, context: int):
    """The decode row's step: bs requests at position `context`, each with its own pages (page 0
    is the null page)."""
    import numpy as np

    from jengine.engine.batch import StepBatch

    pages = _pages(context + 1, runner.page_size)
    tables = 1 + np.arange(bs * pages, dtype=np.int32).reshape(bs, pages)
    return StepBatch(input_ids=np.arange(bs) % 1000, positions=np.full(bs, context),
                     token_req=np.arange(bs), block_tables=tables, hidden_rows=np.arange(bs))


def _experts_read(runner, bs: int, context: int) -> dict | None:
    """For a model that routes tokens to experts: the (layer, expert) pairs the decode row's step
    routes its bs rows to ("rows": the experts whose weights a routed step reads; its token
    bucket's padding rows reach no expert, jengine/models/layers/moe.py) and, on the routed
    backend, the rows each of its grouped GEMMs runs ("layout_rows": static, sized for any routing
    of the bucket); None for a dense model. One untimed step of the timed batch: the same
    routing."""
    import numpy as np

    from jengine.models.layers.moe_routed import layout_rows

    if not runner.routing_shape:
        return None
    ids = np.asarray(runner.forward_routed(_decode_batch(runner, bs, context))[1])

    def pairs(rows):  # a dense layer's ids are -1: it reads no expert
        return int(sum(len(set(rows[:, layer].ravel().tolist()) - {-1})
                       for layer in range(rows.shape[1])))

    out = {"rows": pairs(ids[:bs])}
    cfg = runner.model_config
    if runner.kernels.describe().get("expert_backend") == "batch_invariant" \
            and hasattr(cfg, "moe_intermediate_size"):
        # ids has a row per row of the step program: the bucket the layout is sized for
        out["layout_rows"] = layout_rows(len(ids), cfg.num_experts_per_tok, cfg.num_experts,
                                         cfg.moe_intermediate_size, cfg.hidden_size, runner.dtype)
    return out


def _time_prefill(runner, n: int, iters: int) -> float:
    """Median ms of one n-token prefill chunk of one request (LM head on its last row only)."""
    import jax
    import numpy as np

    from jengine.engine.batch import StepBatch

    tables = 1 + np.arange(_pages(n, runner.page_size), dtype=np.int32)[None]
    batch = StepBatch(input_ids=np.arange(n) % 1000, positions=np.arange(n),
                      token_req=np.zeros(n), block_tables=tables, hidden_rows=[n - 1])
    step = lambda: jax.block_until_ready(runner.logits_at(runner.forward_padded(batch), batch.hidden_rows))
    t0 = time.time()
    step()
    print(f"prefill {n}: compiled and ran once in {time.time() - t0:.1f} s", flush=True)
    # A chunk takes ~100x a decode step: half the samples suffice.
    return _median_time(step, max(3, iters // 2), warmup=1) * 1e3


def _decode_rows(args) -> list[tuple[int, int]]:
    """(batch, context) of every decode row: --batch-sizes at --context, then the long row."""
    long_row = [(args.long_context_batch, args.long_context)] if args.long_context else []
    return [(bs, args.context) for bs in args.batch_sizes] + long_row


def _model_launch(args):
    """Room for the largest row and no more: rows run one at a time and reuse the same pages."""
    from jengine.config import LaunchConfig

    ps = LaunchConfig().page_size
    rows = _decode_rows(args)
    held = [(bs, ctx + 1) for bs, ctx in rows] + [(1, max(args.prefill_tokens, 1))]
    return LaunchConfig(numerics=args.numerics, max_running_requests=max(bs for bs, _ in rows),
                        max_prefill_tokens=max(args.prefill_tokens, 16),
                        context_length=max([ctx for _, ctx in rows] + [args.prefill_tokens]) + ps,
                        max_total_tokens=_pool_tokens(held, ps), skip_warmup=True)


def part_model(args) -> dict:
    import jax

    launch = _model_launch(args)
    t0 = time.time()
    runner, _, loaded = random_runner(args.shape, args.numerics, launch, layers=args.layers)
    jax.block_until_ready(runner.params.arrays)  # drawn on the device: "built" means resident
    print(f"[{args.numerics}] {loaded.config.num_hidden_layers} layers of {args.shape} built on "
          f"random weights in {time.time() - t0:.1f} s", flush=True)
    out = {"numerics": args.numerics, "vocab": loaded.config.vocab_size,
           "kernels": runner.kernels.describe(), "shape": args.shape, "context": args.context,
           "layers": loaded.config.num_hidden_layers,
           "prefill_tokens": args.prefill_tokens, "max_total_tokens": launch.max_total_tokens,
           "build_s": time.time() - t0, "decode_ms": {}, "decode_pipelined_ms": {},
           "decode_dispatch_ms": {}, "compile_s": {}}
    if args.shape != ROOFLINE_SHAPE:  # measures.py counts that one's bytes itself
        out["step_model"] = step_model(shape_config(args.shape, args.layers)[0])
    for bs in args.batch_sizes:
        (out["compile_s"][bs], out["decode_ms"][bs], out["decode_pipelined_ms"][bs],
         out["decode_dispatch_ms"][bs]) = _time_decode(runner, bs, args.context, args.iters,
                                                        args.numerics)
        experts = _experts_read(runner, bs, args.context)
        if experts:
            out.setdefault("experts_read", {})[bs] = experts
        print(f"[{args.numerics}] decode bs={bs}: {out['decode_ms'][bs]:.2f} ms blocked on, "
              f"{out['decode_pipelined_ms'][bs]:.2f} ms pipelined, "
              f"{out['decode_dispatch_ms'][bs]:.2f} ms to dispatch", flush=True)
        _checkpoint(args, out)
    if args.long_context:  # after the normal rows: a failure here keeps them
        bs, ctx = args.long_context_batch, args.long_context
        compile_s, ms, pipelined, launch_ms = _time_decode(runner, bs, ctx, args.iters,
                                                           args.numerics)
        out["long_decode"] = {"batch": bs, "context": ctx, "ms": ms, "pipelined_ms": pipelined,
                              "dispatch_ms": launch_ms, "compile_s": compile_s,
                              "experts_read": _experts_read(runner, bs, ctx)}
        print(f"[{args.numerics}] decode bs={bs} ctx={ctx}: {ms:.2f} ms blocked on, "
              f"{pipelined:.2f} ms pipelined", flush=True)
        _checkpoint(args, out)
    if args.prefill_tokens:
        out["prefill_ms"] = _time_prefill(runner, args.prefill_tokens, args.iters)
        print(f"[{args.numerics}] prefill {args.prefill_tokens}: {out['prefill_ms']:.1f} ms", flush=True)
    return out
