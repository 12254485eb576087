"""The step executor: runs one scheduled step on the runner and turns its hidden rows into tokens
and logprobs (SGLang's forward + LogitsProcessor + sampler call).

First the step's KV page transfers, in the order the scheduler emitted them (`runner.
execute_kv_transfers`), then the forward, if the step has one. Sampling rows: one `runner.logits_at`
over all of them, then `sampler.sample_on_device` keyed by each request's (seed, absolute position
of the new token), and the sampled token's logprob through `sampler.token_logprobs_on_device`.
Prompt rows: logits in chunks of --input-logprob-chunk-tokens rows (so the [rows, vocab] tensor
stays bounded) through the SAME token-logprob program (spec, "Logprobs: one arithmetic for prompt
and output"). Both consumers take logits from the same LM-head route.

`dispatch_step` only enqueues that work: JAX dispatch is asynchronous, and nothing here waits for
the device. It returns an `InFlightStep` whose `tokens` (the sampled ids, still on the device) the
next step may take as input, and whose `resolve()` copies the results to the host -- the one place
a step waits. The engine resolves a step at once, or (the overlap schedule) after it has scheduled
and dispatched the next one (docs/engine.md, "Overlap schedule"). `execute_step` is both at once.

Under tensor parallelism with a block-aligned head (`runner.scores_without_gather(sampler)`), greedy
steps and prompt rows are scored by the vocab-parallel head instead (`runner.score_rows`: argmax,
logprobs and top-k with no rank holding a whole row; the Sampler's bits, sharding/vocab_parallel.py).
A step with a T > 0 row still gathers its sampled rows' logits: the Gumbel draw with top-k/top-p
filters needs the whole row. `score_rows` answers on the host, so such a step is resolved as it
is dispatched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from jengine.engine.batch import SamplingRows
from jengine.engine.scheduler import ScheduledStep, Segment


@dataclass
class SegmentResult:
    prompt_logprobs: list[float] = field(default_factory=list)  # one per scored prompt row
    prompt_tops: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    token: int | None = None  # the sampled token, when the segment samples
    token_logprob: float | None = None
    token_top: tuple[np.ndarray, np.ndarray] | None = None
    # The expert ids int32[length, layers, k] of the segment's rows, positions routed_start ..
    # routed_start + length - 1, when its request asked for them.
    routed_experts: np.ndarray | None = None
    routed_start: int = 0


@dataclass
class InFlightStep:
    """A dispatched step: its results are device arrays until `resolve()` copies them out.

    tokens: the sampled ids in the order of `sampled` (a device or host array, padded past
    len(sampled)): the next step's placeholder rows read them (`batch.placeholder`).
    """

    step: ScheduledStep
    sampled: list[Segment] = field(default_factory=list)
    tokens: Any = None
    committed: bool = False  # the engine advanced its frontiers before resolving (overlap)
    started: float = 0.0  # when the engine began scheduling it (perf_counter), for step latency
    _reads: list[Callable[[dict[int, SegmentResult]], None]] = field(default_factory=list)
    _results: dict[int, SegmentResult] | None = None

    def resolve(self) -> dict[int, SegmentResult]:
        """The result of each segment, keyed by id(segment); waits for the device (once)."""
        if self._results is None:
            results = {id(seg): SegmentResult() for seg in self.step.segments}
            for read in self._reads:
                read(results)
            self._results, self._reads = results, []
        return self._results


def execute_step(runner: Any, sampler: Any, step: ScheduledStep,
                 input_logprob_chunk_tokens: int) -> dict[int, SegmentResult]:
    """The result of each segment of `step`, keyed by id(segment): dispatch, then wait."""
    return dispatch_step(runner, sampler, step, input_logprob_chunk_tokens).resolve()


def dispatch_step(runner: Any, sampler: Any, step: ScheduledStep, input_logprob_chunk_tokens: int,
                  previous_tokens: Any = None) -> InFlightStep:
    """Enqueue `step` on the device. previous_tokens: the in-flight step's `tokens`, read by this
    step's placeholder rows (None when it has none)."""
    # Before the forward: a restored or copied page must hold its bytes when the step reads it.
    runner.execute_kv_transfers(step.kv_transfers)
    out = InFlightStep(step)
    if step.batch is None:
        return out
    reads = out._reads
    # The step's whole padded bucket of hidden states; `logits_at` gathers rows inside its jitted
    # program, so no small program is compiled per count of sampled or scored rows.
    routing = [seg for seg in step.segments if seg.req.return_routed_experts]
    if routing:  # the same program; only then are the step's ids copied to the host
        hidden, routed = runner.forward_routed(step.batch, previous_tokens)

        def read_routed(results, routed=routed, routing=routing):
            ids = np.asarray(routed)
            for seg in routing:
                res = results[id(seg)]
                res.routed_experts = ids[seg.first_row: seg.first_row + seg.length]
                res.routed_start = seg.start
        reads.append(read_routed)
    else:
        hidden = runner.forward_padded(step.batch, previous_tokens)
    step_rows = step.batch.hidden_rows

    scores_locally = getattr(runner, "scores_without_gather", None)
    scores_locally = bool(scores_locally and scores_locally(sampler))
    sampled = out.sampled = [seg for seg in step.segments if seg.sample]
    want = any(s.req.return_logprob for s in sampled)
    k = max((s.req.top_logprobs_num for s in sampled if s.req.return_logprob), default=0)
    if sampled and scores_locally and all(s.req.sampling.temperature == 0 for s in sampled):
        tokens, lps, tops = runner.score_rows(hidden, step_rows[[s.sample_hidden for s in sampled]],
                                              sampler, k=k)
        out.tokens = tokens
        reads.append(_sampled_reader(sampled, tokens, lps if want else None, tops))
    elif sampled:
        logits = runner.logits_at(hidden, step_rows[[s.sample_hidden for s in sampled]])
        out.tokens = sampler.sample_on_device(logits, _sampling_rows(sampled))
        lps = sampler.token_logprobs_on_device(logits, out.tokens) if want else None
        tops = sampler.top_logprobs_on_device(logits, k, len(sampled)) if k else None
        reads.append(_sampled_reader(sampled, out.tokens, lps, tops))

    # Prompt rows, in bounded chunks; each row's target is the next prompt token.
    scored = [(seg, h, seg.req.prompt_ids[p + 1])
              for seg in step.segments for p, h in zip(seg.scored, seg.scored_hidden)]
    chunk = input_logprob_chunk_tokens
    for i in range(0, len(scored), chunk):
        part = scored[i: i + chunk]
        rows = step_rows[[h for _, h, _ in part]]
        targets = np.array([t for _, _, t in part], np.int32)
        k = max(seg.req.top_logprobs_num for seg, _, _ in part)
        if scores_locally:
            _, lps, tops = runner.score_rows(hidden, rows, sampler, target_ids=targets, k=k)
        else:
            logits = runner.logits_at(hidden, rows)
            lps = sampler.token_logprobs_on_device(logits, targets)
            tops = sampler.top_logprobs_on_device(logits, k, len(part)) if k else None
        reads.append(_prompt_reader(part, lps, tops))
    return out


