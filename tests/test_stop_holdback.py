"""Stop strings' hold-back (``openai_api.TextOutput``): text that could still start a stop
string is held back until it cannot. It used to be recomputed per token by slicing every
suffix of the text up to each stop string's length, some 4000 slices and compares a token
on the event loop with 16 stop strings of 256 characters (a request's allowed maximum):
about a millisecond of the loop per token, a hundred times the rest of a token's cost, for
every client of the server. Now each stop string's longest matched prefix is carried from
token to token (KMP). The answers are the reference's (the old algorithm, below) on random
streams; the work per token is bounded, counted as Python lines run (no clock)."""

from __future__ import annotations

import random
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from calexec.drivers.serving import openai_api
from calexec.drivers.serving.byte_tokenizer import ByteTokenizer
from calexec.drivers.serving.openai_api import TextOutput

TOK = ByteTokenizer()


class Reference:
    """The hold-back as it was computed before (every suffix sliced and compared)."""

    def __init__(self, stop: tuple[str, ...], keep_stop: bool = False) -> None:
        self._detok = TOK.detokenizer()
        self._stop, self._keep_stop = stop, keep_stop
        self.text, self._sent, self.stopped = "", 0, False

    @property
    def sent(self) -> int:
        return self._sent

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        return self._emit(self.text + self._detok.feed(token), final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.text + self._detok.flush(), final=True)

    def _emit(self, text: str, final: bool) -> str:
        if self._stop:
            start = max(0, self._sent - max(len(s) for s in self._stop))
            hits = [(p, len(s)) for p, s in ((text.find(s, start), s) for s in self._stop)
                    if p >= 0]
            if hits:
                at, length = min(hits)
                text = text[:at + length] if self._keep_stop else text[:at]
                self.stopped = final = True
        self.text = text
        end = len(text) if final else len(text) - self._held(text)
        piece = text[self._sent:end]
        self._sent = max(self._sent, end)
        return piece

    def _held(self, text: str) -> int:
        held = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if s.startswith(text[-n:]):
                    held = n
                    break
        return held


#: the byte tokenizer: ids 256..511 are bytes (0x61 'a' is 353), others print as <id>
ALPHABET = [256 + ord(c) for c in "ab<>1"] + [1, 11, 111]


@settings(max_examples=300, deadline=None)
@given(stop=st.lists(st.text(alphabet="ab<>1", min_size=1, max_size=12), min_size=1,
                     max_size=4),
       tokens=st.lists(st.sampled_from(ALPHABET), max_size=60), keep=st.booleans())
def test_the_pieces_are_the_reference_algorithms(stop, tokens, keep):
    ours, ref = TextOutput(TOK, tuple(stop), keep), Reference(tuple(stop), keep)
    for token in tokens:
        assert ours.add(token) == ref.add(token), (stop, tokens)
        assert ours.stopped == ref.stopped and ours.sent == ref.sent
    assert ours.flush() == ref.flush()
    assert ours.text == ref.text and ours.stopped == ref.stopped


def _lines_run(fn) -> int:
    """Python lines ``fn()`` runs in drivers/serving/openai_api.py (deterministic)."""
    count = 0
    target = openai_api.__file__

    def trace(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != target:
            return None
        if event == "line":
            count += 1
        return trace
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_the_work_per_token_does_not_grow_with_the_stop_strings_length():
    """16 stop strings of 256 characters (the most a request may send), each starting like
    the text does ('<'): per token, a bounded number of lines run, not one per character of
    each stop string (the reference ran some 8000 a token here)."""
    rng = random.Random(7)
    stop = tuple("<" + "".join(rng.choice("0123456789<>") for _ in range(255))
                 for _ in range(16))
    tokens = [1000 + i % 50 for i in range(200)]  # "<1000><1001>...": 6 characters each
    out = TextOutput(TOK, stop)

    def run() -> None:
        for token in tokens:
            out.add(token)
    per_token = _lines_run(run) / len(tokens)
    assert not out.stopped
    assert per_token < 1500, per_token  # 16 stops x 6 characters, a few lines each
