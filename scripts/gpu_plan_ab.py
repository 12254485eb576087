"""The bench's model rows with some leaves taken out of the registry: what a different plan would
give, before anyone changes a priority. An experiment for issue #19.

    python scripts/gpu_plan_ab.py --without attention.paged.triton_wide_prefill \\
        attention.paged.triton_fixed_split -- --numerics auto --batch-sizes 1 64 --iters 10 \\
        --long-context 0

Everything after `--` is `jengine bench`'s own options for one model part (one --numerics).
The leaves named by --without (family.name.impl) are unregistered before the runner plans, so
the next leaf by priority is planned instead; the row prints the plan it ran. Bits are not
checked here: only a plan without the batch_invariant feature (auto) is a fair use.
Writes the part's JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    argv = sys.argv[1:]
    bench_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser()
    p.add_argument("--without", nargs="+", required=True, help="family.name.impl")
    p.add_argument("--out", default="/tmp/plan_ab.json")
    args = p.parse_args(own)

    import pallas_kernels  # noqa: F401  (registers every leaf)
    from jengine.bench import _child_main
    from pallas_kernels.registry import REGISTRY

    for spec in args.without:
        family, name, impl = spec.split(".")
        REGISTRY.unregister(family, name, impl)
        print(f"unregistered {family}.{name}.{impl}", flush=True)
    rc = _child_main([*bench_argv, "--child", "model", "--child-out", args.out])
    with open(args.out) as f:
        result = json.load(f)
    keep = ("kernels", "decode_ms", "decode_pipelined_ms", "decode_dispatch_ms", "prefill")
    print(json.dumps({k: v for k, v in result.items() if k in keep}, indent=1, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
