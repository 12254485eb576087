"""`jengine align`: teacher-force a trainer dump through the engine and compare logprobs bit for bit.

    jengine align --model DIR --dump DUMP [--numerics rl-bitwise] [--logprob-order blockwise]
                  [--bisect] [--no-self-consistency]

For every sequence of the dump (interop/dumps.py) the engine scores its ids with
``generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
logprob_start_len=0)``; positions 1..T-1 of ``input_token_logprobs`` (the first is None: nothing
predicts the first token) are compared with the dump's ``logprob`` by their fp32 bits, so -0.0 and
+0.0 differ. Each sequence prints MATCH, or its first divergent position with both values, their
bits and the ulp distance. Agreement up to a tolerance is a finding to bisect, not a pass.

The spec's two self-consistency checks ride along (skip with --no-self-consistency):
  (a) generate greedily from each sequence's prompt (``prompt_len`` in the dump, else half the
      sequence), re-score prompt + generated tokens teacher-forced, and require the response part
      of input_token_logprobs to equal the output_token_logprobs reported while generating;
  (b) teacher-force every sequence alone and all of them packed into one batch; both must give the
      same bits.
The exit status is 0 only if every sequence matches and both checks pass.

``--bisect``: for a mismatching sequence whose dump carries ``states`` (trainer_dump
--record-states N), name the first layer and op whose outputs differ (interop/bisect.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import numpy as np

DEFAULT_SELF_CONSISTENCY_TOKENS = 8


@dataclass(frozen=True)
class Comparison:
    """One sequence's engine-vs-reference logprobs (positions are token indices 1..T-1)."""

    positions: int
    differing: int
    first_position: int | None  # token index of the first differing logprob
    engine_value: float | None
    reference_value: float | None
    ulp: int | None

    @property
    def match(self) -> bool:
        return self.differing == 0


def _ordered(bits: np.ndarray) -> np.ndarray:
    i = bits.astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def compare_logprobs(engine: np.ndarray, reference: np.ndarray, first_index: int = 1) -> Comparison:
    """Bitwise comparison of two f32 vectors; ``first_index`` is the token index of element 0."""
    engine = np.ascontiguousarray(engine, np.float32)
    reference = np.ascontiguousarray(reference, np.float32)
    if engine.shape != reference.shape:
        raise ValueError(f"engine returned {engine.shape[0]} logprobs, the reference has "
                         f"{reference.shape[0]}")
    ea, ra = engine.view(np.int32), reference.view(np.int32)
    neq = np.nonzero(ea != ra)[0]
    if not len(neq):
        return Comparison(len(engine), 0, None, None, None, None)
    j = int(neq[0])
    ulp = int(abs(_ordered(ea[j:j + 1]) - _ordered(ra[j:j + 1]))[0])
    return Comparison(len(engine), len(neq), j + first_index, float(engine[j]), float(reference[j]), ulp)


def describe(c: Comparison, what: str = "dump") -> str:
    if c.match:
        return f"MATCH ({c.positions} positions)"
    e, r = np.float32(c.engine_value), np.float32(c.reference_value)
    zero_sign = " (same value, different sign of zero)" if c.ulp == 0 else ""
    return (f"MISMATCH at position {c.first_position}: engine {format_f32(e)} vs {what} "
            f"{format_f32(r)}, {c.ulp} ulp{zero_sign}; {c.differing} of {c.positions} positions differ")


def format_f32(v) -> str:
    """Shortest decimal that reads back as this f32, and its bits."""
    v = np.float32(v)
    text = np.format_float_positional(v, unique=True, trim="0") if abs(v) >= 1e-4 or v == 0 else \
        np.format_float_scientific(v, unique=True, trim="0")
    return f"{text} (0x{int(np.array(v).view(np.uint32)):08x})"


def scored_logprobs(out: dict) -> np.ndarray:
    """Positions 1..T-1 of a teacher-forced output's input_token_logprobs, as f32."""
    entries = out["meta_info"]["input_token_logprobs"]
    if entries[0][0] is not None:
        raise ValueError("input_token_logprobs[0] should be None with logprob_start_len=0")
    return np.asarray([e[0] for e in entries[1:]], np.float32)


def teacher_force(eng, sequences: list[list[int]], *, packed: bool) -> list[np.ndarray]:
    """Score each sequence with max_new_tokens=0: one request at a time, or all in one batch."""
    params = {"max_new_tokens": 0}
    if packed:
        outs = eng.generate(input_ids=[list(s) for s in sequences], sampling_params=params,
                            return_logprob=True, logprob_start_len=0)
        return [scored_logprobs(o) for o in outs]
    return [scored_logprobs(eng.generate(input_ids=list(s), sampling_params=params,
                                         return_logprob=True, logprob_start_len=0))
            for s in sequences]


def check_generate_rescore(eng, prompt: list[int], max_new_tokens: int) -> Comparison:
    """Self-consistency (a): output_token_logprobs while generating == teacher-forced re-score."""
    out = eng.generate(input_ids=list(prompt), return_logprob=True, logprob_start_len=len(prompt) - 1,
                       sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0,
                                        "ignore_eos": True})
    generated = out["output_ids"]
    reported = np.asarray([e[0] for e in out["meta_info"]["output_token_logprobs"]], np.float32)
    rescored = teacher_force(eng, [list(prompt) + list(generated)], packed=False)[0]
    return compare_logprobs(rescored[len(prompt) - 1:], reported, first_index=len(prompt))


