"""Bisect a DeepSeek-V3 teacher-forcing mismatch by hand: the trainer (HF under trainer mode) and
the engine's own forward over one sequence, state by state, layer by layer.

    python3 scripts/gpu_bisect_mla.py --out DIR [--seq 2] [--smoke]     (gpu_run.sh: bisect_mla)

interop/bisect.py names a dense GQA layer's ops only; this covers an MLA + MoE layer with the
states that have a clear counterpart on both sides: every RMSNorm's input (the residual stream
entering each layer and its post-attention norm, the q_a / kv_a latents), the router's f32 logits,
its expert ids and weights, and o_proj's output. It builds the checkpoint and sequences of
scripts/gpu_acceptance.py's deepseek_v3 case, runs the engine's forward over the whole sequence
at once (`ModelRunner.forward_sequence`, instrumented; no chunking, no paging beyond one table).
Prints, per state, the rows that differ and the first of them: if none differs while the
alignment of the same sequence fails, the difference is in how the engine chunks or pages it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_acceptance as acc  # noqa: E402


def trainer_states(model, ids, device) -> dict:
    """Trainer-mode forward with hooks: norm inputs, router outputs, o_proj outputs."""
    import torch

    from interop import trainer_mode

    t = len(ids)
    states, handles = {}, []

    def keep(name, x):
        states.setdefault(name, x.detach().float().cpu().numpy().reshape(t, -1))

    for name, mod in model.model.named_modules():
        if name.endswith("layernorm") or name == "norm":
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, name=name: keep(name, a[0])))
        elif name.endswith("mlp.gate"):
            def router(m, a, out, name=name):
                logits, weights, ids_ = out
                keep(name + ".logits", logits)
                keep(name + ".weights", weights.float())
                keep(name + ".ids", ids_.float())
            handles.append(mod.register_forward_hook(router))
        elif name.endswith("self_attn.o_proj"):
            handles.append(mod.register_forward_hook(lambda m, a, o, name=name: keep(name, o)))
    from interop import trainer_mla

    original = trainer_mla.twin_mla_attention

    def attention(table, query, latent, **kw):  # the first call is layer 0's
        out = original(table, query, latent, **kw)
        for name, x in (("query", query), ("latent", latent), ("out_latent", out)):
            keep("layers.0.self_attn." + name, x)
        return out

    trainer_mla.twin_mla_attention = attention
    attn0 = model.model.layers[0].self_attn
    handles.append(attn0.q_b_proj.register_forward_hook(
        lambda m, a, o: keep("layers.0.self_attn.q_b_proj", o)))
    handles.append(attn0.o_proj.register_forward_hook(
        lambda m, a, o: keep("layers.0.self_attn.o_proj.input", a[0])))
    mode = trainer_mode.enable(model, device=device)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device), use_cache=False).logits[0]
    finally:
        trainer_mode.disable()
        trainer_mla.twin_mla_attention = original
        for h in handles:
            h.remove()
    print(mode.summary(), flush=True)
    return states, logits


def engine_states(runner, ids) -> dict:
    """The engine's forward over the whole sequence with its kernel plans recorded."""
    import numpy as np

    t = len(ids)

    def instrument(model):
        log = {}
        names = {id(v): p.removesuffix(".weight") for p, v in model.named_parameters().items()}
        moe_layers = [p.split(".")[1] for p in names.values() if p.endswith("mlp.gate")]
        routed = iter(moe_layers)

        class Rec:
            def __init__(self, plan, kind):
                self.plan, self.kind = plan, kind

            def __call__(self, *a, **k):
                out = self.plan(*a, **k)
                name = names.get(id(a[1]), "") if len(a) > 1 else ""
                if self.kind == "rmsnorm":
                    log.setdefault(name, a[0])
                elif self.kind == "router_gemm":
                    log.setdefault(name + ".logits", out)
                elif self.kind == "router_grouped_topk":
                    layer = next(routed)
                    log[f"layers.{layer}.mlp.gate.ids"] = out[0].astype("float32")
                    log[f"layers.{layer}.mlp.gate.weights"] = out[1]
                elif self.kind == "gemm" and name.endswith("self_attn.o_proj"):
                    log.setdefault(name, out)
                    log.setdefault(name + ".input", a[0])
                elif self.kind == "gemm" and name == "layers.0.self_attn.q_b_proj":
                    log.setdefault(name, out)
                elif self.kind == "mla_attention" and "layers.0.self_attn.query" not in log:
                    q, pages, tables = a[0], a[1], a[2]
                    log["layers.0.self_attn.query"] = q
                    log["layers.0.self_attn.latent"] = pages[tables[0]].reshape(-1, pages.shape[-1])[:t]
                    log["layers.0.self_attn.out_latent"] = out
                return out

        kern = model.kernels
        wanted = ("rmsnorm", "router_gemm", "router_grouped_topk", "gemm", "mla_attention")
        model.kernels = dataclasses.replace(kern, **{
            f.name: Rec(getattr(kern, f.name), f.name)
            for f in dataclasses.fields(kern) if f.name in wanted})
        return lambda: log

    _, states = runner.forward_sequence(ids, instrument=instrument)
    return {k: np.asarray(v, np.float32).reshape(t, -1) for k, v in states.items()}


