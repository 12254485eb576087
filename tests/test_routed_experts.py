"""return_routed_experts: the expert ids each forwarded token row was routed to, per MoE layer, in
SGLang's `meta_info["routed_experts"]` (base64 int32 [positions, layers, k]; docs/serving.md).

One tiny Qwen3-MoE (interop.testing: 8 experts, top-2, 2 layers) whose router rows 1, 4 and 6 are
planted equal in every layer: every token's router logits tie exactly on those experts, so which of
them a token gets, and in which slot order, is decided by the router leaf's tie order -- what the
export must carry bit for bit. The engine runs --numerics auto with --router-topk torch (the torch
leaf: PyTorch CUDA's tie order); HF's router under trainer mode runs that leaf's twin.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from interop import trainer_mode  # noqa: E402
from interop.testing import make_tiny_hf_model  # noqa: E402
from jengine.engine.engine import Engine  # noqa: E402
from jengine.engine.io_struct import RequestLimits, decode_routed_experts, validate_request  # noqa: E402
from jengine.engine.request import InvalidRequest  # noqa: E402

ARCH = "Qwen3MoeForCausalLM"
LAYERS, TOP_K = 2, 2
TIED = (1, 4, 6)
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 30000, size=21)]


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("qwen3-moe-tied"), ARCH)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w[TIED[1]] = w[TIED[2]] = w[TIED[0]]
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(tied_dir):
    # chunked_prefill_size 8: the 21-token prompt is prefilled over three steps.
    with Engine(model_path=str(tied_dir), dtype="float32", max_total_tokens=1024,
                max_prefill_tokens=64, chunked_prefill_size=8, max_running_requests=4,
                skip_warmup=True, router_topk="torch") as eng:
        yield eng


def _routed(out) -> np.ndarray:
    return decode_routed_experts(out["meta_info"]["routed_experts"], LAYERS, TOP_K)


def _hf_router_ids(tied_dir, ids, *, trainer: bool) -> np.ndarray:
    """int32[T, layers, k]: the ids HF's Qwen3MoeTopKRouter selects for a teacher-forced `ids`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tied_dir), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager").eval()
    captured = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda mod, args, out: captured.append(out[2]))
    with torch.no_grad():
        if trainer:
            with trainer_mode.enable(device="cpu") as mode:
                assert mode.route_moe_routers(model) == LAYERS
                model(torch.tensor(ids)[None])
        else:
            model(torch.tensor(ids)[None])
    return np.stack([c.numpy().astype(np.int32) for c in captured], axis=1)


@pytest.fixture(scope="module")
def generated(engine):
    return engine.generate(input_ids=PROMPT, return_routed_experts=True,
                           sampling_params={"max_new_tokens": 4, "temperature": 0,
                                            "ignore_eos": True})


def test_ids_equal_hf_router_under_trainer_mode(tied_dir, generated):
    # Positions: the prompt and every generated token but the last (never fed back): SGLang's
    # seqlen - 1. Teacher-forcing that sequence through HF gives the router's ids for each row.
    seq = PROMPT + generated["output_ids"][:-1]
    ours = _routed(generated)
    assert ours.shape == (len(seq), LAYERS, TOP_K)
    want = _hf_router_ids(tied_dir, seq, trainer=True)
    assert (ours == want).all(), np.argwhere(ours != want)[:8]
    # The planted tie decided experts: some row holds two of the tied ids.
    assert any(len(set(r) & set(TIED)) == 2 for r in ours.reshape(-1, TOP_K).tolist())


def test_negative_control_stock_hf_topk_differs_on_tied_rows(tied_dir, generated):
    # HF's stock CPU torch.topk breaks the same exact ties otherwise: the comparison above sees
    # tie order, so a wrong router leaf (or export of another tensor) would fail it.
    seq = PROMPT + generated["output_ids"][:-1]
    stock = _hf_router_ids(tied_dir, seq, trainer=False)
    assert (_routed(generated) != stock).any()


def test_alone_equals_packed_and_prompt_only(engine, generated):
    # The same request packed with two others (chunked prefill beside their rows), and a
    # prompt-only request (max_new_tokens=0): its ids are every prompt position's.
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    handles = [engine.submit(input_ids=ids, sampling_params=sp, return_routed_experts=True)
               for ids in (PROMPT[5:], PROMPT, PROMPT[::-1])]
    packed = handles[1].result()
    for h in handles:
        h.result()
    assert packed["output_ids"] == generated["output_ids"]
    assert (_routed(packed) == _routed(generated)).all()
    scored = engine.generate(input_ids=PROMPT, return_routed_experts=True,
                             sampling_params={"max_new_tokens": 0})
    assert (_routed(scored) == _routed(generated)[: len(PROMPT)]).all()


def test_repeated_prompt_is_not_served_from_the_prefix_cache(engine, generated):
    # The prompt is cached by now; a routed-experts request recomputes it (its ids are not cached).
    again = engine.generate(input_ids=PROMPT, return_routed_experts=True,
                            sampling_params={"max_new_tokens": 4, "temperature": 0,
                                             "ignore_eos": True, "n": 2})
    for out in again:
        assert out["meta_info"]["cached_tokens"] == 0
        assert (_routed(out) == _routed(generated)).all()
    plain = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1})
    assert "routed_experts" not in plain["meta_info"]


def test_refused_without_moe_layers():
    limits = RequestLimits(max_context=256, input_vocab_size=100, vocab_size=100, pool_tokens=256,
                           page_size=4, architecture="Qwen3ForCausalLM", routes_experts=False)
    with pytest.raises(InvalidRequest, match="return_routed_experts.*Qwen3ForCausalLM.*no MoE"):
        validate_request(limits, input_ids=[1, 2], sampling_params=None, return_logprob=False,
                         logprob_start_len=-1, top_logprobs_num=0, rid="r",
                         return_routed_experts=True)
    with pytest.raises(InvalidRequest, match="return_routed_experts.*must be a bool"):
        validate_request(limits, input_ids=[1, 2], sampling_params=None, return_logprob=False,
                         logprob_start_len=-1, top_logprobs_num=0, rid="r",
                         return_routed_experts="yes")
