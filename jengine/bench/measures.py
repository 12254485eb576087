"""What a `jengine bench` result measures, computed the same way by the report and the targets:
byte and FLOP counts of the Llama-3-8B shape (bf16), decode rows, percentages of the roofline.

  decode step reads every projection weight once, the LM head once, and each request's KV:
    weights = 32 * (2*4096*4096 + 2*1024*4096 + 3*14336*4096) + vocab*4096 parameters, 2 bytes each
    KV      = batch * context * 32 layers * 2 (K, V) * 8 heads * 128 * 2 bytes
  prefill of n tokens (one request, LM head on the last row only):
    2 * 32 * (projection parameters) * n  +  attention 2 * 2 * n^2/2 * 4096 * 32
  the Engine workload (R requests x (n in + m out), every request admitted at once): each prompt's
    prefill at the GEMM peak, then m - 1 decode steps of all R rows at contexts n + 1 .. n + m - 1,
    each at the larger of its bytes over the HBM bandwidth and its FLOPs over the GEMM peak -- the
    fastest that work can be done on this GPU, so no scheduler can beat it
Another GQA shape (the MoE shape, the small CPU ones) carries its own counts in its model result
(`step_model`, jengine/bench/common.py): the same terms, with a MoE decode step's experts counted
as the (layer, expert) pairs its rows were routed to. The Engine workload's bound stays the
Llama-3-8B shape's only.
"""

from __future__ import annotations

LAYER_PARAMS = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
ROOFLINE_SHAPE = "llama3-8b"  # the shape the constants above count


def shape_label(r: dict) -> str:
    """A result's shape, with its layer count where --layers ran fewer than the shape has."""
    from jengine.bench.common import SHAPES

    shape = r.get("shape", ROOFLINE_SHAPE)
    whole = SHAPES[shape][0]["num_hidden_layers"] if shape in SHAPES else None
    layers = r.get("layers")
    return f"{shape} ({layers} of its {whole} layers)" if layers and layers != whole else shape


def decode_bytes(batch: int, context: int, vocab: int) -> float:
    return (32 * LAYER_PARAMS + vocab * 4096) * 2 + batch * context * KV_BYTES_PER_TOKEN


def prefill_flops(n: int) -> float:
    return 2 * 32 * LAYER_PARAMS * n + 2 * 2 * (n * n / 2) * 4096 * 32


def workload_bound_s(requests: int, n_in: int, n_out: int, vocab: int, bw, peak) -> float | None:
    """The Engine workload's roofline wall time (module docstring), None without a roofline."""
    if not (bw and peak and requests and n_in and n_out):
        return None
    lm_head = 2 * 4096 * vocab
    prefill = requests * (prefill_flops(n_in) + lm_head) / (peak * 1e12)
    decode = 0.0
    for ctx in range(n_in + 1, n_in + n_out):
        flops = requests * (2 * 32 * LAYER_PARAMS + lm_head + 2 * 2 * ctx * 4096 * 32)
        decode += max(decode_bytes(requests, ctx, vocab) / (bw * 1e12), flops / (peak * 1e12))
    return prefill + decode


def workload_bound(r: dict, bw, peak) -> tuple[float, float] | None:
    """(roofline wall s, the output tok/s it allows) of an Engine result's workload; None off the
    Llama-3-8B shape or without a roofline."""
    if r.get("shape", ROOFLINE_SHAPE) != ROOFLINE_SHAPE:
        return None
    requests, n_out = r.get("requests"), r.get("output_tokens")
    s = workload_bound_s(requests, r.get("input_tokens"), n_out, r.get("vocab", 128256), bw, peak)
    return (s, requests * n_out / s) if s else None


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def at(d: dict, key):
    """d[key] for an int key that JSON turned into a string."""
    return d.get(str(key), d.get(key)) if d else None


def status(value, target: float, *, at_least: bool, unit: str = "", digits: int = 2) -> str:
    """'**met**' or '**missed** by <gap><unit>', the gap to `digits` decimals (None: 'not
    measured')."""
    if value is None:
        return "not measured"
    if (value >= target) if at_least else (value <= target):
        return "**met**"
    return f"**missed** by {abs(target - value):.{digits}f}{unit}"


def not_measured(part: dict | None, what: str = "part not run") -> str:
    if part and "error" in part:
        return f"not measured ({part['error']})"
    return f"not measured ({what})"


def by_numerics(results: dict, part: str) -> dict:
    return {k.split(":", 1)[1]: r for k, r in results.items()
            if k.startswith(part + ":") and isinstance(r, dict)}


