"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer`, plus incremental detokenization and chat
templates.

- `encode` adds special tokens only when the tokenizer's own post-processor says so (e.g. Llama's
  BOS); it never invents any. `decode` skips special tokens.
- `IncrementalDetokenizer` turns a token stream into text deltas the way vLLM and SGLang do: decode
  a small window twice (without and with the new tokens) and emit the difference only once it no
  longer ends in U+FFFD, so a UTF-8 character split across tokens is never emitted half-formed.
- `apply_chat_template` renders the model's Jinja chat template in jinja2's immutable sandbox,
  with the same globals and filters HF transformers provides. Templates come from model
  directories and are untrusted: nothing from them runs outside the sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

# Special-token names HF passes to chat templates (`special_tokens_map`).
_TEMPLATE_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                            "cls_token", "mask_token")

# vLLM's window: decode from up to this many tokens before the unread ones, so tokenizers whose
# decoding depends on the preceding token (SentencePiece's leading space) decode each delta right.
_DETOKENIZE_CONTEXT = 5


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        # bos_token, eos_token, ... as strings, for chat templates.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """Read `tokenizer.json` (required), `tokenizer_config.json` and `chat_template.jinja`."""
        directory = Path(directory)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {str(tokenizer_file)!r} (jengine "
                                    "needs a fast-tokenizer tokenizer.json in the model directory)")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust error names no file; add it
            raise ValueError(f"cannot read tokenizer file {str(tokenizer_file)!r}: {exc}") from exc

        tokenizer_config = read_json_if_present(directory / "tokenizer_config.json")
        special_tokens = {}
        for name in _TEMPLATE_SPECIAL_TOKENS:
            value = tokenizer_config.get(name)
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                special_tokens[name] = value
        return cls(tokenizer, chat_template=_chat_template(directory, tokenizer_config),
                   special_tokens=special_tokens)

    # -- ids <-> text --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (model vocabulary plus added tokens)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens are added only if the post-processor defines them;
        pass add_special_tokens=False for text that already carries them (a rendered chat)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tokenizer

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's template.

        Extra keyword arguments reach the template as variables (e.g. `tools`,
        `enable_thinking`). Template errors (including its own `raise_exception`) become ValueError.
        """
        if self.chat_template is None:
            raise ValueError("model has no chat template")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of {{'role', 'content'}} objects, got {messages!r}")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role', got {message!r}")

        import jinja2  # imported here: only chat requests need it

        variables = {**self.special_tokens, **template_kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                **variables)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    @cached_property
    def _compiled_template(self):
        return compile_chat_template(self.chat_template)


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids: `add(token_id)` returns the new text.

    Text is held back while the decoded window ends in U+FFFD (an incomplete UTF-8 sequence);
    `flush()` releases whatever is held back at the end of the stream. `prompt_ids` (optional)
    seeds the window so the first output token decodes in context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)[-_DETOKENIZE_CONTEXT:]
        self._prefix_offset = 0               # window start
        self._read_offset = len(self._ids)    # ids before this have been emitted
        self.text = ""                        # everything emitted so far

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        delta = self._pending_text()
        if not delta or delta.endswith("\ufffd"):
            return ""  # nothing visible yet, or a multi-byte character still incomplete
        self._emit(delta)
        return delta

    def flush(self) -> str:
        """Emit any held-back text (a trailing incomplete character comes out as U+FFFD)."""
        delta = self._pending_text()
        if delta:
            self._emit(delta)
        return delta

    def _pending_text(self) -> str:
        # Decoding the window with and without the unread ids: the difference is their text.
        emitted_part = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        return window[len(emitted_part):] if len(window) > len(emitted_part) else ""

    def _emit(self, delta: str) -> None:
        self.text += delta
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # Ids before the window are never decoded again; drop them so memory stays flat.
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def compile_chat_template(source: str):
    """Compile a chat template in jinja2's immutable sandbox with HF transformers' environment:
    trim_blocks/lstrip_blocks, loop controls, `tojson` without HTML escaping, `raise_exception`,
    `strftime_now`, and the `{% generation %}` tag (rendered as its body)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # HF uses {% generation %} to mark assistant spans for training masks; serving ignores it.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


def read_json_if_present(path: Path) -> dict:
    """Parsed JSON object at `path`, {} when the file is absent; a clear error when malformed."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(value).__name__}")
    return value


def _chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` (transformers >= 4.43 writes it) wins over tokenizer_config's field,
    as in transformers. A list of named templates picks the one named "default"."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"tokenizer_config.json chat_template must be a string, got {template!r}")
    return template
