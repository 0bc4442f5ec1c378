"""Issue 28 (stop 66): ``byte_tokenizer.Detokenizer`` skips its UTF-8 decoder (a ``decode(b"",
final=True)`` and two ``reset`` calls, Python code in ``codecs``) when no byte token came since
the last flush, which is every token of a model whose ids are not byte tokens (the synthetic
model's, once a streamed or not streamed token). A fast path is a claim of equality: here the
detokenizer against the plain one it was (a fresh incremental decoder flushed at every
non-byte id and at every ``flush``), on drawn sequences of feeds and flushes: byte tokens that
make whole characters, cut ones, stray continuation bytes, non-byte ids, flushes anywhere.
Passes on the code before the fast path as after it."""

from __future__ import annotations

import codecs

from hypothesis import example, given, settings
from hypothesis import strategies as st

from calexec.drivers.serving import byte_tokenizer
from calexec.drivers.serving.byte_tokenizer import BYTE_OFFSET, Detokenizer


class PlainDetokenizer:
    """The detokenizer before stop 66, as the reference."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if byte_tokenizer.is_byte_token(token_id):
            return self._utf8.decode(bytes((token_id - BYTE_OFFSET,)))
        return self.flush() + f"<{token_id}>"

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


#: one step: feed a byte token (any byte: ASCII, lead and continuation bytes), feed the bytes
#: of a whole character (1-4 bytes), feed a non-byte id, or flush (None)
steps_st = st.one_of(
    st.integers(0, 255).map(lambda b: [BYTE_OFFSET + b]),
    st.characters().map(lambda c: [BYTE_OFFSET + b
                                   for b in c.encode("utf-8", errors="surrogatepass")]),
    st.integers(0, 2**31 - 1).filter(lambda t: not byte_tokenizer.is_byte_token(t)).map(
        lambda t: [t]),
    st.none())


@settings(max_examples=400, derandomize=True, deadline=None)
@given(steps=st.lists(steps_st, max_size=30))
@example(steps=[[7], [8], None, [9]])  # non-byte ids only, the synthetic model's
@example(steps=[[BYTE_OFFSET + 0xE2], [BYTE_OFFSET + 0x82], [7], [BYTE_OFFSET + 0xAC]])
@example(steps=[[BYTE_OFFSET + 0xF0], None, None, [BYTE_OFFSET + 0x41], [7], None])
def test_the_detokenizer_reads_every_sequence_as_the_plain_one(steps):
    fast, plain = Detokenizer(), PlainDetokenizer()
    for step in steps:
        if step is None:
            assert fast.flush() == plain.flush(), steps
        else:
            for token in step:
                assert fast.feed(token) == plain.feed(token), steps
    assert fast.flush() == plain.flush(), steps
    assert fast.flush() == plain.flush() == ""  # a second flush: nothing left either way
