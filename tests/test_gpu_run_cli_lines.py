"""Every `jengine` command line of scripts/gpu_run.sh (bench, invariance, generate) parses with
today's options.

A device call is scarce, and a step whose bench line names an option that was renamed or removed
fails only there, after the machine's start and setup (tests/test_gpu_run_edits.py guards the
steps' source edits the same way). Here each line is read as the device's shell would read it --
the step's `a="..."` options and $out expanded -- and handed to the command's own parser.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from jengine.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (ROOT / "scripts" / "gpu_run.sh").read_text(encoding="utf-8")
CLI = "python3 -m jengine.cli "


def _expand(words: str, shell_vars: dict[str, str]) -> str:
    """words with $name / ${name} / ${name:-default} as the shell expands them, out and s (the
    step) standing for their values on the device; ${s#prefix} (the number a step's name ends
    in) reads 1. An unknown variable raises KeyError, naming it."""
    def one(m):
        name, op = m.group(1) or m.group(3), m.group(2) or ""
        if op.startswith("#"):
            return "1"
        if name in shell_vars:
            return shell_vars[name]
        if op.startswith(":-"):
            return op[2:]
        return {"out": "/tmp/out", "s": "step"}[name]

    return re.sub(r"\$\{([A-Za-z_]\w*)((?:#|:-)[^}]*)?\}|\$([A-Za-z_]\w*)", one, words)


def cli_lines(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv after `jengine`) of each jengine command in the script, its variables
    expanded as the device's shell would: a step's options (`a="..."`) from its earlier line, a
    loop's variable (`for numerics in auto rl-bitwise`) as its first value, a value chosen by a
    command (`m=$(... echo rl-bitwise || echo auto)`) as the first it echoes."""
    shell_vars: dict[str, str] = {}
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        assigned = re.match(r"\s*(?:local\s+)?([a-z_]\w*)=\"([^\"]*)\"\s*$", line)
        if assigned:
            shell_vars[assigned.group(1)] = _expand(assigned.group(2), shell_vars)
        chosen = re.match(r"\s*([a-z_]\w*)=\$\(.*?echo (\S+)", line)
        if chosen:  # m=$([ "$s" = kvtile_ab_rl ] && echo rl-bitwise || echo auto)
            shell_vars[chosen.group(1)] = chosen.group(2)
        loop = re.match(r"\s*for ([a-z_]\w*) in (.*?); do", line)
        if loop:
            shell_vars[loop.group(1)] = shlex.split(_expand(loop.group(2), shell_vars))[0]
        if CLI in line:
            cmd = line[line.index(CLI) + len(CLI):].split(";;")[0]
            out.append((number, shlex.split(_expand(cmd, shell_vars), comments=True)))
    return out


def parse_error(argv: list[str]) -> str | None:
    """None where the jengine command argv[0]'s parser takes argv, else the error it prints."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser(argv[0]).parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    return None


LINES = cli_lines(SCRIPT)


def test_the_script_has_such_lines_and_their_options_are_read():
    """The reading finds the steps (an empty list would pass the test below), of every command
    the script runs, with a step's shared options expanded: triton_layers_ab's bench lines carry
    its `a` variable's --iters 20."""
    assert len(LINES) >= 80, len(LINES)
    assert {argv[0] for _, argv in LINES} == {"bench", "invariance", "generate"}
    assert any(argv[argv.index("--iters") + 1] == "20" and "--long-context" in argv
               for _, argv in LINES if "--iters" in argv)


@pytest.mark.parametrize("number,argv", LINES, ids=[f"line{n}" for n, _ in LINES])
def test_every_jengine_line_parses(number, argv):
    assert parse_error(argv) is None, f"scripts/gpu_run.sh:{number}: {parse_error(argv)}"


def test_negative_control_a_stale_option_is_caught():
    """A renamed option (in bench and invariance), a value of the wrong type and an unknown part
    timeout are refused; the same lines with the options as they are parse."""
    good = ["bench", "--parts", "model", "--iters", "20", "--part-timeout", "60", "model=110"]
    assert parse_error(good) is None
    assert "--iterations" in parse_error(["bench", "--parts", "model", "--iterations", "20"])
    assert parse_error(["bench", "--parts", "model", "--iters", "twenty"]) is not None
    assert parse_error(["bench", "--parts", "model", "--part-timeout", "nopart=10"]) is not None
    assert parse_error(["invariance", "--numerics", "rl-bitwise", "--max-new-tokens", "8"]) is None
    assert "--max-tokens" in parse_error(["invariance", "--numerics", "rl-bitwise",
                                          "--max-tokens", "8"])
    stale_step = ('    x)  # a step with a stale option in its shared ones\n'
                  '      a="--iterz 3"\n'
                  '      step x 10 python3 -m jengine.cli bench --parts model $a ;;\n')
    [(number, argv)] = cli_lines(stale_step)
    assert number == 3 and "--iterz 3" in parse_error(argv)
