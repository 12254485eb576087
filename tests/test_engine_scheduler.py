"""Scheduler, paged KV, prefix cache and retraction, tested exactly against a fake model.

The fake runner keeps a real paged KV pool (one uint64 "K/V" per token slot). A token's K/V chains
on the K/V of the previous position, read back through the block table, and a hidden row folds the
K/V of every position up to it -- so a wrong page table, a missing copy-on-write, a restore that
writes the wrong bytes or a prefix hit at the wrong length changes the logits, and with them the
greedy tokens. The reference (`reference_greedy`) computes the same chain with no pages at all.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from jengine.config import LaunchConfig
from jengine.launch import plan_launch
from jengine.numerics import resolve_launch
from jengine.engine.batch import PageRestore, PageSave, fill_placeholders
from jengine.engine.engine import Engine
from jengine.engine.kv_manager import KVManager
from jengine.engine.model_runner import ModelRunner
from jengine.engine.prefix_cache import PrefixCache
from jengine.engine.io_struct import visible_text
from jengine.engine.output_processor import RequestState
from jengine.engine.request import Req, RetractionImage, SamplingParams, derive_sample_seeds
from jengine.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from jengine.engine.step_executor import execute_step
from jengine.models.kv_cache import NULL_PAGE

VOCAB = 32
MASK = (1 << 64) - 1


def mix(a: int, b: int) -> int:
    x = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & MASK
    x ^= x >> 29
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    return x ^ (x >> 32)


def kv_value(prev: int, token: int, pos: int) -> int:
    return mix(mix(prev, token), pos)


def fake_logits(h: int) -> np.ndarray:
    return np.random.default_rng(h).standard_normal(VOCAB).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(np.float32)


class FakeRunner:
    def __init__(self, page_size=4, num_pages=64, max_context=160, poison_token=None, step_delay=0.0):
        self.page_size, self.num_pages, self.max_context = page_size, num_pages, max_context
        self.kv = np.zeros((num_pages, page_size), np.uint64)
        self.poison_token = poison_token
        self.step_delay = step_delay
        self.null_reads = 0

    def _slot(self, table, pos):
        page = int(table[pos // self.page_size])
        if page == NULL_PAGE:
            self.null_reads += 1
        return page, pos % self.page_size

    def forward_padded(self, batch, previous_tokens=None):
        """Like the real runner: one entry per step row (only hidden_rows are computed here);
        placeholder rows read the previous step's sampled tokens (the overlap schedule)."""
        if previous_tokens is not None:
            batch = dataclasses.replace(batch, input_ids=fill_placeholders(
                batch.input_ids, np.asarray(previous_tokens)))
        assert (batch.input_ids >= 0).all(), "a placeholder row without the previous tokens"
        out = np.zeros(len(batch.input_ids), np.uint64)
        out[batch.hidden_rows] = self.forward(batch)
        return out

    def logits_at(self, hidden, rows):
        """Like the real runner: the rows' logits, then padding rows up to a power of two >= 8."""
        logits = self.compute_logits(hidden[np.asarray(rows, np.int64)])
        pad = max(8, 1 << max(len(rows) - 1, 0).bit_length()) - len(rows)
        return np.concatenate([logits, np.full((pad, VOCAB), np.nan)])

    def forward(self, batch):
        time.sleep(self.step_delay)
        if self.poison_token is not None and self.poison_token in batch.input_ids:
            raise RuntimeError("poisoned step")
        for tok, pos, r in zip(batch.input_ids, batch.positions, batch.token_req):
            table = batch.block_tables[r]
            prev = int(self.kv[self._slot(table, pos - 1)]) if pos > 0 else 0
            self.kv[self._slot(table, pos)] = np.uint64(kv_value(prev, int(tok), int(pos)))
        rows = []
        for i in batch.hidden_rows:
            table, pos = batch.block_tables[batch.token_req[i]], int(batch.positions[i])
            h = 0
            for q in range(pos + 1):  # "attention" over every position up to this one
                h = mix(h, int(self.kv[self._slot(table, q)]))
            rows.append(h)
        return np.array(rows, np.uint64)

    def compute_logits(self, hidden):
        return np.stack([fake_logits(int(h)) for h in hidden]) if len(hidden) else np.zeros((0, VOCAB))

    def copy_pages(self, src, dst):
        self.kv[dst] = self.kv[src]

    def read_pages(self, pages):
        return self.kv[pages].copy()

    def write_pages(self, pages, data):
        self.kv[pages] = data

    # The real runner's dispatch of the scheduler's page commands, over this fake's pages.
    execute_kv_transfers = ModelRunner.execute_kv_transfers


