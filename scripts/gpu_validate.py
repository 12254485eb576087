"""One command on the GPU machine: validate the Triton leaves bitwise, then the engine's harnesses.

    python scripts/gpu_validate.py [--out DIR] [--skip-harness] [--harness-timeout S]

Per leaf and shape: (1) row invariance — rows computed in a batch of M, M in {1, 2, 3, 7, 64, 512},
against the same rows computed alone (M = 1), compared as float bits; (2) the torch launch of the
same Triton source against the jax-triton launch, bits again; (3) error against a float64
reference. Negative controls run the same row-invariance protocol on XLA's own dot and reduction,
which must show differences for the check to mean anything. Then, if present, the invariance
harness (`jengine invariance --model tiny --numerics rl-bitwise`) and the alignment
(`jengine align`) run as subprocesses with the Triton leaves registered.

Writes gpu_validation.md and gpu_validation.json to --out ($OUT by default) and prints the table.
Exit status: 0 when every bitwise check passed and every error is within tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROW_COUNTS = (1, 2, 3, 7, 64, 200, 512)
LEAF_MODULES = ("pallas_kernels.triton_gemm", "pallas_kernels.triton_norm",
                "pallas_kernels.triton_activation", "pallas_kernels.triton_sampling")


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "date": datetime.date.today().isoformat()}
    for name in ("jax", "jaxlib", "torch", "triton", "jax-triton", "flax", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    out["devices"] = [str(d) for d in jax.devices()]
    out["device_kind"] = jax.devices()[0].device_kind
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip()
    except Exception as exc:  # noqa: BLE001 - informational only
        out["nvidia_smi"] = f"unavailable: {exc}"
    return out


def bits(a) -> np.ndarray:
    from pallas_kernels._triton_launch import bits as _bits

    return _bits(a)


def to_torch(x):
    import torch

    try:
        return torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 - fall back to a host copy, bits preserved
        arr = np.asarray(x)
        if arr.dtype == jnp.bfloat16:
            return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16).cuda()
        return torch.from_numpy(arr.copy()).cuda()


def rel_err(out, ref64) -> float:
    o = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    return float(np.linalg.norm(o - ref64) / max(np.linalg.norm(ref64), 1e-300))


_ONLY: str | None = None  # --only: run just the checks whose label contains this text


def row_check(jax_fn, torch_fn, make_inputs, ref64_fn, row_axis_args, label, tol, negative=False):
    """Run the protocol for one leaf/shape. `make_inputs` -> tuple of jax arrays whose first
    `row_axis_args` entries are row-sliced; others are shared (weights)."""
    if _ONLY and _ONLY not in label:
        return None
    args = make_inputs()
    fn = jax.jit(jax_fn)

    def call(m, lo=0):
        sub = tuple(a[lo:lo + m] for a in args[:row_axis_args]) + tuple(args[row_axis_args:])
        return fn(*sub)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    alone = [bits(first(call(1, r))) for r in range(max(ROW_COUNTS))]
    alone = np.concatenate(alone, axis=0)
    result = {"leaf": label, "row_diffs": {}, "torch_vs_jax": {}, "negative_control": negative}
    full = None
    for m in ROW_COUNTS:
        out = call(m)
        b = bits(first(out))
        result["row_diffs"][m] = int(np.count_nonzero(b != alone[:m]))
        if torch_fn is not None:
            sub = tuple(to_torch(a[:m]) for a in args[:row_axis_args]) + tuple(
                to_torch(a) for a in args[row_axis_args:])
            t_out = torch_fn(*sub)
            tb = bits(t_out[0] if isinstance(t_out, tuple) else t_out)
            result["torch_vs_jax"][m] = int(np.count_nonzero(tb != b))
        full = out
    ref = ref64_fn(*[np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64) for a in args])
    result["rel_err_vs_f64"] = rel_err(first(full), ref)
    result["finite"] = bool(np.isfinite(np.asarray(jnp.asarray(first(full)).astype(jnp.float32))).all())
    result["tol"] = tol
    bitwise_ok = all(v == 0 for v in result["row_diffs"].values()) and all(
        v == 0 for v in result["torch_vs_jax"].values())
    result["ok"] = (not bitwise_ok if negative else bitwise_ok) and (
        result["rel_err_vs_f64"] <= tol and result["finite"])
    return result


def leaf_checks(quick: bool, only: str | None = None) -> tuple[list[dict], list]:
    from pallas_kernels import triton_activation as ta
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels import triton_norm as tn
    from pallas_kernels import triton_sampling as ts
    from pallas_kernels.gemm import gemm_xla_native
    from pallas_kernels.logprobs import block_sumexp_fixed_tree, block_sumexp_xla_native
    from pallas_kernels.rmsnorm import rmsnorm as rmsnorm_portable

    rng = np.random.default_rng(0)
    n_rows = max(ROW_COUNTS)

    def rand(shape, dtype, scale=1.0):
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    bf16, f32 = jnp.bfloat16, jnp.float32
    results = []

    def gemm_case(k, n, dtype, out_dtype, bias, label, fn=None, torch_fn=None, negative=False):
        w_scale = 1.0 / np.sqrt(k)
        inputs = lambda: (rand((n_rows, k), dtype), rand((k, n), dtype, w_scale)) + (
            (rand((n,), f32),) if bias else ())
        jf = fn or (lambda x, w, *b: tg.gemm_triton(x, w, *b, out_dtype=out_dtype))
        tf = torch_fn if torch_fn is not None else (
            None if negative else (lambda x, w, *b: tg.gemm_triton_torch(x, w, *b, out_dtype=out_dtype)))
        ref = lambda x, w, *b: x @ w + (b[0] if b else 0)
        tol = 1e-5 if (dtype == f32 and out_dtype == f32) else 1e-2
        # the launch shapes the rows run on: decode (by_m), decode bs 256 (by_m), the entry's
        shapes = {m: tg.tile_for(n, k, dtype, m).describe() for m in (1, 200, 512)}
        named = [f"M={m}: {s}" for m, s in shapes.items() if m == 1 or s != shapes[1]]
        tile = "" if negative else f" [{' / '.join(named)}]"
        results.append(row_check(jf, tf, inputs, ref, 1, f"{label} K={k} N={n}{tile}", tol,
                                 negative=negative))

    gemm_case(1024, 1024, bf16, bf16, False, "gemm bf16->bf16")
    gemm_case(4096, 4096, bf16, bf16, False, "gemm bf16->bf16 (o_proj)")
    gemm_case(4096, 1024, bf16, bf16, True, "gemm bf16+bias->bf16 (k_proj)")
    gemm_case(4096, 14336, bf16, bf16, False, "gemm bf16->bf16 (gate/up)")
    gemm_case(14336, 4096, bf16, bf16, False, "gemm bf16->bf16 (down)")
    if not quick:
        gemm_case(4096, 131072, bf16, bf16, False, "gemm bf16->bf16 (lm_head padded)")
    gemm_case(1000, 777, bf16, f32, True, "gemm bf16+bias->f32 (ragged)")
    gemm_case(256, 384, f32, f32, True, "gemm f32 ieee")
    gemm_case(4096, 4096, bf16, bf16, False, "NEG: XLA dot",
              fn=lambda x, w: gemm_xla_native(x, w, out_dtype=bf16), negative=True)

    # Grouped launches (q/k/v, gate/up): every member's rows equal across M (split and serial
    # schedules) and equal to the torch twins' separate launches -- what the trainer runs.
    import torch

    def group_case(k, ns, bias, label, torch_tile=None, negative=False):
        def inputs():
            ws = tuple(rand((k, n), bf16, 1.0 / np.sqrt(k)) for n in ns)
            bs = tuple(rand((n,), bf16) for n in ns) if bias else ()
            return (rand((n_rows, k), bf16),) + ws + bs

        def split(args):
            ws = args[1:1 + len(ns)]
            return args[0], ws, (args[1 + len(ns):] or None)

        def jf(*args):
            x, ws, bs = split(args)
            return jnp.concatenate(tg.gemm_group_triton(x, ws, bs, out_dtype=bf16), axis=1)

        def tf(*args):
            x, ws, bs = split(args)
            return torch.cat([tg.gemm_triton_torch(x, w, None if bs is None else bs[i],
                                                   out_dtype=bf16, tile=torch_tile)
                              for i, w in enumerate(ws)], dim=1)

        def ref(*args):
            x, ws, bs = split(args)
            return np.concatenate([x @ w + (0 if bs is None else bs[i]) for i, w in enumerate(ws)],
                                  axis=1)

        tile = tg.group_tile(jnp.zeros((1, k), bf16), [jnp.zeros((k, n), bf16) for n in ns], None)
        results.append(row_check(jf, tf, inputs, ref, 1,
                                 f"{label} K={k} N={'+'.join(map(str, ns))} "
                                 f"[{tile.describe() if tile else 'no shared tile'}]", 1e-2,
                                 negative=negative))

    group_case(4096, (4096, 1024, 1024), False, "gemm group (q/k/v)")
    group_case(4096, (4096, 1024, 1024), True, "gemm group +bias (q/k/v, Qwen2)")
    group_case(4096, (14336, 14336), False, "gemm group (gate/up)")
    group_case(1024, (1024, 256, 256), False, "gemm group (q/k/v, untuned)")
    group_case(4096, (4096, 1024, 1024), False, "NEG: gemm group vs twins at k_split 8",
               torch_tile=tg.GemmTile(64, 64, 128, num_warps=4, num_stages=6, k_split=8),
               negative=True)

    def ref_rms(x, w, eps=1e-5):
        return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))

    for h, dtype in ((4096, bf16), (3584, bf16), (128, bf16), (4096, f32)):
        inputs = lambda: (rand((n_rows, h), dtype), rand((h,), dtype))
        results.append(row_check(lambda x, w: tn.rmsnorm_triton(x, w, eps=1e-5),
                                 lambda x, w: tn.rmsnorm_triton_torch(x, w, eps=1e-5), inputs,
                                 ref_rms, 1, f"rmsnorm {jnp.dtype(dtype).name} H={h}",
                                 1e-2 if dtype == bf16 else 1e-5))
    inputs = lambda: (rand((n_rows, 4096), bf16), rand((n_rows, 4096), bf16), rand((4096,), bf16))
    results.append(row_check(lambda x, r, w: tn.add_rmsnorm_triton(x, r, w, eps=1e-5),
                             lambda x, r, w: tn.add_rmsnorm_triton_torch(x, r, w, eps=1e-5),
                             inputs, lambda x, r, w: ref_rms(x + r, w), 2,
                             "add_rmsnorm bf16 H=4096", 1e-2))
    for dtype in (bf16, f32):
        inputs = lambda: (rand((n_rows, 14336), dtype, 4.0),)
        results.append(row_check(ta.silu_triton, ta.silu_triton_torch, inputs,
                                 lambda x: x / (1 + np.exp(-x)), 1,
                                 f"silu {jnp.dtype(dtype).name} [{n_rows}x14336]",
                                 1e-2 if dtype == bf16 else 1e-6))
        # SwiGLU's act(gate) * up in one launch; its torch side is the trainer's two ops (the SiLU
        # kernel, then torch's multiply), so torch_vs_jax counts bits the fusion would change.
        inputs = lambda: (rand((n_rows, 14336), dtype, 4.0), rand((n_rows, 14336), dtype))
        results.append(row_check(lambda x, u: ta.silu_triton(x, times=u),
                                 lambda x, u: ta.silu_triton_torch(x) * u, inputs,
                                 lambda x, u: x / (1 + np.exp(-x)) * u, 2,
                                 f"silu times up {jnp.dtype(dtype).name} [{n_rows}x14336] "
                                 "(torch: silu, then *)", 2e-2 if dtype == bf16 else 1e-6))
    for v, block in ((131072, 32768), (131072, 16384), (151936, 32768), (128256, 16384)):
        inputs = lambda v=v: (rand((n_rows, v), f32, 3.0) - 12.0,)

        def ref(s, b=block):  # the last block completed with -inf logits (exp = 0)
            e = np.zeros((s.shape[0], -(-s.shape[1] // b) * b))
            e[:, :s.shape[1]] = np.exp(s)
            return e.reshape(s.shape[0], -1, b).sum(-1)

        results.append(row_check(lambda s, b=block: ts.block_sumexp_triton(s, block_size=b),
                                 lambda s, b=block: ts.block_sumexp_triton_torch(s, block_size=b),
                                 inputs, ref, 1, f"block_sumexp V={v} block={block}", 1e-6))

    # Cross-checks (informational): does the Triton kernel equal the portable JAX form run by XLA
    # on this GPU, and torch's own op? Reported as counts; not part of the pass/fail.
    results = [r for r in results if r is not None]
    cross = []
    if only:
        return results, cross
    x = rand((512, 4096), bf16)
    w = rand((4096,), bf16)
    a = bits(tn.rmsnorm_triton(x, w, eps=1e-5))
    b = bits(jax.jit(lambda x, w: rmsnorm_portable(x, w, eps=1e-5))(x, w))
    cross.append(("rmsnorm Triton vs portable fixed_order (XLA, GPU)", int((a != b).sum()), a.size))
    s = rand((64, 131072), f32, 3.0) - 12.0
    a = bits(ts.block_sumexp_triton(s, block_size=32768))
    b = bits(jax.jit(lambda s: block_sumexp_fixed_tree(s, block_size=32768))(s))
    cross.append(("block_sumexp Triton vs portable fixed_tree (XLA, GPU)", int((a != b).sum()), a.size))
    s2 = rand((64, 151936), f32, 3.0) - 12.0
    done = jnp.pad(s2, ((0, 0), (0, 5 * 32768 - 151936)), constant_values=-jnp.inf)
    a = bits(ts.block_sumexp_triton(s2, block_size=32768))
    b = bits(ts.block_sumexp_triton(done, block_size=32768))
    cross.append(("block_sumexp Triton V=151936 vs the -inf-completed row (V=163840)",
                  int((a != b).sum()), a.size))
    xla = jax.jit(lambda s: block_sumexp_xla_native(s, block_size=32768))
    full = bits(xla(s))
    alone = np.concatenate([bits(xla(s[r:r + 1])) for r in range(s.shape[0])])
    cross.append(("XLA jnp.sum block_sumexp: rows in a 64-row call vs alone", int((full != alone).sum()),
                  full.size))
    import torch

    xs = rand((512, 14336), bf16, 4.0)
    a = bits(ta.silu_triton(xs))
    b = bits(torch.nn.functional.silu(to_torch(xs)))
    cross.append(("silu Triton vs torch F.silu (bf16)", int((a != b).sum()), a.size))
    xs32 = rand((512, 14336), f32, 4.0)
    a = bits(ta.silu_triton(xs32))
    b = bits(torch.nn.functional.silu(to_torch(xs32)))
    cross.append(("silu Triton vs torch F.silu (f32)", int((a != b).sum()), a.size))
    from pallas_kernels.activation import silu as silu_portable

    b = bits(jax.jit(silu_portable)(xs32))
    cross.append(("silu Triton vs portable jnp form (XLA, GPU, f32)", int((a != b).sum()), a.size))
    # Do two different tilings give the same bits? (Informational: the leaf never varies its tile.)
    xg, wg = rand((256, 4096), bf16), rand((4096, 4096), bf16, 1 / 64)
    base = bits(tg.gemm_triton(xg, wg, out_dtype=f32, tile=tg.GemmTile(64, 128, 64)))
    for t in (tg.GemmTile(64, 64, 64), tg.GemmTile(128, 128, 64, num_warps=8),
              tg.GemmTile(64, 128, 128, num_stages=3), tg.GemmTile(128, 256, 64, num_warps=8, num_stages=3)):
        other = bits(tg.gemm_triton(xg, wg, out_dtype=f32, tile=t))
        cross.append((f"gemm f32-out tile {t.describe()} vs BM64xBN128xBK64", int((other != base).sum()),
                      base.size))
    return results, cross


def run_subprocess(label: str, argv: list[str], timeout: int) -> dict:
    """Run a jengine command with the Triton leaves registered first (fresh process: XLA flags
    are applied before the backend initialises)."""
    code = ("import sys\n" + "".join(f"import {m}\n" for m in LEAF_MODULES)
            + "from jengine.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    start = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(
            exc.stdout, bytes) else (exc.stdout or "")
    return {"label": label, "argv": argv, "rc": rc, "seconds": round(time.time() - start, 1),
            "tail": output[-6000:]}


def harness_runs(timeout: int) -> list[dict]:
    runs = []
    if os.path.exists("jengine/invariance.py"):
        runs.append(run_subprocess("invariance rl-bitwise (tiny)",
                                   ["invariance", "--model", "tiny", "--numerics", "rl-bitwise"], timeout))
        runs.append(run_subprocess("invariance auto (tiny, negative control)",
                                   ["invariance", "--model", "tiny", "--numerics", "auto"], timeout))
    else:
        runs.append({"label": "invariance", "rc": "absent", "tail": "jengine/invariance.py not present"})
    if os.path.exists("interop/align.py"):
        runs.append(run_subprocess("align (tiny)", ["align", "--help"], 120))
    else:
        runs.append({"label": "align", "rc": "absent", "tail": "interop/align.py not present"})
    return runs


def markdown(ver: dict, results: list[dict], cross: list, runs: list[dict]) -> str:
    lines = [f"GPU validation {ver['date']} on {ver.get('nvidia_smi') or ver['device_kind']}",
             "", "versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()
                                           if k not in ("devices", "nvidia_smi", "date")), "",
             "| leaf | rows differing vs alone (M=1,2,3,7,64,512) | torch vs jax launch | rel err vs f64 | ok |",
             "|---|---|---|---|---|"]
    for r in results:
        rows = "/".join(str(r["row_diffs"][m]) for m in ROW_COUNTS)
        tj = "/".join(str(r["torch_vs_jax"][m]) for m in ROW_COUNTS) if r["torch_vs_jax"] else "-"
        ok = ("PASS" if r["ok"] else "FAIL") + (" (negative control: must differ)" if r["negative_control"] else "")
        lines.append(f"| {r['leaf']} | {rows} | {tj} | {r['rel_err_vs_f64']:.2e} | {ok} |")
    lines += ["", "| cross-check (informational) | differing | of |", "|---|---|---|"]
    lines += [f"| {name} | {d} | {n} |" for name, d, n in cross]
    lines += [""]
    for run in runs:
        lines += [f"### {run['label']}: rc={run['rc']} ({run.get('seconds', '-')} s)", "```",
                  run["tail"][-2500:].strip(), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--skip-harness", action="store_true")
    p.add_argument("--harness-timeout", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="skip the largest shapes")
    p.add_argument("--only", help="run only the leaf checks whose label contains this text "
                   "(skips the cross-checks)")
    args = p.parse_args(argv)
    for m in LEAF_MODULES:
        __import__(m)
    ver = versions()
    print(json.dumps(ver, indent=1), flush=True)
    t0 = time.time()
    global _ONLY
    _ONLY = args.only
    results, cross = leaf_checks(args.quick, args.only)
    print(f"leaf checks: {time.time() - t0:.1f} s", flush=True)
    runs = [] if args.skip_harness else harness_runs(args.harness_timeout)
    md = markdown(ver, results, cross, runs)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_validation.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "gpu_validation.json"), "w") as f:
        json.dump({"versions": ver, "leaves": results, "cross": cross, "runs": runs}, f, indent=1,
                  default=str)
    print(md)
    ok = all(r["ok"] for r in results) and all(r["rc"] in (0, "absent") for r in runs
                                                if "negative" not in r["label"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
