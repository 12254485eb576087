"""`jengine bench`: decode/prefill cost on the accelerator, against a roofline measured in the same run.

    jengine bench [--parts roofline leaves model] [--batch-sizes 1 16 64 256] [--out DIR]

Parts, each run in its own subprocess (XLA flags differ per --numerics and must be set before the
backend starts):
  roofline  HBM copy bandwidth (a warmed 4 GiB copy, bytes read + written) and bf16 8192^3 GEMM
            TFLOP/s, through XLA and, when installed, torch.
  leaves    every Llama-3-8B projection GEMM at M in {1, 16, 64, 256, 4096}: XLA's dot (what
            --numerics auto plans) against the fixed-tile Triton leaf (what rl-bitwise plans on a
            GPU), each timed over a chain of distinct weight matrices (no L2 reuse) inside one jit;
            summed into the GEMM share of one decode step (32 layers + LM head).
  model     the real ModelRunner on a Llama-3-8B-shaped model with random bf16 weights created on
            the device: decode steps at each batch size with context --context, and one prefill
            chunk of --prefill-tokens, for --numerics auto and rl-bitwise.
Every time is the median of --iters timed runs after warm-up. Writes bench.json and bench.md
(results: docs/performance.md). Not implemented yet: the end-to-end Engine workload, the 8k-context
decode, the MoE shape and the HF transformers `generate` peer of issue 8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                 vocab_size=128256, tie_word_embeddings=False, torch_dtype="bfloat16",
                 bos_token_id=128000, eos_token_id=128001)
# A 2-layer shape with the same structure, for smoke-testing the bench on a CPU (--shape small).
SMALL = dict(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000)
SHAPES = {"llama3-8b": (LLAMA3_8B, 131072), "small": (SMALL, 32768)}
PADDED_VOCAB = 131072  # the rl-bitwise variant: a multiple of the 32768-wide logprob block
ROWS = (1, 16, 64, 256, 4096)


def _checkpoint(args, result: dict) -> None:
    """Write what a part has measured so far: a part stopped by its timeout still reports."""
    if getattr(args, "child_out", None):
        with open(args.child_out, "w") as f:
            json.dump({**result, "partial": True}, f, default=str)


def _median_time(fn, iters: int, warmup: int = 2, back_to_back: int = 1, sync=None) -> float:
    """Median seconds per call. With back_to_back > 1 each sample is that many asynchronous calls
    followed by one `sync` of the last result, so host dispatch overlaps the device work."""
    for _ in range(warmup):
        out = fn()
    if sync:
        sync(out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(back_to_back):
            out = fn()
        if sync:
            sync(out)
        times.append((time.perf_counter() - t0) / back_to_back)
    return statistics.median(times)


# -- parts (each runs in a child process) -----------------------------------------------------------


def part_roofline(args) -> dict:
    import jax
    import jax.numpy as jnp

    out = {}
    x = jnp.ones((2**31 // 2,), jnp.bfloat16) * 1.5  # 2 GiB... doubled below to 4 GiB
    x = jnp.concatenate([x, x])
    bump = jax.jit(lambda a: a + jnp.bfloat16(1))  # one read + one write of every byte
    t = _median_time(lambda: bump(x).block_until_ready(), args.iters)
    out["jax_elementwise_copy_TBps"] = 2 * x.nbytes / t / 1e12
    del x
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t = _median_time(lambda: mm(a, b).block_until_ready(), args.iters)
    out["jax_gemm_bf16_TFLOPs"] = 2 * 8192**3 / t / 1e12
    try:
        import torch
        import triton

        src = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
        out["torch_copy_TBps"] = 2 * src.numel() * 2 / (ms * 1e-3) / 1e12
        del src, dst
        ta = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        tb = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ms = triton.testing.do_bench(lambda: ta @ tb, warmup=50, rep=200, return_mode="median")
        out["torch_gemm_bf16_TFLOPs"] = 2 * 8192**3 / (ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001 - torch is optional on the bench machine
        out["torch_error"] = repr(exc)[:200]
    out["hbm_TBps"] = max(v for k, v in out.items() if k.endswith("TBps"))
    out["gemm_TFLOPs"] = max(v for k, v in out.items() if k.endswith("TFLOPs"))
    return out


def _layer_shapes(vocab: int) -> dict:
    h, i, kv = 4096, 14336, 8 * 128
    return {"q/o_proj": (h, h, 2), "k/v_proj": (kv, h, 2), "gate/up_proj": (i, h, 2),
            "down_proj": (h, i, 1), "lm_head": (vocab, h, 0)}  # (N, K, uses per layer)


def part_leaves(args) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gemm import gemm_xla_native
    from pallas_kernels.triton_gemm import gemm_triton, tile_for

    from pallas_kernels.triton_gemm import GemmTile

    impls = {"auto (XLA dot)": gemm_xla_native, "rl-bitwise (Triton fixed tile)": gemm_triton}
    # Extra tiles (BM,BN,BK,GROUP_M,WARPS,STAGES) timed on the projection shapes, through the very
    # path the model uses (jax-triton inside jit): the data behind TUNED_BF16_TILES.
    extra = {}
    for spec in args.tile_candidates or ():
        tile = GemmTile(*map(int, spec.split(",")))
        extra["Triton " + tile.describe()] = (
            lambda x, w, out_dtype, tile=tile: gemm_triton(x, w, out_dtype=out_dtype, tile=tile))
    out = {"per_gemm_us": {}, "tiles": {}}
    for vocab_label, vocab in (("auto", LLAMA3_8B["vocab_size"]), ("rl-bitwise", PADDED_VOCAB)):
        for name, (n, k, _) in _layer_shapes(vocab).items():
            if name != "lm_head" and vocab_label == "rl-bitwise":
                continue
            label = f"{name} N={n} K={k}"
            out["tiles"][label] = tile_for(n, k, jnp.bfloat16).describe()
            layers = max(2, min(32, (2**31) // (n * k * 2)))  # >= 2 GiB of distinct weights
            keys = jax.random.split(jax.random.key(n + k), layers)
            ws = [jax.random.normal(kk, (k, n), jnp.bfloat16) * (k ** -0.5) for kk in keys]
            todo = dict(impls, **(extra if name != "lm_head" else {}))
            for impl_name, fn in todo.items():
                for m in args.rows:
                    x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                    chain = jax.jit(lambda x, ws, fn=fn: tuple(fn(x, w, out_dtype=jnp.bfloat16)
                                                             for w in ws))
                    t = _median_time(lambda: chain(x, ws), args.iters, back_to_back=3,
                                     sync=jax.block_until_ready)
                    out["per_gemm_us"].setdefault(label, {}).setdefault(impl_name, {})[m] = (
                        t / layers * 1e6)
                    _checkpoint(args, out)
            del ws
    # GEMM share of one decode/prefill step: 32 layers of projections + the LM head.
    step = {}
    for impl_name, vocab in (("auto (XLA dot)", LLAMA3_8B["vocab_size"]),
                             ("rl-bitwise (Triton fixed tile)", PADDED_VOCAB)):
        for m in args.rows:
            total = 0.0
            for name, (n, k, uses) in _layer_shapes(vocab).items():
                per = out["per_gemm_us"][f"{name} N={n} K={k}"][impl_name][m]
                total += per * (uses * 32 if uses else 1)
            step.setdefault(impl_name, {})[m] = total
    out["step_gemm_us"] = step
    return out


def _random_llama(base: dict, vocab: int):
    """A LoadedModel-like object whose weights are created on the device, never on the host."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jengine.models.dense as dense
    from jengine.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({**base, "vocab_size": vocab})
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"embed_tokens": (vocab, h), "q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h),
              "o_proj": (h, h), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    counter = iter(range(10**6))

    def random_param(weights, name, dtype, transpose=False):  # replaces dense._param
        stem = name.split(".")[-2]
        shape = shapes.get(stem, (h,))  # norms are [H]
        if transpose:
            shape = shape[::-1]
        key = jax.random.key(next(counter))
        scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5 if not transpose else shape[0] ** -0.5
        return nnx.Param((jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype))

    dense._param = random_param
    # The LM head is read with np.asarray by the model; a tiled host block keeps that cheap.
    block = (np.random.default_rng(0).standard_normal((1024, h)) * h ** -0.5).astype(jnp.bfloat16)

    class Weights(dict):
        def __contains__(self, key):
            return key == "lm_head.weight" or dict.__contains__(self, key)

        def __getitem__(self, key):
            if key == "lm_head.weight":
                return np.tile(block, (-(-vocab // 1024), 1))[:vocab]
            raise KeyError(key)

    class Loaded:
        config = cfg
        weights = Weights()
        eos_token_ids = (128001,)
    return Loaded()


def part_model(args) -> dict:
    import numpy as np

    from jengine.config import LaunchConfig
    from jengine.numerics import resolve_launch

    base, padded = SHAPES[args.shape]
    vocab = padded if args.numerics != "auto" else base["vocab_size"]
    max_bs = max(args.batch_sizes)
    launch = LaunchConfig(numerics=args.numerics, max_running_requests=max_bs,
                          max_prefill_tokens=max(args.prefill_tokens, 16),
                          context_length=max(args.context + 16, args.prefill_tokens),
                          max_total_tokens=(max_bs + 1) * (args.context + 16), skip_warmup=True)
    resolved = resolve_launch(launch)
    resolved.apply_environment()
    for m in ("pallas_kernels.triton_gemm", "pallas_kernels.triton_norm",
              "pallas_kernels.triton_activation", "pallas_kernels.triton_sampling"):
        __import__(m)  # register the GPU leaves before the model plans its kernels
    import jax

    from jengine.engine.batch import StepBatch
    from jengine.engine.model_runner import ModelRunner

    from jengine.profiles import override_profile

    t0 = time.time()
    # Timing only: random weights prove nothing about the contract, so the model's verification
    # gate (require_verified_numerics) is overridden for this process and nothing else.
    with override_profile(base["architectures"][0], numerics_envelopes={args.numerics}):
        runner = ModelRunner(_random_llama(base, vocab), resolved)
    out = {"numerics": args.numerics, "vocab": vocab, "kernels": runner.kernels.describe(),
           "shape": args.shape, "context": args.context, "prefill_tokens": args.prefill_tokens,
           "build_s": time.time() - t0, "decode_ms": {}, "compile_s": {}}
    ps = runner.page_size
    pages_per_req = -(-(args.context + 1) // ps)
    for bs in args.batch_sizes:
        tables = 1 + np.arange(bs * pages_per_req, dtype=np.int32).reshape(bs, pages_per_req)
        batch = StepBatch(input_ids=np.arange(bs) % 1000, positions=np.full(bs, args.context),
                          token_req=np.arange(bs), block_tables=tables, hidden_rows=np.arange(bs))

        def step():
            hidden = runner.forward(batch)
            jax.block_until_ready(runner.compute_logits(hidden))

        t1 = time.time()
        step()
        out["compile_s"][bs] = time.time() - t1
        out["decode_ms"][bs] = _median_time(step, args.iters, warmup=1) * 1e3
        print(f"[{args.numerics}] decode bs={bs}: {out['decode_ms'][bs]:.2f} ms", flush=True)
        _checkpoint(args, out)
    if args.prefill_tokens:
        n = args.prefill_tokens
        tables = 1 + np.arange(-(-n // ps), dtype=np.int32)[None]
        batch = StepBatch(input_ids=np.arange(n) % 1000, positions=np.arange(n),
                          token_req=np.zeros(n), block_tables=tables, hidden_rows=[n - 1])
        step = lambda: jax.block_until_ready(runner.compute_logits(runner.forward(batch)))
        step()
        out["prefill_ms"] = _median_time(step, max(3, args.iters // 2), warmup=1) * 1e3
        print(f"[{args.numerics}] prefill {n}: {out['prefill_ms']:.1f} ms", flush=True)
    return out


PARTS = {"roofline": part_roofline, "leaves": part_leaves, "model": part_model}


# -- orchestration ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--parts", nargs="+", default=["roofline", "leaves", "model"], choices=list(PARTS))
    p.add_argument("--numerics", nargs="+", default=["auto", "rl-bitwise"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--context", type=int, default=1024, help="decode context length (tokens)")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="prefill chunk (0 = skip)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="GEMM M values (leaves)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
    p.add_argument("--tile-candidates", nargs="*", default=[],
                   help="extra Triton GEMM tiles for the leaves part, as BM,BN,BK,GROUP_M,WARPS,STAGES")
    p.add_argument("--part-timeout", type=int, default=540, help="seconds per child process")
    p.add_argument("--shape", default="llama3-8b", choices=list(SHAPES),
                   help="model shape for the model part (small: a CPU smoke test)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p


def add_parser(subparsers):
    return add_arguments(subparsers.add_parser("bench", help="benchmark on the accelerator",
                                               description=__doc__.split("\n\n")[0]))


def _run_child(part: str, numerics: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = [sys.executable, "-m", "jengine.bench", "--child", part, "--child-out", path,
            "--numerics", numerics, "--batch-sizes", *map(str, args.batch_sizes),
            "--context", str(args.context), "--prefill-tokens", str(args.prefill_tokens),
            "--rows", *map(str, args.rows), "--iters", str(args.iters), "--shape", args.shape,
            "--tile-candidates", *args.tile_candidates]
    start = time.time()
    try:
        proc = subprocess.run(argv, timeout=args.part_timeout, text=True, capture_output=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sys.stdout.write(proc.stdout[-4000:])
        if proc.returncode != 0:
            partial = {}
            if os.path.getsize(path):
                with open(path) as f:
                    partial = json.load(f)
            return {**partial, "error": f"rc={proc.returncode}",
                    "tail": (proc.stdout + proc.stderr)[-3000:]}
        with open(path) as f:
            result = json.load(f)
        result.pop("partial", None)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        partial = {}
        if os.path.getsize(path):
            with open(path) as f:
                partial = json.load(f)
        return {**partial, "error": f"timeout after {args.part_timeout} s",
                "tail": (tail or "")[-3000:]}
    result["seconds"] = round(time.time() - start, 1)
    return result


def _versions() -> dict:
    import datetime
    import importlib.metadata as md
    import platform

    v = {"date": datetime.datetime.now().isoformat(timespec="minutes"),
         "python": platform.python_version()}
    for name in ("jax", "jaxlib", "torch", "triton", "jax-triton", "flax"):
        try:
            v[name] = md.version(name)
        except md.PackageNotFoundError:
            v[name] = None
    return v


def main(args) -> int:
    results = {"versions": _versions(), "command": "jengine bench " + " ".join(sys.argv[2:])}
    for part in args.parts:
        for numerics in (args.numerics if part == "model" else ["-"]):
            key = part if part != "model" else f"model:{numerics}"
            print(f"== {key}", flush=True)
            results[key] = _run_child(part, numerics if numerics != "-" else "auto", args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    from jengine.bench_report import render

    md = render(results)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if not any("error" in v for v in results.values() if isinstance(v, dict)) else 1


def _child_main(argv) -> int:
    p = add_arguments(argparse.ArgumentParser())
    p.add_argument("--child", required=True, choices=list(PARTS))
    p.add_argument("--child-out", required=True)
    args = p.parse_args(argv)
    args.numerics = args.numerics[0]
    result = PARTS[args.child](args)
    with open(args.child_out, "w") as f:
        json.dump(result, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