class FakeSampler:
    def sample(self, logits, rows):
        out = []
        for i, row in enumerate(logits[:len(rows.temperature)]):  # rows past S are padding
            if rows.temperature[i] == 0:
                out.append(int(np.argmax(row)))
            else:  # keyed by (seed, position) only, like the real per-request stream
                g = np.random.default_rng([int(rows.seed[i]), int(rows.position[i])]).gumbel(size=VOCAB)
                out.append(int(np.argmax(row / rows.temperature[i] + g)))
        return np.array(out, np.int32)

    def token_logprobs(self, logits, ids):
        return log_softmax(np.asarray(logits))[np.arange(len(ids)), ids]

    # The engine's calls: the Sampler's padded buckets, here host arrays (this fake has no device).
    def sample_on_device(self, logits, rows):
        tokens = self.sample(logits, rows)
        return np.pad(tokens, (0, max(8, 1 << max(len(tokens) - 1, 0).bit_length()) - len(tokens)))

    def token_logprobs_on_device(self, logits, ids):
        return self.token_logprobs(np.asarray(logits)[:len(ids)], ids)

    def top_logprobs_on_device(self, logits, k, rows):
        return self.top_logprobs(logits, k, rows)

    def top_logprobs(self, logits, k, rows=None):
        lp = log_softmax(np.asarray(logits)[:rows])
        ids = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
        return np.take_along_axis(lp, ids, -1), ids.astype(np.int32)


class FakeDetokenizer:
    def __init__(self, prompt_ids=()):
        pass

    def add(self, t):
        return chr(ord("a") + t % 26)

    def flush(self):
        return ""


def fake_model_config(max_context: int) -> SimpleNamespace:
    """The ModelConfig fields the launch plan reads, for a model that is only a FakeRunner."""
    return SimpleNamespace(architecture="FakeForCausalLM", vocab_size=VOCAB, input_vocab_size=VOCAB + 8,
                           max_position_embeddings=max_context, torch_dtype="float32",
                           quantization_config=None, num_experts=0, kv_lora_rank=0,
                           rope_scaling=None)


def make_engine(runner=None, eos=(), detokenizer_factory=FakeDetokenizer, **launch):
    """An engine over a FakeRunner, planned through the real launch path (jengine.launch): the
    pool the plan sizes is the fake's (num_pages, page_size), its context the fake's."""
    runner = runner or FakeRunner()
    cfg = LaunchConfig(**{"chunked_prefill_size": 8, "max_prefill_tokens": 24,
                          "max_running_requests": 8, "page_size": runner.page_size,
                          "max_total_tokens": (runner.num_pages - 1) * runner.page_size, **launch})
    model_config = fake_model_config(runner.max_context)
    plan = plan_launch(resolve_launch(cfg, hardware="cpu", probe_xla_flags=False), model_config)
    assert (plan.kv.num_pages, plan.kv.page_size) == (runner.num_pages, runner.page_size)
    return Engine.from_components(
        plan=plan, model_config=model_config,
        tokenizer=SimpleNamespace(encode=lambda s: [ord(c) % VOCAB for c in s]), eos_token_ids=eos,
        runner=runner, sampler=FakeSampler(), detokenizer_factory=detokenizer_factory)


def ref_hidden(tokens):
    kv, h_rows, prev = [], [], 0
    for p, t in enumerate(tokens):
        prev = kv_value(prev, t, p)
        kv.append(prev)
    for p in range(len(tokens)):
        h = 0
        for q in range(p + 1):
            h = mix(h, kv[q])
        h_rows.append(h)
    return h_rows


def reference_greedy(prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(fake_logits(ref_hidden(tokens)[-1]))))
    return tokens[len(prompt):]


def greedy(n, **kw):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **kw}


