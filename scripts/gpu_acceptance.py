"""Trainer alignment at production widths on the GPU: the acceptance step of docs/gpu-validation.md.

    python3 scripts/gpu_acceptance.py --out DIR [--cases llama ... qwen3moe] [--max-len 4096]
    python3 scripts/gpu_acceptance.py --out DIR --smoke   # the plumbing on a CPU: small widths
    python3 scripts/gpu_acceptance.py --out DIR --small --cases qwen3moe   # --small = --smoke

(scripts/gpu_run.sh step `acceptance` installs the carried jax-triton wheel and runs it.)

Per case, a random HF checkpoint in bf16 (every >= 2-D weight ~ N(0, 0.02), norms 1), 2 layers,
hidden 4096, 32 query / 8 KV heads, head_dim 128, the real vocabularies:

  llama    LlamaForCausalLM, intermediate 14336, rope_theta 5e5, vocab 128256
  llama31  the same with Llama-3.1 rope scaling (llama3: factor 8, low 1, high 4, original 8192)
  qwen3    Qwen3ForCausalLM (q/k norm), intermediate 12288, vocab 151936
  qwen2    Qwen2ForCausalLM (q/k/v bias), intermediate 18944, vocab 152064
  qwen3moe Qwen3MoeForCausalLM at Qwen3-30B-A3B's widths: hidden 2048, 32 query / 4 KV heads,
           64 experts, top-8 (norm_topk_prob), moe_intermediate_size 768, vocab 151936;
           both layers sparse. The trainer's experts run under trainer mode's expert path.
  deepseek_v3 DeepseekV3ForCausalLM at DeepSeek widths: hidden 2048, 16 heads, q_lora 1536,
           kv_lora 512, qk_rope 64 (interleaved, YaRN factor 4 / mscale_all_dim 1), qk_nope 128,
           v_head 128, vocab 129280; layer 0 dense, layer 1 DeepSeek-MoE: 64 experts in 8 groups,
           4 groups kept, top-8 (norm_topk_prob, routed_scaling_factor 2.5), one shared expert,
           moe_intermediate_size 1024, a random e_score_correction_bias ~ N(0, 0.05^2) (HF's
           init is zeros). The trainer's attention runs the absorbed MLA, its router and experts
           the grouped router's twin and the slot-order expert path under trainer mode
           (interop/trainer_mla.py, interop/trainer_moe.py).
  longcat  LongcatFlashForCausalLM at LongCat-Flash's attention widths, scaled down: hidden 2048,
           16 heads, q_lora 1536, kv_lora 512, qk_rope 64, qk_nope 128, v_head 128, 2 layers (each
           two MLA blocks, two dense MLPs of 6144 and a shortcut MoE), 64 real + 32 zero (identity)
           experts, top-12, expert width 1024, routed_scaling_factor 6, vocab 131072, HF's runtime
           LoRA scales; a random correction bias. The model is reloaded with `from_pretrained`
           (bf16), so the trainer holds what HF's loader gives (its router stays bf16).

Sequences: random ids of 7, 64, 333, 1000 and --max-len tokens, and a chat-template conversation;
for qwen3moe only random ids of 1100 and 2048 tokens, for deepseek_v3 64, 1100 and 2048 (`LENGTHS`:
the step stays under 5 minutes).
The trainer is HF transformers' own forward on CUDA under trainer mode (the Triton twins); its
logprobs are written in all four forms the engine offers (neg-ce / direct x 32768 / 16384 blocks).
The engine (one rl-bitwise Engine per case; the sampler is re-planned per logprob order, which
changes no step program) teacher-forces every sequence and runs both self-consistency checks.
Negative control per case: the same forward without trainer mode (stock torch) must MISMATCH.

Writes DIR/acceptance.md (the table for docs/gpu-validation.md) and DIR/acceptance.json; exit 0 only
if every variant of every case matches and every negative control mismatches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTHS = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              num_hidden_layers=2, max_position_embeddings=16384, rms_norm_eps=1e-5)
CASES = {
    "llama": ("LlamaForCausalLM", dict(intermediate_size=14336, vocab_size=128256,
                                       rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                       tie_word_embeddings=False)),
    "llama31": ("LlamaForCausalLM", dict(intermediate_size=14336, vocab_size=128256,
                                         tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                          "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192})),
    "qwen3": ("Qwen3ForCausalLM", dict(intermediate_size=12288, vocab_size=151936,
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("Qwen2ForCausalLM", dict(intermediate_size=18944, vocab_size=152064,
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3moe": ("Qwen3MoeForCausalLM", dict(hidden_size=2048, num_key_value_heads=4,
                                             num_experts=64, num_experts_per_tok=8,
                                             moe_intermediate_size=768, norm_topk_prob=True,
                                             intermediate_size=6144, vocab_size=151936,
                                             tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "default",
                                                              "rope_theta": 1e6})),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        hidden_size=2048, num_attention_heads=16, intermediate_size=10944, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=8, n_group=8,
        topk_group=4, n_shared_experts=1, moe_intermediate_size=1024, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_interleave=True, vocab_size=129280,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1})),
    "longcat": ("LongcatFlashForCausalLM", dict(
        hidden_size=2048, num_attention_heads=16, ffn_hidden_size=6144, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=64, zero_expert_num=32, moe_topk=12, expert_ffn_hidden_size=1024,
        routed_scaling_factor=6.0, vocab_size=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0})),
}
# Per case, its sequences' lengths where they are not the dense default (7, 64, 333, 1000, --max-len
# and the chat). The engine runs every expert on every row (E/k = 8x the routed FLOPs) and the
# trainer loops over the experts: two sequences past 1k tokens, no chat, keep the step short.
LENGTHS = {"qwen3moe": (1100, 2048), "deepseek_v3": (64, 1100, 2048), "longcat": (64, 1100, 2048)}
# --smoke / --small: CPU widths, one vocabulary block, short sequences; every case takes the
# fields it has.
SMOKE = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=512,
             num_experts=16, n_routed_experts=16, moe_intermediate_size=64, vocab_size=32768, q_lora_rank=96,
             kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
             ffn_hidden_size=512, expert_ffn_hidden_size=64, zero_expert_num=8)
SMOKE_LENGTHS = {"qwen3moe": (37, 70), "deepseek_v3": (37, 70), "longcat": (37, 70)}
VARIANTS = [("neg-ce", 32768), ("direct", 32768), ("neg-ce", 16384), ("direct", 16384)]
CHAT = [{"role": "system", "content": "You are a numerical analyst."},
        {"role": "user", "content": " ".join(f"Question {i}: why is the fp32 fold of block partials "
                                             "done left to right?" for i in range(30))},
        {"role": "assistant", "content": " ".join(f"Answer {i}: so the order never depends on the "
                                                  "batch or on the shard count." for i in range(30))}]


DEVICE = "cuda"


def hf_fields(arch: str, dims: dict) -> dict:
    """The HF config's keyword arguments of a case: the shared widths, the case's own, renamed
    where a family names them differently."""
    fields = {**WIDTHS, **dims}
    if arch == "DeepseekV3ForCausalLM":  # MLA: every head reads the latent; head_dim = rope dim
        fields["num_key_value_heads"] = fields["num_attention_heads"]
        del fields["head_dim"]
    if arch == "LongcatFlashForCausalLM":  # its own names; head_dim = the rope dim
        del fields["num_key_value_heads"]
        fields["num_layers"] = fields.pop("num_hidden_layers")
        fields["head_dim"] = fields["qk_rope_head_dim"]
    return fields


def build_model(directory: Path, arch: str, dims: dict, seed: int):
    """The checkpoint on disk and the same model on the GPU (bf16)."""
    import torch
    import transformers

    from interop.testing import write_tiny_tokenizer
    from jengine.models import tiny

    directory.mkdir(parents=True, exist_ok=True)
    special = write_tiny_tokenizer(directory)
    fields = hf_fields(arch, dims)
    longcat = arch == "LongcatFlashForCausalLM"
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        **fields, eos_token_id=special[tiny.IM_END],
        pad_token_id=special[tiny.ENDOFTEXT],
        bos_token_id=None, architectures=[arch], dtype="bfloat16",
        **({"attention_bias": False} if arch != "Qwen2ForCausalLM" else {}))
    with torch.device(DEVICE):
        model = getattr(transformers, arch)(cfg).to(torch.bfloat16)
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    for router in routers if not longcat else ():  # f32, as HF's from_pretrained keeps DeepSeek's
        router.float()  # (_keep_in_fp32_modules_strict); LongCat's list is not strict: bf16
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # biases
                p.normal_(0.0, 0.02, generator=g)
        for router in routers:  # a buffer, zeros in HF's init: the bias's role would go untested
            router.e_score_correction_bias.normal_(0.0, 0.05, generator=g)
    model.save_pretrained(directory)
    if longcat:  # what HF's loader gives a trainer, whatever the in-memory model held
        del model
        model = getattr(transformers, arch).from_pretrained(directory,
                                                            dtype=torch.bfloat16).to(DEVICE)
    return model.eval()


def sequences(directory: Path, case: str, vocab: int, max_len: int,
              seed: int) -> list[tuple[list[int], int | None]]:
    import numpy as np

    from interop.trainer_dump import parse_input_line
    from jengine.models.tokenizer import Tokenizer

    rng = np.random.default_rng(seed)
    if case in LENGTHS:
        return [(rng.integers(0, vocab, n).tolist(), None) for n in LENGTHS[case]]
    out = [(rng.integers(0, vocab, n).tolist(), None) for n in (7, 64, 333, 1000, max_len)]
    chat = parse_input_line({"messages": CHAT}, "chat", Tokenizer.from_dir(directory))
    return out + [(chat.ids, chat.prompt_len)]


def trainer_records(model, seqs, *, stock: bool) -> dict:
    """{(form, block): [dump records]} from one forward per sequence."""
    import contextlib

    import torch

    from interop import trainer_mode
    from interop.states import capture_hf_states
    from interop.twins import plan_twin_table
    from interop.trainer_logprobs import token_logprobs

    variants = VARIANTS[:1] if stock else VARIANTS
    records = {v: [] for v in variants}
    mode = None if stock else trainer_mode.enable(model, device=DEVICE)
    table = plan_twin_table(DEVICE)
    # Named states (interop/states.py) name a dense GQA layer's ops; a MoE layer and an MLA
    # attention have none of them.
    moe = getattr(model.config, "num_experts", 0) > 0
    mla = getattr(model.config, "kv_lora_rank", None) is not None
    unnamed = moe or mla
    try:
        for ids, prompt_len in seqs:
            t = torch.tensor(ids, dtype=torch.long, device=DEVICE)[None]
            with torch.no_grad():
                # Named states of the first 64 positions, for --bisect should a sequence mismatch.
                capture = (contextlib.nullcontext({}) if unnamed
                           else capture_hf_states(model, min(64, len(ids))))
                with capture as states:
                    logits = model(t, use_cache=False).logits[0]
                for form, block in variants:
                    lp = token_logprobs(logits[:-1], t[0, 1:], form=form, block_size=block, table=table)
                    rec = {"ids": t[0].cpu(), "logprob": lp.float().cpu(),
                           "layout": f"TP1 bf16 {DEVICE} {'stock-torch' if stock else 'trainer-mode'}",
                           "commit": "scripts/gpu_acceptance.py"}
                    if prompt_len:
                        rec["prompt_len"] = prompt_len
                    if not stock and states:
                        rec["states"] = dict(states)
                    records[(form, block)].append(rec)
            del logits
    finally:
        if mode is not None:
            summary = mode.summary()
            trainer_mode.disable()
            print(summary, flush=True)
            if mode.fallbacks:
                raise RuntimeError(f"trainer mode fell back to torch kernels: {summary}")
    # Unrouted experts would run HF's grouped_mm, which trainer mode does not count as a fallback.
    if mode is not None and moe and not mode.routed["moe_experts"]:
        raise RuntimeError(f"trainer mode did not route the MoE experts: {summary}")
    # Unrouted MLA would run HF's expanded attention: other arithmetic, no fallback counted.
    if mode is not None and mla and not mode.routed["mla_attention"]:
        raise RuntimeError(f"trainer mode did not route the MLA attention: {summary}")
    return records


def rope_finding(case: str, arch: str, dims: dict) -> str:
    """How far the old XLA-on-GPU frequencies were from torch's (the cause found for this issue)."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from interop import trainer_mode
    from jengine.models.layers.rope import inv_freq_and_scaling

    rope = dims["rope_parameters"]
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**hf_fields(arch, dims))
    dim = cfg.head_dim
    with trainer_mode.enable(device=DEVICE):  # HF's own function on CUDA, pow routed to XLA's
        if rope["rope_type"] == "default":
            exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=DEVICE).float() / dim
            hf = 1.0 / (rope["rope_theta"] ** exponent)
        else:
            hf, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, device=DEVICE)
    hf = hf.cpu().numpy()
    ours, _ = inv_freq_and_scaling(dim, rope["rope_theta"], None if rope["rope_type"] == "default"
                                   else {k: v for k, v in rope.items() if k != "rope_theta"},
                                   WIDTHS["max_position_embeddings"],
                                   frequency_device="device")
    exponent = jnp.arange(0, dim, 2, dtype=jnp.int32).astype(jnp.float32) / jnp.float32(dim)
    old = np.asarray(jnp.float32(1.0) / (jnp.float32(rope["rope_theta"]) ** exponent))
    diff = lambda a, b: int((a.view(np.uint32) != b.view(np.uint32)).sum())  # noqa: E731
    return (f"{case}: inv_freq, HF on CUDA (pow routed) vs engine: {diff(hf, ours)} of "
            f"{dim // 2} differ; "
            f"the default frequencies with XLA's GPU division (the old engine) vs HF default: "
            f"{diff(old, hf) if rope['rope_type'] == 'default' else 'n/a'}")


