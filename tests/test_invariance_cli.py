"""`jengine invariance` as a command: prompt files, the table, and the exit status."""

import argparse
import json

import pytest

from jengine import invariance
from jengine.invariance import Divergence, ModeResult


def _args(**kw):
    base = dict(model="tiny", numerics="rl-bitwise", prompts=None, temperature=[0.0], trials=1,
                max_new_tokens=4, seed=0)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("diverged", [False, True])
def test_exit_status_follows_the_first_divergence(monkeypatch, capsys, diverged):
    result = ModeResult("packed", 0.0, 1, compared_values=3)
    if diverged:
        result.divergences.append(Divergence("packed", 0.0, 0, "output logprob", 2, -1.5, -1.25))

    def fake_run(self, report=print):
        report(invariance.format_table([result], self.cfg.numerics))
        return [result]

    monkeypatch.setattr(invariance.InvarianceHarness, "run", fake_run)
    status = invariance.main(_args())
    out, err = capsys.readouterr()
    assert status == (1 if diverged else 0)
    assert ("DIVERGED" in out) == diverged and ("PASS (bitwise)" in out) != diverged
    if diverged:
        assert "request 0: output logprob differs at position 2" in err


def test_prompt_file_forms_and_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"text": "hi"}) + "\n\n" + json.dumps({"input_ids": [1, 2]}) + "\n")
    assert invariance.load_prompts(str(good)) == ("hi", (1, 2))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: expected a 'text' or 'input_ids' field"):
        invariance.load_prompts(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        invariance.load_prompts(str(empty))