def assert_pool_clean(eng):
    """After all requests: every used page belongs to the prefix cache alone."""
    eng.kv.check_consistent()
    cache = eng.scheduler.cache
    held = cache.num_pages if cache else 0
    assert eng.kv.num_used == held
    if cache:
        cache.flush()
    assert eng.kv.num_used == 0


@pytest.fixture
def rnd():
    return random.Random(1234)


# -- the reference property under load --------------------------------------------------------------
@pytest.mark.parametrize("launch", [
    {},
    {"disable_radix_cache": True},
    {"debug_force_retraction_interval": 3},
    {"debug_force_retraction_interval": -2, "chunked_prefill_size": 3},
])
def test_concurrent_mixed_requests_match_reference(launch, rnd):
    # 40 pages x 4 tokens: far less than the load needs at once, so retraction and eviction happen.
    eng = make_engine(FakeRunner(num_pages=41), **launch)
    base = [rnd.randrange(VOCAB) for _ in range(20)]
    prompts = [base[: rnd.randrange(1, 20)] + [rnd.randrange(VOCAB) for _ in range(rnd.randrange(0, 12))]
               for _ in range(24)]
    lengths = [rnd.randrange(1, 24) for _ in prompts]
    with eng:
        outs = eng.generate(input_ids=prompts, sampling_params=[greedy(n) for n in lengths])
        for prompt, n, out in zip(prompts, lengths, outs):
            assert out["output_ids"] == reference_greedy(prompt, n)
            assert out["meta_info"]["finish_reason"] == {"type": "length"}
            assert out["meta_info"]["completion_tokens"] == n
        stats = eng.stats()
        if launch.get("debug_force_retraction_interval"):
            assert stats["retractions_total"] >= len(prompts)
        assert eng.runner.null_reads == 0
        assert_pool_clean(eng)


@pytest.mark.parametrize("launch", [{}, {"disable_overlap_schedule": True},
                                    {"debug_force_retraction_interval": 2}])
def test_token_stops_end_requests_exactly(launch, rnd):
    """stop_token_ids end most requests mid-run. Under the overlap schedule such a request is known
    to have ended one step late: its extra row is computed and discarded, and its KV (cached, its
    pages handed on) must not reach any other request -- the fake's KV chain would show it."""
    eng = make_engine(FakeRunner(num_pages=41), **launch)
    prompts = [[rnd.randrange(VOCAB) for _ in range(rnd.randrange(1, 14))] for _ in range(24)]
    stops = [[rnd.randrange(VOCAB), rnd.randrange(VOCAB)] for _ in prompts]
    with eng:
        outs = eng.generate(input_ids=prompts, sampling_params=[
            greedy(16, ignore_eos=False, stop_token_ids=s) for s in stops])
        ended_by_token = 0
        for prompt, stop, out in zip(prompts, stops, outs):
            want = reference_greedy(prompt, 16)
            cut = next((i + 1 for i, t in enumerate(want) if t in stop), 16)
            assert out["output_ids"] == want[:cut]
            ended_by_token += cut < 16
        assert ended_by_token >= 6
        assert eng.runner.null_reads == 0
        assert_pool_clean(eng)


def test_pool_exhaustion_retracts_and_completes():
    runner = FakeRunner(num_pages=9)  # 8 pages = 32 tokens for eight requests of 5 + 12 tokens
    eng = make_engine(runner, disable_radix_cache=True)
    prompts = [[i, i + 1, 2, 3, 4] for i in range(8)]
    with eng:
        outs = eng.generate(input_ids=prompts, sampling_params=greedy(12))
        assert [o["output_ids"] for o in outs] == [reference_greedy(p, 12) for p in prompts]
        assert eng.stats()["retractions_total"] > 0
        # A request longer than the whole pool is aborted with a message; the engine keeps serving.
        big = eng.generate(input_ids=[1, 2, 3], sampling_params=greedy(40))
        assert big["meta_info"]["finish_reason"]["type"] == "abort"
        assert "KV pool exhausted" in big["meta_info"]["finish_reason"]["message"]
        assert eng.generate(input_ids=[5, 6], sampling_params=greedy(3))["output_ids"] == reference_greedy([5, 6], 3)
        assert_pool_clean(eng)