def decode_rows(models: dict) -> dict:
    """{(batch, context): {numerics: (ms, model result)}} over the normal and the long-context rows."""
    rows: dict = {}
    for name, r in models.items():
        for bs, ms in (r.get("decode_ms") or {}).items():
            rows.setdefault((int(bs), r.get("context", 1024)), {})[name] = (ms, r)
        long = r.get("long_decode")
        if long and long.get("ms"):
            rows.setdefault((long["batch"], long["context"]), {})[name] = (long["ms"], r)
    return dict(sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])))


def pipelined_ms(r: dict, bs: int, ctx: int):
    """The row's step time dispatched back to back (jengine/bench/model.py), None if not measured."""
    long = r.get("long_decode") or {}
    if (long.get("batch"), long.get("context")) == (bs, ctx):
        return long.get("pipelined_ms")
    return at(r.get("decode_pipelined_ms") or {}, bs) if r.get("context", 1024) == ctx else None


def dispatch_ms(r: dict, bs: int, ctx: int):
    """How long the row's step calls took to return with the device idle (the host's share)."""
    long = r.get("long_decode") or {}
    if (long.get("batch"), long.get("context")) == (bs, ctx):
        return long.get("dispatch_ms")
    return at(r.get("decode_dispatch_ms") or {}, bs) if r.get("context", 1024) == ctx else None


def row_bytes(bs: int, ctx: int, r: dict) -> float | None:
    """Bytes the row's decode step must read: the Llama-3-8B shape's decode_bytes, or from another
    GQA shape's step model (jengine/bench/common.py step_model, bf16): every fixed weight, each
    (layer, expert) pair its rows routed to once (the model part counts them), the KV. None where
    the result has no such model (an MLA shape; a MoE row whose routing was not counted)."""
    if r.get("shape", ROOFLINE_SHAPE) == ROOFLINE_SHAPE:
        return decode_bytes(bs, ctx, r.get("vocab", 128256))
    sm = r.get("step_model")
    if not sm:
        return None
    experts = experts_read(r, bs, ctx)
    if sm["expert"] and not experts:
        return None
    routed = experts["rows"] * sm["expert"] if sm["expert"] else 0
    return (sm["fixed"] + routed) * 2 + bs * ctx * sm["kv_bytes_per_token"]


def experts_read(r: dict, bs: int, ctx: int) -> dict | None:
    """{"rows"}: the (layer, expert) pairs the row's step routed its rows to
    (jengine/bench/model.py), None for a dense model or an older bench."""
    long = r.get("long_decode") or {}
    if (long.get("batch"), long.get("context")) == (bs, ctx):
        return long.get("experts_read")
    return at(r.get("experts_read") or {}, bs) if r.get("context", 1024) == ctx else None


def hbm_percent(ms, bs: int, ctx: int, r: dict, bw) -> float | None:
    """% of the HBM-bound step time reached (None without a byte count for the row, or without a
    roofline)."""
    nbytes = row_bytes(bs, ctx, r)
    if not (ms and bw and nbytes):
        return None
    return 100 * nbytes / (bw * 1e12) / (ms * 1e-3)


def step_model_prefill_flops(n: int, sm: dict) -> float:
    """prefill_flops for another GQA shape's step model: every token through its matrices (its
    routed experts only), causal attention over q heads x head_dim in every layer."""
    return (2 * sm["token_flop_params"] * n
            + 2 * 2 * (n * n / 2) * sm["attention_width"] * sm["layers"])


def prefill_stats(r: dict, peak) -> tuple | None:
    """(tokens, ms, tok/s, TFLOP/s, % of peak) of a model result's prefill chunk; the last two
    are None for a shape without a FLOP count (an MLA shape), the last without a roofline."""
    ms, n = r.get("prefill_ms"), r.get("prefill_tokens")
    if not (ms and n):
        return None
    if r.get("shape", ROOFLINE_SHAPE) == ROOFLINE_SHAPE:
        flops = prefill_flops(n)
    elif r.get("step_model"):
        flops = step_model_prefill_flops(n, r["step_model"])
    else:
        return n, ms, n / ms * 1e3, None, None
    tflops = flops / (ms * 1e-3) / 1e12
    return n, ms, n / ms * 1e3, tflops, 100 * tflops / peak if peak else None


def numerics_ratio(times: dict):
    a, b = times.get("auto"), times.get("rl-bitwise")
    return b / a if a and b else None


def vs_engine(server: dict, engines: dict, name: str) -> tuple:
    """(server output tok/s, the in-process Engine's of the same numerics); None where missing."""
    return server.get("output_tok_s"), (engines.get(name) or {}).get("output_tok_s")
