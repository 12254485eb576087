"""`jengine invariance`: the rl-bitwise invariance harness (spec "Acceptance").

For a fixed prompt set it records, from one baseline engine, each prompt's output ids, output
logprobs and prompt logprobs generated ALONE at batch size 1, then checks the same request bit for
bit under every other condition the contract covers:

  packed      the prompts submitted together with random co-batches of random lengths
  rerun       the packed run again (run invariance)
  chunk-N     fresh engines with chunked-prefill sizes N in {small, odd, large}
  prefix-hit  a prefix of each prompt cached first, ending at an odd position off a page boundary
              (`prefix_cut`; the table lists each prompt's cut)
  retract+N   --debug-force-retraction-interval N (N < 0 also retracts mid-prefill)
  overlap-off a fresh engine with --disable-overlap-schedule (overlap-on when the baseline has it)

at every requested temperature (T > 0 with a fixed seed per prompt). Logprobs are compared as
float bits, so -0.0 != +0.0 and a NaN is caught. The first divergence is reported with the request,
the position and both values, and the exit status is non-zero.

Under `--numerics auto` the same harness is the negative control: it is allowed to, and where the
leaves are batch-variant does, find differences; they are reported, not hidden.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import struct
import sys
from dataclasses import dataclass, field

DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "In 1905 Einstein published four papers",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Bitwise reproducibility means",
    "Once upon a time, in a land far away, there lived a numerical analyst who distrusted every "
    "floating-point reduction she had not written herself.",
    "a",
)

logger = logging.getLogger("jengine.invariance")


@dataclass
class Record:
    """What one request produced: the things the contract says must not move."""

    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[float | None]
    cached_tokens: int = 0


@dataclass
class Divergence:
    mode: str
    temperature: float
    request: int
    what: str
    position: int
    expected: object
    got: object

    def __str__(self) -> str:
        return (f"[{self.mode} T={self.temperature}] request {self.request}: {self.what} differs at "
                f"position {self.position}: expected {_show(self.expected)}, got {_show(self.got)}")


@dataclass
class ModeResult:
    mode: str
    temperature: float
    requests: int
    compared_values: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    # prefix-hit only: per request, the length of the prefix cached first (0: too short, scored cold)
    prefix_cuts: list[int] = field(default_factory=list)


def _bits(x) -> object:
    if x is None:
        return None
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _show(x) -> str:
    if isinstance(x, float):
        return f"{x!r} (bits 0x{_bits(x):08x})"
    return repr(x)


def _record(out: dict) -> Record:
    meta = out["meta_info"]
    return Record(
        output_ids=list(out["output_ids"]),
        output_logprobs=[lp for lp, _, _ in meta.get("output_token_logprobs", [])],
        input_logprobs=[lp for lp, _, _ in meta.get("input_token_logprobs", [])],
        cached_tokens=int(meta.get("cached_tokens", 0)),
    )


def compare(mode: str, temperature: float, index: int, want: Record, got: Record,
            result: ModeResult, *, input_offset: int = 0) -> None:
    """Append the first divergence of ``got`` against ``want`` (bits, ids, lengths) to result."""

    def diverge(what, pos, a, b):
        result.divergences.append(Divergence(mode, temperature, index, what, pos, a, b))

    if want.output_ids != got.output_ids:
        pos = next((i for i, (a, b) in enumerate(zip(want.output_ids, got.output_ids)) if a != b),
                   min(len(want.output_ids), len(got.output_ids)))
        a = want.output_ids[pos] if pos < len(want.output_ids) else "<end>"
        b = got.output_ids[pos] if pos < len(got.output_ids) else "<end>"
        diverge("output token", pos, a, b)
        return
    # A request scored from logprob_start_len = s > 0 reports position s as context (None), like
    # the baseline's position 0; its scored values start at s + 1.
    got_inputs = got.input_logprobs
    if input_offset:
        if got_inputs[:1] != [None]:
            diverge("prompt logprob", input_offset, None, got_inputs[:1])
            return
        input_offset, got_inputs = input_offset + 1, got_inputs[1:]
    for name, xs, ys, offset in (("output logprob", want.output_logprobs, got.output_logprobs, 0),
                                 ("prompt logprob", want.input_logprobs[input_offset:],
                                  got_inputs, input_offset)):
        if len(xs) != len(ys):
            diverge(f"{name} count", 0, len(xs), len(ys))
            return
        for i, (a, b) in enumerate(zip(xs, ys)):
            result.compared_values += 1
            if _bits(a) != _bits(b):
                diverge(name, i + offset, a, b)
                return


# -- the harness ------------------------------------------------------------------------------------


def prefix_cut(length: int, page_size: int) -> int:
    """How many of a `length`-token prompt's tokens the prefix-hit mode caches first: the largest
    odd count <= max(1, length - 2), below `length`, that is not a whole number of pages; 0 when
    the prompt is too short to split (it is then scored cold).

    The hit then resumes at an odd position. Pages and the leaves' tiles (attention key blocks,
    GEMM row tiles, vector widths) have even widths, so an odd boundary falls inside a page and
    inside every such tile: cached and new rows share both, where a kernel that treats "the rest
    of a page" or "a partial tile" differently would show. An even cut can sit on a 2-, 8- or
    16-row tile edge and miss it. With an odd page size some odd counts are whole pages; those
    are skipped (page size 1: every count is, and the largest odd one is taken)."""
    for cut in range(min(max(1, length - 2), length - 1), 0, -1):
        if cut % 2 and (page_size == 1 or cut % page_size):
            return cut
    return 0



@dataclass(frozen=True)
class HarnessConfig:
    model: str = "tiny"
    numerics: str = "rl-bitwise"
    prompts: tuple = DEFAULT_PROMPTS
    temperatures: tuple = (0.0, 1.0)
    trials: int = 1
    max_new_tokens: int = 12
    chunk_sizes: tuple = (4, 7, 256)  # small, odd, large
    retraction_intervals: tuple = (3, -3)
    co_batch: int = 6
    seed: int = 0
    page_size: int = 4
    launch: tuple = ()  # extra launch options as (name, value) pairs


class InvarianceHarness:
    def __init__(self, cfg: HarnessConfig, engine_factory=None):
        self.cfg = cfg
        self._factory = engine_factory or self._default_factory
        self.rng = random.Random(cfg.seed)

    def _default_factory(self, **options):
        from jengine import Engine

        base = dict(page_size=self.cfg.page_size, skip_warmup=True, **dict(self.cfg.launch))
        base.update(options)
        return Engine(model_path=self.cfg.model, numerics=self.cfg.numerics, **base)

    def _encode(self, eng) -> list[list[int]]:
        return [eng.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in self.cfg.prompts]

    def _params(self, temperature: float, index: int, **extra) -> dict:
        params = {"max_new_tokens": self.cfg.max_new_tokens, "temperature": temperature,
                  "ignore_eos": True}
        if temperature > 0:
            params["seed"] = 1000 + index
        params.update(extra)
        return params

    def _request(self, ids, temperature, index, logprob_start_len=0):
        return dict(input_ids=ids, sampling_params=self._params(temperature, index),
                    return_logprob=True, logprob_start_len=logprob_start_len)

    def _alone(self, eng, prompts, temperature) -> list[Record]:
        return [_record(eng.generate(**self._request(ids, temperature, i)))
                for i, ids in enumerate(prompts)]

    def _packed(self, eng, prompts, temperature, vocab) -> list[Record]:
        """The prompts among random co-batch requests, submitted together in random order."""
        reqs = [("target", i, self._request(ids, temperature, i)) for i, ids in enumerate(prompts)]
        for j in range(self.cfg.co_batch):
            n = self.rng.randint(1, 40)
            ids = [self.rng.randrange(vocab) for _ in range(n)]
            params = {"max_new_tokens": self.rng.randint(1, 2 * self.cfg.max_new_tokens),
                      "temperature": self.rng.choice([0.0, 0.7, 1.0]), "seed": 5000 + j,
                      "ignore_eos": True}
            reqs.append(("filler", j, dict(input_ids=ids, sampling_params=params,
                                           return_logprob=self.rng.random() < 0.5,
                                           logprob_start_len=0)))
        self.rng.shuffle(reqs)
        handles = [(kind, i, eng.submit(**kw)) for kind, i, kw in reqs]
        out = {i: _record(h.result()) for kind, i, h in handles if kind == "target"}
        return [out[i] for i in range(len(prompts))]

    def _prefix_hit(self, eng, prompts, temperature) -> tuple[list[Record], list[int]]:
        """Cache each prompt's `prefix_cut` tokens, then send the whole prompt."""
        records, offsets = [], []
        eng.flush_cache()
        for i, ids in enumerate(prompts):
            cut = prefix_cut(len(ids), self.cfg.page_size)
            if cut:
                eng.generate(input_ids=ids[:cut], sampling_params={"max_new_tokens": 0})
            records.append(_record(eng.generate(**self._request(ids, temperature, i,
                                                                logprob_start_len=cut))))
            offsets.append(cut)
        return records, offsets

    def run(self, report=print) -> list[ModeResult]:
        results: list[ModeResult] = []
        base = self._factory()
        try:
            prompts = self._encode(base)
            vocab = base.model_config.input_vocab_size
            baselines = {t: self._alone(base, prompts, t) for t in self.cfg.temperatures}
            for t in self.cfg.temperatures:
                for trial in range(self.cfg.trials):
                    for mode in ("packed", "rerun"):
                        res = ModeResult(mode, t, len(prompts))
                        for i, rec in enumerate(self._packed(base, prompts, t, vocab)):
                            compare(mode, t, i, baselines[t][i], rec, res)
                        results.append(res)
                res = ModeResult("prefix-hit", t, len(prompts))
                records, offsets = self._prefix_hit(base, prompts, t)
                res.prefix_cuts = offsets
                hits = sum(r.cached_tokens > 0 for r in records)
                for i, (rec, off) in enumerate(zip(records, offsets)):
                    compare("prefix-hit", t, i, baselines[t][i], rec, res, input_offset=off)
                if hits == 0:
                    res.divergences.append(Divergence("prefix-hit", t, -1, "cache hits", 0,
                                                      ">0", 0))
                results.append(res)
        finally:
            base.shutdown()
        variants = [(f"chunk-{n}", dict(chunked_prefill_size=n)) for n in self.cfg.chunk_sizes]
        variants += [(f"retract{n:+d}", dict(debug_force_retraction_interval=n))
                     for n in self.cfg.retraction_intervals]
        # The other engine loop: the overlap schedule changes when an ended request leaves the
        # batch, never a bit (docs/engine.md, "Overlap schedule").
        overlap_off = bool(dict(self.cfg.launch).get("disable_overlap_schedule"))
        variants.append(("overlap-on" if overlap_off else "overlap-off",
                         dict(disable_overlap_schedule=not overlap_off)))
        for mode, options in variants:
            eng = self._factory(**options)
            try:
                for t in self.cfg.temperatures:
                    res = ModeResult(mode, t, len(prompts))
                    for i, rec in enumerate(self._packed(eng, prompts, t, vocab)):
                        compare(mode, t, i, baselines[t][i], rec, res)
                    results.append(res)
            finally:
                eng.shutdown()
        report(format_table(results, self.cfg.numerics))
        return results