# -- prefix cache -------------------------------------------------------------------------------------
def test_prefix_hit_resumes_at_exact_token_count():
    eng = make_engine()
    with eng:
        a = [3, 1, 4, 1, 5, 9, 2]  # 7 tokens: the prompt end sits mid-page (page_size 4)
        out_a = eng.generate(input_ids=a, sampling_params=greedy(3))
        assert out_a["meta_info"]["cached_tokens"] == 0
        # Prompt end published at 7; the finish at 7 + 3 - 1 = 9 tokens (the last sampled token
        # has no K/V yet). A prompt extending A's full sequence hits all 9.
        b = a + out_a["output_ids"] + [7, 7]
        out_b = eng.generate(input_ids=b, sampling_params=greedy(4))
        assert out_b["meta_info"]["cached_tokens"] == 9
        assert out_b["output_ids"] == reference_greedy(b, 4)
        # Diverging after 6 tokens: hit 6 (inside a cached page: copied, not shared).
        c = a[:6] + [0, 0, 0]
        out_c = eng.generate(input_ids=c, sampling_params=greedy(4))
        assert out_c["meta_info"]["cached_tokens"] == 6
        assert out_c["output_ids"] == reference_greedy(c, 4)
        # The cached run A was not overwritten by C's writes after the shared tail (copy-on-write).
        again = eng.generate(input_ids=b, sampling_params=greedy(4))
        assert again["meta_info"]["cached_tokens"] == len(b) - 1
        assert again["output_ids"] == out_b["output_ids"]
        # A hit never covers the whole prompt: the last prompt token is always computed.
        assert eng.generate(input_ids=a, sampling_params=greedy(3))["meta_info"]["cached_tokens"] == 6
        assert eng.stats()["cache_hit_tokens_total"] > 0
        assert eng.flush_cache()
        assert eng.generate(input_ids=a, sampling_params=greedy(1))["meta_info"]["cached_tokens"] == 0
        assert_pool_clean(eng)


def test_prefix_cache_unit_split_evict_and_partial_leaves():
    kv = KVManager(num_pages=20, page_size=4)
    cache = PrefixCache(kv)
    kv.evict_hook = cache.evict
    seq = list(range(10))
    pages = kv.alloc(3)
    cache.insert(seq[:6], pages[:2])  # prompt end mid-page: a partial leaf
    assert cache.match(seq, 10).length == 6
    cache.insert(seq, pages)  # the finish extends it: the partial leaf is dropped, not duplicated
    assert cache.num_pages == 3 and [kv.refcount(p) for p in pages] == [2, 2, 2]
    m = cache.match(seq[:5] + [99, 99], 7)
    assert (m.length, m.shared_pages, m.partial_page) == (5, pages[:1], pages[1])
    other = kv.alloc(2)
    cache.insert(seq[:5] + [99, 99, 98], [pages[0], other[0]])  # splits after page 0
    assert cache.match(seq[:5] + [99, 99, 98, 1], 100).length == 8
    assert cache.match(seq, 100).length == 10
    kv.decref(pages)
    kv.decref(other)  # the tree is the only holder now; other[1] was never cached
    assert kv.num_used == 4
    # Least recently used leaf first: the [99, 99, 98] branch (seq was matched after it).
    assert cache.evict(1) == 1
    assert cache.match(seq[:5] + [99, 99, 98, 1], 100).length == 5  # still inside seq's page 1
    assert cache.match(seq, 100).length == 10
    assert cache.evict(2) == 2  # seq's tail leaf; the shared first page stays
    assert cache.match(seq, 100).length == 4
    cache.flush()
    kv.check_consistent()
    assert kv.num_used == 0


