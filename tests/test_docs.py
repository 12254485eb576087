"""Docs that run: every ```bash and ```python block of README.md and docs/*.md is executed here.

Conventions (docs/README-style, one place):

* ```bash and ```python blocks run, top to bottom, one scratch directory per file, with the
  repository on PYTHONPATH and its `jengine` on PATH; ```text (or untagged) blocks are output and
  notation and never run. A Python block sees the names of the file's earlier Python blocks.
* `<!-- docs-test: gpu -->` on the line before a block: GPU-only, not run on the CPU.
  `<!-- docs-test: slow -->`: run with `-m slow` only (the same block, just minutes long).
* `jengine serve` / `python -m jengine.serve` runs in the background until the file's last block,
  and must answer /health on its port first. `curl` fails on an HTTP error status.
* A `pip install` is the install CI has already performed: it is checked to be one of this
  package's install commands, and the rest of its line runs. README's `python -m pytest ...` is
  this suite: it is checked to be exactly what `.ci/run` runs, and not run again from inside itself.
* `export NAME=value` lines carry over to the file's later blocks.

Also checked: the docs reference only files that exist in the repository.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"(?:<!-- docs-test: (\w+) -->\n)?^```(\w*)\n(.*?)^```", re.S | re.M)
INSTALLS = ('pip install -e . && ', 'pip install -e ".[dev]" && ')
SERVE = ("jengine serve", "python -m jengine.serve")
BLOCK_TIMEOUT_S = 900


def blocks(doc: str) -> list[tuple[str, str, str, int]]:
    """(mark, language, code, line) of every fenced block."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [(m.group(1) or "", m.group(2), m.group(3), text[:m.start(2)].count("\n") + 1)
            for m in BLOCK.finditer(text)]


def runnable(doc: str, slow: bool) -> list[tuple[str, str, int]]:
    out = []
    for mark, lang, code, line in blocks(doc):
        if lang not in ("bash", "python") or mark == "gpu" or (mark == "slow" and not slow):
            continue
        out.append((lang, code, line))
    return out


class DocRunner:
    def __init__(self, doc: str, workdir: Path):
        self.doc, self.workdir = doc, workdir
        # A reader runs a doc's commands from the repository root (`python examples/rl_loop.py`);
        # the blocks run in workdir, so what they write stays out of the checkout, with the
        # root's script folders linked there.
        for name in ("scripts", "examples"):
            (workdir / name).symlink_to(ROOT / name, target_is_directory=True)
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.python_so_far: list[str] = []
        self.servers: list[tuple[subprocess.Popen, Path]] = []

    def run(self, lang: str, code: str, line: int) -> None:
        where = f"{self.doc}:{line}"
        if lang == "python":
            self.python_so_far.append(code)
            self._check(subprocess.run([sys.executable, "-c", "\n".join(self.python_so_far)],
                                       cwd=self.workdir, env=self.env, capture_output=True,
                                       text=True, timeout=BLOCK_TIMEOUT_S), where)
            return
        script = []
        for cmd in self._commands(code):
            for prefix in INSTALLS:
                if cmd.startswith(prefix):
                    cmd = cmd[len(prefix):]
            if cmd.startswith("python -m pytest"):
                assert f"&& {cmd}\n" in (ROOT / ".ci" / "run").read_text(), where
                continue
            if cmd.startswith(SERVE):
                self._serve(cmd, where)
                continue
            if cmd.startswith("export ") and "=" in cmd:
                name, _, value = cmd[len("export "):].partition("=")
                self.env[name] = value
                continue
            script.append(cmd)
        if script:
            prelude = 'curl() { command curl --fail-with-body "$@"; }\n'
            self._check(subprocess.run(["bash", "-eo", "pipefail", "-c", prelude + "\n".join(script)],
                                       cwd=self.workdir, env=self.env, capture_output=True,
                                       text=True, timeout=BLOCK_TIMEOUT_S), where)

    @staticmethod
    def _commands(code: str) -> list[str]:
        """Logical lines: backslash continuations and open quotes joined, comments dropped."""
        out, pending, joiner = [], "", ""
        for raw in code.splitlines():
            pending = pending + joiner + raw if pending else raw
            if pending.endswith("\\"):  # a continuation: the next line joins this one
                pending, joiner = pending[:-1], ""
                continue
            joiner = "\n"
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # an unclosed quote: the command continues on the next line
                continue
            if shlex.split(pending, comments=True):
                out.append(pending.strip())
            pending = ""
        return out

    def _serve(self, cmd: str, where: str) -> None:
        words = shlex.split(cmd, comments=True)
        port = int(words[words.index("--port") + 1]) if "--port" in words else 30000
        log = self.workdir / f"server-{len(self.servers)}.log"
        proc = subprocess.Popen(words, cwd=self.workdir, env=self.env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT)
        self.servers.append((proc, log))
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{where}: the server exited:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"{where}: no /health on port {port}:\n{log.read_text()[-3000:]}")

    @staticmethod
    def _check(proc: subprocess.CompletedProcess, where: str) -> None:
        assert proc.returncode == 0, (f"{where} exited {proc.returncode}\n--- stdout\n"
                                      f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")

    def close(self) -> None:
        for proc, log in self.servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            assert proc.returncode in (0, -signal.SIGTERM), log.read_text()[-3000:]


def _run_doc(doc: str, tmp_path: Path, slow: bool) -> None:
    steps = runnable(doc, slow)
    runner = DocRunner(doc, tmp_path)
    try:
        for lang, code, line in steps:
            runner.run(lang, code, line)
    finally:
        runner.close()


@pytest.mark.parametrize("doc", [d for d in DOCS if runnable(d, slow=False)])
def test_doc_blocks_run(doc, tmp_path):
    _run_doc(doc, tmp_path, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if len(runnable(d, True)) > len(runnable(d, False))])
