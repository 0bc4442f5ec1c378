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
        #: a byte token was fed since the last flush: only then can the decoder hold bytes
        #: of a character not yet whole (without one, a flush has nothing to end: the
        #: decoder's three Python calls a token skipped, issue 28 stop 66)
        self._bytes = False

    def feed(self, token_id: int) -> str:
        """Text that became final with ``token_id`` (possibly empty)."""
        if is_byte_token(token_id):
            self._bytes = True
            return self._utf8.decode(bytes((token_id - BYTE_OFFSET,)))
        if not self._bytes:
            return f"<{token_id}>"
        return self.flush() + f"<{token_id}>"

    def flush(self) -> str:
        """Text of any pending bytes; the decoder is then empty."""
        if not self._bytes:
            return ""
        self._bytes = False
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

    def detokenizer(self) -> Detokenizer:
        return Detokenizer()

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (the ``tokens`` of logprobs)."""
        return decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (logprobs' ``bytes``): a byte token's one byte, even when it
        is part of a character (its text on its own is U+FFFD), so that the bytes of
        consecutive tokens join into the text, as OpenAI documents the field."""
        if is_byte_token(token_id):
            return [token_id - BYTE_OFFSET]
        return list(self.token_text(token_id).encode("utf-8"))
