"""`jengine convert SRC DST`: a Hugging Face model directory -> a model directory whose weights are
an Orbax checkpoint of the engine's parameters (jengine/models/orbax_checkpoint.py).

    jengine convert /models/Qwen3-8B /models/Qwen3-8B-orbax
    jengine serve --model-path /models/Qwen3-8B-orbax      # loaded as any model directory

DST gets SRC's config, generation config and tokenizer files (every file but the weights) and
DST/orbax/; it must not exist yet, or be empty. SRC's weights are read and checked as a launch
reads them (`load_model`), so a checkpoint the engine would refuse is refused here.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

FORMATS = ("orbax",)
# What a model directory holds besides its config and tokenizer: never copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="convert a Hugging Face model directory to an Orbax "
                              "checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("src", metavar="SRC", help="Hugging Face model directory (safetensors), or "
                   "'tiny'")
    p.add_argument("dst", metavar="DST", help="output model directory (new, or empty)")
    p.add_argument("--format", choices=FORMATS, default="orbax", help="output weights format")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(args: argparse.Namespace) -> int:
    try:
        n = convert(args.src, args.dst, progress=not args.no_progress)
    except (FileExistsError, NotADirectoryError, ValueError) as exc:
        print(f"jengine convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} parameters to {args.dst}")
    return 0


def convert(src: str, dst: str | Path, *, progress: bool = True) -> int:
    """Write DST from the HF model directory SRC; returns the number of parameters written."""
    from jengine.models import load_model
    from jengine.models.orbax_checkpoint import has_orbax_checkpoint, write_orbax

    dst = Path(dst).expanduser()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"DST {str(dst)!r} exists and is not an empty directory (jengine "
                              "convert never overwrites)")
    loaded = load_model(src, progress=False)  # FileNotFoundError: jengine's CLI reports it
    source = Path(loaded.path)
    if has_orbax_checkpoint(source):
        raise ValueError(f"SRC {src!r} already holds an Orbax checkpoint ({source / 'orbax'})")
    dst.mkdir(parents=True, exist_ok=True)
    n = write_orbax(loaded.checkpoint, loaded.config, dst, progress=progress)
    # Config and tokenizer last: a conversion that failed midway is no loadable model directory.
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) \
                and path.name != "model.safetensors.index.json":
            shutil.copy2(path, dst / path.name)
    return n
