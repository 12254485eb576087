"""Bisect an MLA + MoE teacher-forcing mismatch by hand: the trainer (HF under trainer mode) and the
engine's own forward over one sequence, state by state, layer by layer.

    python3 scripts/gpu_bisect_mla.py --out DIR [--case deepseek_v3|longcat] [--seq 2] [--smoke]
                                      [--perturb STATE:ROW]
    (gpu_run.sh: bisect_mla, bisect_longcat = --case longcat)

interop/bisect.py names a dense GQA layer's ops only; this covers DeepSeek-V3's and LongCat-Flash's
layers with the states that have a clear counterpart on both sides, named as the engine's
parameters are (HF's LongCat router `mlp.router` is the engine's `mlp.gate`):

  every RMSNorm's input     the residual stream entering each block (`input_layernorm[.j]`,
                            `post_attention_layernorm[.j]`, the final `norm`) and the q_a / kv_a
                            latents (`self_attn[.j].q_a_layernorm`, `.kv_a_layernorm`)
  <block>.input             what each attention block, dense MLP (`mlp`, `mlps.j`, DeepSeek's
                            `mlp.shared_experts`) and MoE (`mlp`, LongCat's shortcut) reads
  <block>.query / .latent / .out_latent   each absorbed-MLA leaf call's operands and output
  q_b_proj, o_proj, down_proj              those GEMMs' outputs (o_proj's input too)
  mlp.gate.logits / .ids / .weights        the router's f32 logits, expert ids (LongCat's zero
                            experts included, as ids >= n_routed_experts) and f32 weights
  mlp.experts               the routed experts' slot-order sum (before DeepSeek's shared expert)

It builds the checkpoint and sequences of scripts/gpu_acceptance.py's case and runs the engine's
forward over the whole sequence at once (`ModelRunner.forward_sequence`, instrumented; no chunking,
no paging beyond one table). Prints, per state in the trainer's execution order, the rows that
differ and the first of them: if none differs while the alignment of the same sequence fails, the
difference is in how the engine chunks or pages it.

--perturb STATE:ROW, the negative control: after the plain bisect, the engine runs again with
column 0 of row ROW of the RMSNorm input STATE one ulp further from zero (engine side only); it must
name STATE and ROW as the first difference, every state before it equal (exit 1 otherwise).
E.g. `--case longcat --smoke --seq 0 --perturb layers.1.input_layernorm.1:40`, what
tests/test_bisect_mla.py runs (-m slow).
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

CASES = ("deepseek_v3", "longcat")


def canonical(hf_name: str) -> str:
    """An HF module path (under `model.`) as the engine names it."""
    return hf_name[:-len("router")] + "gate" if hf_name.endswith("mlp.router") else hf_name


def trainer_states(model, ids, device) -> tuple[dict, object]:
    """Trainer-mode forward with hooks: ({state: f32 [T, -1]} in execution order, logits)."""
    import torch

    from interop import trainer_mla, trainer_mode, trainer_moe

    t = len(ids)
    states, handles = {}, []
    blocks = [canonical(n) for n, m in model.model.named_modules()  # in call order
              if type(m).__name__ in trainer_mla.MLA_ATTENTION_MODULES]
    router = {"name": None}

    def keep(name, x):
        states.setdefault(name, x.detach().float().cpu().numpy().reshape(t, -1))

    def keep_input(name):
        def hook(m, args, kwargs):
            keep(name, args[0] if args else kwargs["hidden_states"])
        return hook

    routers = trainer_moe.GROUPED_ROUTERS + trainer_moe.SOFTMAX_BIAS_ROUTERS
    for hf_name, mod in model.model.named_modules():
        name, kind = canonical(hf_name), type(mod).__name__
        if kind.endswith("RMSNorm"):
            handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: keep(name, a[0])))
        elif kind in trainer_mla.MLA_ATTENTION_MODULES or kind.endswith(("MLP", "MoE")):
            handles.append(mod.register_forward_pre_hook(keep_input(name + ".input"),
                                                         with_kwargs=True))
            if kind in trainer_moe.ZERO_EXPERT_BLOCKS:
                # trainer mode's forward of this block calls the expert path itself, not its
                # experts module (whose hook below then never runs): the block's output is that
                # path's slot-order sum, zero experts included
                handles.append(mod.register_forward_hook(
                    lambda m, a, o, name=name: keep(name + ".experts", o)))
        elif kind in routers:  # the twin below records under this name
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, name=name: router.update(name=name)))
        elif kind in trainer_moe.SLOT_ORDER_EXPERTS:
            handles.append(mod.register_forward_hook(lambda m, a, o, name=name: keep(name, o)))
        elif hf_name.endswith(("q_b_proj", "o_proj", "down_proj")):
            handles.append(mod.register_forward_hook(lambda m, a, o, name=name: keep(name, o)))
            if hf_name.endswith("o_proj"):
                handles.append(mod.register_forward_pre_hook(
                    lambda m, a, name=name: keep(name + ".input", a[0])))

    # The twins see what the modules' outputs do not show (on every transformers version: 5.17's
    # LongCat router returns no logits): the MLA leaf's operands, the router's logits.
    mla_original = trainer_mla.twin_mla_attention
    route_original = trainer_moe.twin_router_grouped_topk
    calls = iter(blocks)

    def attention(table, query, latent, **kw):
        out = mla_original(table, query, latent, **kw)
        block = next(calls)
        for name, x in (("query", query), ("latent", latent), ("out_latent", out)):
            keep(f"{block}.{name}", x)
        return out

    def route(twin, logits, bias, **static):
        ids_, weights = route_original(twin, logits, bias, **static)
        keep(router["name"] + ".logits", logits)
        keep(router["name"] + ".ids", ids_)
        keep(router["name"] + ".weights", weights)
        return ids_, weights

    trainer_mla.twin_mla_attention, trainer_moe.twin_router_grouped_topk = attention, route
    mode = trainer_mode.enable(model, device=device)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device), use_cache=False).logits[0]
    finally:
        trainer_mode.disable()
        trainer_mla.twin_mla_attention, trainer_moe.twin_router_grouped_topk = \
            mla_original, route_original
        for h in handles:
            h.remove()
    print(mode.summary(), flush=True)
    return states, logits


def _one_ulp_up(x, row: int):
    """x with x[row, 0] moved one ulp away from zero (its bits + 1)."""
    import jax
    import jax.numpy as jnp

    uint = {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x[row, 0], uint) + uint(1)
    return x.at[row, 0].set(jax.lax.bitcast_convert_type(bits, x.dtype))


def engine_states(runner, ids, perturb: tuple[str, int] | None = None) -> dict:
    """The engine's forward over the whole sequence with its kernel plans (and its MoE blocks'
    expert combine) recorded, named as `trainer_states` names them. perturb: (an RMSNorm input's
    state, row) to move by one ulp before that norm runs."""
    import numpy as np

    t = len(ids)
    norms = set()

    def instrument(model):
        log = {}
        names = {id(v): p.removesuffix(".weight") for p, v in model.named_parameters().items()}
        blocks = iter([p.removesuffix(".kv_b_proj") for p in names.values()
                       if p.endswith("kv_b_proj")])  # the MLA blocks, in call order
        routed = iter(p.removesuffix(".gate") for p in names.values() if p.endswith("mlp.gate"))
        moe = {"name": None}

        class Rec:
            def __init__(self, plan, kind):
                self.plan, self.kind = plan, kind

            def __call__(self, *a, **k):
                if self.kind == "add_rmsnorm":
                    return self.boundary(*a, **k)
                weight = a[1][0] if self.kind == "gemm_group" else a[1] if len(a) > 1 else None
                name = names.get(id(weight), "")
                if self.kind == "rmsnorm" and perturb is not None and name == perturb[0]:
                    a = (_one_ulp_up(a[0], perturb[1]),) + a[1:]
                out = self.plan(*a, **k)
                if self.kind == "rmsnorm":
                    norms.add(name)
                    log.setdefault(name, a[0])
                elif self.kind == "gemm_group":  # an MLA block's q_a / kv_a, an MLP's gate / up
                    log.setdefault(name.rsplit(".", 1)[0] + ".input", a[0])
                elif self.kind == "router_gemm":  # its weight is cast first: named by order
                    moe["name"] = next(routed)
                    log[moe["name"] + ".input"] = a[0]
                    log[moe["name"] + ".gate.logits"] = out
                elif self.kind == "router_grouped_topk":
                    log[moe["name"] + ".gate.ids"] = out[0].astype("float32")
                    log[moe["name"] + ".gate.weights"] = out[1]
                elif self.kind == "gemm" and name.endswith(("q_b_proj", "o_proj", "down_proj")):
                    log.setdefault(name, out)
                    if name.endswith("o_proj"):
                        log.setdefault(name + ".input", a[0])
                elif self.kind == "mla_attention":
                    q, pages, tables = a[0], a[1], a[2]
                    block = next(blocks)
                    log[block + ".query"] = q
                    log[block + ".latent"] = pages[tables[0]].reshape(-1, pages.shape[-1])[:t]
                    log[block + ".out_latent"] = out
                return out

            def boundary(self, x, residual, weight, **k):
                """A layer boundary's norm (its input the residual sum, which the leaf returns
                beside the norm): the sum is that norm's input state. Perturbed, only the norm
                reads the moved sum (the plain rmsnorm leaf on it: the rounded-sum boundary's
                bits), as a perturbed plain norm's input leaves the residual stream as it was."""
                name = names.get(id(weight), "")
                normed, total = self.plan(x, residual, weight, **k)
                state = total
                if perturb is not None and name == perturb[0]:
                    state = _one_ulp_up(total, perturb[1])
                    normed = kern.rmsnorm(state, weight, eps=k["eps"])
                norms.add(name)
                log.setdefault(name, state)
                return normed, total

        def record_combine(mod, name):
            combine = mod.combine

            def wrapped(*a, **k):
                out = combine(*a, **k)
                log.setdefault(name + ".experts", out)
                return out

            mod.combine = wrapped

        for i, layer in enumerate(model.layers):
            if hasattr(layer.mlp, "combine"):
                record_combine(layer.mlp, f"layers.{i}.mlp")
        kern = model.kernels
        wanted = ("rmsnorm", "add_rmsnorm", "router_gemm", "router_grouped_topk", "gemm",
                  "gemm_group", "mla_attention")
        model.kernels = dataclasses.replace(kern, **{
            f.name: Rec(getattr(kern, f.name), f.name)
            for f in dataclasses.fields(kern) if f.name in wanted})
        return lambda: log

    _, states = runner.forward_sequence(ids, instrument=instrument)
    if perturb is not None and perturb[0] not in norms:
        raise ValueError(f"--perturb {perturb[0]!r} is not an RMSNorm input state of this model "
                         f"(one of {sorted(norms)[:4]} ...)")
    return {k: np.asarray(v, np.float32).reshape(t, -1) for k, v in states.items()}


