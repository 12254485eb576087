"""The attention experiment scripts' row-sum flag reaches their launches (under the Triton interpreter).

scripts/gpu_attention_split.py once took `--rowsum-tree` and set an attribute no launch read, so a
device call "measured the tree" twice on Triton's sum (docs/gpu-validation.md, eighteenth
session). Here the scripts' own launch helpers run one small decode step under each `--rowsum`
form: the forms must give other bits (the flag reached the kernel), each form's split schedule
must equal its serial one (the scripts compare launches within a form), and Triton's form must
equal the leaf's own launch (the scripts' reference is the engine's).
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
    monkeypatch.delenv(rows_exp.ta.ROWSUM_ENV, raising=False)
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
    assert rows_exp.rows_differ(leaf, outs["triton"][0]) == 0
