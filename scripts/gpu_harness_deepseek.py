"""The invariance harness on a DeepSeek-V3 checkpoint at production-like widths (issue #20).

    python3 scripts/gpu_harness_deepseek.py --out DIR [--layers 3] [--ep-size 1]
    python3 scripts/gpu_harness_deepseek.py --out DIR --tiny   # a CPU run: acceptance's --smoke widths

(scripts/gpu_run.sh step `harness_deepseek`.) Writes the random bf16 checkpoint of
scripts/gpu_acceptance.py's deepseek_v3 case (`build_model`: hidden 2048, 16 heads, q_lora 1536,
kv_lora 512, qk_rope 64 interleaved with YaRN, qk_nope 128, v_head 128, 64 experts in 8 groups with
4 kept, top-8, one shared expert, a non-zero e_score_correction_bias) with --layers layers, the
first dense, then runs jengine.invariance on it twice, each in its own process (the numerics' XLA
flags are set before JAX starts):

  rl-bitwise  alone / packed / rerun / prefix hit at an odd position / chunk 7 / retraction -3 /
              overlap off, at T=0 and T=1: every mode must PASS bitwise;
  auto        the same at T=0: the negative control, whose divergences are reported (expected on
              the H200, where XLA's kernels depend on the batch; the CPU may well pass).

Prints the harness tables and a verdict table, writes harness_deepseek.md; exit status 1 when
rl-bitwise diverged or a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# (numerics, temperatures): the control at T=0 only, to keep the step short.
RUNS = (("rl-bitwise", (0.0, 1.0)), ("auto", (0.0,)))


def build_checkpoint(directory: Path, layers: int, tiny: bool) -> dict:
    """gpu_acceptance's deepseek_v3 checkpoint, `layers` deep; returns its HF config fields."""
    import gpu_acceptance as acc

    arch, dims = acc.CASES["deepseek_v3"]
    dims = dict(dims, num_hidden_layers=layers)
    if tiny:  # what gpu_acceptance --smoke does
        acc.DEVICE = "cpu"
        acc.WIDTHS.update({k: v for k, v in acc.SMOKE.items() if k in acc.WIDTHS})
        dims.update({k: v for k, v in acc.SMOKE.items() if k in dims})
    model = acc.build_model(directory, arch, dims, seed=20)
    del model
    if not tiny:
        import torch

        torch.cuda.empty_cache()  # the engine runs in other processes: leave them the memory
    return dims


def child(args) -> dict:
    """One harness run (this process's numerics); its results as plain data."""
    from jengine.invariance import HarnessConfig, InvarianceHarness

    temperatures = dict(RUNS)[args.numerics]
    launch = (("ep_size", args.ep_size),) if args.ep_size > 1 else ()
    cfg = HarnessConfig(model=args.model, numerics=args.numerics, temperatures=temperatures,
                        max_new_tokens=args.max_new_tokens, chunk_sizes=(7,),
                        retraction_intervals=(-3,), launch=launch)
    results = InvarianceHarness(cfg).run(report=lambda table: print(table, flush=True))
    return {"modes": [{"mode": r.mode, "T": r.temperature, "values": r.compared_values,
                       "prefix_cuts": r.prefix_cuts,
                       "first_divergence": str(r.divergences[0]) if r.divergences else None}
                      for r in results]}


def run_child(numerics: str, model: Path, timeout: int, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = [sys.executable, __file__, "--child", numerics, "--model", str(model),
            "--child-out", path, "--ep-size", str(args.ep_size),
            "--max-new-tokens", str(args.max_new_tokens)]
    start = time.time()
    try:
        proc = subprocess.run(argv, timeout=timeout, text=True, capture_output=True)
        print(proc.stdout[-6000:], flush=True)
        if proc.returncode:
            return {"error": f"rc={proc.returncode}", "tail": proc.stderr[-2000:]}
        result = json.loads(Path(path).read_text())
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        print((out or "")[-6000:], flush=True)
        return {"error": f"timeout after {timeout} s"}
    finally:
        os.unlink(path)
    result["seconds"] = round(time.time() - start, 1)
    return result


def verdicts(runs: dict) -> tuple[list[str], bool]:
    """The verdict table, and whether the step passed: rl-bitwise bitwise in every mode; the
    control ran (a control that finds nothing is reported as such, not failed)."""
    lines = ["| numerics | modes | diverged | verdict | s |", "|---|---|---|---|---|"]
    ok = True
    for numerics, r in runs.items():
        if "error" in r:
            lines.append(f"| {numerics} | - | - | ERROR {r['error']} | - |")
            ok = False
            continue
        diverged = [m for m in r["modes"] if m["first_divergence"]]
        if numerics == "rl-bitwise":
            verdict = "PASS (bitwise)" if not diverged else f"FAIL: {diverged[0]['first_divergence']}"
            ok &= not diverged
        else:
            verdict = (f"diverged, as expected: {diverged[0]['first_divergence']}" if diverged
                       else "no divergence found (control not shown on this device)")
        lines.append(f"| {numerics} | {len(r['modes'])} | {len(diverged)} | {verdict} | "
                     f"{r['seconds']} |")
    return lines, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--work", default="/tmp/harness_deepseek", help="the checkpoint's directory")
    p.add_argument("--layers", type=int, default=3, help="decoder layers (the first is dense)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU, gpu_acceptance's --smoke widths (hidden 256, 16 experts)")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel size (EP4: 4 GPUs)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--only", choices=[n for n, _ in RUNS], default=None,
                   help="run one numerics (e.g. the auto control after a passing rl-bitwise run)")
    p.add_argument("--child-timeout", type=int, nargs=2, metavar=("RL", "AUTO"),
                   help="seconds of the rl-bitwise and of the auto harness run (default 120 80; "
                        "--tiny: 1200 1200, a CPU is slower)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.numerics = args.child
        Path(args.child_out).write_text(json.dumps(child(args)))
        return 0

    args.child_timeout = args.child_timeout or ([1200, 1200] if args.tiny else [120, 80])
    if args.layers < 2:
        raise SystemExit(f"--layers {args.layers}: at least 2 (layer 0 is dense, the rest MoE)")
    t0 = time.time()
    model = Path(args.work) / "deepseek_v3"
    dims = build_checkpoint(model, args.layers, args.tiny)
    print(f"checkpoint written to {model} in {time.time() - t0:.0f} s: hidden "
          f"{dims['hidden_size']}, {dims['num_hidden_layers']} layers, "
          f"{dims['n_routed_experts']} experts", flush=True)
    runs = {numerics: run_child(numerics, model, timeout, args)
            for (numerics, _), timeout in zip(RUNS, args.child_timeout)
            if args.only in (None, numerics)}
    table, ok = verdicts(runs)
    head = (f"DeepSeek-V3 invariance harness: hidden {dims['hidden_size']}, {args.layers} layers, "
            f"{dims['n_routed_experts']} experts top-{dims['num_experts_per_tok']}, EP{args.ep_size}, "
            f"{'CPU (tiny)' if args.tiny else 'GPU'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "harness_deepseek.md").write_text("\n".join([head, ""] + table) + "\n")
    (out / "harness_deepseek.json").write_text(json.dumps(runs, indent=1))
    print("\n".join([head] + table), flush=True)
    print(f"harness_deepseek: {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
