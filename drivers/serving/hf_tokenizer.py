"""The server's tokenizers: the synthetic model's byte-level one (byte_tokenizer.py, the
default) or a Hugging Face ``tokenizer.json`` given by ``calexec serve --tokenizer PATH``,
loaded with the ``tokenizers`` library (the ``[tokenizer]`` extra, imported only then). Both
offer ``encode``, ``decode``, ``detokenizer()`` (incremental ``feed``/``flush``),
``token_text``, ``token_bytes``, ``chat_template``, ``bos_token``, ``eos_token``,
``eos_token_id``."""

from __future__ import annotations

import re
import time
from typing import Any

from calexec.drivers.serving.byte_tokenizer import ByteTokenizer


class TokenizerLoadError(ValueError):
    """A tokenizer path cannot be loaded (the message names the setting, the path and
    why)."""


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (optional extra
    ``calexec[tokenizer]``, imported only here). ``tokenizer_config.json`` next to it, when
    present, gives the chat template (``chat_template``) and the special tokens (``bos_token``,
    ``eos_token``); streaming decodes with ``tokenizers.decoders.DecodeStream``."""

    def __init__(self, path: str, setting: str = "tokenizer_path") -> None:
        """``setting``: what a load error names as the source of ``path`` (``calexec serve``
        passes ``--tokenizer``; an embedder set ``ServerConfig.tokenizer_path``)."""
        import json
        import os
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if os.path.exists(file) and not os.path.isfile(file):  # the library would wait for a
            # FIFO's writer, or read /dev/zero without end (checked first: a wrong path is
            # wrong whether or not the library is installed)
            shown = "it" if file == path else repr(file)
            raise TokenizerLoadError(f"{setting}={path!r}: {shown} is not a regular file, "
                                     "not a tokenizer.json")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise TokenizerLoadError(f"{setting}={path!r}: the `tokenizers` library is not "
                                     f"installed ({err}); pip install 'calexec[tokenizer]'") from None
        try:
            self._tok = _tokenizer_from(Tokenizer, file)
        except Exception as err:  # noqa: BLE001 - the library raises its own Exception type
            raise TokenizerLoadError(f"{setting}={path!r}: cannot load {file!r} as a "
                                     f"tokenizer.json: {err}") from None
        self.name = file
        #: added (special) tokens: written as their text, never as byte-level pieces
        self._added = frozenset(self._tok.get_added_tokens_decoder())
        self.chat_template = None
        self.bos_token = self.eos_token = ""
        self.eos_token_id = None
        config_file = os.path.join(os.path.dirname(os.path.abspath(file)), "tokenizer_config.json")
        if os.path.isfile(config_file):
            try:
                # (-sig: an editor's leading byte order mark, as Notepad saves one, is
                # dropped, as for the other files calexec reads; ``json`` refused it)
                with open(config_file, encoding="utf-8-sig") as f:
                    config = json.load(f)
            except (OSError, ValueError) as err:
                raise TokenizerLoadError(f"{setting}={path!r}: {config_file!r} is not "
                                         f"readable JSON: {err}") from None
            template = config.get("chat_template")
            if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
            self.chat_template = template if isinstance(template, str) else None
            if self.chat_template is not None:  # a template that does not compile refused
                # every chat request as the client's ("messages: the chat template refused
                # them: unexpected '}'"): it is the server's, refused here
                try:
                    compiled_chat_template(self.chat_template)
                except ImportError:
                    pass  # (no jinja2: rendering says so, naming it)
                except Exception as err:  # noqa: BLE001 - jinja2's TemplateSyntaxError
                    line = getattr(err, "lineno", None)
                    raise TokenizerLoadError(
                        f"{setting}={path!r}: {config_file!r}: its chat_template is no "
                        f"Jinja template: {err}" + (f" (line {line})" if line else "")
                    ) from None
            self.bos_token = _special(config.get("bos_token"))
            self.eos_token = _special(config.get("eos_token"))
            if self.eos_token:
                self.eos_token_id = self._tok.token_to_id(self.eos_token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def detokenizer(self) -> _StreamDetokenizer:
        return _StreamDetokenizer(self._tok)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (logprobs' ``bytes``), so that a character written by several
        tokens is rebuilt by joining them: a byte-level BPE piece (GPT-2's alphabet) mapped
        back to its bytes, a ``<0xHH>`` byte-fallback piece to its byte; otherwise (added
        tokens, other decoders) the UTF-8 of the token's text."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id not in self._added:
            from tokenizers import decoders
            if isinstance(self._tok.decoder, decoders.ByteLevel) \
                    and all(ch in _BYTE_OF_CHAR for ch in piece):
                return [_BYTE_OF_CHAR[ch] for ch in piece]
            if _BYTE_FALLBACK.fullmatch(piece) and getattr(self._tok.model, "byte_fallback",
                                                           False):
                return [int(piece[3:5], 16)]
        return list(self.token_text(token_id).encode("utf-8"))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``bytes_to_unicode``), character -> byte: printable bytes
    stand for themselves, the others for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()
#: a byte-fallback piece (sentencepiece-style BPE: ``<0xE8>``)
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _tokenizer_from(tokenizer: Any, file: str) -> Any:
    """``tokenizers.Tokenizer`` (the class, passed in: the library is imported only when a
    tokenizer is given) of the tokenizer.json ``file``; a leading UTF-8 byte order mark (an
    editor's, as Notepad saves one) is dropped, as for every file calexec reads: the library
    refused it, ``expected value at line 1 column 1``."""
    with open(file, "rb") as f:
        marked = f.read(3) == b"\xef\xbb\xbf"
    if not marked:
        return tokenizer.from_file(file)
    with open(file, encoding="utf-8-sig") as f:
        return tokenizer.from_str(f.read())


def _special(value: object) -> str:
    """A special token of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class _StreamDetokenizer:
    """``feed``/``flush`` over ``tokenizers.decoders.DecodeStream``. The stream holds back the
    tokens of a character not yet whole; ``flush`` gives what ``decode`` makes of them (U+FFFD
    for a cut character, as the byte-level tokenizer's ``flush``), so that the text of an
    answer is the text of its token ids."""

    def __init__(self, tok) -> None:
        from tokenizers.decoders import DecodeStream
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        #: ids fed since the stream last gave text (what it may be holding back)
        self._held: list[int] = []
        #: the last ids that gave text (the context the held ones are decoded in)
        self._context: list[int] = []

    def feed(self, token_id: int) -> str:
        text = self._stream.step(self._tok, token_id) or ""
        self._held.append(token_id)
        if text:
            self._context, self._held = self._held[-4:], []
        return text

    def flush(self) -> str:
        held, self._held = self._held, []
        if not held:
            return ""
        before = self._tok.decode(self._context, skip_special_tokens=True)
        after = self._tok.decode(self._context + held, skip_special_tokens=True)
        return after[len(before):] if after.startswith(before) else ""


#: what the server encodes and decodes with
Tokenizer = ByteTokenizer | HFTokenizer

_TEMPLATES: dict[str, Any] = {}


def compiled_chat_template(source: str) -> Any:
    """A chat template compiled as transformers compiles it (``apply_chat_template``, which
    vLLM renders with): Jinja, sandboxed, immutable, ``trim_blocks`` and ``lstrip_blocks``,
    the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``), the
    ``{% generation %}`` block (rendered as its body), ``raise_exception``, ``strftime_now``
    and transformers' ``tojson`` filter: ``json.dumps`` as it is, keys in their order,
    non-ASCII and ``<>&'`` written as they are (Jinja's own sorts the keys and escapes
    those, so a tool's schema in Qwen3's template was not the text the model was trained
    on). Kept by its source. Raises jinja2's ``TemplateSyntaxError`` for one that does not
    compile, ImportError without jinja2 (the ``[tokenizer]`` extra)."""
    compiled = _TEMPLATES.get(source)
    if compiled is None:
        import json

        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_block()])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        compiled = _TEMPLATES[source] = env.from_string(source)
    return compiled


def _generation_block() -> Any:
    """transformers' ``{% generation %}...{% endgeneration %}`` (its ``AssistantTracker``
    marks the assistant's tokens with it): here the body, rendered as it is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> Any:
            return caller()

    return Generation


def load(path: str | None, setting: str = "tokenizer_path") -> Tokenizer:
    """The tokenizer of ``--tokenizer PATH`` (a tokenizer.json or a directory holding one);
    None: the byte-level tokenizer. Raises :class:`TokenizerLoadError` naming ``setting``
    and the path."""
    return ByteTokenizer() if path is None else HFTokenizer(path, setting)
