"""`jengine bench`: the report's target statuses (pure), and the engine and hf parts end to end on
the small shape (CPU, tiny workload), through the CLI as a user runs them."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jengine import bench
from jengine.bench import e2e as bench_e2e
from jengine.bench import model as bench_model
from jengine.bench.compare import compare_rows, render_comparison
from jengine.bench.measures import LAYER_PARAMS, decode_bytes, prefill_flops, workload_bound_s
from jengine.bench.report import render
from jengine.bench.targets import target_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BW, PEAK = 4.0, 600.0  # TB/s, TFLOP/s of the synthetic roofline


def _ms_at_hbm_percent(pct, bs, ctx, vocab):
    return decode_bytes(bs, ctx, vocab) / (BW * 1e12) / (pct / 100) * 1e3


def _synthetic() -> dict:
    """A run where each kind of target is met once and missed once, by known amounts."""
    auto_bs1 = _ms_at_hbm_percent(90, 1, 1024, 128256)  # >= 75 %: met
    auto_bs64 = _ms_at_hbm_percent(50, 64, 1024, 128256)  # >= 70 %: missed by 20 points
    pipe_bs64 = _ms_at_hbm_percent(72, 64, 1024, 128256)  # pipelined: met
    prefill_ms = prefill_flops(4096) / (0.65 * PEAK * 1e12) * 1e3  # 65 % >= 60 %: met
    return {
        "versions": {"date": "2026-01-01T00:00", "jax": "x"},
        "command": "jengine bench (synthetic)",
        "roofline": {"hbm_TBps": BW, "gemm_TFLOPs": PEAK},
        "model:auto": {"numerics": "auto", "shape": "llama3-8b", "vocab": 128256, "context": 1024,
                       "prefill_tokens": 4096, "prefill_ms": prefill_ms,
                       "decode_ms": {"1": auto_bs1, "64": auto_bs64},
                       "decode_pipelined_ms": {"1": auto_bs1 * 0.9, "64": pipe_bs64},
                       "decode_dispatch_ms": {"1": 4.25, "64": 5.5},
                       "long_decode": {"batch": 16, "context": 8192, "ms": 40.0,
                                       "pipelined_ms": 39.0, "dispatch_ms": 6.75}},
        "model:rl-bitwise": {"numerics": "rl-bitwise", "shape": "llama3-8b", "vocab": 131072,
                             "context": 1024, "prefill_tokens": 4096,
                             # ratios 1.04 (met) and 1.5 (missed by 0.45x) blocked on; at
                             # bs 64 pipelined 1.051 (missed by 0.001x: three decimals show it)
                             "decode_ms": {"1": auto_bs1 * 1.04, "64": auto_bs64 * 1.5},
                             "decode_pipelined_ms": {"64": pipe_bs64 * 1.051},
                             "long_decode": {"batch": 16, "context": 8192, "ms": 42.0}},
        "engine:auto": {"requests": 256, "input_tokens": 1024, "output_tokens": 256, "wall_s": 40.0,
                        "output_tok_s": 1638.4, "total_tok_s": 8192.0, "req_s": 6.4,
                        "compiles_in_timing": 0, "compile_s_in_timing": 0.0,
                        "finish_reasons": {"length": 256},
                        "loop_overhead": {"overlap": {"batch": 64, "context": 1152,
                                                     "engine_step_ms": 10.4, "model_step_ms": 10.0,
                                                     "overhead_pct": 4.0}}},
        "engine:rl-bitwise": {"error": "timeout after 540 s", "tail": "...", "warmup_s": 100.0},
        "server:auto": {"clients": 256, "input_tokens": 1024, "output_tokens": 256,
                        "wall_s": 50.0, "output_tok_s": 1310.72},
        "hf": {"batch": 64, "context": 1024, "new_tokens": 64, "shape": "llama3-8b",
               "cache": "static", "device": "cuda", "dtype": "bfloat16", "generate_s": 3.0,
               "generate_1_s": 0.5, "tok_s_with_prefill": 1365.3, "decode_tok_s": 2000.0},
    }


def _status_of(rows, *words):
    matches = [(m, s) for t, m, s in rows if all(w in t for w in words)]
    assert len(matches) == 1, (words, rows)
    return matches[0]


def test_target_statuses():
    rows = target_rows(_synthetic())
    assert _status_of(rows, "`auto` decode bs 1,", "(blocked on)")[1] == "**met**"
    measured, st = _status_of(rows, "`auto` decode bs 64,", "(blocked on)")
    assert measured.startswith("50 % (") and st == "**missed** by 20.00 points"
    assert _status_of(rows, "`auto` decode bs 64,", "(pipelined)")[1] == "**met**"
    assert _status_of(rows, "`rl-bitwise` decode bs 1,", "(pipelined)")[1] == (
        "not measured (no pipelined time (a bench from before it was measured))")
    assert not [t for t, _, _ in rows if "x auto, decode bs 1," in t and "(pipelined)" in t]
    assert _status_of(rows, "`rl-bitwise` decode bs 1,", "(blocked on)")[1] == "**met**"
    assert _status_of(rows, "`auto` prefill")[1] == "**met**"
    assert _status_of(rows, "`rl-bitwise` prefill >=")[1] == "not measured (no prefill row)"
    assert _status_of(rows, "1.05 x auto", "bs 1, ctx 1024", "(blocked on)") == ("1.040x",
                                                                                "**met**")
    assert _status_of(rows, "1.05 x auto", "bs 64, ctx 1024", "(blocked on)") == (
        "1.500x", "**missed** by 0.450x")
    assert _status_of(rows, "1.05 x auto", "bs 64, ctx 1024", "(pipelined)") == (
        "1.051x", "**missed** by 0.001x")
    assert _status_of(rows, "1.05 x auto", "bs 16, ctx 8192", "(blocked on)") == ("1.050x",
                                                                                  "**met**")
    assert _status_of(rows, "rl-bitwise prefill <=")[1].startswith("not measured")
    measured, st = _status_of(rows, "`auto` Engine workload")
    ceiling = 256 * 256 / workload_bound_s(256, 1024, 256, 128256, BW, PEAK)
    assert measured == (f"1638 tok/s (0.41x; the workload's roofline allows {ceiling:.0f} (the "
                        f"goal is above it))") and st == "**missed** by 6273.60 tok/s"
    assert _status_of(rows, "`rl-bitwise` Engine workload")[1] == "not measured (timeout after 540 s)"
    assert _status_of(rows, "`auto` Engine decode step") == ("4.0 %", "**met**")
    assert _status_of(rows, "`auto` server") == ("0.80x (1311 vs 1638 tok/s)", "**missed** by 0.10x")


def test_the_workload_roofline_is_its_bytes_or_its_flops():
    """One decode step of one row with a GEMM peak so high that only bytes count, then a bandwidth
    so high that only FLOPs do; the synthetic run's 4 TB/s / 600 TFLOP/s allow less than the 2x
    goal (7912 tok/s), which the targets say. Control: twice the bandwidth, a shorter bound."""
    vocab = 1000
    # rel 1e-6: the other term (FLOPs over a 1e12 TFLOP/s peak, or bytes over 1e12 TB/s) adds
    # less than 1e-9 of the total; the formulas are otherwise the same sums
    assert workload_bound_s(1, 8, 2, vocab, BW, 1e12) == pytest.approx(
        decode_bytes(1, 9, vocab) / (BW * 1e12), rel=1e-6)
    flops = (prefill_flops(8) + 2 * 4096 * vocab
             + 2 * 32 * LAYER_PARAMS + 2 * 4096 * vocab + 2 * 2 * 9 * 4096 * 32)
    assert workload_bound_s(1, 8, 2, vocab, 1e12, PEAK) == pytest.approx(
        flops / (PEAK * 1e12), rel=1e-9)
    slow = workload_bound_s(256, 1024, 256, 128256, BW, PEAK)
    assert 256 * 256 / slow < 2 * 3956
    assert workload_bound_s(256, 1024, 256, 128256, 2 * BW, PEAK) < slow
    assert workload_bound_s(256, 1024, 256, 128256, None, PEAK) is None


def test_render_tables():
    md = render(_synthetic())
    assert "| decode bs 16, ctx 8192 | 40.00 |" in md
    assert "| decode bs 64, ctx 1024 |" in md and "| 1.50 |" in md  # the ratio column
    assert "| `auto` | 4096 |" in md and "| 65 % |" in md  # prefill: tok/s, TFLOP/s, % of peak
    assert "| decode bs 64, ctx 1024 | " in md and "| 72 % |" in md  # the pipelined column
    # host dispatch per row: auto measured it, rl-bitwise's result predates it
    assert "| decode bs 1, ctx 1024 | 4.25 | - |" in md
    assert "| decode bs 16, ctx 8192 | 6.75 | - |" in md
    assert "| `auto` | 256 x (1024 + 256) | 40.00 | 1638 | 8192 | 6.40 |" in md
    assert "`auto`: the workload's roofline" in md and "measured 24 % of it" in md
    assert "`engine --numerics rl-bitwise`: stopped (timeout after 540 s)" in md
    assert "| 64 x (1024 + 64) | static | cuda, bfloat16 | 3.00 | 0.50 |" in md


def test_render_old_and_missing_parts():
    """A bench.json of the previous bench (no shape, no long row, no engine/hf) still renders."""
    old = {"versions": {"date": "2026-11-30T10:00"}, "command": "jengine bench --parts model",
           "roofline": {"error": "rc=1", "tail": "oom"},
           "model:auto": {"numerics": "auto", "vocab": 128256, "context": 1024, "decode_ms":
                          {"1": 36.65, "64": 57.74}, "prefill_tokens": 4096, "compile_s": {}}}
    md = render(old)
    assert "roofline: not measured (rc=1)" in md
    assert "| decode bs 64, ctx 1024 | 57.74 | 1108 | - | - |" in md
    rows = {t: s for t, _, s in target_rows(old)}
    assert rows["`auto` decode bs 1, ctx 1024 >= 75 % of HBM bound (blocked on)"] == (
        "not measured (no roofline in this run)")
    assert rows["`auto` decode bs 1, ctx 1024 >= 75 % of HBM bound (pipelined)"] == (
        "not measured (no pipelined time (a bench from before it was measured))")
    assert any(s == "not measured (part not run)" for t, s in rows.items() if "server" in t)
    assert "not measured" in render({})


def test_part_timeouts_and_launch_sizing():
    assert bench.part_timeouts(["300", "engine=540"]) == {"": 300, "engine": 540}
    with pytest.raises(ValueError, match="nope"):
        bench.part_timeouts(["nope=3"])
    args = bench.add_arguments(argparse.ArgumentParser()).parse_args([])
    args.numerics = "auto"
    assert args.parts == ["roofline", "leaves", "model", "engine", "server", "hf"]
    model = bench_model._model_launch(args)  # bs 256 x 1025 tokens beats bs 16 x 8193
    assert model.max_total_tokens == 256 * 65 * 16 and model.context_length > 8192
    e2e = bench_e2e._e2e_launch(args)
    assert (e2e.max_total_tokens, e2e.max_running_requests, e2e.max_prefill_tokens) == (
        256 * 1280, 256, 4096)


def test_a_parts_output_is_passed_on_as_it_comes_and_kept_past_its_timeout(monkeypatch, capsys):
    """A part's lines reach the bench's stdout while the part runs: a step cut short on the device
    (which kills the bench itself) keeps in its log how far each part got. A part stopped by its
    timeout returns its lines as the error's tail."""
    child = ("import sys, time; print('built in 0.1 s', flush=True); "
             "print('to stderr', file=sys.stderr, flush=True); time.sleep(60)")
    monkeypatch.setattr(bench, "_child_command", lambda *a: [sys.executable, "-c", child])
    args = bench.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--part-timeout", "model=3"])
    result = bench._run_child("model", "auto", args)
    assert result["error"] == "timeout after 3 s" and "built in 0.1 s" in result["tail"]
    assert "to stderr" not in result["tail"]  # stderr joins the tail only when a part fails
    assert "built in 0.1 s" in capsys.readouterr().out
    failing = ("import sys; print('half', flush=True); print('Traceback', file=sys.stderr); "
               "sys.exit(3)")
    monkeypatch.setattr(bench, "_child_command", lambda *a: [sys.executable, "-c", failing])
    result = bench._run_child("model", "auto", args)
    assert result["error"] == "rc=3" and "half" in result["tail"] and "Traceback" in result["tail"]


