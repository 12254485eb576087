"""Loading: ModelConfig from HF configs, safetensors checkpoints, tokenizer, the embedded tiny model."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jengine.cache import cache_root
from jengine.models import LoadedModel, ModelConfig, load_model
from jengine.models import tiny
from jengine.models.loader import SafetensorsCheckpoint
from jengine.models.registry import architectures

SUPPORTED_ARCHITECTURES = architectures()

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def load_safetensors_dir(directory) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint (tests only: the engine reads one tensor at a time)."""
    checkpoint = SafetensorsCheckpoint(directory)
    return {name: checkpoint.read(name) for name in checkpoint.names()}


def bits(array: np.ndarray) -> np.ndarray:
    """The raw bit pattern of a float array (so -0.0 != +0.0 and NaN payloads count)."""
    return np.ascontiguousarray(array).view({2: np.uint16, 4: np.uint32, 8: np.uint64}[array.itemsize])


def torch_bits(t) -> np.ndarray:
    t = t.detach().contiguous()
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(view).numpy().view({2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()])


# ---------------------------------------------------------------------------------------------
# ModelConfig
# ---------------------------------------------------------------------------------------------

FAMILIES = {
    "LlamaForCausalLM": transformers.LlamaConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "Qwen3ForCausalLM": transformers.Qwen3Config,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
}


# The GQA families; DeepSeek-V3's MLA config has its own rules (tests/test_deepseek_v3.py).
@pytest.mark.parametrize("architecture", tuple(FAMILIES))
@pytest.mark.parametrize("named", [False, True], ids=["model_type", "architectures"])
def test_config_from_transformers_families(architecture, named):
    hf = FAMILIES[architecture](**SMALL, eos_token_id=[7, 9], bos_token_id=3)
    d = hf.to_dict()
    if named:
        d["architectures"] = [architecture]
    else:
        assert d["architectures"] is None  # falls back on model_type
    cfg = ModelConfig.from_hf_dict(d)

    assert cfg.architecture == architecture
    # HF attention's own rule: the config's head_dim, else hidden_size // num_attention_heads
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.num_key_value_heads == hf.num_key_value_heads
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and cfg.rope_scaling is None
    assert cfg.attention_bias is (architecture == "Qwen2ForCausalLM")
    assert cfg.attention_output_bias is False
    assert cfg.qk_norm is architecture.startswith("Qwen3")
    assert cfg.num_experts == getattr(hf, "num_experts", 0)
    assert cfg.input_vocab_size == cfg.vocab_size == hf.vocab_size and not cfg.split_vocab
    assert cfg.eos_token_ids == (7, 9) and cfg.bos_token_id == 3
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.quantization_config is None and not cfg.is_quantized


def test_config_llama_attention_bias_reaches_o_proj():
    d = transformers.LlamaConfig(**SMALL, attention_bias=True).to_dict()
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.attention_bias and cfg.attention_output_bias


def test_config_rope_scaling_transformers5_layout():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128, "rope_theta": 500000.0}
    d = transformers.LlamaConfig(**SMALL, rope_parameters=rope).to_dict()
    assert "rope_theta" not in d or d.get("rope_theta") is None  # transformers 5 moved it
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_config_rope_scaling_transformers4_layout():
    d = {"architectures": ["Qwen2ForCausalLM"], **SMALL, "rope_theta": 1000000.0,
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
         "torch_dtype": "torch.bfloat16", "eos_token_id": 5}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 1000000.0
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert cfg.torch_dtype == "bfloat16" and cfg.eos_token_ids == (5,)
    assert d["rope_scaling"] == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_config_keeps_quantization_config_and_is_hashable():
    q = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen3", **SMALL, "quantization_config": q})
    assert cfg.quantization_config == q and cfg.is_quantized
    assert hash(cfg) == hash(ModelConfig.from_hf_dict({"model_type": "qwen3", **SMALL, "quantization_config": dict(q)}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 3


def test_config_split_vocabulary():
    cfg = ModelConfig.from_hf_dict({"model_type": "llama", **SMALL, "output_vocab_size": 600})
    assert (cfg.input_vocab_size, cfg.vocab_size, cfg.split_vocab) == (1000, 600, True)
    same = ModelConfig.from_hf_dict({"model_type": "llama", **SMALL, "output_vocab_size": None})
    assert (same.input_vocab_size, same.vocab_size) == (1000, 1000)


@pytest.mark.parametrize("vocab_size, output_vocab_size", [
    (1000, 1001),      # output larger than input
    (0, None),         # zero
    (1000, 0),
    (-5, None),
    (1000.0, None),    # not an integer
    (1000, "600"),
    (True, None),
])
def test_config_bad_vocab_sizes(vocab_size, output_vocab_size):
    d = {"model_type": "llama", **SMALL, "vocab_size": vocab_size, "output_vocab_size": output_vocab_size}
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_dict(d)
    runtime_output = vocab_size if output_vocab_size is None else output_vocab_size
    message = str(err.value)
    assert f"input_vocab_size={vocab_size!r}" in message
    assert f"vocab_size={runtime_output!r}" in message


def test_config_unknown_architecture_lists_supported():
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], **SMALL})
    assert "MistralForCausalLM" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match="model_type='gpt2'.*LlamaForCausalLM"):
        ModelConfig.from_hf_dict({"model_type": "gpt2", **SMALL})