def compare(trainer: dict, engine: dict) -> list[dict]:
    """Per trainer state, in its order: the rows whose float bits differ, the first of them and
    how many of its columns differ."""
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


def summarize(rows: list[dict], tokens: int) -> dict:
    return {"tokens": tokens, "states": rows,
            "all_equal": all(r.get("rows_differ") == 0 for r in rows),
            "first_differing": next((r for r in rows if r.get("rows_differ")), None)}


def control_verdict(rows: list[dict], state: str, row: int) -> str | None:
    """None when the perturbed STATE is the first difference, at ROW, and every state before it
    has an engine counterpart; else what went wrong."""
    for r in rows:
        if r["state"] == state:
            if r.get("first_row") != row:
                return f"{state}: first differing row {r.get('first_row')}, perturbed row {row}"
            return None
        if r.get("rows_differ", 1):
            return f"{r['state']} differs or is missing before the perturbed {state}: {r}"
    return f"{state} is not among the trainer's states"


def setup(case: str, smoke: bool) -> None:
    """The acceptance case's widths (--smoke: its CPU widths) and the sequence lengths."""
    if smoke:
        acc.DEVICE = "cpu"
        acc.WIDTHS.update({k: v for k, v in acc.SMOKE.items() if k in acc.WIDTHS})
        dims = acc.CASES[case][1]
        dims.update({k: v for k, v in acc.SMOKE.items() if k in dims})
        acc.LENGTHS[case] = (64, 1100, 2048)  # the production lengths at the smoke widths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--case", default="deepseek_v3", choices=CASES)
    p.add_argument("--work", default="/tmp/bisect_mla")
    p.add_argument("--seq", type=int, default=2, help="which of the case's sequences (64, 1100, "
                   "2048 tokens)")
    p.add_argument("--smoke", action="store_true", help="CPU, the acceptance's smoke widths")
    p.add_argument("--perturb", metavar="STATE:ROW", help="the negative control (module docstring)")
    args = p.parse_args(argv)
    case = args.case
    perturb = None
    if args.perturb:
        state, _, row = args.perturb.rpartition(":")
        if not state or not row.isdigit():
            p.error(f"--perturb {args.perturb!r}: expected STATE:ROW, e.g. "
                    "layers.1.input_layernorm.1:40")
        perturb = (state, int(row))
    setup(case, args.smoke)
    from interop import trainer_mode

    trainer_mode.ensure_xla_environment()
    from jengine.engine.engine import Engine

    t0 = time.time()
    arch, dims = acc.CASES[case]
    work = Path(args.work) / case
    model = acc.build_model(work, arch, dims, seed=len(case))
    ids = acc.sequences(work, case, dims["vocab_size"], 4096, seed=len(case))[args.seq][0]
    if perturb is not None and not 0 <= perturb[1] < len(ids):
        p.error(f"--perturb row {perturb[1]} is outside the {len(ids)}-token sequence")
    print(f"{case}: checkpoint and {len(ids)} tokens at {time.time() - t0:.0f} s", flush=True)
    trainer, logits = trainer_states(model, ids, acc.DEVICE)
    del model, logits
    print(f"trainer states at {time.time() - t0:.0f} s", flush=True)
    eng = Engine(model_path=str(work), numerics="rl-bitwise", skip_warmup=True,
                 max_total_tokens=3 * 8192, chunked_prefill_size=1024, max_prefill_tokens=2048,
                 input_logprob_chunk_tokens=256)
    try:
        rows = compare(trainer, engine_states(eng.runner, ids))
        summary = {"case": case, **summarize(rows, len(ids))}
        for r in rows:
            print(r, flush=True)
        print({k: v for k, v in summary.items() if k != "states"}, flush=True)
        ok = True
        if perturb is not None:
            control = summarize(compare(trainer, engine_states(eng.runner, ids, perturb)), len(ids))
            failure = control_verdict(control["states"], *perturb)
            ok = failure is None
            summary["control"] = {"perturbed": args.perturb, "named": ok, "failure": failure,
                                  "first_differing": control["first_differing"]}
            print(f"negative control (engine {perturb[0]} row {perturb[1]} moved one ulp): "
                  f"{'PASS, the bisect names it' if ok else 'FAIL: ' + failure}; first differing "
                  f"{control['first_differing']}", flush=True)
    finally:
        eng.shutdown()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"bisect_{case}.json").write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
