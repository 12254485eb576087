"""The embedded default model, `--model tiny`: a small Qwen3 with deterministic weights.

It exists so that `jengine serve` works on a fresh machine with no download. Its outputs are
gibberish; its numerics are real (bf16 weights through the same code paths as any checkpoint).

On first use it is written as an ordinary Hugging Face directory (so HF transformers loads it
too) under `<cache root>/tiny-v1` (jengine/cache.py: `$JENGINE_CACHE_DIR`, else
`$XDG_CACHE_HOME/jengine`, else `~/.cache/jengine`). The files are built in a temporary directory next to the target and
renamed into place, so concurrent first uses never see a half-written model.

"tiny-v1" names one exact set of bytes: `TINY_V1_SHA256` pins every file, and generation checks
the result against it, so the name can never silently mean two different models (for example if a
future numpy changed its normal-sampling stream). A change to the model needs a new name.

Tokenizer: a byte-level BPE (8192 ids, specials first) trained once with `tokenizers` and shipped
as `jengine/assets/tiny_tokenizer_base.json` (see `train_base_tokenizer`), extended here to
exactly 32768 ids with filler added tokens `<t8192>` ... `<t32767>`: random outputs still decode to
visible text. Composing it with `json.dumps` keeps the file byte-identical across machines.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from jengine.cache import cache_root as jengine_cache_root
from jengine.logprob_orders import BLOCKWISE_VOCAB_BLOCK

TINY_NAME = "tiny"
TINY_VERSION = "tiny-v1"

VOCAB_SIZE = BLOCKWISE_VOCAB_BLOCK  # one rl-bitwise vocabulary block; input == output
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": None,  # nothing is ever prepended
    "eos_token_id": 2,     # <|im_end|>, filled from the tokenizer below
}

_BASE_TOKENIZER_ASSET = Path(__file__).resolve().parent.parent / "assets" / "tiny_tokenizer_base.json"

# What "tiny-v1" means (see the module docstring): SHA-256 of each text file's bytes, and of the
# tensors' names, dtypes, shapes and bytes (`weights_digest`) rather than of model.safetensors itself,
# whose header layout belongs to the safetensors version.
TINY_V1_SHA256 = {
    "config.json": "4a8c821fe5e451c336552f8c0006695e543bbe083fd2b77dab9c49494e3e4c4c",
    "generation_config.json": "c19f11c8899d7362efc425399f3c3ef5d3c52488b14c5a37934ead364f1d9720",
    "tokenizer.json": "2bdeafe5766e38b1f9d7bbde75e1b56ac1afac931089497833e79ab6d4af8ad0",
    "tokenizer_config.json": "5d8c4875ff919322b7e01d4fd0d118c03036d1f6ae0460e9a0b2ae565f59599c",
    "model.safetensors": "b445790f24c714d128c187fb67133265d1ed033f2a9a6a6354426ad99d9f2f65",
}


def ensure_tiny_model(cache_root: str | os.PathLike | None = None) -> Path:
    """The tiny model's directory, generating it on first use."""
    root = Path(cache_root) if cache_root is not None else jengine_cache_root()
    target = root / TINY_VERSION
    if target.exists():
        missing = [name for name in TINY_V1_SHA256 if not (target / name).is_file()]
        if missing:
            raise RuntimeError(f"the tiny model directory {str(target)!r} is incomplete (missing "
                               f"{', '.join(missing)}); delete it and it will be regenerated")
        return target

    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_VERSION}-", dir=root))
    try:
        write_tiny_model(staging)
        check_tiny_model(staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.rename(staging, target)  # atomic; fails if another process got there first
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def check_tiny_model(directory: Path) -> None:
    """Raise if the model in `directory` is not exactly tiny-v1."""
    from jengine.models.loader import SafetensorsCheckpoint

    for name, expected in TINY_V1_SHA256.items():
        if name == "model.safetensors":
            actual = weights_digest(SafetensorsCheckpoint(directory))
        else:
            actual = hashlib.sha256((directory / name).read_bytes()).hexdigest()
        if actual != expected:
            raise RuntimeError(
                f"generated {name} has SHA-256 {actual}, but {TINY_VERSION} is pinned to {expected}: "
                f"this machine (numpy {np.__version__}) produces a different tiny model, which "
                "would break bitwise comparisons against other machines; please report it")


def weights_digest(checkpoint) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order, of a checkpoint
    reader (jengine.models.loader.SafetensorsCheckpoint) read one tensor at a time."""
    h = hashlib.sha256()
    for name in sorted(checkpoint.names()):
        w = np.ascontiguousarray(checkpoint.read(name))
        h.update(f"{name}|{w.dtype.name}|{list(w.shape)}|".encode())
        h.update(w.tobytes())
    return h.hexdigest()


def write_tiny_model(directory: Path) -> None:
    """Write every file of the tiny model into `directory` (which must exist)."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    tokenizer_json, special_ids = _tokenizer_json()
    eos_ids = [special_ids[IM_END], special_ids[ENDOFTEXT]]
    config = {**TINY_CONFIG, "eos_token_id": special_ids[IM_END]}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {"bos_token_id": None, "eos_token_id": eos_ids,
                         "pad_token_id": special_ids[ENDOFTEXT]}

    _write_text(directory / "config.json", _dump_json(config))
    _write_text(directory / "generation_config.json", _dump_json(generation_config))
    _write_text(directory / "tokenizer_config.json", _dump_json(tokenizer_config))
    _write_text(directory / "tokenizer.json", tokenizer_json)
    # safetensors writes tensors in a canonical order with a canonical header: deterministic bytes.
    save_file(tiny_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})