def format_table(results: list[ModeResult], numerics: str) -> str:
    lines = [f"invariance harness, --numerics {numerics}",
             f"{'mode':<14}{'T':>5}{'requests':>10}{'values':>9}  verdict"]
    for r in results:
        verdict = "PASS (bitwise)" if not r.divergences else f"DIVERGED: {r.divergences[0]}"
        if r.prefix_cuts:
            verdict += f"  (cached prefixes: {r.prefix_cuts} tokens)"
        lines.append(f"{r.mode:<14}{r.temperature:>5}{r.requests:>10}{r.compared_values:>9}  {verdict}")
    return "\n".join(lines)


# -- CLI --------------------------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("invariance", help="run the rl-bitwise invariance harness",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="model directory or 'tiny'")
    p.add_argument("--numerics", default="rl-bitwise", help="envelope to check (auto = control)")
    p.add_argument("--prompts", help="JSONL file: one {\"text\": ...} or {\"input_ids\": [...]} per line")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--trials", type=int, default=1, help="packed/rerun repetitions")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="seed of the random co-batches")
    return p


def load_prompts(path: str) -> tuple:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if "text" in item:
                prompts.append(str(item["text"]))
            elif "input_ids" in item:
                prompts.append(tuple(int(i) for i in item["input_ids"]))
            else:
                raise ValueError(f"{path}:{n}: expected a 'text' or 'input_ids' field")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return tuple(prompts)


def main(args) -> int:
    cfg = HarnessConfig(model=args.model, numerics=args.numerics,
                        prompts=load_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS,
                        temperatures=tuple(args.temperature), trials=args.trials,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    results = InvarianceHarness(cfg).run()
    diverged = [d for r in results for d in r.divergences]
    if diverged:
        print(f"FIRST DIVERGENCE: {diverged[0]}", file=sys.stderr)
        return 1
    return 0
