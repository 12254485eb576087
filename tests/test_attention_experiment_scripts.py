"""The attention experiment scripts' row-sum flag reaches their launches (under the Triton interpreter).

scripts/gpu_attention_split.py once took `--rowsum-tree` and set an attribute no launch read, so a
device call "measured the tree" twice on Triton's sum (docs/gpu-validation.md, eighteenth
session). Here the scripts' own launch helpers run one small decode step under each `--rowsum`
form: the forms must give other bits (the flag reached the kernel), each form's split schedule
must equal its serial one (the scripts compare launches within a form), and the default form must
equal the leaf's own launch with the variable unset (the default form; the scripts' reference is
the engine's).
"""

from __future__ import annotations

import os
import sys

import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)

if not triton_interpreter.AVAILABLE:
    pytest.skip("triton's interpreter is not available", allow_module_level=True)

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import gpu_attention_rows as rows_exp  # noqa: E402
import gpu_attention_split as split_exp  # noqa: E402


@pytest.fixture()
def case(monkeypatch):
    monkeypatch.setattr(rows_exp, "DEV", "cpu")
    monkeypatch.delenv(rows_exp.tap.ROWSUM_ENV, raising=False)
    # Two decode rows at contexts that cross a split (SPLIT 256), on a pool of shuffled pages.
    return rows_exp.make_case(torch.Generator().manual_seed(1), [301, 40], [1, 1])


def _outputs(monkeypatch, case, form):
    monkeypatch.setattr(rows_exp, "ROWSUM", form)
    split = split_exp.split_launch(case, *split_exp.TODAY)[1]
    serial = split_exp.serial_launch(case, *split_exp.TODAY)[1]
    return split.clone(), serial.clone()


def test_the_rowsum_flag_reaches_the_launches(monkeypatch, case):
    outs = {form: _outputs(monkeypatch, case, form) for form in ("triton", "dot")}
    for split, serial in outs.values():
        assert rows_exp.rows_differ(split, serial) == 0
    assert rows_exp.rows_differ(outs["triton"][0], outs["dot"][0]) > 0
    q, k, v, table, req, pos = case
    leaf = rows_exp.ta.paged_attention_triton_torch(q, (k, v), table, req, pos,
                                                    scale=rows_exp.D ** -0.5, schedule="split")
    assert rows_exp.rows_differ(leaf, outs[rows_exp.tap.DEFAULT_ROWSUM][0]) == 0  # env unset


def test_pages_ab_gives_every_launch_its_own_page_window(monkeypatch, tmp_path):
    """--pages-ab's control runs another SPLIT; it once reused the config's page window, which
    at SPLIT 64 (4 pages) is too small for its SPLIT 128 control: the interpreter's gather raised,
    and on the GPU the out-of-range gather would have read whatever the registers held. A stand-in
    launch (no kernel) checks the window each launch is given against the split it runs."""
    seen = []

    def launch(case, warps, stages, tpp=None, block_n=None, split=None, maxnreg=None,
               pages=None):
        split = split or rows_exp.tap.SPLIT
        if pages:
            assert pages >= rows_exp.tap.pages_per_split(rows_exp.PAGE, split), (split, pages)
        seen.append((split, pages))
        out = torch.full((2, rows_exp.HQ, rows_exp.D), float(split), dtype=torch.bfloat16)
        return (lambda: None), out

    args = type("Args", (), {"out": str(tmp_path), "smoke": True})()
    monkeypatch.setattr(split_exp, "device_us", lambda run: 0.0)  # timings are not checked here
    split_exp.pages_ab(args, launch, {"c": None}, [(4, 3, 0, 0, 64), (4, 3, 0, 0, 512)], "t")
    # (pages_ab records a launch that raises as that row's error, so what ran is checked here.)
    assert (128, rows_exp.tap.pages_per_split(rows_exp.PAGE, 128)) in seen  # SPLIT 64's control
    assert (512, rows_exp.tap.pages_per_split(rows_exp.PAGE, 512)) in seen
