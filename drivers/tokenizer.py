"""The byte-level tokenizer of the synthetic model (the reference server's text interface).

The emulator's synthetic Qwen3 model has no real vocabulary, so the server defines one that is
exact and reversible for text:

* a text prompt is encoded as UTF-8 and byte ``b`` becomes token id ``BYTE_OFFSET + b``
  (ids 256..511);
* decoding maps ids 256..511 back to bytes and decodes them as UTF-8 (invalid sequences become
  U+FFFD); any other id renders as ``<id>`` (the model's greedy output is mostly such ids);
* ``END_TOKEN_ID`` (151643, Qwen's ``<|endoftext|>``) ends a generation and is never rendered.

:class:`Detokenizer` decodes incrementally with the same rules, so the pieces streamed one token
at a time concatenate to exactly the text of :func:`decode` over the same ids.
"""

from __future__ import annotations

import codecs

#: First id of the 256 byte tokens.
BYTE_OFFSET = 256
#: Default end-of-text token: generation stops when the model produces it.
END_TOKEN_ID = 151643


def encode(text: str) -> list[int]:
    """Token ids of ``text``: one id per UTF-8 byte, ``BYTE_OFFSET + byte``."""
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def is_byte_token(token_id: int) -> bool:
    return BYTE_OFFSET <= token_id < BYTE_OFFSET + 256


class Detokenizer:
    """Incremental decoder: ``feed`` one id at a time, ``flush`` at the end.

    Byte tokens are buffered while they form an incomplete UTF-8 sequence; a non-byte id first
    flushes pending bytes (an incomplete sequence becomes U+FFFD) and then renders as ``<id>``.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text that became final with ``token_id`` (possibly empty)."""
        if is_byte_token(token_id):
            return self._utf8.decode(bytes((token_id - BYTE_OFFSET,)))
        return self.flush() + f"<{token_id}>"

    def flush(self) -> str:
        """Text of any pending bytes; the decoder is then empty."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def decode(token_ids: list[int]) -> str:
    """Text of ``token_ids`` (the concatenation of a :class:`Detokenizer`'s output)."""
    detok = Detokenizer()
    return "".join(detok.feed(t) for t in token_ids) + detok.flush()


class ByteTokenizer:
    """The byte-level tokenizer above as an object (the server's default): the interface
    :class:`HFTokenizer` shares."""

    name = "byte-level"
    chat_template: str | None = None
    #: the end-of-text id this tokenizer knows (None: the server's ``end_token_id``)
    eos_token_id: int | None = None
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return decode(token_ids)

    def detokenizer(self) -> "Detokenizer":
        return Detokenizer()

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (the ``tokens`` of logprobs)."""
        return decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.token_text(token_id).encode("utf-8"))


class TokenizerLoadError(ValueError):
    """``--tokenizer PATH`` cannot be loaded (the message names the path and why)."""


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (optional extra
    ``calexec[tokenizer]``, imported only here). ``tokenizer_config.json`` next to it, when
    present, gives the chat template (``chat_template``) and the special tokens (``bos_token``,
    ``eos_token``); streaming decodes with ``tokenizers.decoders.DecodeStream``."""

    def __init__(self, path: str) -> None:
        import json
        import os
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise TokenizerLoadError(f"--tokenizer={path!r}: the `tokenizers` library is not "
                                     f"installed ({err}); pip install 'calexec[tokenizer]'") from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as err:  # the library raises its own Exception type
            raise TokenizerLoadError(f"--tokenizer={path!r}: cannot load {file!r} as a "
                                     f"tokenizer.json: {err}") from None
        self.name = file
        self.chat_template = None
        self.bos_token = self.eos_token = ""
        self.eos_token_id = None
        config_file = os.path.join(os.path.dirname(os.path.abspath(file)), "tokenizer_config.json")
        if os.path.isfile(config_file):
            try:
                with open(config_file, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as err:
                raise TokenizerLoadError(f"--tokenizer={path!r}: {config_file!r} is not "
                                         f"readable JSON: {err}") from None
            template = config.get("chat_template")
            if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
            self.chat_template = template if isinstance(template, str) else None
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

    def detokenizer(self) -> "_StreamDetokenizer":
        return _StreamDetokenizer(self._tok)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.token_text(token_id).encode("utf-8"))


def _special(value: object) -> str:
    """A special token of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class _StreamDetokenizer:
    """``feed``/``flush`` over ``tokenizers.decoders.DecodeStream``."""

    def __init__(self, tok) -> None:
        from tokenizers.decoders import DecodeStream
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def feed(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""

    def flush(self) -> str:
        return ""


def load(path: str | None) -> "ByteTokenizer | HFTokenizer":
    """The tokenizer of ``--tokenizer PATH`` (a tokenizer.json or a directory holding one);
    None: the byte-level tokenizer. Raises :class:`TokenizerLoadError` naming the path."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