def test_prompt_logprobs_recomputed_under_a_prefix_hit():
    eng = make_engine(input_logprob_chunk_tokens=3)
    prompt = [5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4]
    with eng:
        eng.generate(input_ids=prompt, sampling_params=greedy(2))  # cache the whole prompt
        out = eng.generate(input_ids=prompt, sampling_params=greedy(0), return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=2)
        meta = out["meta_info"]
        assert meta["cached_tokens"] == 0  # capped at logprob_start_len = 0
        assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length"}
        hidden = ref_hidden(prompt)
        expected = [log_softmax(fake_logits(hidden[p]))[prompt[p + 1]] for p in range(len(prompt) - 1)]
        got = meta["input_token_logprobs"]
        assert got[0] == (None, prompt[0], None) and len(got) == len(prompt)
        assert [t for _, t, _ in got] == prompt
        assert np.array(expected, np.float32).view(np.uint32).tolist() == \
            np.array([v for v, _, _ in got[1:]], np.float32).view(np.uint32).tolist()
        assert len(meta["input_top_logprobs"]) == len(prompt) and meta["input_top_logprobs"][0] is None
        # From logprob_start_len = 6 the hit may cover at most 6 tokens.
        out6 = eng.generate(input_ids=prompt, sampling_params=greedy(1), return_logprob=True,
                            logprob_start_len=6)
        assert out6["meta_info"]["cached_tokens"] == 6
        lp6 = [v for v, _, _ in out6["meta_info"]["input_token_logprobs"]]
        assert lp6[0] is None and lp6[1:] == [float(x) for x in expected[6:]]
        # Output logprobs use the same function as prompt logprobs.
        (lp, tok, _), = out6["meta_info"]["output_token_logprobs"]
        assert lp == float(log_softmax(fake_logits(hidden[-1]))[tok])


# -- the scheduler is device-free: its page moves are commands the runner executes in order ----------
class RecordingRunner(FakeRunner):
    """Logs each page operation and forward, in the order the runner performs them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log = []

    def forward_padded(self, batch, previous_tokens=None):
        self.log.append(("forward",))
        return super().forward_padded(batch, previous_tokens)

    def copy_pages(self, src, dst):
        self.log.append(("copy", list(src), list(dst)))
        super().copy_pages(src, dst)

    def read_pages(self, pages):
        self.log.append(("read", list(pages)))
        return super().read_pages(pages)

    def write_pages(self, pages, data):
        self.log.append(("write", list(pages)))
        super().write_pages(pages, data)


def run_one_step(sched, runner):
    """The engine's step without its thread: schedule, execute, commit, append the sampled tokens."""
    step = sched.schedule()
    results = execute_step(runner, FakeSampler(), step, input_logprob_chunk_tokens=64)
    for seg in step.segments:
        sched.commit(seg)
        if seg.sample:
            seg.req.append_token(results[id(seg)].token, eos_token_ids=frozenset(), max_context=64)
            if seg.req.finished:
                sched.finish(seg.req)
    return step


def test_retraction_and_resume_are_page_commands_run_in_order():
    runner = RecordingRunner(num_pages=5)  # 4 pages of 4 tokens: two 8-token prompts fill the pool
    sched = Scheduler(SchedulerConfig(page_size=4, max_context=64, chunked_prefill_size=16,
                                      max_prefill_tokens=16, enable_prefix_cache=False,
                                      debug_force_retraction_interval=2), KVManager(5, 4))
    a, b = reqs = [Req(rid=r, prompt_ids=p, seed=0, sampling=SamplingParams(max_new_tokens=3, temperature=0))
                   for r, p in (("a", list(range(1, 9))), ("b", list(range(9, 17))))]
    for req in reqs:
        sched.add_request(req)
    assert run_one_step(sched, runner).kv_transfers == []  # both prompts prefill
    assert (a.pages, b.pages) == ([1, 2], [3, 4])
    before = {req.rid: runner.kv[req.pages].copy() for req in reqs}
    runner.log.clear()

    # Step 2 retracts both (forced), then resumes a at once -- into b's freed pages 3 and 4, so b's
    # save must run before a's restore, and both before the forward.
    step = run_one_step(sched, runner)
    save_b, save_a, restore_a = step.kv_transfers
    assert (type(save_b), type(save_a), type(restore_a)) == (PageSave, PageSave, PageRestore)
    assert (save_b.pages, save_a.pages, restore_a.pages) == ((3, 4), (1, 2), (3, 4))
    assert restore_a.image is save_a.image
    assert runner.log == [("read", [3, 4]), ("read", [1, 2]), ("write", [3, 4]), ("forward",)]
    assert np.array_equal(save_a.image.kv, before["a"]) and np.array_equal(save_b.image.kv, before["b"])
    assert np.array_equal(runner.kv[[3, 4]], before["a"])  # the restore wrote the saved bytes back

    for _ in range(10):
        if not sched.has_work():
            break
        run_one_step(sched, runner)
    assert ("write", [2, 3]) in runner.log  # b resumed later, into other fresh pages
    assert [req.output_ids for req in reqs] == [reference_greedy(req.prompt_ids, 3) for req in reqs]
    assert runner.null_reads == 0 and sched.kv.num_used == 0
    sched.kv.check_consistent()


