"""`jengine <command>`: one entry point, one module per command.

Each command module exposes ``add_parser(subparsers)`` and ``main(args) -> int``; this file only
wires them, importing a module when its command runs so `jengine --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("jengine.server.cli", "serve the OpenAI and SGLang /generate APIs over HTTP"),
    "generate": ("jengine.generate", "generate a completion offline and print it"),
    "invariance": ("jengine.invariance", "run the rl-bitwise invariance harness"),
    "align": ("interop.align", "teacher-force a trainer dump and compare logprobs bitwise"),
    "ops-report": ("interop.ops_report", "compare jengine's ops with torch's, bit by bit"),
    "bench": ("jengine.bench", "benchmark decode/prefill on the accelerator"),
    "convert": ("jengine.convert", "convert a Hugging Face model directory to an Orbax checkpoint"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jengine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=help_)
            continue
        mod = importlib.import_module(module)
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from jengine.numerics import load_numerics_plugins

    load_numerics_plugins()  # plugin envelopes exist before any --numerics is validated
    command = argv[0] if argv and argv[0] in COMMANDS else None
    from jengine.numerics import NumericsRefusal

    try:
        parser = build_parser(command)
        if command is None:
            parser.print_help()
            return 0 if not argv or argv[0] in ("-h", "--help") else 2
        args = parser.parse_args(argv)
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.main(args) or 0)
    except (NumericsRefusal, FileNotFoundError) as e:  # the answer to the user's input, not a crash
        print(f"jengine {command}: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name not in TORCH_SIDE:
            raise
        print(torch_side_message(f"jengine {command}", e.name), file=sys.stderr)
        return 2


# The trainer side (interop: align, ops-report, trainer_dump) runs torch and HF transformers, which
# the serving install does not pull in.
TORCH_SIDE = ("torch", "transformers")


def torch_side_message(command: str, missing: str) -> str:
    return (f"{command} needs {missing} (the trainer side, not installed with jengine itself): "
            "pip install 'jengine[torch]'")


if __name__ == "__main__":
    sys.exit(main())
