"""Measure what release_memory_occupation gives back: device bytes in use (memory_stats) after
start, release of each tag, and resume, and whether the outputs after resume are bit-identical.

    python scripts/memory_release_check.py --model-path tiny [--numerics rl-bitwise]

On the CPU, memory_stats() is None: the table shows n/a and only the bit check means anything.
"""

from __future__ import annotations

import argparse

import numpy as np


def bytes_in_use() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if stats is None else int(stats.get("bytes_in_use", 0))


def fingerprint(eng) -> tuple:
    out = eng.generate(input_ids=list(range(1, 33)), return_logprob=True, logprob_start_len=0,
                       sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    lps = [t[0] for t in out["meta_info"]["input_token_logprobs"][1:]
           + out["meta_info"]["output_token_logprobs"]]
    return tuple(out["output_ids"]), np.asarray(lps, np.float32).view(np.uint32).tobytes()


def main() -> None:
    from jengine import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="tiny")
    ap.add_argument("--numerics", default="rl-bitwise")
    args = ap.parse_args()
    rows = []
    # skip_warmup: a model with a long context has hundreds of step buckets; two are enough here.
    with Engine(model_path=args.model_path, numerics=args.numerics, skip_warmup=True) as eng:
        before = fingerprint(eng)
        rows.append(("serving", bytes_in_use()))
        for tags in (["kv_cache"], ["weights"]):
            eng.release_memory_occupation(tags)
            rows.append((f"released {'+'.join(tags)}", bytes_in_use()))
        eng.resume_memory_occupation(["weights"])
        rows.append(("resumed weights", bytes_in_use()))
        eng.resume_memory_occupation(["kv_cache"])
        rows.append(("resumed kv_cache", bytes_in_use()))
        same = fingerprint(eng) == before
    base = rows[0][1]
    print(f"{'state':<22}{'bytes_in_use':>16}{'vs serving':>16}")
    for name, used in rows:
        shown = "n/a" if used is None else f"{used:,}"
        delta = "n/a" if used is None or base is None else f"{used - base:+,}"
        print(f"{name:<22}{shown:>16}{delta:>16}")
    print(f"outputs after resume bit-identical: {same}")
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
