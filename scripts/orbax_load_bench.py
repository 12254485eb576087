"""Load time of the bench model's weights from safetensors and from Orbax, into the parameter tuple
a ModelRunner serves (on the device, on its placement).

    python scripts/orbax_load_bench.py --work /tmp/orbax_bench                    # 8B widths, 2 layers
    python scripts/orbax_load_bench.py --work /tmp/ob --shape small --iters 1     # CPU smoke test

Writes a random checkpoint of the bench shape (jengine/bench/common.py SHAPES; --layers of them)
as safetensors (the HF layout) and converts it to Orbax (jengine/models/orbax_checkpoint.py), then
builds a runner from the safetensors and times `runner.build_params(weights)` -- every parameter
read, placed and cast, block_until_ready -- for each format: the median of --iters after one
warm-up (the OS page cache is warm for both). The two tuples are compared bit for bit. Prints a
table and, last, one JSON line. Under --tp-size N the runner's mesh placement is the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_safetensors(directory: Path, config, seed: int = 0) -> int:
    """Random bf16 tensors for every checkpoint name the model reads; returns the bytes written."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from jengine.models.registry import get_family

    rng = np.random.default_rng(seed)
    tensors = {}
    for spec in get_family(config.architecture).param_specs(config, dtype="bfloat16").values():
        if spec.checkpoint not in tensors:
            shape = spec.stored_shape if spec.rows is None else (spec.rows, *spec.stored_shape[1:])
            values = rng.standard_normal(shape, dtype=np.float32) * 0.02
            tensors[spec.checkpoint] = values.astype(ml_dtypes.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"))
    return sum(t.nbytes for t in tensors.values())


def build_runner(config, weights, tp_size: int):
    from jengine.config import LaunchConfig
    from jengine.engine.model_runner import ModelRunner
    from jengine.launch import plan_launch
    from jengine.numerics import resolve_launch
    from jengine.profiles import override_profile

    resolved = resolve_launch(LaunchConfig(max_total_tokens=256, chunked_prefill_size=64,
                                           max_prefill_tokens=64, max_running_requests=1,
                                           skip_warmup=True, log_level="warning"))
    resolved.apply_environment()
    # Timing only: random weights prove nothing about the contract (as jengine bench does).
    with override_profile(config.architecture, numerics_envelopes={"auto"}):
        plan = plan_launch(resolved, config)
    return ModelRunner(config, weights, dataclasses.replace(plan.runner, tp_size=tp_size))


def time_load(runner, open_weights, iters: int) -> tuple[list[float], tuple]:
    import jax

    times, params = [], None
    for i in range(iters + 1):  # the first is the warm-up
        params = None  # the previous tuple's device memory is free before the next load
        t0 = time.perf_counter()
        params = jax.block_until_ready(runner.build_params(open_weights()))
        if i:
            times.append(time.perf_counter() - t0)
    return times, params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder for the two checkpoints")
    ap.add_argument("--shape", default="llama3-8b", choices=("llama3-8b", "small"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--tp-size", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    from jengine.bench.common import SHAPES
    from jengine.models.config import ModelConfig
    from jengine.models.loader import SafetensorsCheckpoint
    from jengine.models.orbax_checkpoint import OrbaxCheckpoint, write_orbax

    base, _ = SHAPES[args.shape]
    config = ModelConfig.from_hf_dict({**base, "num_hidden_layers": args.layers})
    work = Path(args.work)
    st_dir, orbax_dir = work / "safetensors", work / "orbax_model"
    st_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    nbytes = write_safetensors(st_dir, config)
    t1 = time.perf_counter()
    write_orbax(SafetensorsCheckpoint(st_dir), config, orbax_dir, progress=False)
    t2 = time.perf_counter()

    runner = build_runner(config, SafetensorsCheckpoint(st_dir), args.tp_size)
    st_times, st_params = time_load(runner, lambda: SafetensorsCheckpoint(st_dir), args.iters)
    st_host = [np.asarray(p) for p in st_params]
    del st_params
    orbax_times, orbax_params = time_load(runner, lambda: OrbaxCheckpoint(orbax_dir, config),
                                          args.iters)
    from tests.bits import count_bit_differences

    differing = sum(count_bit_differences(a, b) for a, b in zip(st_host, orbax_params))
    result = {
        "shape": args.shape, "layers": args.layers, "tp_size": args.tp_size,
        "device": str(orbax_params[0].devices().pop().platform), "gib": round(nbytes / 2**30, 3),
        "write_safetensors_s": round(t1 - t0, 2), "convert_to_orbax_s": round(t2 - t1, 2),
        "safetensors_load_s": round(statistics.median(st_times), 3),
        "orbax_load_s": round(statistics.median(orbax_times), 3),
        "safetensors_all_s": [round(t, 3) for t in st_times],
        "orbax_all_s": [round(t, 3) for t in orbax_times],
        "param_elements_differing": differing,
    }
    print(f"| format | load (median of {args.iters}) | GiB/s |\n|---|---|---|")
    for name in ("safetensors", "orbax"):
        s = result[f"{name}_load_s"]
        print(f"| {name} | {s:.3f} s | {nbytes / 2**30 / s:.2f} |")
    print(json.dumps(result))
    return 0 if differing == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