def test_page_transfers_run_even_when_the_step_has_no_forward():
    runner = RecordingRunner()
    runner.kv[5] = np.arange(4, dtype=np.uint64) + 7
    image = RetractionImage(num_pages=1, num_computed=3)
    assert not image.saved  # the scheduler creates it; only the runner fills it
    assert execute_step(runner, FakeSampler(), ScheduledStep([PageSave((5,), image)]), 64) == {}
    assert runner.log == [("read", [5])] and image.saved
    assert np.array_equal(image.kv, runner.kv[[5]])
    with pytest.raises(RuntimeError, match=r"restore into pages \[6\]: its image was never saved"):
        runner.execute_kv_transfers([PageRestore((6,), RetractionImage(num_pages=1, num_computed=3))])


def test_scheduler_imports_no_device_library():
    probe = ("import sys, {module}; print(sorted(m for m in ('jax', 'jaxlib', 'torch', 'triton') "
             "if m in sys.modules))")
    code = "; ".join([probe.format(module="jengine.engine.scheduler"),
                      probe.format(module="jengine.engine.model_runner")])  # the control: it does
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split("\n")
    assert out[0] == "[]"
    assert "jax" in out[1]


# -- sampling streams ---------------------------------------------------------------------------------
def test_sampled_tokens_independent_of_batch_and_retraction():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [2, 2]]
    params = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "seed": 11}
    with make_engine() as eng:
        alone = [eng.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    with make_engine(debug_force_retraction_interval=2) as eng:
        packed = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert packed == alone
    with make_engine() as eng:
        other_seed = eng.generate(input_ids=prompts[0], sampling_params={**params, "seed": 12})
        assert other_seed["output_ids"] != alone[0]  # negative control: the seed matters
        outs = eng.generate(input_ids=prompts[0], sampling_params={**params, "n": 3}, rid="x")
        assert [o["meta_info"]["id"] for o in outs] == ["x-0", "x-1", "x-2"]
        assert len({tuple(o["output_ids"]) for o in outs}) == 3
        assert len(set(derive_sample_seeds(11, 8))) == 8


# -- stop conditions ----------------------------------------------------------------------------------
def test_stop_conditions():
    prompt = [1, 2, 3]
    ref = reference_greedy(prompt, 12)
    letters = "".join(chr(ord("a") + t % 26) for t in ref)
    with make_engine(eos=(ref[4],)) as eng:
        out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0})
        first = ref.index(ref[4])
        assert out["output_ids"] == ref[: first + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[4]}
        out = eng.generate(input_ids=prompt, sampling_params=greedy(12, stop_token_ids=[ref[2]]))
        assert out["output_ids"] == ref[: ref.index(ref[2]) + 1]
        stop = letters[5:7]
        out = eng.generate(input_ids=prompt, sampling_params=greedy(12, stop=stop))
        at = letters.index(stop)
        assert out["text"] == letters[:at] and out["meta_info"]["finish_reason"]["matched"] == stop
        out = eng.generate(input_ids=prompt, sampling_params=greedy(12, stop=[stop], no_stop_trim=True))
        assert out["text"] == letters[: at + 2]
        # Context length: 160 tokens; a 150-token prompt gets 10 tokens.
        out = eng.generate(input_ids=[1] * 150, sampling_params=greedy(50))
        assert len(out["output_ids"]) == 10 and out["meta_info"]["finish_reason"]["type"] == "length"
        out = eng.generate(input_ids=[1] * 150, sampling_params=greedy(None))  # None: up to the context
        assert len(out["output_ids"]) == 10


