"""The tokenizer wrapper, the incremental detokenizer and chat templates, on the tiny model's
real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from jengine.models import IncrementalDetokenizer, Tokenizer
from jengine.models import tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny.ensure_tiny_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


TEXTS = ["Hello, world!", "def add(a, b):\n\treturn a + b\n", "naïve café — 日本語のテキスト 🎉🦀",
         "  leading and trailing spaces  ", "", "mixed\r\nline\u2028endings", "Ünïcödé ∑ ∫ √"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < 32768 for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_vocab_specials_and_fillers(tokenizer):
    assert tokenizer.vocab_size == 32768
    im_start, im_end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end  # special-token text becomes the special id
    assert tokenizer.decode(ids) == "user\nhi"       # and decode skips it
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert im_start not in tokenizer.encode("hi")     # nothing is prepended
    assert tokenizer.decode([12345, 32767]) == "<t12345><t32767>"


def test_tokenizer_adds_only_what_the_post_processor_defines(tokenizer):
    import tokenizers

    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])  # a Llama-style BOS
    with_bos = Tokenizer(backend)
    assert with_bos.encode("hi") == [0] + tokenizer.encode("hi")
    assert with_bos.encode("hi", add_special_tokens=False) == tokenizer.encode("hi")


def test_incremental_detokenizer_multibyte(tokenizer):
    text = "naïve café — 日本語 🎉🦀 done"
    ids = tokenizer.encode(text)
    # Negative control: token-by-token decoding really does split characters here.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)

    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "" in deltas  # some steps held text back
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text
    assert detok.flush() == ""


def test_incremental_detokenizer_flush_and_specials(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    detok = IncrementalDetokenizer(tokenizer)
    held = "".join(detok.add(i) for i in ids[:-1])  # the emoji's last byte never arrives
    assert held == "ok "
    assert detok.flush() == "\ufffd"

    im_end = tokenizer.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("prompt text"))
    stream = tokenizer.encode(" one") + [im_end] + tokenizer.encode(" two")
    assert "".join(detok.add(i) for i in stream) == " one two"


def test_chat_template_rendering(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi ✓"},
                {"role": "assistant", "content": "Yo"}]
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tokenizer.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"messages\[0\] must be an object with a string 'role'"):
        tokenizer.apply_chat_template([{"content": "no role"}])


def test_chat_template_errors_and_sandbox(tokenizer):
    bare = Tokenizer(tokenizer.backend)
    with pytest.raises(ValueError, match="^model has no chat template$"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])

    raising = Tokenizer(tokenizer.backend, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="chat template error: roles must alternate"):
        raising.apply_chat_template([{"role": "user", "content": "hi"}])

    escaping = Tokenizer(tokenizer.backend, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template error"):
        escaping.apply_chat_template([{"role": "user", "content": "hi"}])

    mutating = Tokenizer(tokenizer.backend, chat_template="{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="chat template error"):
        mutating.apply_chat_template([{"role": "user", "content": "hi"}])

    hf_like = Tokenizer(tokenizer.backend, special_tokens={"eos_token": "<|im_end|>"}, chat_template=(
        "{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
        "{% if loop.first %}{% continue %}{% endif %}{% endfor %}{{ eos_token }}"))
    assert hf_like.apply_chat_template([{"role": "user", "content": "é<"}]) == '"é<"<|im_end|>'
