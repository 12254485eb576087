"""Trainer dumps: what a trainer recorded per sequence, in ``.pt`` or ``.safetensors``.

Per sequence (spec, "Acceptance"):

  ids            int64[T]        prompt followed by response token ids (T >= 2)
  logprob        float32[T-1]    log p(ids[t+1] | ids[:t+1]), from the trainer's own log-softmax
  layout         str             the trainer's TP/PP/EP factorization and dtype
  commit         str             trainer commit that produced the dump
  logits         float[n, V]     optional: the first n <= 8 positions' logits (bisect)
  prompt_len     int             optional: where the response starts (self-consistency check (a))
  states         {name: float[n, width]} optional: named intermediate states of the forward at
                                 the first n positions (interop/states.py; for --bisect)

``write_dump(path, sequences)`` takes a list of dicts with exactly these keys (arrays as numpy or
torch); ``read_dump(path)`` returns the same shape with numpy arrays (bf16 as ml_dtypes). Both
validate every field and raise ``DumpFormatError`` naming the file, the sequence index and the
field. Values are never converted in a way that could change a bit: a float64 logprob is refused,
not rounded.

File layouts:
* ``.pt``: ``torch.save({"format": FORMAT, "version": 1, "sequences": [dict, ...]})`` of plain
  tensors, strings and ints; read with ``torch.load(weights_only=True)`` (no pickled code runs).
* ``.safetensors``: tensors ``seq{i}.ids``, ``seq{i}.logprob``, ``seq{i}.logits``,
  ``seq{i}.states.{name}``; strings and ints in the metadata (``format``, ``version``,
  ``num_sequences``, ``seq{i}.layout``, ``seq{i}.commit``, ``seq{i}.prompt_len``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

FORMAT = "jengine-trainer-dump"
VERSION = 1
REQUIRED_FIELDS = ("ids", "logprob", "layout", "commit")
OPTIONAL_FIELDS = ("logits", "prompt_len", "states")
TENSOR_FIELDS = ("ids", "logprob", "logits")
MAX_LOGIT_ROWS = 8


class DumpFormatError(ValueError):
    """A malformed dump. The message names the file, the sequence index and the field."""


def _to_numpy(value: Any) -> Any:
    """torch tensor -> numpy with the same bits; numpy and everything else pass through."""
    if hasattr(value, "detach") and hasattr(value, "dtype"):
        from interop.convert import tensor_to_numpy

        return tensor_to_numpy(value)
    return value


def _describe(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype}{list(a.shape)}"
    return type(a).__name__


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f" or str(a.dtype) == "bfloat16"


def validate_sequence(index: int, seq: Mapping[str, Any], where: str = "dump") -> dict[str, Any]:
    """Check one sequence; returns it with numpy arrays. Raises DumpFormatError naming the field."""
    def fail(field: str, message: str):
        raise DumpFormatError(f"{where}: sequence {index}: field {field!r}: {message}")

    if not isinstance(seq, Mapping):
        raise DumpFormatError(f"{where}: sequence {index}: expected a dict, got {type(seq).__name__}")
    missing = [f for f in REQUIRED_FIELDS if f not in seq]
    if missing:
        fail(missing[0], f"missing (required fields: {list(REQUIRED_FIELDS)})")
    unknown = sorted(set(seq) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        fail(unknown[0], f"unknown field (allowed: {list(REQUIRED_FIELDS + OPTIONAL_FIELDS)})")
    out = {k: _to_numpy(v) for k, v in seq.items()}

    ids = out["ids"]
    if isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        ids = out["ids"] = np.asarray(ids, np.int64)
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu" or ids.ndim != 1:
        fail("ids", f"expected int64[T], got {_describe(ids)}")
    if ids.dtype != np.int64:
        ids = out["ids"] = ids.astype(np.int64)  # widening an integer is exact
    if len(ids) < 2:
        fail("ids", f"needs at least 2 tokens (one scored position), got {len(ids)}")
    if (ids < 0).any():
        fail("ids", f"negative token id {int(ids[ids < 0][0])} at position {int(np.argmax(ids < 0))}")
    t = len(ids)

    lp = out["logprob"]
    if not isinstance(lp, np.ndarray) or lp.dtype != np.float32 or lp.shape != (t - 1,):
        fail("logprob", f"expected float32[{t - 1}] (T-1 for T={t} ids), got {_describe(lp)}")
    if np.isnan(lp).any():
        fail("logprob", f"NaN at position {int(np.argmax(np.isnan(lp))) + 1}")

    for name in ("layout", "commit"):
        if not isinstance(out[name], str):
            fail(name, f"expected a string, got {type(out[name]).__name__}")

    if "logits" in out:
        lg = out["logits"]
        if not isinstance(lg, np.ndarray) or lg.ndim != 2 or not _is_float(lg):
            fail("logits", f"expected a float [n, vocab] array, got {_describe(lg)}")
        if not 1 <= lg.shape[0] <= min(MAX_LOGIT_ROWS, t):
            fail("logits", f"expected 1..{min(MAX_LOGIT_ROWS, t)} rows (logits[:8]), got {lg.shape[0]}")
    if "prompt_len" in out:
        pl = out["prompt_len"]
        if isinstance(pl, np.ndarray) and pl.ndim == 0:
            pl = out["prompt_len"] = int(pl)
        if not isinstance(pl, (int, np.integer)) or isinstance(pl, bool) or not 1 <= pl < t:
            fail("prompt_len", f"expected an int in [1, {t - 1}], got {pl!r}")
        out["prompt_len"] = int(pl)
    if "states" in out:
        states = out["states"]
        if not isinstance(states, Mapping) or not states:
            fail("states", f"expected a non-empty dict name -> [n, width] array, got {type(states).__name__}")
        states = out["states"] = {k: _to_numpy(v) for k, v in states.items()}
        rows = {a.shape[0] for a in states.values() if isinstance(a, np.ndarray)}
        for name, a in states.items():
            if not isinstance(name, str) or not isinstance(a, np.ndarray) or a.ndim != 2 or not _is_float(a):
                fail("states", f"entry {name!r}: expected a float [n, width] array, got {_describe(a)}")
        if len(rows) != 1 or not 1 <= rows.pop() <= t:
            fail("states", f"every entry needs the same number n of positions, 1 <= n <= {t}")
    return out


def write_dump(path, sequences: Sequence[Mapping[str, Any]]) -> None:
    """Validate and write ``sequences`` to ``path`` (.pt or .safetensors)."""
    path = Path(path)
    if isinstance(sequences, Mapping) or not isinstance(sequences, Sequence):
        raise DumpFormatError(f"{path}: sequences must be a list of dicts, got {type(sequences).__name__}")
    checked = [validate_sequence(i, s, str(path)) for i, s in enumerate(sequences)]
    if not checked:
        raise DumpFormatError(f"{path}: a dump needs at least one sequence")
    from interop.convert import numpy_to_tensor

    if path.suffix == ".pt":
        import torch

        def tensorize(v):
            if isinstance(v, np.ndarray):
                return numpy_to_tensor(v)
            if isinstance(v, dict):
                return {k: numpy_to_tensor(a) for k, a in v.items()}
            return v

        payload = [{k: tensorize(v) for k, v in s.items()} for s in checked]
        torch.save({"format": FORMAT, "version": VERSION, "sequences": payload}, str(path))
    elif path.suffix == ".safetensors":
        from safetensors.torch import save_file

        tensors, meta = {}, {"format": FORMAT, "version": str(VERSION),
                             "num_sequences": str(len(checked))}
        for i, s in enumerate(checked):
            for k, v in s.items():
                if k in TENSOR_FIELDS:
                    tensors[f"seq{i}.{k}"] = numpy_to_tensor(v).contiguous()
                elif k == "states":
                    for name, a in v.items():
                        tensors[f"seq{i}.states.{name}"] = numpy_to_tensor(a).contiguous()
                else:
                    meta[f"seq{i}.{k}"] = str(v)
        save_file(tensors, str(path), metadata=meta)
    else:
        raise DumpFormatError(f"{path}: unknown dump suffix {path.suffix!r} (use .pt or .safetensors)")


def read_dump(path) -> list[dict[str, Any]]:
    """Read and validate a dump; returns one dict per sequence with numpy arrays."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trainer dump not found: {path}")
    if path.suffix == ".pt":
        sequences = _read_pt(path)
    elif path.suffix == ".safetensors":
        sequences = _read_safetensors(path)
    else:
        raise DumpFormatError(f"{path}: unknown dump suffix {path.suffix!r} (use .pt or .safetensors)")
    if not sequences:
        raise DumpFormatError(f"{path}: the dump holds no sequences")
    return [validate_sequence(i, s, str(path)) for i, s in enumerate(sequences)]