def test_streaming_callbacks_and_abort():
    with make_engine() as eng:
        seen = []
        h = eng.submit(input_ids=[1, 2, 3], sampling_params=greedy(5), stream=True, on_output=seen.append)
        final = h.result(timeout=30)
        assert [len(o["output_ids"]) for o in seen] == [1, 2, 3, 4, 5]
        assert seen[-1] == final and final["finished"]
        # Abort from inside a callback (the engine thread) after the third token.
        h = eng.submit(input_ids=[1, 2, 3], sampling_params=greedy(150), stream=True, rid="long",
                       on_output=lambda o: len(o["output_ids"]) == 3 and not o["finished"] and eng.abort("long"))
        out = h.result(timeout=30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) == 3
        assert not eng.abort("long") and not eng.abort("never-seen")
        assert_pool_clean(eng)
    # Abort from the caller's thread: each step takes 20 ms, the request would need 3 s.
    with make_engine(FakeRunner(step_delay=0.02)) as eng:
        started = threading.Event()
        h = eng.submit(input_ids=[1, 2, 3], sampling_params=greedy(150), stream=True, rid="slow",
                       on_output=lambda o: started.set())
        assert started.wait(30) and eng.abort("slow")
        out = h.result(timeout=30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 150
        assert_pool_clean(eng)


# -- bad input and failing steps ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": [1, VOCAB + 8]}, r"input_ids\[1\]=40"),
    ({"input_ids": [1] * 160}, "context length is 160"),
    ({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}, "temprature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, r"top_p=0"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, r"top_k=0"),
    ({"input_ids": [1, 2], "sampling_params": {"min_p": 2}}, r"min_p=2"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, r"temperature=-1"),
    ({"input_ids": [1, 2], "sampling_params": {"seed": -3}}, r"seed=-3"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, r"n=0"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1000}}, "max_new_tokens=1000"),
    ({"input_ids": [1, 2], "logprob_start_len": 2}, "logprob_start_len=2"),
    ({"input_ids": [1, VOCAB + 1, 3], "return_logprob": True, "logprob_start_len": 0},
     r"input_ids\[1\]=33 is a prompt-logprob target"),
    ({"input_ids": [[1, 2], [3]], "rid": "same"}, "list of rids"),
    ({"prompt": "ab", "input_ids": [1]}, "exactly one"),
])
def test_bad_input_raises_and_engine_keeps_serving(kwargs, match, engine_for_errors):
    with pytest.raises(ValueError, match=match):
        engine_for_errors.generate(**kwargs)
    assert engine_for_errors.generate(input_ids=[1, 2], sampling_params=greedy(2))["output_ids"] == \
        reference_greedy([1, 2], 2)


@pytest.fixture(scope="module")
def engine_for_errors():
    with make_engine() as eng:
        yield eng


def test_input_only_token_is_allowed_as_unscored_context(engine_for_errors):
    # VOCAB + 1 is a valid input id (input_vocab_size = VOCAB + 8) but not an output id. As the
    # token AT logprob_start_len it is context, not a target (spec, "Input and output vocabularies").
    out = engine_for_errors.generate(input_ids=[VOCAB + 1, 2, 3], sampling_params=greedy(1),
                                     return_logprob=True, logprob_start_len=0)
    assert len(out["meta_info"]["input_token_logprobs"]) == 3


def test_failing_step_aborts_its_requests_only():
    with make_engine(FakeRunner(poison_token=31)) as eng:
        out = eng.generate(input_ids=[1, 31, 2], sampling_params=greedy(3))
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "poisoned step" in out["meta_info"]["finish_reason"]["message"]
        assert eng.generate(input_ids=[1, 2], sampling_params=greedy(3))["output_ids"] == reference_greedy([1, 2], 3)
        assert_pool_clean(eng)


def test_sampling_params_validation_names_field():
    assert SamplingParams.from_dict({"stop": "x"}).stop == ("x",)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bogus'\]"):
        SamplingParams.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos="yes")


def test_concurrent_callers(engine_for_errors):
    prompts = [[i, i + 3, 7] for i in range(8)]
    results = {}

    def call(i):
        results[i] = engine_for_errors.generate(input_ids=prompts[i], sampling_params=greedy(6))["output_ids"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(8)] == [reference_greedy(p, 6) for p in prompts]


