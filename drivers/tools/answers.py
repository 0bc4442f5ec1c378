"""How the fault soaks judge a whole answer's tokens and its end (``calexec bench soak``,
drivers/tools/chaos.py): one rule for both, no server import (the soak's module loads without
the ``[server]`` extra)."""

from __future__ import annotations

from calexec.drivers.serving.byte_tokenizer import END_TOKEN_ID


def answer_wrong(tokens: list[int], finish: str | None, expected: list[int],
                 max_tokens: int, end_token: int = END_TOKEN_ID) -> bool:
    """Whether a whole answer (not a disconnected stream's prefix) is wrong: its tokens are
    not ``expected``'s first ones, or it ends as no right answer of this traffic ends (no stop
    string, stop token or grammar in it): right is ``max_tokens`` tokens and ``length``, or
    the end token last and ``stop``. Until stop 72 ``stop`` took any length: a server that
    ended a request after its first tokens and said ``stop`` passed with 0 wrong tokens."""
    if list(tokens) != list(expected[:len(tokens)]):
        return True
    if finish == "length":
        return len(tokens) != max_tokens
    if finish == "stop":
        return not tokens or tokens[-1] != end_token
    return True