def run_case(case: str, work: Path, max_len: int, lines: list[str]) -> dict:
    import torch

    from interop.align import run_alignment
    from jengine.engine.engine import Engine
    from jengine.engine.sampler import Sampler
    from interop.trainer_logprobs import logprob_order_for

    arch, dims = CASES[case]
    t0 = time.perf_counter()
    model = build_model(work / case, arch, dims, seed=len(case))
    seqs = sequences(work / case, case, dims["vocab_size"], max_len, seed=len(case))

    # Progress with elapsed seconds: a step killed by its time limit still says how far it got.
    def progress(what: str) -> None:
        print(f"{case}: {what} at {time.perf_counter() - t0:.0f} s", flush=True)

    progress(f"checkpoint written, sequences {[len(s) for s, _ in seqs]}")
    trainer = trainer_records(model, seqs, stock=False)
    progress("trainer-mode dump")
    stock = trainer_records(model, seqs, stock=True)[VARIANTS[0]]
    progress("stock-torch dump")
    finding = rope_finding(case, arch, dims)
    del model
    torch.cuda.empty_cache()
    result = {"case": case, "arch": arch, "lengths": [len(s) for s, _ in seqs], "variants": {},
              "rope": finding}
    eng = Engine(model_path=str(work / case), numerics="rl-bitwise", skip_warmup=True,
                 max_total_tokens=3 * 8192, chunked_prefill_size=1024, max_prefill_tokens=2048,
                 input_logprob_chunk_tokens=256)
    try:
        for form, block in VARIANTS:
            order = logprob_order_for(form, block)
            options = dataclasses.replace(eng.plan.sampler, logprob_order=order)
            eng.sampler = Sampler(options, dims["vocab_size"])  # the step programs are unchanged
            out: list[str] = []
            ok = run_alignment(eng, trainer[(form, block)], self_consistency=True, bisect=True,
                               out=out.append)
            result["variants"][order] = {"ok": ok, "report": out}
            progress(f"engine --logprob-order {order}: {'MATCH' if ok else 'FAIL'}")
            lines.append(f"### {case} {arch} --logprob-order {order}: {'PASS' if ok else 'FAIL'}")
            lines += [f"    {line}" for line in out]
        eng.sampler = Sampler(dataclasses.replace(eng.plan.sampler, logprob_order="blockwise"),
                              dims["vocab_size"])
        out = []
        ok = run_alignment(eng, stock, self_consistency=False, out=out.append)
        result["negative_control"] = {"mismatched": not ok, "report": out}
        lines.append(f"### {case} negative control (stock torch, must MISMATCH): "
                     f"{'PASS' if not ok else 'FAIL'}")
        lines += [f"    {line}" for line in out]
    finally:
        eng.shutdown()
    lines.append(f"    {finding}")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print("\n".join(lines[-3:]), flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--work", default="/tmp/acceptance")
    p.add_argument("--smoke", "--small", action="store_true", help="CPU, hidden 256 / 2 query "
                   "heads, 16 experts, vocab 32768, short MoE sequences: the script's plumbing and "
                   "the CPU alignment, no GPU evidence")
    args = p.parse_args(argv)
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        WIDTHS.update({k: v for k, v in SMOKE.items() if k in WIDTHS})
        for _, dims in CASES.values():
            dims.update({k: v for k, v in SMOKE.items() if k in dims})
        LENGTHS.update(SMOKE_LENGTHS)
    from interop import trainer_mode

    trainer_mode.ensure_xla_environment()  # the engine's XLA flags, before JAX starts
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    import jax
    import torch
    import transformers

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU smoke run"
    lines = [f"H200 acceptance: {device}, jax {jax.__version__}, torch "
             f"{torch.__version__}, transformers {transformers.__version__}"]
    results, all_ok = [], True
    for case in args.cases:
        try:
            r = run_case(case, work, args.max_len, lines)
        except Exception as e:  # one case's crash is a FAIL row, not a lost run
            import traceback

            traceback.print_exc()
            r = {"case": case, "error": f"{type(e).__name__}: {e}"}
            lines.append(f"### {case}: ERROR {r['error']}")
        results.append(r)
        case_ok = "error" not in r and all(v["ok"] for v in r["variants"].values()) and \
            r["negative_control"]["mismatched"]
        all_ok &= case_ok
        (out / "acceptance.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "acceptance.md").write_text("\n".join(lines) + "\n")
    table = summary_table(results)
    (out / "acceptance.md").write_text("\n".join(lines + [""] + table) + "\n")
    print("\n".join(table), flush=True)
    print(json.dumps({"acceptance": "PASS" if all_ok else "FAIL", "cases": {
        r["case"]: r.get("error") or {"variants": {o: v["ok"] for o, v in r["variants"].items()},
                                      "stock_mismatched": r["negative_control"]["mismatched"],
                                      "lengths": r["lengths"], "seconds": r["seconds"]}
        for r in results}}), flush=True)
    print(f"acceptance: {'PASS' if all_ok else 'FAIL'}", flush=True)
    return 0 if all_ok else 1


def summary_table(results: list[dict]) -> list[str]:
    """One row per case: each logprob order MATCH or FAIL, the stock control MISMATCH (expected)."""
    orders = [o for r in results if "error" not in r for o in r["variants"]][:len(VARIANTS)]
    rows = [f"| case | lengths | {' | '.join(orders)} | stock torch (must mismatch) | s |",
            "|---" * (len(orders) + 4) + "|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['case']} | ERROR {r['error'][:80]} |")
            continue
        cells = ["MATCH" if r["variants"][o]["ok"] else "FAIL" for o in orders]
        stock = "MISMATCH" if r["negative_control"]["mismatched"] else "MATCH (FAIL)"
        rows.append(f"| {r['case']} | {r['lengths']} | {' | '.join(cells)} | {stock} | "
                    f"{r['seconds']} |")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
