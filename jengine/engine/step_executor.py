"""The step executor: runs one scheduled step on the runner and turns its hidden rows into tokens
and logprobs (SGLang's forward + LogitsProcessor + sampler call).

First the step's KV page transfers, in the order the scheduler emitted them (`runner.
execute_kv_transfers`), then the forward, if the step has one. Sampling rows: one `runner.logits_at` over all of them, then `sampler.sample` keyed by each
request's (seed, absolute position of the new token), and the sampled token's logprob through
`sampler.token_logprobs`. Prompt rows: logits in chunks of --input-logprob-chunk-tokens rows (so the
[rows, vocab] tensor stays bounded) through the SAME `sampler.token_logprobs` (spec, "Logprobs: one
arithmetic for prompt and output"). Both consumers take logits from the same LM-head route.

Under tensor parallelism with a block-aligned head (`runner.scores_without_gather(sampler)`), greedy
steps and prompt rows are scored by the vocab-parallel head instead (`runner.score_rows`: argmax,
logprobs and top-k with no rank holding a whole row; the Sampler's bits, sharding/vocab_parallel.py).
A step with a T > 0 row still gathers its sampled rows' logits: the Gumbel draw with top-k/top-p
filters needs the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jengine.engine.batch import SamplingRows
from jengine.engine.scheduler import ScheduledStep


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


def execute_step(runner: Any, sampler: Any, step: ScheduledStep,
                 input_logprob_chunk_tokens: int) -> dict[int, SegmentResult]:
    """The result of each segment of `step`, keyed by id(segment)."""
    # Before the forward: a restored or copied page must hold its bytes when the step reads it.
    runner.execute_kv_transfers(step.kv_transfers)
    if step.batch is None:
        return {}
    results = {id(seg): SegmentResult() for seg in step.segments}
    # The step's whole padded bucket of hidden states; `logits_at` gathers rows inside its jitted
    # program, so no small program is compiled per count of sampled or scored rows.
    routing = [seg for seg in step.segments if seg.req.return_routed_experts]
    if routing:  # the same program; only then are the step's ids copied to the host
        hidden, routed = runner.forward_routed(step.batch)
        routed = np.asarray(routed)
        for seg in routing:
            res = results[id(seg)]
            res.routed_experts = routed[seg.first_row: seg.first_row + seg.length]
            res.routed_start = seg.start
    else:
        hidden = runner.forward_padded(step.batch)
    step_rows = step.batch.hidden_rows

    scores_locally = getattr(runner, "scores_without_gather", None)
    scores_locally = bool(scores_locally and scores_locally(sampler))
    sampled = [seg for seg in step.segments if seg.sample]
    if sampled and scores_locally and all(s.req.sampling.temperature == 0 for s in sampled):
        k = max((s.req.top_logprobs_num for s in sampled if s.req.return_logprob), default=0)
        tokens, lps, tops = runner.score_rows(hidden, step_rows[[s.sample_hidden for s in sampled]],
                                              sampler, k=k)
        want = any(s.req.return_logprob for s in sampled)
        for i, seg in enumerate(sampled):
            res = results[id(seg)]
            res.token = int(tokens[i])
            if want:
                res.token_logprob = lps[i]
            if tops is not None:
                res.token_top = (tops[0][i], tops[1][i])
    elif sampled:
        logits = runner.logits_at(hidden, step_rows[[s.sample_hidden for s in sampled]])
        params = [s.req.sampling for s in sampled]
        rows = SamplingRows(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            seed=np.array([s.req.seed for s in sampled], np.uint32),
            # The key of a draw is the absolute position the sampled token will occupy.
            position=np.array([s.start + s.length for s in sampled], np.int32),
        )
        tokens = np.asarray(sampler.sample(logits, rows), np.int32)
        want = [s.req.return_logprob for s in sampled]
        lps = np.asarray(sampler.token_logprobs(logits, tokens)) if any(want) else None
        k = max((s.req.top_logprobs_num for s in sampled if s.req.return_logprob), default=0)
        tops = [np.asarray(a) for a in sampler.top_logprobs(logits, k, len(sampled))] if k else None
        for i, seg in enumerate(sampled):
            res = results[id(seg)]
            res.token = int(tokens[i])
            if lps is not None:
                res.token_logprob = lps[i]
            if tops is not None:
                res.token_top = (tops[0][i], tops[1][i])

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
            lps = np.asarray(sampler.token_logprobs(logits, targets))
            tops = [np.asarray(a) for a in sampler.top_logprobs(logits, k, len(part))] if k else None
        for j, (seg, _, _) in enumerate(part):
            res = results[id(seg)]
            res.prompt_logprobs.append(lps[j])
            if seg.req.top_logprobs_num:
                res.prompt_tops.append((tops[0][j], tops[1][j]))
    return results