def compare(trainer: dict, engine: dict) -> list[dict]:
    import numpy as np

    rows = []
    for name, b in trainer.items():
        a = engine.get(name)
        if a is None:
            rows.append(dict(state=name, note="no engine state"))
            continue
        if a.shape != b.shape:
            rows.append(dict(state=name, note=f"shapes {a.shape} vs {b.shape}"))
            continue
        d = (a.view(np.uint32) != b.view(np.uint32)).any(axis=1)
        first = int(np.argmax(d)) if d.any() else -1
        rows.append(dict(state=name, rows_differ=int(d.sum()), first_row=first,
                         cols_differ_in_first=int((a[first].view(np.uint32) !=
                                                   b[first].view(np.uint32)).sum()) if d.any()
                         else 0))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/bisect_mla")
    p.add_argument("--seq", type=int, default=2, help="which of the case's sequences")
    p.add_argument("--smoke", action="store_true", help="CPU, the acceptance's smoke widths")
    args = p.parse_args(argv)
    case = "deepseek_v3"
    if args.smoke:
        acc.DEVICE = "cpu"
        acc.WIDTHS.update({k: v for k, v in acc.SMOKE.items() if k in acc.WIDTHS})
        acc.CASES[case][1].update({k: v for k, v in acc.SMOKE.items() if k in acc.CASES[case][1]})
        acc.LENGTHS[case] = (64, 1100, 2048)
    from interop import trainer_mode

    trainer_mode.ensure_xla_environment()
    from jengine.engine.engine import Engine

    t0 = time.time()
    arch, dims = acc.CASES[case]
    model = acc.build_model(Path(args.work) / case, arch, dims, seed=len(case))
    ids = acc.sequences(Path(args.work) / case, case, dims["vocab_size"], 4096,
                        seed=len(case))[args.seq][0]
    print(f"checkpoint and {len(ids)} tokens at {time.time() - t0:.0f} s", flush=True)
    trainer, logits = trainer_states(model, ids, acc.DEVICE)
    del model, logits
    print(f"trainer states at {time.time() - t0:.0f} s", flush=True)
    eng = Engine(model_path=str(Path(args.work) / case), numerics="rl-bitwise", skip_warmup=True,
                 max_total_tokens=3 * 8192, chunked_prefill_size=1024, max_prefill_tokens=2048,
                 input_logprob_chunk_tokens=256)
    try:
        engine = engine_states(eng.runner, ids)
    finally:
        eng.shutdown()
    rows = compare(trainer, engine)
    summary = {"tokens": len(ids), "states": rows,
               "first_differing": next((r for r in rows if r.get("rows_differ")), None)}
    for r in rows:
        print(r, flush=True)
    print({k: v for k, v in summary.items() if k != "states"}, flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bisect_mla.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
