"""Stop 72 (faults): seeded fault schedules under load, faults during a model switch, and the
soak's own checks.

1. The soak's and the chaos soak's token checks took any answer that ended early with
   ``finish_reason: "stop"`` as right, whatever its last token: a server that ended a request
   after its first tokens (a resume that lost its place, a burst cut short) and said ``stop``
   passed every check with 0 wrong tokens. The chaos check took even an answer with no
   ``finish_reason`` at all. An answer ends right only with its ``max_tokens`` tokens and
   ``length``, or with the end token last and ``stop`` (the synthetic model's traffic asks for
   no stop string, stop token or grammar).

Bundled emulator, seeded fault plans; every wait bounded; no timing threshold.
"""

from __future__ import annotations

import json

import pytest

import needs

needs.module("httpx", "server")  # the chaos and soak checks are the [server] tools'
from calexec.drivers.serving.byte_tokenizer import END_TOKEN_ID  # noqa: E402
from calexec.drivers.tools import chaos  # noqa: E402
from calexec.drivers.tools.bench import soak  # noqa: E402

PROMPT = (1, 2, 3)


def _plain(tokens: list[int], finish: str | None, max_tokens: int) -> chaos.Record:
    rec = chaos.Record("plain", list(PROMPT), max_tokens, 4.0)
    rec.start, rec.end, rec.code = 100.0, 100.1, 200
    rec.body = {"choices": [{"token_ids": tokens, "finish_reason": finish}]}
    return rec


def _stream(tokens: list[int], finish: str | None, max_tokens: int) -> chaos.Record:
    rec = chaos.Record("stream", list(PROMPT), max_tokens, 4.0)
    rec.start, rec.end, rec.code = 100.0, 100.1, 200
    rec.events = [f"data: {json.dumps({'choices': [{'token_ids': [t], 'finish_reason': None}]})}"
                  for t in tokens[:-1]]
    rec.events.append(f"data: {json.dumps({'choices': [{'token_ids': tokens[-1:], 'finish_reason': finish}]})}")
    rec.events.append("data: [DONE]")
    return rec


@pytest.mark.parametrize("shape", [_plain, _stream])
@pytest.mark.parametrize("finish", ["stop", None])
def test_the_chaos_check_counts_an_answer_cut_short_as_wrong(shape, finish):
    """Two of six oracle tokens and ``stop`` (the second token is no end token): wrong. On the
    old code no wrong token was counted (``stop`` took any length; a plain answer was judged
    on its length only when it said ``length``)."""
    oracle = list(chaos.oracle_tokens(PROMPT, 6))
    assert END_TOKEN_ID not in oracle  # (the cut is no real end)
    problems: list[str] = []
    wrong: list[str] = []
    chaos.check_record(shape(oracle[:2], finish, 6), 0.5, 0.1, problems, wrong)
    assert len(wrong) == 1 and not problems, (wrong, problems)


@pytest.mark.parametrize("shape", [_plain, _stream])
def test_the_chaos_check_takes_a_whole_answer_and_one_ended_by_the_end_token(shape):
    oracle = list(chaos.oracle_tokens(PROMPT, 6))
    problems: list[str] = []
    wrong: list[str] = []
    chaos.check_record(shape(oracle, "length", 6), 0.5, 0.1, problems, wrong)
    assert not wrong and not problems, (wrong, problems)
    assert soak.answer_wrong(oracle, "length", oracle, 6) is False
    # an answer the end token ended: what the oracle gives up to it, that token last
    ended = [*oracle[:2], END_TOKEN_ID]
    assert soak.answer_wrong(ended, "stop", ended, 6) is False


@pytest.mark.parametrize("tokens,finish,why", [
    (2, "stop", "cut short, its last token no end token"),
    (2, "length", "length before max_tokens"),
    (6, None, "no finish_reason"),
    (0, "stop", "no token at all"),
])
def test_the_soak_counts_an_answer_that_ends_wrongly_as_wrong(tokens, finish, why):
    oracle = list(chaos.oracle_tokens(PROMPT, 6))
    assert soak.answer_wrong(oracle[:tokens], finish, oracle, 6) is True, why
