"""Does rl-bitwise's "no PDL" pin reach XLA? (the spec's kernels.deterministic)

    python scripts/gpu_pdl_check.py [--out DIR]

XLA launches its own kernels with programmatic dependent launch (PDL) when
`--xla_gpu_enable_pdl` is on: each kernel may start before the one before it has finished and
waits at its entry (`griddepcontrol.wait` in its PTX). rl-bitwise pins the flag off
(jengine/xla_environment.py). This script, on the GPU machine:

1. reads the installed jaxlib's default of `xla_gpu_enable_pdl` and `xla_gpu_enable_pdl_launch`
   (`xla_environment.xla_flag_default`: the default compile options of child processes);
2. for `--numerics auto` and `rl-bitwise`, in a child each: resolves the launch as the engine does
   (`resolve_launch(...).apply_environment()`, XLA_FLAGS also carrying `--xla_dump_to`), runs a
   jitted chain of XLA fusions and counts `griddepcontrol` in the PTX XLA wrote.

Expected: PDL on by default; rl-bitwise's modules compiled with `xla_gpu_enable_pdl: false` (the
dumped debug options), auto's with the default; where XLA dumps PTX, `griddepcontrol` in auto's
(the control) and none in rl-bitwise's. Writes pdl_check.json / .md to --out; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A chain of dependent fusions: XLA cannot fuse across the reductions, so each is its own kernel.
_CHAIN = """
import json, sys
from jengine.config import LaunchConfig
from jengine.numerics import resolve_launch
resolved = resolve_launch(LaunchConfig(numerics=sys.argv[1]))
resolved.apply_environment()
import os
import jax, jax.numpy as jnp

@jax.jit
def chain(x):
    for _ in range(6):
        x = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
        x = x / jnp.sum(x, axis=-1, keepdims=True)
    return x

y = chain(jnp.ones((64, 4096), jnp.float32)).block_until_ready()
print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""),
                  "resolved_flags": list(resolved.xla_flags), "sum": float(y.sum())}))
"""


def defaults() -> dict:
    from jengine.xla_environment import XlaFlagError, xla_flag_default

    out = {}
    for flag in ("xla_gpu_enable_pdl", "xla_gpu_enable_pdl_launch"):
        try:
            out[flag] = {True: "on", False: "off", None: "unknown to this jaxlib"}[
                xla_flag_default(flag)]
        except XlaFlagError:
            out[flag] = "?"
    return out


def chain_ptx(numerics: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"pdl-{numerics}-") as dump:
        # No persistent cache: an executable loaded from it is not compiled, so nothing is dumped.
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
                   JAX_ENABLE_COMPILATION_CACHE="false",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        proc = subprocess.run([sys.executable, "-c", _CHAIN, numerics], env=env,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        files = sorted(p for p in pathlib.Path(dump).rglob("*") if p.is_file())
        # PTX wherever XLA put it: by suffix, or any dumped text holding a kernel entry
        ptx = [p for p in files if p.suffix == ".ptx"
               or ".visible .entry" in p.read_text(errors="replace")]
        text = "".join(p.read_text(errors="replace") for p in ptx)
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        suffixes: dict[str, int] = {}
        for p in files:
            suffixes[p.suffix] = suffixes.get(p.suffix, 0) + 1
        # The options each compiled module ran under (the dump lists the non-default fields)
        pdl_options = sorted({line.strip() for p in files if p.suffix == ".debug_options"
                              for line in p.read_text(errors="replace").splitlines()
                              if "xla_gpu_enable_pdl" in line})
        row.update(dumped=suffixes, dumped_names=[p.name for p in files[:12]],
                   pdl_options=pdl_options,
                   ptx_files=len(ptx), entries=text.count(".entry"),
                   griddepcontrol_wait=text.count("griddepcontrol.wait"),
                   griddepcontrol_launch=text.count("griddepcontrol.launch_dependents"))
        return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    import jax

    result = {"jax": jax.__version__, "defaults": defaults(),
              "chain": {m: chain_ptx(m) for m in ("auto", "rl-bitwise")}}
    rl, auto = result["chain"]["rl-bitwise"], result["chain"]["auto"]
    ok = "error" not in rl and "error" not in auto \
        and "xla_gpu_enable_pdl: false" in rl["pdl_options"] \
        and "xla_gpu_enable_pdl: false" not in auto["pdl_options"]
    if ok and rl["ptx_files"] and auto["ptx_files"]:  # the PTX itself, auto's the control
        ok = rl["griddepcontrol_wait"] == rl["griddepcontrol_launch"] == 0 \
            and auto["griddepcontrol_wait"] > 0
    result["verdict"] = ("PASS" if ok else "FAIL") + ("" if rl.get("ptx_files") else
                                                     " (from the modules' options: no PTX dumped)")
    lines = [f"jax {result['jax']}; defaults: " + ", ".join(
        f"{k} {v}" for k, v in result["defaults"].items()), "",
        "| numerics | PTX files | .entry | griddepcontrol.wait | .launch_dependents | XLA_FLAGS |",
        "|---|---|---|---|---|---|"]
    for m, r in result["chain"].items():
        if "error" in r:
            lines.append(f"| {m} | error: {r['error'][-300:]} |")
        else:
            lines.append(f"| {m} | {r['ptx_files']} | {r['entries']} | {r['griddepcontrol_wait']} "
                         f"| {r['griddepcontrol_launch']} | {r['xla_flags']} |")
    for m, r in result["chain"].items():
        if "dumped" in r:
            lines.append(f"{m}: dumped {r['dumped']}; e.g. {r['dumped_names'][:4]}; "
                         f"the modules' PDL options: {r['pdl_options'] or 'defaults'}")
    lines += ["", f"rl-bitwise without griddepcontrol: {result['verdict']}"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pdl_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "pdl_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
