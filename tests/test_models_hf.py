"""The dense family against HF transformers' own forward (Levanter-style logits round trip).

Tiny random HF models are saved with `save_pretrained`, loaded by jengine's loader and run through
the ModelRunner. fp32: rtol/atol 1e-4 (the engine and torch reduce in different orders; 1e-4 is
the usual bound for whole models). bf16: every activation is rounded to 8 mantissa bits at each op,
so two correct implementations that round at different points drift by a few bf16 ulps per layer;
we bound the logits' difference by 0.05 absolute on logits of magnitude < 2 (about 6 bf16 ulps) and
require the top-1 token to agree where HF's margin exceeds that bound.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jengine.config import LaunchConfig  # noqa: E402
from jengine.engine.batch import StepBatch  # noqa: E402
from jengine.engine.model_runner import ModelRunner  # noqa: E402
from jengine.launch import plan_launch  # noqa: E402
from jengine.models import load_model  # noqa: E402
from jengine.numerics import resolve_launch  # noqa: E402

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": lambda dt: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, head_dim=16, torch_dtype=dt, tie_word_embeddings=False)),
    "qwen2": lambda dt: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **COMMON, torch_dtype=dt, tie_word_embeddings=True)),
    "qwen3": lambda dt: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, head_dim=16, torch_dtype=dt, tie_word_embeddings=False)),
}


def _save(tmp_path_factory, family, dtype):
    torch.manual_seed(0)
    model = FAMILIES[family](dtype).to(getattr(torch, dtype)).eval()
    path = tmp_path_factory.mktemp(f"{family}-{dtype}")
    model.save_pretrained(path)
    from jengine.models.tiny import ensure_tiny_model  # a real tokenizer for the directory

    tiny = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tiny / name).read_bytes())
    return model, path


def _runner(path, numerics="auto"):
    resolved = resolve_launch(LaunchConfig(model_path=str(path), numerics=numerics, page_size=4,
                                           max_total_tokens=2048, max_prefill_tokens=64,
                                           max_running_requests=4), hardware="cpu")
    loaded = load_model(str(path), progress=False)
    return ModelRunner(loaded.config, loaded.checkpoint, plan_launch(resolved, loaded.config).runner)


def _prefill_logits(runner, ids, pages=range(1, 65)):
    n = len(ids)
    table = np.asarray([list(pages)[: -(-n // runner.page_size)]])
    batch = StepBatch(input_ids=ids, positions=np.arange(n), token_req=np.zeros(n),
                      block_tables=table, hidden_rows=np.arange(n))
    return np.asarray(runner.compute_logits(runner.forward(batch)))


def _greedy(runner, prompt, steps):
    """A naive loop: one prefill, then decode steps of one token each through the KV pages."""
    ids = list(prompt)
    table = np.asarray([list(range(1, 65))])
    n = len(ids)
    hidden = runner.forward(StepBatch(input_ids=ids, positions=np.arange(n), token_req=np.zeros(n),
                                      block_tables=table, hidden_rows=[n - 1]))
    for _ in range(steps):
        ids.append(int(np.argmax(np.asarray(runner.compute_logits(hidden))[0])))
        pos = len(ids) - 1
        hidden = runner.forward(StepBatch(input_ids=[ids[-1]], positions=[pos], token_req=[0],
                                          block_tables=table, hidden_rows=[0]))
    return ids[len(prompt):]


def _both_logits(tmp_path_factory, family, dtype, seed):
    """(HF model, jengine runner, prompt ids, jengine logits, HF logits) for one random prompt."""
    model, path = _save(tmp_path_factory, family, dtype)
    runner = _runner(path)
    ids = np.random.default_rng(seed).integers(0, 512, size=24)
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None]).logits[0].float().numpy()
    return model, runner, ids, _prefill_logits(runner, ids), ref


def hf_greedy(model, prompt, n: int) -> list[int]:
    """HF transformers' own greedy continuation of `prompt`, exactly n tokens."""
    with torch.no_grad():
        return model.generate(torch.tensor(prompt)[None], max_new_tokens=n, do_sample=False,
                              min_new_tokens=n)[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_logits_and_greedy_match_hf(tmp_path_factory, family):
    model, runner, ids, ours, ref = _both_logits(tmp_path_factory, family, "float32", seed=1)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)

    prompt = ids[:8]
    assert _greedy(runner, prompt, 16) == hf_greedy(model, prompt, 16)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_logits_close_to_hf(tmp_path_factory, family):
    _, _, _, ours, ref = _both_logits(tmp_path_factory, family, "bfloat16", seed=2)
    assert np.abs(ours - ref).max() < 0.05
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.1
    assert (ours.argmax(-1) == ref.argmax(-1))[clear].all()