def run_alignment(eng, records: list[dict], *, self_consistency: bool = True,
                  self_consistency_tokens: int = DEFAULT_SELF_CONSISTENCY_TOKENS, bisect: bool = False,
                  out: Callable[[str], None] = print) -> bool:
    """Compare every record; print the report through ``out``; True iff everything matched."""
    ok = True
    ids = [r["ids"].tolist() for r in records]
    alone = teacher_force(eng, ids, packed=False)
    results = []
    for i, (r, lp) in enumerate(zip(records, alone)):
        c = compare_logprobs(lp, r["logprob"])
        results.append(c)
        out(f"seq {i} ({len(r['ids'])} tokens, layout {r['layout']!r}): {describe(c)}")
        if not c.match:
            ok = False
            if bisect:
                out(_bisect(eng, r))
    if self_consistency:
        packed = teacher_force(eng, ids, packed=True)
        n_bad_b = 0
        for i, (a, p) in enumerate(zip(alone, packed)):
            c = compare_logprobs(p, a)
            if not c.match:
                n_bad_b += 1
                out(f"self-consistency (b) seq {i}: packed vs alone {describe(c, 'alone')}")
        out(f"self-consistency (b) alone vs packed ({len(ids)} sequences in one batch): "
            + ("MATCH" if not n_bad_b else f"{n_bad_b} sequences differ"))
        n_bad_a = 0
        for i, r in enumerate(records):
            t = len(ids[i])
            prompt_len = r.get("prompt_len") or max(1, t // 2)
            c = check_generate_rescore(eng, ids[i][:prompt_len], self_consistency_tokens)
            if not c.match:
                n_bad_a += 1
                out(f"self-consistency (a) seq {i}: re-scored vs generated {describe(c, 'generated')}")
        ok = ok and not n_bad_a and not n_bad_b
        out(f"self-consistency (a) generate then re-score ({self_consistency_tokens} tokens each): "
            + ("MATCH" if not n_bad_a else f"{n_bad_a} sequences differ"))
    n_match = sum(c.match for c in results)
    out(f"{n_match} of {len(results)} sequences MATCH the dump bit for bit"
        + ("" if ok else "; alignment FAILED"))
    return ok


def _bisect(eng, record: dict) -> str:
    if "states" not in record:
        return "  bisect: the dump has no states for this sequence (trainer_dump --record-states N)"
    from interop.bisect import bisect_sequence

    return bisect_sequence(eng.runner, record)


# -- the command ---------------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    from jengine.config import add_launch_arguments

    p = subparsers.add_parser("align", help="teacher-force a trainer dump and compare logprobs bitwise",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_launch_arguments(p)
    p.set_defaults(numerics="rl-bitwise")
    p.add_argument("--dump", required=True, help="trainer dump (.pt or .safetensors)")
    p.add_argument("--bisect", action="store_true",
                   help="name the first layer/op that differs (needs states in the dump)")
    p.add_argument("--no-self-consistency", dest="self_consistency", action="store_false",
                   help="skip self-consistency checks (a) and (b)")
    p.add_argument("--self-consistency-tokens", type=int, default=DEFAULT_SELF_CONSISTENCY_TOKENS,
                   help="tokens generated per sequence for check (a)")
    p.add_argument("--allow-unverified-profile", action="store_true",
                   help="run under --numerics for a model whose profile does not (yet) declare it: "
                        "how a model earns the declaration (this process only)")
    return p


def main(args: argparse.Namespace) -> int:
    import contextlib

    from interop.dumps import read_dump
    from jengine.config import launch_config_from_args
    from jengine.engine.engine import Engine

    records = read_dump(args.dump)  # fail on a malformed dump before starting an engine
    cfg = launch_config_from_args(args)
    guard = contextlib.nullcontext()
    if args.allow_unverified_profile and cfg.numerics != "auto":
        guard = _earn_profile(cfg)
    with guard, Engine.from_config(cfg) as eng:
        print(f"jengine align: {len(records)} sequences from {args.dump}; model "
              f"{eng.model_config.architecture}, --numerics {eng.config.numerics}, "
              f"--logprob-order {eng.config.logprob_order}")
        ok = run_alignment(eng, records, self_consistency=args.self_consistency,
                           self_consistency_tokens=args.self_consistency_tokens, bisect=args.bisect)
    return 0 if ok else 1


def _earn_profile(cfg):
    """Declare ``cfg.numerics`` on the model's profile for this process (jengine.profiles hook)."""
    import json
    from pathlib import Path

    from jengine.models.config import ModelConfig
    from jengine.profiles import PROFILES, override_profile

    if cfg.model_path in (None, "tiny"):
        from jengine.models.tiny import TINY_CONFIG as config
    else:
        config = json.loads((Path(cfg.model_path) / "config.json").read_text(encoding="utf-8"))
    arch = ModelConfig.from_hf_dict(config).architecture
    have = PROFILES[arch].numerics_envelopes if arch in PROFILES else frozenset()
    print(f"jengine align: --allow-unverified-profile: treating {arch} as declaring "
          f"{cfg.numerics!r} for this run")
    return override_profile(arch, numerics_envelopes=have | {cfg.numerics})