def _sampling_rows(sampled: list[Segment]) -> SamplingRows:
    """The sampled rows' parameters, one pass over the rows (this runs for every step)."""
    table = [(s.req.sampling.temperature, s.req.sampling.top_k, s.req.sampling.top_p,
              s.req.sampling.min_p, s.req.seed, s.start + s.length) for s in sampled]
    temperature, top_k, top_p, min_p, seed, position = zip(*table)
    return SamplingRows(
        temperature=np.array(temperature, np.float32), top_k=np.array(top_k, np.int32),
        top_p=np.array(top_p, np.float32), min_p=np.array(min_p, np.float32),
        seed=np.array(seed, np.uint32),
        # The key of a draw is the absolute position the sampled token will occupy.
        position=np.array(position, np.int32))


def _sampled_reader(sampled: list[Segment], tokens, lps, tops):
    def read(results):
        ids = np.asarray(tokens)[: len(sampled)].tolist()  # Python ints, one conversion
        values = None if lps is None else np.asarray(lps)
        top = None if tops is None else [np.asarray(a) for a in tops]
        for i, seg in enumerate(sampled):
            res = results[id(seg)]
            res.token = ids[i]
            if values is not None:
                res.token_logprob = values[i]
            if top is not None:
                res.token_top = (top[0][i], top[1][i].astype(np.int32))
    return read


def _prompt_reader(part, lps, tops):
    def read(results):
        values = np.asarray(lps)
        top = None if tops is None else [np.asarray(a) for a in tops]
        for j, (seg, _, _) in enumerate(part):
            res = results[id(seg)]
            res.prompt_logprobs.append(values[j])
            if seg.req.top_logprobs_num:
                res.prompt_tops.append((top[0][j], top[1][j].astype(np.int32)))
    return read
