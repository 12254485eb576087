"""Goldens: the bits a refactor must not change, recorded before it and compared after.

    python scripts/goldens.py record --out tests/goldens/cpu.json [--sections tiny families moe]
    python scripts/goldens.py check tests/goldens/cpu.json [--sections tiny]

A golden document holds, per case, the token ids and the exact bits (float64 hex, so -0.0 != +0.0)
of every logprob an rl-bitwise engine returned: prompt and output logprobs and their top-k
alternatives. Sections:

  tiny        the embedded tiny model: greedy, T=1 seeded and n=2 seeded generations with
              logprobs, and a packed teacher-forced batch
  families    a tiny random checkpoint per dense family (interop.testing.make_tiny_hf_model: Llama,
              Qwen2, Qwen3, and Llama with llama3 rope at head_dim 128): the engine's teacher-forced
              logprobs, a greedy continuation, and the trainer-mode dump's logprobs (torch)
  moe         the same per MoE family (Qwen3-MoE, DeepSeek-V3 with MLA, LongCat-Flash; tiny random
              checkpoints), the engine's bits only: its routed experts, router and combine (no
              trainer dumps: tests/test_moe_align.py aligns the trainer bit for bit)
  production  (GPU) 8B-class widths, 2 layers (hidden 4096, 32/8 heads, head_dim 128, Llama-3 and
              Qwen3 vocabularies): teacher-forced 1200-token sequences and 16 greedy tokens

`check` recomputes the sections the document holds (or those named) and exits 1 on any differing
bit, naming the case, the field and the first differing position.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    if n < 2:", "Numbers: 1, 2, 3, 4, 5, 6, 7, 8"]
FAMILY_CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "llama3_rope_hd128": ("LlamaForCausalLM", dict(
        head_dim=128, num_attention_heads=4, num_key_value_heads=1, hidden_size=128,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256})),
}
MOE_CASES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", {}),
    "deepseek_v3": ("DeepseekV3ForCausalLM", {}),
    "longcat_flash": ("LongcatFlashForCausalLM", {}),
}
PRODUCTION_CASES = {
    "llama_8b_width": ("LlamaForCausalLM", dict(intermediate_size=14336, vocab_size=128256,
                                                rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 5e5})),
    "qwen3_8b_width": ("Qwen3ForCausalLM", dict(intermediate_size=12288, vocab_size=151936,
                                                rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 1e6})),
}


# -- encoding -------------------------------------------------------------------------------------


def bits(value):
    """A float as its float64 bit pattern in hex (exact; -0.0 and +0.0 differ); None stays None."""
    if value is None:
        return None
    return np.float64(value).view(np.uint64).item().to_bytes(8, "big").hex()


def _entry(e):
    """[logprob, id, text] -> [logprob bits, id] (the text is the tokenizer's, not the engine's)."""
    return None if e is None else [bits(e[0]), e[1]]


def output_record(out: dict) -> dict:
    meta = out["meta_info"]
    rec = {"output_ids": list(out["output_ids"]), "cached_tokens": meta.get("cached_tokens")}
    for field in ("input_token_logprobs", "output_token_logprobs"):
        if field in meta:
            rec[field] = [_entry(e) for e in meta[field]]
    for field in ("input_top_logprobs", "output_top_logprobs"):
        if field in meta:
            rec[field] = [None if top is None else [_entry(e) for e in top] for top in meta[field]]
    return rec


# -- sections -------------------------------------------------------------------------------------


def _tiny_requests(eng) -> dict:
    cases = {}
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    for i, prompt in enumerate(ids):
        common = dict(input_ids=prompt, return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
        cases[f"greedy_{i}"] = eng.generate(
            **common, sampling_params=dict(max_new_tokens=16, temperature=0, ignore_eos=True))
        cases[f"t1_seed_{i}"] = eng.generate(
            **common, sampling_params=dict(max_new_tokens=16, temperature=1.0, seed=100 + i,
                                           ignore_eos=True))
        for j, out in enumerate(eng.generate(
                input_ids=prompt, return_logprob=True, logprob_start_len=len(prompt) - 1,
                sampling_params=dict(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7 + i,
                                     n=2, ignore_eos=True))):
            cases[f"n2_seed_{i}_{j}"] = out
    packed = eng.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                          sampling_params=dict(max_new_tokens=0))
    for i, out in enumerate(packed):
        cases[f"teacher_forced_packed_{i}"] = out
    return {name: output_record(out) for name, out in cases.items()}


def section_tiny() -> dict:
    from jengine import Engine

    with Engine("tiny", numerics="rl-bitwise", skip_warmup=True, page_size=4,
                chunked_prefill_size=8) as eng:
        return _tiny_requests(eng)


def _family_engine(model_dir, arch, **launch):
    from jengine import Engine
    from jengine.profiles import override_profile

    with override_profile(arch, numerics_envelopes={"rl-bitwise"}):
        return Engine(model_path=str(model_dir), numerics="rl-bitwise", skip_warmup=True,
                      **{**dict(max_total_tokens=8192, chunked_prefill_size=128,
                                max_prefill_tokens=256), **launch})


def _sequences(vocab: int, lengths, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _engine_case(eng, seqs, gen_prompt_len: int, gen_tokens: int) -> dict:
    cases = {}
    for i, s in enumerate(seqs):
        cases[f"teacher_forced_{i}"] = output_record(eng.generate(
            input_ids=s, return_logprob=True, logprob_start_len=0,
            sampling_params=dict(max_new_tokens=0)))
    cases["greedy"] = output_record(eng.generate(
        input_ids=seqs[-1][:gen_prompt_len], return_logprob=True, logprob_start_len=0,
        top_logprobs_num=2,
        sampling_params=dict(max_new_tokens=gen_tokens, temperature=0, ignore_eos=True)))
    return cases


def _trainer_logprobs(model_dir, seqs, workdir: Path, device: str) -> list:
    from interop import trainer_dump
    from interop.dumps import read_dump

    inputs = workdir / "inputs.jsonl"
    inputs.write_text("".join(json.dumps({"ids": s}) + "\n" for s in seqs))
    out = workdir / "dump.pt"
    if trainer_dump.main(["--hf-model", str(model_dir), "--input", str(inputs), "--out", str(out),
                          "--device", device]) != 0:
        raise RuntimeError(f"trainer_dump failed for {model_dir}")
    return [[bits(float(x)) for x in np.asarray(r["logprob"], np.float32)] for r in read_dump(out)]


def section_families(trainer: bool, device: str = "cpu", cases=None) -> dict:
    from interop.testing import make_tiny_hf_model

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, overrides) in (FAMILY_CASES if cases is None else cases).items():
            d = make_tiny_hf_model(Path(tmp) / name, arch, seed=11, **overrides)
            seqs = _sequences(32768, (9, 37, 70), seed=5)
            eng = _family_engine(d, arch)
            try:
                case = _engine_case(eng, seqs, gen_prompt_len=20, gen_tokens=10)
            finally:
                eng.shutdown()
            if trainer:
                case["trainer_dump"] = _trainer_logprobs(d, seqs, Path(tmp) / name, device)
            result[name] = case
    return result


def section_production(trainer: bool) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_acceptance import build_model  # noqa: E402  (adds the 8B widths itself)

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, dims) in PRODUCTION_CASES.items():
            d = Path(tmp) / name
            model = build_model(d, arch, {**dims, "tie_word_embeddings": False}, seed=1)
            del model
            seqs = _sequences(dims["vocab_size"], (1200,), seed=9)
            eng = _family_engine(d, arch, max_prefill_tokens=2048, chunked_prefill_size=512)
            try:
                result[name] = _engine_case(eng, seqs, gen_prompt_len=1024, gen_tokens=16)
            finally:
                eng.shutdown()
            if trainer:
                result[name]["trainer_dump"] = _trainer_logprobs(d, seqs, d, "cuda")
    return result


def compute(sections, *, trainer: bool, device: str) -> dict:
    doc = {}
    for s in sections:
        if s == "tiny":
            doc[s] = section_tiny()
        elif s == "families":
            doc[s] = section_families(trainer, device)
        elif s == "moe":
            doc[s] = section_families(False, device, MOE_CASES)
        elif s == "production":
            doc[s] = section_production(trainer)
        else:
            raise SystemExit(f"unknown section {s!r} (tiny, families, moe, production)")
    return doc


# -- comparison -----------------------------------------------------------------------------------


def differences(want, got, path="") -> list[str]:
    """Every place the two documents differ (the first differing position per list)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            if k not in got:
                out.append(f"{path}/{k}: missing now")
            elif k not in want:
                out.append(f"{path}/{k}: not in the golden")
            else:
                out += differences(want[k], got[k], f"{path}/{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: length {len(want)} -> {len(got)}"]
        for i, (a, b) in enumerate(zip(want, got)):
            d = differences(a, b, f"{path}[{i}]")
            if d:
                return d[:1]
        return []
    return [] if want == got else [f"{path}: {want!r} -> {got!r}"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", required=True)
    r.add_argument("--sections", nargs="+", default=["tiny", "families", "moe"])
    c = sub.add_parser("check")
    c.add_argument("golden")
    c.add_argument("--sections", nargs="+")
    for q in (r, c):
        q.add_argument("--no-trainer", action="store_true", help="skip the torch trainer dumps")
        q.add_argument("--device", default="cpu", help="the trainer's torch device (cpu, cuda)")
    args = p.parse_args(argv)

    if args.cmd == "record":
        doc = compute(args.sections, trainer=not args.no_trainer, device=args.device)
        doc["_recorded_on"] = {"machine": platform.machine(), "python": platform.python_version()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
        return 0
    want = json.loads(Path(args.golden).read_text())
    sections = args.sections or [k for k in want if not k.startswith("_")]
    got = compute(sections, trainer=not args.no_trainer, device=args.device)
    diffs = []
    for s in sections:
        w = want[s]
        if args.no_trainer:
            w = {k: {f: v for f, v in case.items() if f != "trainer_dump"} if isinstance(case, dict)
                 else case for k, case in w.items()}
        diffs += differences(w, got[s], s)
    for d in diffs:
        print("DIFFERS", d)
    print(f"goldens {args.golden} [{' '.join(sections)}]: "
          + ("every bit unchanged" if not diffs else f"{len(diffs)} difference(s)"))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
