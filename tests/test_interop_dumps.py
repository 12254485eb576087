"""Trainer dump files: round trips in both formats, and malformed dumps rejected by sequence and field."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np
import pytest
import torch

from interop.dumps import DumpFormatError, read_dump, write_dump
from tests.bits import count_bit_differences


def _sequences():
    rng = np.random.default_rng(0)
    seqs = []
    for i, t in enumerate((5, 12)):
        lp = -np.abs(rng.standard_normal(t - 1)).astype(np.float32)
        lp[0] = np.float32(-0.0)  # the signed zero must survive
        seq = {"ids": rng.integers(0, 32768, t).astype(np.int64), "logprob": lp,
               "layout": "TP2 PP1 EP1 bf16", "commit": f"abc{i}"}
        if i == 1:
            seq["logits"] = torch.randn(8, 32768).to(torch.bfloat16)  # torch in, numpy out
            seq["prompt_len"] = 4
            seq["states"] = {"embed": rng.standard_normal((3, 64)).astype(ml_dtypes.bfloat16),
                             "layers.0.output": rng.standard_normal((3, 64)).astype(np.float32)}
        seqs.append(seq)
    return seqs


def _assert_same(a, b):
    assert set(a) == set(b)
    for key, value in a.items():
        if key == "states":
            _assert_same(value, b[key])
        elif isinstance(value, (str, int)):
            assert value == b[key]
        else:
            va = value.detach().numpy() if isinstance(value, torch.Tensor) and value.dtype != torch.bfloat16 \
                else value
            if isinstance(va, torch.Tensor):
                va = va.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            assert np.asarray(va).dtype == b[key].dtype and np.asarray(va).shape == b[key].shape
            if b[key].dtype.kind in "iu":
                assert np.array_equal(va, b[key])
            else:
                assert count_bit_differences(va, b[key]) == 0


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_round_trip_is_bit_exact(tmp_path, suffix):
    seqs = _sequences()
    path = tmp_path / f"dump{suffix}"
    write_dump(path, seqs)
    back = read_dump(path)
    assert len(back) == len(seqs)
    for a, b in zip(seqs, back):
        _assert_same(a, b)
    assert np.signbit(back[0]["logprob"][0])  # -0.0 kept its sign
    assert back[0]["ids"].dtype == np.int64 and back[0]["logprob"].dtype == np.float32


def test_round_trip_negative_control_detects_a_changed_bit(tmp_path):
    seqs = _sequences()
    write_dump(tmp_path / "d.pt", seqs)
    back = read_dump(tmp_path / "d.pt")
    flipped = back[0]["logprob"].copy()
    flipped[0] = np.float32(0.0)  # +0.0 == -0.0 as values, but not as bits
    assert flipped[0] == seqs[0]["logprob"][0]
    assert count_bit_differences(flipped, seqs[0]["logprob"]) == 1


def _bad(field, value, index=1):
    seqs = _sequences()
    if value is KeyError:
        del seqs[index][field]
    else:
        seqs[index][field] = value
    return seqs


@pytest.mark.parametrize("field,value,needle", [
    ("ids", KeyError, "missing"),
    ("logprob", KeyError, "missing"),
    ("logprob", np.zeros(11, np.float64), "float32[11]"),
    ("logprob", np.zeros(10, np.float32), "float32[11]"),
    ("logprob", np.full(11, np.nan, np.float32), "NaN"),
    ("ids", np.zeros((2, 6), np.int64), "int64[T]"),
    ("ids", np.array([1.0, 2.0]), "int64[T]"),
    ("ids", np.array([3, -1] + [0] * 10), "negative token id"),
    ("layout", 3, "string"),
    ("commit", None, "string"),
    ("logits", np.zeros((9, 32768), np.float32), "rows"),
    ("prompt_len", 12, "prompt_len"),
    ("states", {"embed": np.zeros((3, 4), np.int32)}, "embed"),
    ("tokens", [1, 2], "unknown field"),
])
def test_malformed_sequences_are_rejected_naming_sequence_and_field(tmp_path, field, value, needle):
    with pytest.raises(DumpFormatError) as e:
        write_dump(tmp_path / "d.pt", _bad(field, value))
    msg = str(e.value)
    assert "sequence 1" in msg and repr(field) in msg and needle in msg, msg


def test_malformed_files_are_rejected(tmp_path):
    # A .pt that would run code if unpickled: weights_only refuses it.
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"format": "jengine-trainer-dump", "version": 1, "sequences": [Evil()]}, f)
    with pytest.raises(DumpFormatError, match="weights_only"):
        read_dump(evil)
    torch.save({"format": "something-else", "sequences": []}, tmp_path / "other.pt")
    with pytest.raises(DumpFormatError, match="not a jengine-trainer-dump"):
        read_dump(tmp_path / "other.pt")
    # A file written correctly, then corrupted inside: the reader names sequence and field.
    seqs = _sequences()
    write_dump(tmp_path / "ok.pt", seqs)
    payload = torch.load(tmp_path / "ok.pt", weights_only=True)
    payload["sequences"][0]["logprob"] = payload["sequences"][0]["logprob"].double()
    torch.save(payload, tmp_path / "corrupt.pt")
    with pytest.raises(DumpFormatError, match="sequence 0: field 'logprob'"):
        read_dump(tmp_path / "corrupt.pt")
    # safetensors: a tensor naming a sequence beyond num_sequences.
    from safetensors.torch import save_file

    save_file({"seq3.ids": torch.zeros(4, dtype=torch.int64)}, str(tmp_path / "bad.safetensors"),
              metadata={"format": "jengine-trainer-dump", "version": "1", "num_sequences": "1"})
    with pytest.raises(DumpFormatError, match="names sequence 3"):
        read_dump(tmp_path / "bad.safetensors")
    with pytest.raises(DumpFormatError, match="suffix"):
        write_dump(tmp_path / "d.json", seqs)
    with pytest.raises(DumpFormatError, match="at least one sequence"):
        write_dump(tmp_path / "d.pt", [])
