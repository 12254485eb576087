"""scripts/gpu_run.sh's A/B steps edit the device's copy of a source (with_source_edit,
with_plan_edit: a sed expression) or of the GEMM tile file (with_tiles: a Python statement on its
JSON `d`) for one arm. A device call is scarce and an edit rots silently when what it edits
changes: with_source_edit refuses an edit that changes nothing, and a tile statement naming a
tile that is gone raises -- either only on the device, a step lost. Here every edit the script
spells out (literally or through one of its top-level variables) is applied to a copy: each sed
must change its file, each tile statement must run.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.gpu_run_sh import QUOTED, ROOT, SCRIPT, top_level_variables, word_value

TILES = ROOT / "pallas_kernels" / "triton_gemm_tiles.json"
PLAN = "pallas_kernels/triton_attention_plan.py"


def source_edits(text: str) -> list[tuple[str, str]]:
    """(file, sed expression) of every with_source_edit / with_plan_edit whose expression the
    script spells out (not its definitions)."""
    variables = top_level_variables(text)
    found = [(path, arg) for path, arg in
             re.findall(r"with_source_edit\s+(\S+)\s+" + QUOTED, text)]
    found += [(PLAN, arg) for arg in re.findall(r"with_plan_edit\s+" + QUOTED, text)]
    edits = [(path, word_value(arg, variables)) for path, arg in found
             if not arg.startswith('"$@')]
    return sorted({(path, expr) for path, expr in edits if expr is not None})


def tile_edits(text: str) -> list[str]:
    """The Python statements of every with_tiles the script spells out."""
    variables = top_level_variables(text)
    statements = [word_value(arg, variables) for arg in re.findall(r"with_tiles\s+" + QUOTED, text)
                  if arg != '"$@"']
    return sorted({s for s in statements if s is not None})


def changes(path: Path, expr: str) -> bool:
    """Whether sed's expression changes the file's text (GNU sed, as on the device; printed, the
    file itself left as it is)."""
    out = subprocess.run(["sed", "-e", expr, str(path)], capture_output=True, text=True,
                         check=True).stdout
    return out != path.read_text(encoding="utf-8")


def test_the_script_spells_out_edits_of_both_kinds():
    """The parsing finds what the script holds (an empty list would pass everything below), and
    leaves out what only the device can expand (a loop's ${ms%b})."""
    files = {path for path, _ in source_edits(SCRIPT)}
    assert {"pallas_kernels/_triton_attention_kernels.py", PLAN,
            "pallas_kernels/triton_rope_attention.py"} <= files, files
    assert len(tile_edits(SCRIPT)) >= 5
    assert not any("$" in expr for _, expr in source_edits(SCRIPT) if "MERGE_STAGES" in expr)


@pytest.mark.parametrize("path,expr", source_edits(SCRIPT))
def test_every_source_edit_changes_its_file(path, expr):
    assert changes(ROOT / path, expr), f"{path}: {expr!r} matches nothing (the device refuses it)"


@pytest.mark.parametrize("statement", tile_edits(SCRIPT))
def test_every_tile_edit_runs_on_the_tile_file(statement):
    d = json.loads(TILES.read_text(encoding="utf-8"))
    exec(statement, {"d": d})  # the script's own statement, as its with_tiles runs it


def test_negative_controls_a_stale_edit_is_caught(tmp_path):
    """An expression that matches nothing is found unchanging, a statement naming a tile that is
    not there raises, and an edit that matches does change the file."""
    source = tmp_path / "k.py"
    clamped = "page = tl.gather(split_pages, tl.minimum(tl.maximum(at, 0), PAGES - 1), 0)\n"
    source.write_text(clamped, encoding="utf-8")
    assert not changes(source, "s/^NO_SUCH_LINE = .*/x/")
    unclamp = top_level_variables(SCRIPT)["UNCLAMP"]
    assert changes(source, unclamp)
    d = json.loads(TILES.read_text(encoding="utf-8"))
    with pytest.raises(KeyError):
        exec("d['tiles']['no_such_tile'].update(grouped=False)", {"d": d})
