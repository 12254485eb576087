"""`load_model`: a Hugging Face model directory (or "tiny") -> config, checkpoint reader, tokenizer.

What is read, and nothing else (no Python file in the directory is ever imported or run; there is
no trust_remote_code):

- `config.json` -> `ModelConfig`;
- `generation_config.json` (optional): its `eos_token_id` wins over config.json's, as in HF
  `generate`;
- weights: `model.safetensors.index.json` and the shards it names, else `model.safetensors`, else
  every `*.safetensors` in the directory. `SafetensorsCheckpoint` reads only the headers up front
  (names, shapes, dtypes: what the checks below need); a tensor is read when the model asks for
  it, one at a time, and placed (jengine/models/layers/param.py), so the host never holds the
  whole model. Read with safetensors' numpy backend (no torch needed): arrays keep the stored
  dtype, bf16 arriving as `ml_dtypes.bfloat16`. A directory `jengine convert` wrote holds an
  Orbax checkpoint (orbax/) instead: `OrbaxCheckpoint` (jengine/models/orbax_checkpoint.py),
  restored onto each parameter's placement;
- `tokenizer.json` (required), `tokenizer_config.json`, `chat_template.jinja` -> `Tokenizer`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jengine.models.config import ModelConfig, token_id_tuple
from jengine.models.tokenizer import Tokenizer, read_json_if_present

logger = logging.getLogger(__name__)

WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    checkpoint: "SafetensorsCheckpoint | OrbaxCheckpoint"  # HF tensor names -> arrays
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]   # == config.eos_token_ids (generation_config.json wins)
    chat_template: str | None
    path: str                        # the resolved model directory


def load_model(path_or_name: str | None = "tiny", *, progress: bool = True) -> LoadedModel:
    """Load "tiny" (also None: the embedded model) or a local HF-format model directory."""
    directory = _resolve_directory(path_or_name)
    config_dict = _read_config(directory)
    config = ModelConfig.from_hf_dict(config_dict)

    generation_config = read_json_if_present(directory / "generation_config.json")
    if generation_config.get("eos_token_id") is not None:
        eos = token_id_tuple("generation_config.json eos_token_id", generation_config["eos_token_id"])
        config = dataclasses.replace(config, eos_token_ids=eos)

    tokenizer = Tokenizer.from_dir(directory)
    checkpoint = open_weights(directory, config, progress=progress)

    if not (config_dict.get("torch_dtype") or config_dict.get("dtype")):
        # No dtype in config.json: HF would assume float32; the stored floats are the better guide.
        config = dataclasses.replace(config, torch_dtype=_stored_float_dtype(checkpoint,
                                                                             config.torch_dtype))
    _check_vocab_shapes(config, checkpoint, directory)
    if tokenizer.vocab_size > config.input_vocab_size:
        logger.warning("tokenizer knows %d ids but the embedding has input_vocab_size=%d rows; "
                       "ids beyond it will be rejected as input", tokenizer.vocab_size,
                       config.input_vocab_size)

    return LoadedModel(config=config, checkpoint=checkpoint, tokenizer=tokenizer,
                       eos_token_ids=config.eos_token_ids, chat_template=tokenizer.chat_template,
                       path=str(directory))


def open_weights(directory: Path, config: ModelConfig, *, progress: bool = False):
    """The directory's weights: its Orbax checkpoint when it has one, else its safetensors."""
    from jengine.models.orbax_checkpoint import OrbaxCheckpoint, has_orbax_checkpoint

    from jengine.models.registry import get_family

    if has_orbax_checkpoint(directory):
        return OrbaxCheckpoint(directory, config)
    # A family may read another tensor layout too (Qwen3-MoE: transformers 5's fused experts).
    return get_family(config.architecture).read_checkpoint(
        config, SafetensorsCheckpoint(directory, progress=progress))


# safetensors header dtype -> numpy's name for it (floats only: what the dtype guess counts).
_FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


