"""Continuous batching: which tokens of which requests go into the next forward.

Two queues, as in nano-vllm/SGLang: `waiting` (new requests, and retracted ones at the FRONT) and
`running` (requests holding KV pages, in admission order). Each step builds ONE flat batch:

1. grow: every decoding request whose next token starts a new page gets one; if the pool (after
   prefix-cache eviction) cannot supply it, the latest-admitted running request is retracted;
2. decode rows: one token per decoding request;
3. prefill chunks: the prompt remainder of running requests, at most --chunked-prefill-size tokens
   per request, until the step's --max-prefill-tokens budget (decode tokens included) is spent;
4. admission: from the front of `waiting` while budget, --max-running-requests and pages allow. A
   new request takes its prefix-cache hit and pages for its whole prompt; a retracted one takes
   fresh pages and gets its image written back.

The scheduler owns no device and imports nothing that does: it moves no bytes itself. Every page
move it decides -- a copy-on-write of a prefix hit's tail page, a retraction's save to host bytes, a
resume's restore -- becomes a `KVTransfer` command in the step's `kv_transfers`, in decision order,
and the runner executes them before the step's forward (engine/step_executor.py). The scheduler never
looks at logits either; the engine turns the step's hidden rows into tokens and calls `commit` for
each segment afterwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from jengine.engine.batch import KVTransfer, PageCopy, PageRestore, PageSave, StepBatch
from jengine.engine.kv_manager import KVManager
from jengine.engine.prefix_cache import PrefixCache
from jengine.engine.request import Req, ReqStatus, RetractionImage
from jengine.models.kv_cache import NULL_PAGE


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_context: int
    chunked_prefill_size: int = 256
    max_prefill_tokens: int = 512
    max_running_requests: int = 32
    enable_prefix_cache: bool = True
    debug_force_retraction_interval: int = 0  # every N steps; N < 0 also retracts mid-prefill


@dataclass(eq=False)
class Segment:
    """The tokens one request contributes to a step: fill_ids[start : start + length]."""

    req: Req
    start: int
    length: int
    sample: bool  # the last row's hidden state samples the request's next token
    scored: range  # prompt positions whose rows score prompt_ids[p + 1]
    first_row: int = 0  # the step row of fill_ids[start]; the segment's rows follow it
    scored_hidden: list[int] = field(default_factory=list)  # indices into the forward's output
    sample_hidden: int | None = None


@dataclass
class ScheduledStep:
    """One step for the runner: first the page transfers, in order, then the forward of `batch`.

    `batch` is None (and `segments` empty) when nothing fits this step; the transfers still run --
    a retraction that freed pages for nobody has its bytes to save all the same.
    """

    kv_transfers: list[KVTransfer]
    batch: StepBatch | None = None
    segments: list[Segment] = field(default_factory=list)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVManager) -> None:
        self.cfg = cfg
        self.kv = kv
        # Page moves decided since the last schedule() returned; it hands them to the runner.
        self._transfers: list[KVTransfer] = []
        self.cache = PrefixCache(kv) if cfg.enable_prefix_cache else None
        if self.cache is not None:
            kv.evict_hook = self.cache.evict
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.finished_by_scheduler: list[Req] = []  # aborted here; the engine reports them
        self.step_count = 0
        self._admit_seq = 0
        self.retractions_total = 0
        self.cache_hit_tokens_total = 0

    # -- queue management -----------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, rid: str) -> Req | None:
        for req in list(self.running) + list(self.waiting):
            if req.rid == rid:
                return req
        return None

    def finish(self, req: Req, cache_kv: bool = True) -> None:
        """Take a finished request out of the queues, offer its KV to the prefix cache, free pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if (cache_kv and req.kv_reusable and self.cache is not None and req.num_computed > 0
                and req.pages):
            tokens = req.fill_ids[: req.num_computed]
            self.cache.insert(tokens, req.pages[: self.kv.pages_for(len(tokens))])
        self.kv.decref(req.pages)
        req.pages = []
        req.image = None

    def flush_cache(self) -> None:
        if self.cache is not None:
            self.cache.flush()

    def retract_all(self) -> list[KVTransfer]:
        """Retract every running request (KV saved to host, pages freed) and hand back the page
        saves to run NOW: no step follows while generation is paused."""
        for req in sorted(self.running, key=lambda r: r.admit_seq, reverse=True):
            self.retract(req)  # latest first, so the earliest ends up first in `waiting`
        transfers, self._transfers = self._transfers, []
        return transfers

    # -- retraction -----------------------------------------------------------------------------
    def retract(self, req: Req) -> None:
        """Suspend a running request: order its KV copied out byte for byte, free its pages (the save
        is ordered before anything that reuses them), requeue it first."""
        n = self.kv.pages_for(req.num_computed)
        req.image = RetractionImage(num_pages=n, num_computed=req.num_computed)
        if n:
            self._transfers.append(PageSave(tuple(req.pages[:n]), req.image))
        self.kv.decref(req.pages)
        req.pages = []
        self.running.remove(req)
        req.status = ReqStatus.RETRACTED
        req.retractions += 1
        self.retractions_total += 1
        self.waiting.appendleft(req)

    def _pages_wanted(self, req: Req) -> int:
        """Pages a running request must hold before its next segment: the whole prompt while it
        prefills (allocated at admission), one more page when its next decode token starts one."""
        if req.is_prefilling:
            return self.kv.pages_for(req.prompt_len)
        return self.kv.pages_for(req.num_computed + 1)

    def _restore(self, req: Req) -> bool:
        image = req.image
        pages = self.kv.alloc(self._pages_wanted(req))
        if pages is None:
            return False
        if image.num_pages:
            self._transfers.append(PageRestore(tuple(pages[: image.num_pages]), image))
        assert req.num_computed == image.num_computed
        req.pages = pages
        req.image = None
        return True

    def _admit_new(self, req: Req) -> bool:
        # At least one prompt token is always computed (it yields the logits of the first output);
        # a prompt-logprob request recomputes every scored row (spec: hit capped at
        # logprob_start_len).
        max_hit = req.prompt_len - 1
        if req.return_logprob:
            max_hit = min(max_hit, req.logprob_start_len)
        if req.return_routed_experts:
            # A cached prefix's routing was computed by an earlier request and is not stored with
            # its pages: the request recomputes its whole prompt, so every position has its ids.
            max_hit = 0
        match = None
        if self.cache is not None and max_hit > 0:
            match = self.cache.match(req.prompt_ids, max_hit)
        shared = list(match.shared_pages) if match else []
        partial = [match.partial_page] if match and match.partial_page is not None else []
        # Hold the hit's pages before allocating, so eviction cannot take them from under us.
        self.kv.incref(shared + partial)
        fresh = self.kv.alloc(self.kv.pages_for(req.prompt_len) - len(shared))
        if fresh is None:
            self.kv.decref(shared + partial)
            return False
        if partial:
            # Copy-on-write: the cached node keeps the tail page; we write after the tail.
            self._transfers.append(PageCopy(tuple(partial), tuple(fresh[:1])))
            self.kv.decref(partial)
        req.pages = shared + fresh
        req.num_computed = req.cached_tokens = match.length if match else 0
        self.cache_hit_tokens_total += req.cached_tokens
        return True

    def _admit(self, req: Req) -> bool:
        ok = self._restore(req) if req.status is ReqStatus.RETRACTED else self._admit_new(req)
        if ok:
            req.status = ReqStatus.RUNNING
            req.admit_seq = self._admit_seq
            self._admit_seq += 1
        return ok

    def _abort_exhausted(self, req: Req) -> None:
        self.finish(req, cache_kv=False)
        req.finish("abort", message=f"KV pool exhausted: {req.num_tokens} tokens do not fit "
                   f"--max-total-tokens={self.kv.capacity_pages * self.kv.page_size}")
        self.finished_by_scheduler.append(req)

    def _grow(self) -> None:
        for req in list(self.running):
            if req not in self.running:
                continue  # retracted as a victim of an earlier request's growth
            while (need := self._pages_wanted(req) - len(req.pages)) > 0:
                pages = self.kv.alloc(need)
                if pages is not None:
                    req.pages += pages
                    break
                if len(self.running) == 1:
                    # Alone, cache evicted, and still short: the request outgrew the whole pool.
                    self._abort_exhausted(req)
                    break
                victim = max(self.running, key=lambda r: r.admit_seq)
                self.retract(victim)
                if victim is req:
                    break

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        self.step_count += 1
        interval = self.cfg.debug_force_retraction_interval
        if interval and self.step_count % abs(interval) == 0:
            for req in sorted(self.running, key=lambda r: r.admit_seq, reverse=True):
                if interval < 0 or not req.is_prefilling:
                    self.retract(req)

        self._grow()
        budget = self.cfg.max_prefill_tokens
        plan: list[tuple[Req, int]] = []
        for req in sorted(self.running, key=lambda r: r.is_prefilling):  # decodes first (stable)
            n = min(req.num_pending, self.cfg.chunked_prefill_size, budget)
            if n > 0:
                plan.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if not self._admit(req):
                if not self.running:
                    # Nothing holds pages (the cache was evicted too) and it still does not fit.
                    self._abort_exhausted(req)
                    continue
                break  # first come, first served: the head waits for pages
            self.waiting.popleft()
            self.running.append(req)
            n = min(req.num_pending, self.cfg.chunked_prefill_size, budget)
            plan.append((req, n))
            budget -= n
        transfers, self._transfers = self._transfers, []
        if not plan:
            return ScheduledStep(transfers)
        return ScheduledStep(transfers, *self._build(plan))

    def _build(self, plan: list[tuple[Req, int]]) -> tuple[StepBatch, list[Segment]]:
        width = max(len(req.pages) for req, _ in plan)
        block_tables = np.full((len(plan), width), NULL_PAGE, np.int32)
        input_ids: list[int] = []
        positions: list[int] = []
        token_req: list[int] = []
        hidden_rows: list[int] = []
        segments = []
        for row, (req, n) in enumerate(plan):
            start = req.num_computed
            assert self.kv.pages_for(start + n) <= len(req.pages), "segment outruns its page table"
            block_tables[row, : len(req.pages)] = req.pages
            base = len(input_ids)
            input_ids += _fill_slice(req, start, start + n)
            positions += range(start, start + n)
            token_req += [row] * n
            seg = Segment(req=req, start=start, length=n, first_row=base,
                          sample=start + n == req.num_tokens and req.sampling.max_new_tokens > 0,
                          scored=req.scored_rows(start, start + n))
            for p in seg.scored:
                seg.scored_hidden.append(len(hidden_rows))
                hidden_rows.append(base + p - start)
            if seg.sample:
                seg.sample_hidden = len(hidden_rows)
                hidden_rows.append(base + n - 1)
            segments.append(seg)
        batch = StepBatch(input_ids=input_ids, positions=positions, token_req=token_req,
                          block_tables=block_tables, hidden_rows=hidden_rows)
        return batch, segments

    def commit(self, seg: Segment) -> None:
        """The segment's K/V are written: advance the frontier; publish a finished prompt."""
        req = seg.req
        req.num_computed = seg.start + seg.length
        if self.cache is not None and seg.start < req.prompt_len <= req.num_computed:
            # Prompt end is a publication point: a later request with this prompt resumes here.
            self.cache.insert(req.prompt_ids, req.pages[: self.kv.pages_for(req.prompt_len)])


def _fill_slice(req: Req, start: int, end: int) -> list[int]:
    """req.fill_ids[start:end] without building fill_ids: that copies the whole context, for
    every row of every step (64 rows x 1k tokens of list copies per decode step at the bench's
    shape) to take one token."""
    prompt = req.prompt_len
    if start >= prompt:
        return req.output_ids[start - prompt: end - prompt]
    if end <= prompt:
        return req.prompt_ids[start:end]
    return req.prompt_ids[start:] + req.output_ids[: end - prompt]