def test_registry_lists_the_families_and_refuses_a_second_registration():
    from jengine.models import registry

    assert SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                       "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
                                       "LongcatFlashForCausalLM")
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'; "
                                         "supported: LlamaForCausalLM, Qwen2ForCausalLM, "
                                         "Qwen3ForCausalLM"):
        registry.get_family("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is already registered"):
        registry.register_family(registry.get_family("LlamaForCausalLM"))


@pytest.mark.parametrize("field, value, pattern", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("mlp_bias", True, "mlp_bias"),
    ("num_key_value_heads", 3, "num_key_value_heads=3"),
    ("eos_token_id", "x", "eos_token_id"),
    # MoE / MLA keys belong to other families: a dense family would serve another model.
    ("num_experts", 8, "num_experts=8 in config.json, but Qwen2ForCausalLM is a dense family"),
    ("kv_lora_rank", 512, "kv_lora_rank=512"),
])
def test_config_refuses_what_the_model_does_not_implement(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_hf_dict({"model_type": "qwen2", **SMALL, field: value})


def test_config_missing_required_field():
    d = {"model_type": "llama", **SMALL}
    del d["intermediate_size"]
    with pytest.raises(ValueError, match="'intermediate_size'"):
        ModelConfig.from_hf_dict(d)


# ---------------------------------------------------------------------------------------------
# Checkpoints written by HF transformers
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny.ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def save_hf(model, directory: Path, tokenizer_from: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    shutil.copy(tokenizer_from / "tokenizer.json", directory / "tokenizer.json")
    return directory


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory, tiny_dir):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    directory = save_hf(model, tmp_path_factory.mktemp("llama"), tiny_dir, max_shard_size="100KB")
    return model, directory


@pytest.fixture(scope="module")
def qwen2_fp32(tmp_path_factory, tiny_dir):
    torch.manual_seed(1)
    config = transformers.Qwen2Config(**SMALL, tie_word_embeddings=True, eos_token_id=4)
    model = transformers.Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [5, 6]
    directory = save_hf(model, tmp_path_factory.mktemp("qwen2"), tiny_dir)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    return model, directory


def test_sharded_checkpoint_loads_bit_exact(sharded_llama):
    model, directory = sharded_llama
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2, "the fixture should be sharded"

    loaded = load_model(str(directory), progress=False)
    assert isinstance(loaded, LoadedModel)
    state = model.state_dict()
    assert set(loaded.checkpoint.names()) == set(state)
    for name, tensor in state.items():
        assert loaded.checkpoint.shape(name) == tuple(tensor.shape), name
        w = loaded.checkpoint.read(name)
        assert w.dtype == ml_dtypes.bfloat16 and w.shape == tuple(tensor.shape), name
        assert np.array_equal(bits(w), torch_bits(tensor)), name
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.config.torch_dtype == "bfloat16"
    assert loaded.eos_token_ids == (2,) and loaded.path == str(directory.resolve())


def test_model_reads_the_checkpoint_one_tensor_at_a_time(sharded_llama):
    """Building the model asks the reader for each parameter's tensor once, in the specs' order;
    the loader holds no tensor itself (no whole-model host dict)."""
    import jax.numpy as jnp

    from jengine.models.layers.param import CheckpointSource
    from jengine.models.registry import get_family

    _, directory = sharded_llama
    loaded = load_model(str(directory), progress=False)
    assert not hasattr(loaded, "weights")

    class Recording:
        def __init__(self, reader):
            self.reader, self.reads = reader, []

        def read(self, name):
            self.reads.append(name)
            return self.reader.read(name)

    reader = Recording(loaded.checkpoint)
    family = get_family(loaded.config.architecture)
    kernels = family.plan_kernels(dtype=jnp.bfloat16, hardware="cpu")
    model = family.build(loaded.config, CheckpointSource(reader), dtype=jnp.bfloat16,
                         kernels=kernels)
    specs = family.param_specs(loaded.config, dtype=jnp.bfloat16)
    assert reader.reads == [spec.checkpoint for spec in specs.values()]
    assert sorted(reader.reads) == sorted(loaded.checkpoint.names())  # untied: every tensor once
    q = model.named_parameters()["layers.0.self_attn.q_proj.weight"]
    stored = loaded.checkpoint.read("model.layers.0.self_attn.q_proj.weight")
    assert np.array_equal(bits(np.asarray(q)), bits(np.ascontiguousarray(stored.T)))  # [in, out]


def test_bit_comparison_negative_control(sharded_llama):
    """The comparison above can fail: one flipped low mantissa bit is caught."""
    model, directory = sharded_llama
    weights = load_safetensors_dir(directory)
    name = "model.layers.1.mlp.down_proj.weight"
    changed = weights[name].copy()
    changed.view(np.uint16)[3, 5] ^= 1
    assert not np.array_equal(bits(changed), torch_bits(model.state_dict()[name]))
    assert np.array_equal(bits(weights[name]), torch_bits(model.state_dict()[name]))


def test_single_file_fp32_generation_config_and_chat_template(qwen2_fp32):
    model, directory = qwen2_fp32
    loaded = load_model(str(directory), progress=False)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: save_pretrained stores it once, as the embedding
            assert name not in loaded.checkpoint
            continue
        assert loaded.checkpoint.dtype(name) == "float32"
        assert np.array_equal(bits(loaded.checkpoint.read(name)), torch_bits(tensor)), name
    assert "model.layers.0.self_attn.q_proj.bias" in loaded.checkpoint
    assert loaded.config.attention_bias and loaded.config.torch_dtype == "float32"
    # generation_config.json's eos wins over config.json's (4)
    assert loaded.eos_token_ids == loaded.config.eos_token_ids == (5, 6)
    assert loaded.chat_template == "{{ messages[0]['content'] }}!"
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def patch_config(directory: Path, **changes) -> None:
    """Rewrite the checkpoint's config.json with ``changes`` applied."""
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_error_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model directory not found: '{missing}'"):
        load_model(str(missing))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        load_model(str(tmp_path / "file"))


def test_error_missing_config(tmp_path, qwen2_fp32):
    d = copy_dir(qwen2_fp32[1], tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"model config not found: '{d / 'config.json'}'"):
        load_model(str(d), progress=False)


def test_error_unknown_architecture(tmp_path, qwen2_fp32):
    d = copy_dir(qwen2_fp32[1], tmp_path / "m")
    patch_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'; "
                                         "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(str(d), progress=False)


def test_error_missing_weights(tmp_path, qwen2_fp32):
    d = copy_dir(qwen2_fp32[1], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=f"no safetensors weights found in '{d}'"):
        load_model(str(d), progress=False)
    (d / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(FileNotFoundError, match="found pytorch_model.bin, but jengine reads only safetensors"):
        load_model(str(d), progress=False)


def test_error_missing_shard_and_missing_indexed_tensor(tmp_path, sharded_llama):
    d = copy_dir(sharded_llama[1], tmp_path / "m")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]

    index["weight_map"]["model.layers.9.bogus.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"maps tensor 'model.layers.9.bogus.weight' to '{d / shard}', "
                                         "which does not contain it"):
        load_model(str(d), progress=False)

    (d / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"weights file not found: '{d / shard}'"):
        load_model(str(d), progress=False)


def test_error_missing_tokenizer(tmp_path, qwen2_fp32):
    d = copy_dir(qwen2_fp32[1], tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"tokenizer file not found: '{d / 'tokenizer.json'}'"):
        load_model(str(d), progress=False)


def test_error_weight_shape_disagrees_with_vocab(tmp_path, qwen2_fp32):
    d = copy_dir(qwen2_fp32[1], tmp_path / "m")
    patch_config(d, vocab_size=999)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight .* shape \(1000, 64\), but the "
                                         "config gives input_vocab_size=999"):
        load_model(str(d), progress=False)