def test_doc_blocks_run_including_slow_ones(doc, tmp_path):
    _run_doc(doc, tmp_path, slow=True)


# Files a doc may name that are not in the repository: written by its own blocks or by the
# scripts it runs, or the files of an HF checkpoint directory.
NOT_IN_THE_REPO = {"seqs.jsonl", "dump.pt", "dump_stock.pt", "prompts.jsonl", "config.json",
                   "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "acceptance.md", "acceptance.json", "summary.md", "gpu_validation.md",
                   "gpu_validation.json", "in.jsonl", "bench.json", "bench.md",
                   "h200_dot.json",  # gpu_run.sh goldens_record_dot
                   "h200_kv64.json"}  # goldens_record_kv64


def test_docs_reference_only_files_in_the_repository():
    """A path-like mention (`something.md`, `scripts/x.py`, `tests/test_y.py`, ...) must exist."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    names = {Path(p).name for p in tracked}
    pattern = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:md|py|sh|toml|jsonl?))\b")
    missing = []
    for doc in DOCS:
        for lineno, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1):
            for path in pattern.findall(line):
                name = path.split("/")[-1]
                if name in NOT_IN_THE_REPO or path in tracked or f"docs/{path}" in tracked:
                    continue
                if "/" in path or name not in names:
                    missing.append(f"{doc}:{lineno}: {path}")
    assert missing == [], "\n".join(missing)


def test_the_runner_can_fail(tmp_path):
    """Negative controls: a failing command, a failing HTTP request, a failing Python block and a
    test command other than .ci/run's are caught."""
    runner = DocRunner("README.md", tmp_path)
    with pytest.raises(AssertionError, match="exited"):
        runner.run("bash", "false\n", 1)
    with pytest.raises(AssertionError, match="exited"):
        runner.run("bash", "curl -s http://127.0.0.1:9/never\n", 2)
    with pytest.raises(AssertionError, match="exited"):
        runner.run("python", "raise SystemExit(3)\n", 3)
    with pytest.raises(AssertionError, match="README.md:4"):  # not the suite .ci/run runs
        runner.run("bash", "python -m pytest -k nothing\n", 4)
    assert DocRunner._commands("a \\\n  b\ncurl -d '{\n  \"x\": 1}'\n# comment\n") == [
        "a   b", "curl -d '{\n  \"x\": 1}'"]
