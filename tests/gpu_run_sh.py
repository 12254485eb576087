"""How the device's shell reads scripts/gpu_run.sh's variables, for the tests that check the
script's lines on the CPU before a device call does (tests/test_gpu_run_edits.py: its source and
tile edits; tests/test_gpu_run_cli_lines.py: its command lines). One reader, so both tests expand
a word by the same rules: what it cannot expand exactly it refuses, it never leaves a `$` behind.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (ROOT / "scripts" / "gpu_run.sh").read_text(encoding="utf-8")

# A single-quoted or double-quoted shell word.
QUOTED = r"""('[^']*'|"(?:[^"\\]|\\.)*")"""

# $out: the device's output folder, which a step's command line names.
OUT = "/tmp/out"


def expand(words: str, shell_vars: dict[str, str]) -> str:
    """words with $name / ${name} / ${name:-default} / ${name#prefix} / ${name//from/to} as the
    shell expands them ($out standing for the device's output folder). An unknown variable, or an
    expansion of another form (`${ms%b}`), raises KeyError: nothing is left unexpanded."""
    def one(m):
        name, op = m.group(1) or m.group(3), m.group(2) or ""
        if name == "out" and name not in shell_vars:
            return OUT
        if op.startswith(":-"):
            return shell_vars.get(name) or op[2:]
        value = shell_vars[name]
        if op.startswith("//"):  # ${cfg//,/_}: every match replaced
            pattern, _, replacement = op[2:].partition("/")
            return value.replace(pattern, replacement)
        if op.startswith("#"):
            return value.removeprefix(op[1:])
        if op:
            raise KeyError(f"${{{name}{op}}}")
        return value

    return re.sub(r"\$\{([A-Za-z_]\w*)([^}]*)\}|\$([A-Za-z_]\w*)", one, words)


def top_level_variables(text: str) -> dict[str, str]:
    """The script's top-level NAME='...' / NAME="..." assignments (one line each), each expanded
    with those before it; one that expands something else is left out."""
    out: dict[str, str] = {}
    for name, value in re.findall(r"^([A-Z_][A-Z0-9_]*)=" + QUOTED + r"\s*$", text, re.M):
        word = word_value(value, out)
        if word is not None:
            out[name] = word
    return out


def word_value(word: str, variables: dict[str, str]) -> str | None:
    """A quoted shell word's value: '...' literally, "..." expanded with `variables`; None where
    it names what only the device knows (a loop's ${ms%b}, a step's local variable)."""
    if word.startswith("'"):
        return word[1:-1]
    try:
        return expand(word[1:-1], variables)
    except KeyError:
        return None