def _bench_cli(tmp_path, numerics):
    argv = [sys.executable, "-m", "jengine.cli", "bench", "--parts", "engine", "server", "hf",
            "--shape", "small", "--numerics", *numerics, "--e2e-requests", "4", "--e2e-input",
            "32", "--e2e-output", "8", "--loop-batch", "2", "--server-clients", "3",
            "--hf-batch", "2", "--context", "32", "--hf-new-tokens", "4",
            "--iters", "2", "--part-timeout", "120", "--out", str(tmp_path)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    results = json.loads((tmp_path / "bench.json").read_text())
    return proc, results, (tmp_path / "bench.md").read_text()


def _check_engine(r):
    assert "error" not in r, r
    for run in (r, r["overlap_off"]):
        assert run["finish_reasons"] == {"length": 4} and run["output_tokens_total"] == 4 * 8
        for key in ("wall_s", "output_tok_s", "total_tok_s", "req_s", "ttft_p50_ms",
                    "itl_p99_ms"):
            assert run[key] > 0, key
        assert run["total_tok_s"] == pytest.approx(run["output_tok_s"] * 5)  # (32 + 8) / 8
    assert r["overlap_schedule"] and not r["overlap_off"]["overlap_schedule"]
    loops = r["loop_overhead"]
    assert [loops[k]["overlap_schedule"] for k in ("overlap", "overlap_off")] == [True, False]
    assert all(row["batch"] == 2 and row["model_step_ms"] > 0 for row in loops.values())
    # the engine thread's phases: every turn of the workload stepped, and its host work is timed
    assert all(row["host_phases"]["turns"] > 0 and row["host_phases"]["host_ms"] > 0
               and row["host_phases"]["wait_ms"] > 0 for row in loops.values())
    assert loops["overlap"]["host_phases"]["commit_ms"] > 0  # only the overlap loop commits ahead
    assert loops["overlap_off"]["host_phases"]["commit_ms"] == 0
    # the workload's loop phases summed over the run, set against the server's by the report
    total = r["host_phases"]["total_s"]
    assert total["wait"] > 0 and total["dispatch"] > 0 and sum(total.values()) <= r["wall_s"]
    # the output processor's holds at the engine's host gate (jengine/engine/host_gate.py)
    assert r["output_hold_s"] == 0.02 and r["host_phases"]["output_holds"] >= 0
    assert r["host_phases"]["output_hold_timeouts"] <= r["host_phases"]["output_holds"]


def _check_server(r, md):
    assert "error" not in r, r
    assert r["clients"] == 3 and r["output_tokens_total"] == 3 * 8
    assert r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0
    # The untimed run compiled what the workload's steps need; the server counted its compiles.
    assert r["warm_run"]["output_tokens_total"] == 3 * 8 and r["warm_run"]["compiles_in_timing"] > 0
    assert r["compiles_in_timing"] >= 0 and r["switch_interval_s"] == 0.0001
    assert "| `auto` | 3 x (32 + 8) |" in md and "x | " in md  # the ratio to the engine row
    # Where the time went: the server's engine loop, its threads' CPU, the clients' CPU.
    total = r["host_phases"]["total_s"]
    assert r["host_phases"]["turns"] > 0 and total["wait"] > 0 and total["dispatch"] > 0
    cpu = r["server_cpu_s"]
    assert set(cpu) == {"event loop", "engine", "output", "other threads"}
    # /proc counts 10 ms ticks: any one thread's share of a 24-token run (~0.2 s) can round to 0
    # (the event loop's and the engine thread's both have, in CI); the whole server's cannot.
    assert all(v >= 0 for v in cpu.values()) and sum(cpu.values()) > 0 and r["client_cpu_s"] > 0
    assert sum(cpu.values()) < 2 * r["wall_s"] * os.cpu_count()  # seconds, not ticks
    assert "| `auto` | server |" in md and "| `auto` | Engine |" in md
    assert r["output_hold_ms"] == 20.0 and "output_holds" in r["host_phases"]
    # the clients ran in 3 processes (--server-client-procs 4, capped at the 3 clients)
    assert r["client_procs"] == 3 and "(3 procs)" in md
    assert "outputs held s (holds / timeouts)" in md
    assert "| numerics | engine | event loop | other threads | output | clients |" in md


def test_mla_shape_matches_the_dense_shape_in_active_parameters():
    """scripts/gpu_mla_decode.py's pair: the DeepSeek-V3-shaped model computes about as many
    parameters per token as Llama-3-8B (within 5 %) while holding ~5x as many, and caches 3.6x
    fewer KV bytes per token; the count sees the routing (the dense shape: active == total)."""
    from jengine.bench.common import kv_bytes_per_token, parameter_counts, shape_config

    mla, dense = (shape_config(s)[0] for s in ("dsv3-8b-active", "llama3-8b"))
    m, d = parameter_counts(mla), parameter_counts(dense)
    assert d["active"] == d["total"] == 8_030_261_248
    assert abs(m["active"] / d["active"] - 1) < 0.05 and m["total"] > 4.5 * d["total"]
    assert (kv_bytes_per_token(mla), kv_bytes_per_token(dense)) == (32 * 576 * 2, 32 * 2 * 8 * 128 * 2)
    short = parameter_counts(shape_config("dsv3-8b-active", layers=16)[0])
    assert short["active"] < 0.6 * m["active"]


def test_moe_shape_is_qwen3_30b_a3b_and_runs_small(tmp_path):
    """Issue 8's MoE shape: the family's own parameter specs count Qwen3-30B-A3B's published
    30.5B parameters, 3.3B active per token. Its small twin runs the model part and the HF peer
    (the shape's own class) through the CLI, and the report says whose shape the goals are."""
    from jengine.bench.common import parameter_counts, shape_config

    counts = parameter_counts(shape_config("qwen3-30b-a3b")[0])
    # the model card's figures, to their one decimal (3.35B active: the card writes 3.3B)
    assert 30.5e9 <= counts["total"] < 30.6e9 and 3.3e9 <= counts["active"] < 3.4e9, counts
    argv = [sys.executable, "-m", "jengine.cli", "bench", "--parts", "model", "hf", "--shape",
            "qwen3-moe-small", "--numerics", "auto", "rl-bitwise", "--batch-sizes", "1",
            "--context", "16",
            "--long-context", "0", "--prefill-tokens", "16", "--iters", "1", "--hf-batch", "2",
            "--hf-new-tokens", "2", "--part-timeout", "120", "--out", str(tmp_path)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "bench.json").read_text())
    model = results["model:auto"]
    assert model["shape"] == "qwen3-moe-small" and model["vocab"] == 32000
    assert model["decode_ms"]["1"] > 0 and model["prefill_ms"] > 0
    assert model["kernels"]["expert_backend"] in ("portable", "batch_invariant")
    # one row routes to exactly top-k experts in each of the 2 layers (its bucket's padding rows
    # reach none); the routed backend (rl-bitwise) runs them in the static layout of its 16-row
    # bucket: 16 x 4 pairs over 16 experts (+ the empty "expert"), tiles of 64 rows
    assert model["experts_read"]["1"] == {"rows": 2 * 4}, model["experts_read"]
    routed = results["model:rl-bitwise"]
    assert routed["kernels"]["expert_backend"] == "batch_invariant"
    assert routed["experts_read"]["1"] == {"rows": 2 * 4, "layout_rows": 17 * 64}, routed
    assert model["step_model"]["expert"] == 3 * 256 * 64
    md = (tmp_path / "bench.md").read_text()
    assert "rows are read against them for information only" in md
    assert "| decode bs 1, ctx 16 | 8 | 8 [1088] |" in md  # the experts table
    if importlib.util.find_spec("transformers") is not None:
        assert results["hf"]["model_class"] == "Qwen3MoeForCausalLM", results["hf"]
        assert results["hf"]["generated"] == 2