def test_split_vocab_checkpoint_loads(tmp_path, qwen2_fp32):
    """A reduced head (output_vocab_size) loads with each matrix at its own checkpoint size."""
    from safetensors.numpy import save_file

    d = copy_dir(qwen2_fp32[1], tmp_path / "m")
    patch_config(d, output_vocab_size=600, tie_word_embeddings=False)
    weights = load_safetensors_dir(d)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"][:600].copy()
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(str(d), progress=False)
    assert (loaded.config.input_vocab_size, loaded.config.vocab_size) == (1000, 600)
    assert loaded.checkpoint.shape("lm_head.weight") == (600, 64)


def test_never_runs_code_from_the_model_dir(tmp_path, qwen2_fp32):
    d = copy_dir(qwen2_fp32[1], tmp_path / "m")
    marker = tmp_path / "ran"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py", "__init__.py"):
        (d / name).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    patch_config(d, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                            "AutoModelForCausalLM": "modeling_evil.EvilModel"})
    load_model(str(d), progress=False)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# The embedded tiny model
# ---------------------------------------------------------------------------------------------

def test_tiny_generation_is_deterministic_and_pinned(tmp_path, tiny_dir):
    other = tiny.ensure_tiny_model(tmp_path / "second-cache")
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in other.iterdir()) == sorted(tiny.TINY_V1_SHA256)
    for name in names:
        assert (tiny_dir / name).read_bytes() == (other / name).read_bytes(), name
    tiny.check_tiny_model(other)  # matches the pinned digests


