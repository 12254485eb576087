"""`jengine bench --compare PREVIOUS.json`: every measured row of this run against the same row of
a previous results file, as new / old ratios (a time's ratio < 1 and a rate's > 1 are better)."""

from __future__ import annotations

import re

from jengine.bench.measures import shape_label

# A leaf is a measurement by its key; counts and settings (requests, batch, context, compile
# counts, build and warm-up seconds) are not compared.
_METRIC = re.compile(r"(_ms|_us|tok_s|req_s|TBps|TFLOPs|wall_s|overhead_pct)$")
_TABLES = ("decode_ms", "per_gemm_us", "step_gemm_us")  # dicts of measurements keyed by M or bs
_RATES = re.compile(r"(tok_s|req_s|TBps|TFLOPs)$")


def measurements(results: dict) -> dict[str, float]:
    """{'engine:auto/output_tok_s': 8123.0, 'model:auto/decode_ms/64': 9.4, ...}"""
    out: dict[str, float] = {}

    def walk(node, path: str, in_table: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}/{key}" if path else str(key), in_table or key in _TABLES)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            if in_table or _METRIC.search(path):
                out[path] = float(node)

    for part, value in results.items():
        if part not in ("versions", "command", "commands"):
            walk(value, part, False)
    return out


def compare_rows(new: dict, old: dict) -> list[tuple[str, float, float, float | None]]:
    """(row, new, old, new / old) for every measurement both runs have."""
    a, b = measurements(new), measurements(old)
    return [(k, a[k], b[k], a[k] / b[k] if b[k] else None) for k in a if k in b]


def shapes(results: dict) -> dict[str, str]:
    """{part: model shape, with its layer count where --layers cut it} of the parts that ran a
    model (a bench.json from before --shape: the Llama-3-8B shape)."""
    return {part: shape_label(r) for part, r in results.items()
            if isinstance(r, dict) and part.split(":")[0] in ("model", "engine", "server", "hf")}


def render_comparison(new: dict, old: dict, old_name: str) -> str:
    rows = compare_rows(new, old)
    lines = [f"## Against {old_name}", ""]
    a, b = shapes(new), shapes(old)
    differ = sorted(f"{part} ({a[part]} vs {b[part]})" for part in a if part in b
                    and a[part] != b[part])
    if differ:  # the same row names, other models: the ratios say nothing about a change
        lines += ["**Other model shapes** in " + ", ".join(differ) + ": those rows compare two "
                  "different models.", ""]
    lines += ["new / old: for a time (ms, µs, s) below 1 is faster; for a rate (tok/s, TB/s, "
              "TFLOP/s) above 1 is.", "", "| row | new | old | new / old | better |",
              "|---|---|---|---|---|"]
    for key, x, y, ratio in rows:
        better = "-" if ratio is None or ratio == 1 else (
            "yes" if (ratio > 1) == bool(_RATES.search(key)) else "no")
        lines.append(f"| {key} | {x:.4g} | {y:.4g} | "
                     f"{'-' if ratio is None else format(ratio, '.3f')} | {better} |")
    if not rows:
        lines.append("| (no row measured in both runs) | | | | |")
    return "\n".join(lines) + "\n"
