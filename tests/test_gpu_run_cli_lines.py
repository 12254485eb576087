"""Every command line of scripts/gpu_run.sh -- `jengine bench / invariance / generate` and
`python3 scripts/<name>.py` -- parses with today's options.

A device call is scarce, and a step whose line names an option that was renamed or removed fails
only there, after the machine's start and setup (tests/test_gpu_run_edits.py guards the steps'
source edits the same way). Here each line is read as the device's shell would read it -- the
step's name, its `a="..."` options, loop variables and $out expanded -- and handed to the
command's own parser: jengine's (jengine.cli.build_parser), or the script's own, which a child
process reaches by running the script with argparse stopped right after it has parsed.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jengine.cli import build_parser
from tests.gpu_run_sh import ROOT, SCRIPT, expand

CLI = "python3 -m jengine.cli "
PY = "python3 scripts/"


# A step named by a pattern (its case label) as a device call names it: the step's name is part
# of its command (`--cases "${s#accept_}"`). A new pattern needs its example here (a KeyError
# names it).
PATTERN_STEPS = {"bench_e2e_hold*": "bench_e2e_hold0.5", "align_*": "align_llama",
                 "accept_*": "accept_llama", "harness_prod_*": "harness_prod_llama",
                 "before_*": "before_model_auto", "*": "unknown"}


def command_lines(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number, "jengine" or the script's path, its argv) of each command in the script,
    its variables expanded as the device's shell would: the step's name (`s`: the case label's
    first name, a pattern's from PATTERN_STEPS), a step's options (`a="..."`)
    from its earlier line, a loop's variable as its first value, a value chosen by a command
    (`m=$(... echo rl-bitwise || echo auto)`) as the first it echoes."""
    text = re.sub(r'"\$\(dirname "\$0"\)/(\w+\.py)"', r"scripts/\1", text)
    shell_vars: dict[str, str] = {}
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        label = re.match(r"\s*([\w*]+)(?:\|[\w*|]+)?\)", line)
        if label:
            step = label.group(1)
            shell_vars["s"] = PATTERN_STEPS[step] if "*" in step else step
        assigned = re.match(r"\s*(?:local\s+)?([a-z_]\w*)=\"([^\"]*)\"\s*$", line)
        if assigned:
            shell_vars[assigned.group(1)] = expand(assigned.group(2), shell_vars)
        chosen = re.match(r"\s*([a-z_]\w*)=\$\(.*?echo (\S+)", line)
        if chosen:
            shell_vars[chosen.group(1)] = chosen.group(2)
        loop = re.match(r"\s*for ([a-z_]\w*) in (.*?); do", line)
        if loop:
            shell_vars[loop.group(1)] = shlex.split(expand(loop.group(2), shell_vars))[0]
        for marker, start in ((CLI, len(CLI)), (PY, len("python3 "))):
            if marker in line:
                cmd = line[line.index(marker) + start:].split(";;")[0]
                argv = shlex.split(expand(cmd, shell_vars), comments=True)
                out.append((number, "jengine" if marker == CLI else argv.pop(0), argv))
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


# Run in a child, one script line at a time (stdin: JSON [[path, argv], ...]): the script's own
# module code up to its parser, whose parse_args parses and then stops the script. Prints JSON
# [error or None, ...]. A script that reaches no parser is reported, not run on.
_SCRIPT_CHECK = r"""
import argparse, contextlib, io, json, runpy, sys
class Parsed(Exception):
    pass
parse = argparse.ArgumentParser.parse_args
def stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = stop
results = []
for path, argv in json.load(sys.stdin):
    sys.argv = [path, *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
        results.append("ran to the end without parsing its arguments")
    except Parsed:
        results.append(None)
    except SystemExit:
        results.append((err.getvalue().strip().splitlines() or ["exit"])[-1])
    except BaseException as e:
        results.append(f"{type(e).__name__}: {e}")
print(json.dumps(results))
"""


