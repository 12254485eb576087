"""`jengine ops-report`: jengine's leaf and glue ops against stock torch, bit for bit, on random inputs.

    jengine ops-report [--device cpu|gpu] [--seed 0] [--json]

One row per op: the shape and dtype tried, how many output elements differ between what jengine
computes (the batch-invariant leaf rl-bitwise plans, or XLA's own function) and torch's stock
kernel, the largest distance in ulps of the output dtype, and -- for the ops trainer mode routes --
how many differ between torch *under trainer mode* and the engine (the reason each twin exists is
the first number; that the twin does its job is the second, which should be 0).

This is the researchers' tool: it measures, it asserts nothing. Inputs are N(0, 1) (positive-domain
ops use |x| + 1e-3), drawn once from ``--seed``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from jengine.logprob_orders import BLOCKWISE_VOCAB_BLOCK

F32_OPS = ("exp", "log", "rsqrt", "sqrt", "tanh", "sigmoid", "cos", "sin", "pow")


@dataclass(frozen=True)
class OpRow:
    op: str
    shape: str
    dtype: str
    differing: int
    total: int
    max_ulp: int
    trainer_mode_differing: int | None  # None: trainer mode does not route this op
    note: str = ""


def _ulps(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    from interop.bisect import _bits, ulp_distance

    neq = _bits(a) != _bits(b)
    return int(neq.sum()), int(ulp_distance(a, b)[neq].max()) if neq.any() else 0


def _count(a, b) -> int:
    return _ulps(a, b)[0]


def build_rows(device: str = "cpu", seed: int = 0, elementwise_size: int = 1 << 20) -> list[OpRow]:
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    from interop import trainer_mode
    from interop.convert import numpy_to_tensor, tensor_to_numpy
    from interop.twins import hardware_for, plan_twin_table
    from pallas_kernels import gemm
    from pallas_kernels.logprobs import _row_logprobs, finish_logprob
    from pallas_kernels.registry import plan

    tdev = "cuda" if device == "gpu" else "cpu"
    hardware = hardware_for(tdev)
    rng = np.random.default_rng(seed)
    rows: list[OpRow] = []

    def leaf(family, name, fmt="bf16", **static):
        """The batch-invariant leaf the engine plans on this device, jitted as in its step program
        (XLA's fusion can change bits: an eagerly evaluated leaf is not what the engine runs)."""
        p = plan(family, name, formats={fmt}, hardware=hardware, features={"batch_invariant"})
        return jax.jit(p.leaf.fn, static_argnames=tuple(static)), p.leaf.impl

    def t(a):  # numpy -> torch on the device, same bits
        return numpy_to_tensor(a).to(tdev)

    def n(x):  # torch or jax -> numpy
        return tensor_to_numpy(x) if isinstance(x, torch.Tensor) else np.asarray(x)

    def bf16(shape, scale=1.0):
        import ml_dtypes
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(ml_dtypes.bfloat16)

    def add(op, shape, dtype, engine, stock, trainer=None, note=""):
        d, ulp = _ulps(n(stock), n(engine))
        tm = None if trainer is None else _count(n(trainer), n(engine))
        rows.append(OpRow(op, "x".join(map(str, shape)), dtype, d, int(np.asarray(n(engine)).size),
                          ulp, tm, note))

    def under_trainer_mode(fn: Callable):
        with trainer_mode.enable(device=tdev):
            return fn()

    # -- GEMM (the linear leaf rl-bitwise plans) ---------------------------------------------
    x, w = bf16((64, 512)), bf16((512, 512), 512 ** -0.5)
    fn, impl = leaf("linear", "gemm", out_dtype=None)
    engine = fn(jnp.asarray(x), jnp.asarray(w), out_dtype=jnp.bfloat16)
    add("gemm (linear leaf)", (64, 512, 512), "bf16", engine, t(x) @ t(w),
        under_trainer_mode(lambda: t(x) @ t(w)), f"torch.mm -> twin of {impl}")
    native = jax.jit(gemm.gemm_xla_native, static_argnames="out_dtype")(
        jnp.asarray(x), jnp.asarray(w), out_dtype=jnp.bfloat16)
    add("gemm (XLA dot, auto)", (64, 512, 512), "bf16", native, t(x) @ t(w), None,
        "XLA's own dot: row-count dependent")

    # -- RMSNorm: HF's op-by-op form in torch vs the leaf -------------------------------------
    h, g = bf16((64, 1024)), (1 + 0.1 * bf16((1024,)).astype(np.float32)).astype(bf16((1,)).dtype)

    def hf_rmsnorm(xt, wt, eps=1e-6):
        xf = xt.to(torch.float32)
        var = xf.pow(2).mean(-1, keepdim=True)
        return wt * (xf * torch.rsqrt(var + eps)).to(xt.dtype)

    fn, impl = leaf("norm", "rmsnorm", eps=None)
    engine = fn(jnp.asarray(h), jnp.asarray(g), eps=1e-6)
    add("rmsnorm", (64, 1024), "bf16", engine, hf_rmsnorm(t(h), t(g)),
        under_trainer_mode(lambda: hf_rmsnorm(t(h), t(g))),
        f"HF's op-by-op norm vs {impl}; mean -> fixed tree, rsqrt -> XLA's")

    # -- SiLU ----------------------------------------------------------------------------------
    for dtype in ("f32", "bf16"):
        a = rng.standard_normal(elementwise_size).astype(np.float32) * 4
        a = a if dtype == "f32" else a.astype(bf16((1,)).dtype)
        fn, impl = leaf("activation", "silu", dtype)
        add("silu", (elementwise_size,), dtype, fn(jnp.asarray(a)), F.silu(t(a)),
            under_trainer_mode(lambda: F.silu(t(a))), f"F.silu -> twin of {impl}")

    # -- elementwise f32 functions: XLA vs torch ----------------------------------------------
    a = rng.standard_normal(elementwise_size).astype(np.float32) * 4
    pos = np.abs(a) + np.float32(1e-3)
    fns = {
        "exp": (jnp.exp, torch.exp, a), "log": (jnp.log, torch.log, pos),
        "rsqrt": (jax.lax.rsqrt, torch.rsqrt, pos), "sqrt": (jnp.sqrt, torch.sqrt, pos),
        "tanh": (jnp.tanh, torch.tanh, a), "sigmoid": (jax.nn.sigmoid, torch.sigmoid, a),
        "cos": (jnp.cos, torch.cos, a), "sin": (jnp.sin, torch.sin, a),
        "pow": (lambda v: jnp.power(v, 0.37), lambda v: torch.pow(v, 0.37), pos),
    }
    routed = {"exp", "log", "rsqrt", "cos", "sin", "pow"}
    for name, (jfn, tfn, inp) in fns.items():
        engine = jax.jit(jfn)(jnp.asarray(inp))
        tm = under_trainer_mode(lambda: tfn(t(inp))) if name in routed else None
        add(name if name != "pow" else "pow(x, 0.37)", (elementwise_size,), "f32", engine,
            tfn(t(inp)), tm, "routed to XLA's" if name in routed else "not on the dense path")

    # -- log-softmax: the engine's blockwise form vs torch's log_softmax ----------------------
    logits = (rng.standard_normal((16, 65536)) * 3).astype(np.float32)
    block_plan = plan("sampling", "block_sumexp", formats={"f32"}, hardware=hardware,
                      features={"batch_invariant"},
                      geometry={"vocab_size": 65536, "block_size": BLOCKWISE_VOCAB_BLOCK})
    engine = jax.jit(lambda x: finish_logprob(*_row_logprobs(x, "blockwise", block_plan)))(jnp.asarray(logits))
    add("log_softmax (blockwise)", logits.shape, "f32", engine, torch.log_softmax(t(logits), -1),
        None, "trainer side: interop.trainer_logprobs")
    add("log_softmax (XLA)", logits.shape, "f32", jax.nn.log_softmax(jnp.asarray(logits), -1),
        torch.log_softmax(t(logits), -1), None, "jax.nn.log_softmax")

    # -- attention: the dense-causal leaf vs torch SDPA ---------------------------------------
    q, k, v = bf16((1, 128, 4, 64)), bf16((1, 128, 2, 64)), bf16((1, 128, 2, 64))
    fn, impl = leaf("attention", "dense_causal", scale=None)
    engine = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=64 ** -0.5)
    tq, tk, tv = (t(z).transpose(1, 2) for z in (q, k, v))
    stock = F.scaled_dot_product_attention(tq, tk.repeat_interleave(2, 1), tv.repeat_interleave(2, 1),
                                           is_causal=True).transpose(1, 2)
    twin = plan_twin_table(tdev).attention(t(q), t(k), t(v), scale=64 ** -0.5)
    add("attention (causal)", (1, 128, 4, 64), "bf16", engine, stock, twin,
        f"SDPA vs {impl}; its twin is registered with AttentionInterface")

    # -- glue: correctly rounded in both frameworks ------------------------------------------
    r1, r2 = bf16((64, 1024)), bf16((64, 1024))
    add("residual add", (64, 1024), "bf16", jnp.asarray(r1) + jnp.asarray(r2), t(r1) + t(r2), None,
        "glue: stays torch's")
    add("cast f32->bf16", (64, 1024), "bf16", jnp.asarray(logits[:, :1024]).astype(jnp.bfloat16),
        t(logits[:, :1024]).to(torch.bfloat16), None, "glue: stays torch's")
    return rows


def format_table(rows: list[OpRow]) -> str:
    head = ("op", "shape", "dtype", "differing (XLA vs torch)", "max ulp", "trainer mode vs engine",
            "note")
    body = [(r.op, r.shape, r.dtype, f"{r.differing} / {r.total}", str(r.max_ulp),
             "-" if r.trainer_mode_differing is None else str(r.trainer_mode_differing), r.note)
            for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ops-report", help="compare jengine's ops with torch's, bit by bit",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=1 << 20, help="elements per elementwise op")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    return p


def main(args: argparse.Namespace) -> int:
    from interop.trainer_mode import ensure_xla_environment

    ensure_xla_environment()
    rows = build_rows(args.device, args.seed, args.size)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        import jax
        import torch

        print(f"jengine ops-report: device {args.device}, jax {jax.__version__}, torch "
              f"{torch.__version__}, seed {args.seed}")
        print(format_table(rows))
    return 0