def test_tiny_pin_check_negative_control(tmp_path, tiny_dir):
    d = copy_dir(tiny_dir, tmp_path / "m")
    from safetensors.numpy import save_file
    weights = load_safetensors_dir(d)
    weights["model.norm.weight"].view(np.uint16)[0] ^= 1
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="model.safetensors has SHA-256"):
        tiny.check_tiny_model(d)


def test_tiny_config_and_weights(tiny_dir):
    loaded = load_model(str(tiny_dir), progress=False)
    c = loaded.config
    assert (c.architecture, c.vocab_size, c.input_vocab_size) == ("Qwen3ForCausalLM", 32768, 32768)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size) == (64, 2, 4, 2, 16, 128)
    assert c.qk_norm and c.tie_word_embeddings and c.torch_dtype == "bfloat16"
    assert (c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (10000.0, None, 2048)
    tok = loaded.tokenizer
    assert loaded.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert {loaded.checkpoint.dtype(n) for n in loaded.checkpoint.names()} == {"bfloat16"}
    assert "lm_head.weight" not in loaded.checkpoint


def test_tiny_by_name_uses_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JENGINE_CACHE_DIR", str(tmp_path / "jc"))
    loaded = load_model("tiny", progress=False)
    assert loaded.path == str(tmp_path / "jc" / "tiny-v1")
    assert load_model(None, progress=False).path == loaded.path

    monkeypatch.delenv("JENGINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "jengine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "jengine"


def test_tiny_concurrent_first_use(tmp_path):
    """Several processes generating at once all get the same complete directory."""
    code = ("import sys; from jengine.models.tiny import ensure_tiny_model; "
            "print(ensure_tiny_model(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "tiny-v1")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-v1"]  # no staging dir left behind
    tiny.check_tiny_model(tmp_path / "tiny-v1")


def test_tiny_incomplete_directory_is_reported(tmp_path):
    (tmp_path / "tiny-v1").mkdir()
    (tmp_path / "tiny-v1" / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="incomplete .*delete it"):
        tiny.ensure_tiny_model(tmp_path)


def test_tiny_loads_in_transformers(tiny_dir):
    loaded = load_model(str(tiny_dir), progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    state = model.state_dict()
    weights = load_safetensors_dir(tiny_dir)
    assert set(state) == set(weights) | {"lm_head.weight"}
    for name, w in weights.items():
        assert np.array_equal(bits(w), torch_bits(state[name])), name
    assert np.array_equal(torch_bits(state["lm_head.weight"]), bits(weights["model.embed_tokens.weight"]))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4000, 32767]])).logits
    assert logits.shape == (1, 5, 32768) and bool(torch.isfinite(logits).all())

    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 日本 🎉"}]
    ours = loaded.tokenizer.apply_chat_template(messages)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for text in (ours, "def f(x):\n    return x  # <t9000>", "naïve café 日本語"):
        assert loaded.tokenizer.encode(text) == hf_tok(text)["input_ids"], text