def _read_pt(path: Path) -> list:
    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses anything but plain containers and tensors
        raise DumpFormatError(f"{path}: not a loadable tensor file under weights_only=True: {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise DumpFormatError(f"{path}: not a {FORMAT} file (expected a dict with format={FORMAT!r})")
    if obj.get("version") != VERSION:
        raise DumpFormatError(f"{path}: version {obj.get('version')!r} is not supported (expected {VERSION})")
    sequences = obj.get("sequences")
    if not isinstance(sequences, list):
        raise DumpFormatError(f"{path}: 'sequences' must be a list, got {type(sequences).__name__}")
    return sequences


def _read_safetensors(path: Path) -> list:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise DumpFormatError(f"{path}: not a readable safetensors file: {e}") from e
    if meta.get("format") != FORMAT:
        raise DumpFormatError(f"{path}: not a {FORMAT} file (metadata format={meta.get('format')!r})")
    if meta.get("version") != str(VERSION):
        raise DumpFormatError(f"{path}: version {meta.get('version')!r} is not supported (expected {VERSION})")
    try:
        n = int(meta["num_sequences"])
    except (KeyError, ValueError):
        raise DumpFormatError(f"{path}: metadata num_sequences={meta.get('num_sequences')!r} "
                              "is not an integer") from None
    sequences: list[dict[str, Any]] = [{} for _ in range(n)]
    for source in (tensors, meta):
        for key, value in source.items():
            if not key.startswith("seq"):
                continue
            head, _, field = key.partition(".")
            try:
                i = int(head[3:])
            except ValueError:
                raise DumpFormatError(f"{path}: entry {key!r} does not name a sequence") from None
            if not 0 <= i < n:
                raise DumpFormatError(f"{path}: entry {key!r} names sequence {i}, but "
                                      f"num_sequences={n}")
            if field.startswith("states.") and source is tensors:
                sequences[i].setdefault("states", {})[field[len("states."):]] = value
                continue
            if field == "prompt_len" and source is meta:
                try:
                    value = int(value)
                except ValueError:
                    raise DumpFormatError(f"{path}: sequence {i}: field 'prompt_len': {value!r} "
                                          "is not an integer") from None
            sequences[i][field] = value
    return sequences