class SafetensorsCheckpoint:
    """A (possibly sharded) safetensors checkpoint, read one tensor at a time.

    Construction opens every file once for its header: a missing shard, a tensor the index
    promises but the file lacks, or a tensor in two files fails here, before any weight is read.
    """

    def __init__(self, directory: str | Path, *, progress: bool = False):
        import ml_dtypes  # noqa: F401  registers bfloat16/float8 with numpy, which safetensors needs
        from safetensors import safe_open

        self.directory = directory = Path(directory)
        self._file: dict[str, Path] = {}
        self._header: dict[str, tuple[tuple[int, ...], str]] = {}
        for path, expected in _weight_files(directory).items():
            try:
                with safe_open(str(path), framework="numpy") as f:
                    names = list(f.keys())
                    for name in names:
                        tensor = f.get_slice(name)
                        if name in self._file:
                            raise _Duplicate(name)
                        self._file[name] = path
                        self._header[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
            except _Duplicate as dup:
                raise ValueError(f"tensor {dup.args[0]!r} appears in more than one safetensors file "
                                 f"under {str(directory)!r}") from None
            except Exception as exc:
                raise ValueError(f"cannot read safetensors file {str(path)!r}: {exc}") from exc
            if expected is not None:
                missing = sorted(set(expected) - set(names))
                if missing:
                    raise ValueError(f"{str(directory / WEIGHTS_INDEX)!r} maps tensor {missing[0]!r} "
                                     f"to {str(path)!r}, which does not contain it "
                                     f"({len(missing)} such tensor(s))")
        self._progress = _Progress(len(self._file), progress)

    def names(self) -> tuple[str, ...]:
        return tuple(self._file)

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header[name][0]

    def dtype(self, name: str) -> str:
        """numpy's name for a float dtype ("bfloat16"), else the safetensors tag ("I64")."""
        tag = self._header[name][1]
        return _FLOAT_DTYPES.get(tag, tag)

    def read(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        if name not in self._file:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        with safe_open(str(self._file[name]), framework="numpy") as f:
            tensor = f.get_tensor(name)
        self._progress.update()
        return tensor

    def read_part(self, name: str, index: tuple) -> np.ndarray:
        """tensor[index] (ints and slices), reading only those bytes (one expert of a fused tensor:
        jengine/models/fused_experts.py)."""
        from safetensors import safe_open

        if name not in self._file:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        with safe_open(str(self._file[name]), framework="numpy") as f:
            part = f.get_slice(name)[index]
        self._progress.update(part.size / max(int(np.prod(self.shape(name))), 1))
        return part


class _Duplicate(Exception):
    pass


class _Progress:
    """A "Loading weights" bar over the checkpoint's tensors, created on the first read."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self._bar = total, enabled, None

    def update(self, tensors: float = 1) -> None:
        """`tensors`: a fraction for a part of one (`read_part`)."""
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc="Loading weights", unit="tensor")
        self._bar.update(tensors)
        if self._bar.n >= self.total - 1e-6:  # the parts' fractions add up with rounding
            self._bar.close()
            self.enabled = False


def _resolve_directory(path_or_name: str | None) -> Path:
    from jengine.models.tiny import TINY_NAME, ensure_tiny_model

    if path_or_name is None or path_or_name == TINY_NAME:
        return ensure_tiny_model()
    directory = Path(path_or_name).expanduser()
    if not directory.exists():
        raise FileNotFoundError(
            f"model directory not found: {str(path_or_name)!r} (jengine loads a local Hugging Face "
            f"model directory, or {TINY_NAME!r} for the embedded model; it does not download)")
    if not directory.is_dir():
        raise NotADirectoryError(f"model path is not a directory: {str(path_or_name)!r}")
    return directory.resolve()


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {str(path)!r}")
    return read_json_if_present(path)


def _weight_files(directory: Path) -> dict[Path, list[str] | None]:
    """Weight files to read -> the tensor names the index promises in each (None: no index)."""
    index_path = directory / WEIGHTS_INDEX
    if index_path.is_file():
        index = read_json_if_present(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index_path)!r} has no 'weight_map' object")
        files: dict[Path, list[str]] = {}
        for name, filename in weight_map.items():
            files.setdefault(directory / filename, []).append(name)
        for path, names in files.items():
            if not path.is_file():
                raise FileNotFoundError(f"weights file not found: {str(path)!r} (named for tensor "
                                        f"{names[0]!r} in {str(index_path)!r})")
        return dict(sorted(files.items()))

    single = directory / SINGLE_WEIGHTS
    if single.is_file():
        return {single: None}
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return {path: None for path in found}
    others = sorted(p.name for p in directory.iterdir()
                    if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
    hint = (f"; found {', '.join(others)}, but jengine reads only safetensors (never pickles)"
            if others else "")
    raise FileNotFoundError(f"no safetensors weights found in {str(directory)!r} (expected "
                            f"{WEIGHTS_INDEX}, {SINGLE_WEIGHTS} or *.safetensors){hint}")


def _stored_float_dtype(checkpoint, default: str) -> str:
    floats = Counter(checkpoint.dtype(n) for n in checkpoint.names()
                     if checkpoint.dtype(n) in _FLOAT_DTYPES.values())
    return floats.most_common(1)[0][0] if floats else default


def _check_vocab_shapes(config: ModelConfig, checkpoint,
                        directory: Path) -> None:
    """Embedding rows must equal input_vocab_size and head rows vocab_size (the spec's split)."""
    expected = {"model.embed_tokens.weight": (config.input_vocab_size, config.hidden_size, "input_vocab_size"),
                "lm_head.weight": (config.vocab_size, config.hidden_size, "vocab_size")}
    for name, (rows, cols, field) in expected.items():
        if name in checkpoint and not config.is_quantized and checkpoint.shape(name) != (rows, cols):
            raise ValueError(f"{name} in {str(directory)!r} has shape {checkpoint.shape(name)}, but the "
                             f"config gives {field}={rows} and hidden_size={cols}")
    if "model.embed_tokens.weight" not in checkpoint:
        raise ValueError(f"no model.embed_tokens.weight in the weights of {str(directory)!r}")
    if not config.tie_word_embeddings and "lm_head.weight" not in checkpoint:
        raise ValueError(f"tie_word_embeddings is false but there is no lm_head.weight in "
                         f"{str(directory)!r}")
