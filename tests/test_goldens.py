"""The structural refactor's acceptance on the CPU: the rl-bitwise engine's ids and logprob bits
equal the goldens recorded before it (scripts/goldens.py; tests/goldens/cpu.json).

The trainer dumps in the goldens are not recomputed here: tests/test_interop_align.py shows every
family's trainer dump equals the engine's logprobs bit for bit, so unchanged engine bits mean
unchanged trainer bits. The negative control flips one bit of a golden and must be reported.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import goldens  # noqa: E402

GOLDEN = json.loads((ROOT / "tests" / "goldens" / "cpu.json").read_text())


@pytest.fixture(scope="module")
def computed():
    return goldens.compute(["tiny", "families", "moe"], trainer=False, device="cpu")


def _without_trainer(section):
    return {k: {f: v for f, v in case.items() if f != "trainer_dump"} for k, case in section.items()}


@pytest.mark.parametrize("section", ["tiny", "families", "moe"])
def test_bits_equal_the_goldens(computed, section):
    want = GOLDEN[section] if section == "tiny" else _without_trainer(GOLDEN[section])
    assert goldens.differences(want, computed[section], section) == []


def test_a_flipped_bit_is_reported(computed):
    want = copy.deepcopy(GOLDEN["tiny"])
    entry = want["greedy_0"]["output_token_logprobs"][3]
    entry[0] = format(int(entry[0], 16) ^ 1, "016x")  # the lowest mantissa bit
    diffs = goldens.differences(want, computed["tiny"], "tiny")
    assert len(diffs) == 1 and diffs[0].startswith("tiny/greedy_0/output_token_logprobs[3][0]: "), diffs