def tiny_weights() -> dict[str, np.ndarray]:
    """HF-named bf16 weights drawn from `numpy.random.default_rng(0)` in a fixed order.

    Scales are chosen so every layer matters to the output: projections ~ N(0, 1/fan_in) keep
    activations O(1) through the layers (with 0.02 they would vanish below bf16's resolution of
    the residual, hiding bugs in attention/MLP), embeddings ~ N(0, 0.25^2) give logits with a
    spread of a few units, and norm weights are 1 + N(0, 0.1^2) rather than exact ones so that a
    norm that forgot its weight shows up. Draws are float64, rounded to float32, then to bf16
    (round to nearest even).
    """
    import ml_dtypes

    c = TINY_CONFIG
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    rng = np.random.default_rng(0)

    def matrix(out_features: int, in_features: int) -> np.ndarray:
        return rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)

    def norm(size: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(size)

    weights = {"model.embed_tokens.weight": 0.25 * rng.standard_normal((VOCAB_SIZE, hidden))}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = matrix(q_out, hidden)
        weights[p + "self_attn.k_proj.weight"] = matrix(kv_out, hidden)
        weights[p + "self_attn.v_proj.weight"] = matrix(kv_out, hidden)
        weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.o_proj.weight"] = matrix(hidden, q_out)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    # Tied embeddings: no lm_head.weight, as HF's save_pretrained writes it.
    return {name: np.ascontiguousarray(w.astype(np.float32).astype(ml_dtypes.bfloat16))
            for name, w in weights.items()}


def _tokenizer_json() -> tuple[str, dict[str, int]]:
    """The full tokenizer.json text and the ids of the special tokens."""
    base = json.loads(_BASE_TOKENIZER_ASSET.read_text(encoding="utf-8"))
    special_ids = {t["content"]: t["id"] for t in base["added_tokens"]}
    base_size = len(base["model"]["vocab"])
    if sorted(base["model"]["vocab"].values()) != list(range(base_size)):
        raise RuntimeError(f"{_BASE_TOKENIZER_ASSET} does not hold ids 0..{base_size - 1}")
    base["added_tokens"] += [
        {"id": i, "content": f"<t{i}>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False}
        for i in range(base_size, VOCAB_SIZE)
    ]
    return json.dumps(base, ensure_ascii=False, separators=(",", ":")), special_ids


def _dump_json(value: dict) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def train_base_tokenizer(output: Path = _BASE_TOKENIZER_ASSET) -> None:
    """How `tiny_tokenizer_base.json` was made (run once; not used at runtime).

    Byte-level BPE, GPT-2 pre-tokenizer regex, no normalizer (exact byte round trip), 8192 ids with
    <|endoftext|>, <|im_start|>, <|im_end|> first, trained on the top-level `*.py` files of the
    CPython 3.11.7 standard library (English docstrings and code). Retraining on another Python
    gives a different file; that is why the result is shipped rather than rebuilt.
    """
    import glob
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, min_frequency=2,
                                  special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train(files, trainer)
    output.write_text(tokenizer.to_str(), encoding="utf-8")