def test_streamed_text_holds_back_a_possible_stop_string():
    req = RequestState.for_req(Req(rid="r", prompt_ids=[1], sampling=SamplingParams(stop=("xyz", "q")),
                                   seed=0), FakeDetokenizer())
    req.text = "abcxy"
    assert visible_text(req) == "abc"  # "xy" may still become "xyz"
    req.text = "abcx!"
    assert visible_text(req) == "abcx!"
    req.finish_reason = {"type": "length"}
    req.text = "abcxy"
    assert visible_text(req) == "abcxy"  # finished: nothing is held back


# -- the output processor: detokenization and stop strings off the engine thread ------------------------
class SlowRecordingDetokenizer(FakeDetokenizer):
    """Records the thread of every call and takes `delay` seconds per token."""

    threads: list[str] = []
    delay = 0.0

    def add(self, t):
        SlowRecordingDetokenizer.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        return super().add(t)


def test_detokenization_and_callbacks_run_off_the_engine_thread():
    SlowRecordingDetokenizer.threads, SlowRecordingDetokenizer.delay = [], 0.05
    prompt = [1, 2, 3]
    letters = "".join(chr(ord("a") + t % 26) for t in reference_greedy(prompt, 8))
    callback_threads, outs = [], []

    def on_output(out):
        callback_threads.append(threading.current_thread().name)
        outs.append(out)

    with make_engine(detokenizer_factory=SlowRecordingDetokenizer) as eng:
        h = eng.submit(input_ids=prompt, sampling_params=greedy(8, stop="#"), stream=True, on_output=on_output)
        final = h.result(timeout=30)
        latency = eng.stats()["step_latency_seconds"]
    assert final["text"] == letters and final["meta_info"]["finish_reason"] == {"type": "length"}
    assert set(SlowRecordingDetokenizer.threads) == {"jengine-output"}
    assert set(callback_threads) == {"jengine-output"}
    # The 50 ms per token of detokenization is not part of any step.
    assert len(latency) >= 8 and sorted(latency)[len(latency) // 2] < SlowRecordingDetokenizer.delay
    # Streaming stays cumulative and in order; the final output comes exactly once, last.
    assert [o["finished"] for o in outs] == [False] * 7 + [True]
    assert [len(o["output_ids"]) for o in outs] == list(range(1, 9))
    assert all(b["text"].startswith(a["text"]) for a, b in zip(outs, outs[1:]))


def test_stop_string_truncates_the_tokens_the_engine_sampled_ahead():
    SlowRecordingDetokenizer.threads, SlowRecordingDetokenizer.delay = [], 0.02
    prompt = [1, 2, 3]
    ref = reference_greedy(prompt, 40)
    letters = "".join(chr(ord("a") + t % 26) for t in ref)
    stop = letters[5:7]
    at = letters.index(stop)  # the stop string is complete after token at + 1
    params = dict(input_ids=prompt, return_logprob=True, top_logprobs_num=2)
    with make_engine(detokenizer_factory=SlowRecordingDetokenizer) as eng:
        full = eng.generate(**params, sampling_params=greedy(40))
        before = eng.stats()["generation_tokens_total"]
        out = eng.generate(**params, sampling_params=greedy(40, stop=stop))
        sampled = eng.stats()["generation_tokens_total"] - before
        trimmed_not = eng.generate(**params, sampling_params=greedy(40, stop=stop, no_stop_trim=True))
        assert_pool_clean(eng)  # the engine finished it: pages freed (or held by the prefix cache)
    assert sampled > at + 2  # the engine really ran ahead of the detokenizer ...
    assert out["output_ids"] == ref[: at + 2]  # ... and the extra tokens are discarded
    assert out["meta_info"]["completion_tokens"] == at + 2
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == letters[:at] and trimmed_not["text"] == letters[: at + 2]
    meta, full_meta = out["meta_info"], full["meta_info"]
    assert meta["output_token_logprobs"] == full_meta["output_token_logprobs"][: at + 2]
    bits = lambda triples: np.array([lp for lp, _, _ in triples], np.float32).view(np.uint32)
    assert np.array_equal(bits(meta["output_token_logprobs"]),
                          bits(full_meta["output_token_logprobs"][: at + 2]))
    assert meta["output_top_logprobs"] == full_meta["output_top_logprobs"][: at + 2]
    assert len(full["output_ids"]) == 40  # negative control: without the stop string nothing is cut
