"""The runner's scoring on the vocab-parallel LM head: greedy ids, logprobs and top-k of a step's
rows while every tensor-parallel rank keeps its own logits columns (sharding/vocab_parallel.py
builds the programs and says why the bits are the Sampler's).

`VocabParallelScoring` holds one head program per Sampler plan set -- or None where the launch
cannot score without the gather (tp_size == 1, a logprob order whose blocks straddle ranks) -- and
pads the rows to the same buckets as `ModelRunner.logits_at`.
"""

from __future__ import annotations

import logging

import numpy as np

from jengine.engine.placement import RunnerPlacement
from pallas_kernels.fixed_order import next_pow2
from sharding.vocab_parallel import make_vocab_parallel_head

logger = logging.getLogger(__name__)


class VocabParallelScoring:
    def __init__(self, placement: RunnerPlacement, model, row_bucket: int):
        """model: params -> the nnx model (the runner's `_model`); row_bucket: the smallest row
        bucket (`logits_at`'s)."""
        self._placement = placement
        self._model = model
        self._row_bucket = row_bucket
        self._heads = {}  # the Sampler's plans -> vocab_parallel_head's program (or None)

    def head(self, sampler, params: tuple):
        """The head program scoring like `sampler`, or None where the step must gather logits."""
        if self._placement.tp is None:
            return None
        key = tuple(sorted(sampler.describe().items()))
        if key not in self._heads:
            def local_logits(params, hidden):  # the LM head without tp: this rank's columns
                model = self._model(params)
                return model.lm_head(model.kernels, hidden, out_dtype=model.dtype)

            try:
                head = make_vocab_parallel_head(
                    self._placement.mesh, tuple(p.sharding.spec for p in params), local_logits,
                    order=sampler.logprob_order, block_sumexp_plan=sampler.block_sumexp_plan,
                    argmax_plan=sampler.argmax_plan, vocab_size=sampler.vocab_size,
                    head_columns=sampler.vocab_size + self._placement.head_pad)
            except ValueError as e:
                logger.info("the step gathers the logits: %s", e)
                head = None
            self._heads[key] = head
        return self._heads[key]

    def score_rows(self, params: tuple, hidden_padded, rows, sampler, *, target_ids=None,
                   k: int = 0) -> tuple[np.ndarray, np.ndarray, tuple | None]:
        """`ModelRunner.score_rows`."""
        head = self.head(sampler, params)
        if head is None:
            raise ValueError("score_rows: no vocab-parallel head here (tp_size=1, or a logprob "
                             "order whose blocks straddle ranks); use logits_at and the Sampler")
        n = len(rows)
        bucket = next_pow2(n, self._row_bucket)  # logits_at's buckets
        idx, ids = np.zeros(bucket, np.int32), np.zeros(bucket, np.int32)
        idx[:n] = rows
        if target_ids is not None:
            ids[:n] = target_ids
        greedy, logprobs, values, top_ids = head(params, hidden_padded, idx, ids,
                                                 greedy_targets=target_ids is None, k=k)
        tops = (np.asarray(values)[:n], np.asarray(top_ids)[:n]) if k else None
        return np.asarray(greedy)[:n].astype(np.int32), np.asarray(logprobs)[:n], tops