def test_layers_runs_the_first_layers_of_a_shape_and_refuses_what_it_would_not_shorten(tmp_path):
    """--layers N: the model part builds the shape's first N layers (same widths), counts its
    roofline bytes over those layers, and the report names the layer count; it says as it goes
    when the model is built and each step compiled (a part stopped by its timeout keeps only what
    it printed). It refuses the parts it would not shorten and the shape the goals count whole."""
    def refusal(*argv):
        args = bench.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))
        with pytest.raises(SystemExit) as e:
            bench.check_layers(args)
        return str(e.value)

    assert "model part only" in refusal("--layers", "1", "--shape", "qwen3-moe-small")
    assert "not for --shape llama3-8b" in refusal("--layers", "1", "--parts", "model")
    assert "has 2 layers" in refusal("--layers", "3", "--parts", "model", "--shape",
                                     "qwen3-moe-small")
    assert ">= 1" in refusal("--layers", "-1", "--parts", "model", "--shape", "qwen3-moe-small")
    argv = [sys.executable, "-m", "jengine.cli", "bench", "--parts", "model", "--shape",
            "qwen3-moe-small", "--layers", "1", "--numerics", "auto", "--batch-sizes", "1",
            "--context", "16", "--long-context", "0", "--prefill-tokens", "16", "--iters", "1",
            "--part-timeout", "120", "--out", str(tmp_path)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[auto] 1 layers of qwen3-moe-small built on random weights in" in proc.stdout
    assert "[auto] decode bs=1 ctx=16: compiled and ran once in" in proc.stdout
    assert "prefill 16: compiled and ran once in" in proc.stdout
    model = json.loads((tmp_path / "bench.json").read_text())["model:auto"]
    assert model["layers"] == 1 and model["step_model"]["moe_layers"] == 1
    assert model["experts_read"]["1"]["rows"] == 1 * 4  # top-4 in the one layer
    assert "qwen3-moe-small (1 of its 2 layers)" in (tmp_path / "bench.md").read_text()


def test_moe_compile_probe_times_each_phase_and_keeps_what_a_stop_leaves(tmp_path):
    """scripts/gpu_moe_compile.py on the CPU twin: each phase of the first decode call is timed, in
    order. A child stopped by its limit is a row saying so with the phases it had finished; a
    limit too short for any (a stop at a given phase would depend on the machine's speed) leaves
    the row with none."""
    script = os.path.join(ROOT, "scripts", "gpu_moe_compile.py")
    base = [sys.executable, script, "--shape", "qwen3-moe-small", "--layers", "1",
            "--context", "16"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    # a variant: auto with XLA's GEMM autotuner off, its flag in the child's XLA_FLAGS
    proc = subprocess.run(base + ["--numerics", "auto-noautotune", "--out", str(tmp_path / "ok")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "ok" / "moe_compile.json").read_text())
    assert row["kernels"] == "portable" and row["stablehlo_lines"] > 100
    assert "--xla_gpu_autotune_level=0" in row["xla_flags"].split(), row["xla_flags"]
    assert all(row[k] > 0 for k in ("build_s", "lower_s", "compile_s", "second_run_ms")), row
    order = [proc.stdout.index(f"[auto-noautotune, 1 layers] {k}") for k in (
        "build_s", "lower_s", "compile_s", "first_run_s", "second_run_ms")]
    assert order == sorted(order)
    proc = subprocess.run(base + ["--numerics", "auto", "--out", str(tmp_path / "cut"),
                                  "--child-timeout", "0.5"],
                          capture_output=True, text=True, timeout=300, env=env)
    (row,) = json.loads((tmp_path / "cut" / "moe_compile.json").read_text())
    assert proc.returncode == 1 and row["error"] == "stopped after 0.5 s" and "build_s" not in row
    assert "| auto | 1 | - | - |" in (tmp_path / "cut" / "moe_compile.md").read_text()


def test_step_model_counts_the_llama_constants_and_a_moe_rows_experts():
    """The generic counts (common.step_model) give measures.py's Llama-3-8B constants (plus the
    norms' weights, which the constants leave out), and a MoE row's bytes are its fixed weights,
    one expert per routed (layer, expert) pair and its KV; a MoE row whose routing was not counted
    gets no percentage, nor does an MLA shape."""
    from jengine.bench.common import shape_config, step_model
    from jengine.bench.measures import hbm_percent, row_bytes

    llama = step_model(shape_config("llama3-8b")[0])
    norms = 32 * 2 * 4096 + 4096
    assert llama["fixed"] - norms == decode_bytes(0, 0, 128256) / 2
    assert llama["token_flop_params"] == 32 * LAYER_PARAMS and llama["expert"] == 0
    assert llama["kv_bytes_per_token"] * 3 * 5 == decode_bytes(3, 5, 0) - decode_bytes(0, 0, 0)
    assert step_model(shape_config("dsv3-small")[0]) is None
    moe = step_model(shape_config("qwen3-30b-a3b")[0])
    assert (moe["experts"], moe["moe_layers"], moe["expert"]) == (128, 48, 3 * 2048 * 768)
    r = {"shape": "qwen3-30b-a3b", "context": 1024, "step_model": moe,
         "experts_read": {"1": {"rows": 48 * 8}}}
    want = (moe["fixed"] + 48 * 8 * moe["expert"]) * 2 + 1024 * moe["kv_bytes_per_token"]
    assert row_bytes(1, 1024, r) == want
    assert hbm_percent(want / 1e12 * 1e3, 1, 1024, r, 1.0) == pytest.approx(100.0)
    assert row_bytes(64, 1024, r) is None  # no routing counted for that row
    assert row_bytes(1, 1024, {**r, "step_model": None}) is None


def test_latency_stats():
    # Two requests submitted at 0 and 1 s; the second's last event brings two tokens at once.
    stats = bench_e2e.latency_stats([0.0, 1.0], [[(0.5, 1), (0.75, 2)], [(1.25, 0), (2.0, 1),
                                                                          (3.0, 3)]])
    assert stats["ttft_p50_ms"] == pytest.approx(750.0)  # 500 and 1000 ms
    assert stats["itl_p50_ms"] == pytest.approx(500.0)  # 250, 500, 500 ms
    assert bench_e2e.latency_stats([0.0], [[]]) == {}


def test_compare_ratios_rows_of_both_runs():
    old = _synthetic()
    new = json.loads(json.dumps(old))
    new["model:auto"]["decode_ms"]["64"] = old["model:auto"]["decode_ms"]["64"] / 2
    new["engine:auto"]["output_tok_s"] *= 2
    rows = {k: r for k, _, _, r in compare_rows(new, old)}
    assert rows["model:auto/decode_ms/64"] == pytest.approx(0.5)
    assert rows["engine:auto/output_tok_s"] == pytest.approx(2.0)
    assert rows["model:auto/decode_ms/1"] == 1.0
    assert "engine:auto/requests" not in rows and "model:auto/context" not in rows  # settings
    md = render_comparison(new, old, "old.json")
    assert "| model:auto/decode_ms/64 |" in md and "| 0.500 | yes |" in md
    assert "| engine:auto/output_tok_s |" in md and "| 2.000 | yes |" in md
    assert "Other model shapes" not in md
    moe = json.loads(json.dumps(new))
    moe["model:auto"]["shape"] = "qwen3-30b-a3b"
    md = render_comparison(moe, old, "old.json")
    assert "**Other model shapes** in model:auto (qwen3-30b-a3b vs llama3-8b)" in md
    short = json.loads(json.dumps(moe))  # the same shape, cut by --layers: another model too
    short["model:auto"]["layers"] = 8
    md = render_comparison(short, moe, "old.json")
    assert ("**Other model shapes** in model:auto (qwen3-30b-a3b (8 of its 48 layers) vs "
            "qwen3-30b-a3b)") in md
    moe["model:auto"]["layers"] = 48  # the whole shape's count is no cut
    assert "Other model shapes" not in render_comparison(moe, json.loads(json.dumps(moe)), "o")


def _check_hf(r, md):
    if importlib.util.find_spec("transformers") is None:
        assert "not importable" in r["error"] and "not measured" in md
        return
    assert "error" not in r, r
    assert r["generated"] == 4 and r["cache"] in ("static", "dynamic (default)")
    assert r["generate_s"] > 0 and r["tok_s_with_prefill"] > 0
    assert "| 2 x (32 + 4) |" in md


def test_engine_and_hf_parts_small(tmp_path):
    proc, results, md = _bench_cli(tmp_path, ["auto"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_engine(results["engine:auto"])
    _check_server(results["server:auto"], md)
    _check_hf(results["hf"], md)
    assert "| `auto` | 4 x (32 + 8) |" in md
    assert "| host ms/step |" in md  # the loop-overhead row's host breakdown
    assert "## Targets (issue #19)" in md


@pytest.mark.slow
def test_engine_both_numerics_small(tmp_path):
    proc, results, md = _bench_cli(tmp_path, ["auto", "rl-bitwise"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for numerics in ("auto", "rl-bitwise"):
        _check_engine(results[f"engine:{numerics}"])
    assert "rl-bitwise / auto wall time:" in md


def test_render_a_partial_leaves_sweep():
    """--leaf-shapes: per-GEMM rows only (no whole-step sum); the table still renders."""
    run = {"versions": {"date": "2026-11-30T19:00"}, "command": "jengine bench --parts leaves",
           "leaves": {"per_gemm_us": {"down_proj N=4096 K=14336": {
               "auto (XLA dot)": {"1": 40.0, "4096": 714.0},
               "rl-bitwise (Triton fixed tile)": {"1": 47.0, "4096": 1405.0}}},
               "tiles": {"down_proj N=4096 K=14336": "BM64xBN64xBK128 g8 w4 s6 k4"},
               "step_gemm_us": {}}}
    md = render(run)
    assert ("| down_proj N=4096 K=14336 [BM64xBN64xBK128 g8 w4 s6 k4] | rl-bitwise (Triton fixed "
            "tile) | 47.0 | 1405.0 |") in md
    assert "GEMM share of one step" not in md