def script_errors(lines: list[tuple[str, list[str]]]) -> list[str | None]:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT_CHECK], input=json.dumps(lines),
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PATH": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LINES = command_lines(SCRIPT)
JENGINE = [(n, argv) for n, cmd, argv in LINES if cmd == "jengine"]
# Scripts that take no arguments have no parser to check (gpu_norm_mean.py runs on CUDA at once).
SCRIPTS = [(n, cmd, argv) for n, cmd, argv in LINES if cmd != "jengine"
           and "ArgumentParser" in (ROOT / cmd).read_text(encoding="utf-8")]


@pytest.fixture(scope="module")
def script_results():
    return dict(zip([n for n, _, _ in SCRIPTS],
                    script_errors([[cmd, argv] for _, cmd, argv in SCRIPTS])))


def test_the_script_has_such_lines_and_their_options_are_read():
    """The reading finds the steps (an empty list would pass the tests below), of every jengine
    command the script runs and of its scripts, with a step's shared options expanded
    (triton_layers_ab's bench lines carry its `a` variable's --iters 20) and a step's name
    (attention_rows_dot's --rowsum dot, from `${s#attention_rows_}`)."""
    assert len(JENGINE) >= 80 and len(SCRIPTS) >= 80, (len(JENGINE), len(SCRIPTS))
    assert {argv[0] for _, argv in JENGINE} == {"bench", "invariance", "generate"}
    assert any(argv[argv.index("--iters") + 1] == "20" and "--long-context" in argv
               for _, argv in JENGINE if "--iters" in argv)
    rows = [argv for _, cmd, argv in SCRIPTS if cmd == "scripts/gpu_attention_rows.py"]
    assert ["--rowsum", "dot"] in [argv[i:i + 2] for argv in rows for i in range(len(argv))]


@pytest.mark.parametrize("number,argv", JENGINE, ids=[f"line{n}" for n, _ in JENGINE])
def test_every_jengine_line_parses(number, argv):
    assert parse_error(argv) is None, f"scripts/gpu_run.sh:{number}: {parse_error(argv)}"


@pytest.mark.parametrize("number", [n for n, _, _ in SCRIPTS],
                         ids=[f"line{n}-{Path(cmd).stem}" for n, cmd, _ in SCRIPTS])
def test_every_script_line_parses(number, script_results):
    assert script_results[number] is None, f"scripts/gpu_run.sh:{number}: {script_results[number]}"


def test_negative_control_a_stale_option_is_caught():
    """A renamed option (in bench, invariance and a script), a value of the wrong type and an
    unknown part timeout are refused; the same lines with the options as they are parse."""
    good = ["bench", "--parts", "model", "--iters", "20", "--part-timeout", "60", "model=110"]
    assert parse_error(good) is None
    assert "--iterations" in parse_error(["bench", "--parts", "model", "--iterations", "20"])
    assert parse_error(["bench", "--parts", "model", "--iters", "twenty"]) is not None
    assert parse_error(["bench", "--parts", "model", "--part-timeout", "nopart=10"]) is not None
    assert parse_error(["invariance", "--numerics", "rl-bitwise", "--max-new-tokens", "8"]) is None
    assert "--max-tokens" in parse_error(["invariance", "--numerics", "rl-bitwise",
                                          "--max-tokens", "8"])
    stale_step = ('    x_dot|x_tree)  # a step with a stale option in its shared ones\n'
                  '      a="--iterz 3"\n'
                  '      step x 10 python3 -m jengine.cli bench --parts model $a ;;\n'
                  '      step x 10 python3 scripts/gpu_attention_rows.py --rowsum "${s#x_}" ;;\n'
                  '      step x 10 python3 scripts/gpu_attention_rows.py --row-sum dot ;;\n')
    (n1, _, bench), (n2, rows_path, rows), (_, _, stale) = command_lines(stale_step)
    assert (n1, n2, rows) == (3, 4, ["--rowsum", "dot"])
    with pytest.raises(KeyError):  # a form the reader does not expand is refused, not kept
        expand("--rowsum ${s%_x}", {"s": "x_dot"})
    assert "--iterz 3" in parse_error(bench)
    good_rows, stale_rows = script_errors([[rows_path, rows], [rows_path, stale]])
    assert good_rows is None and "--row-sum" in stale_rows
